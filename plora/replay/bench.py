"""``plora bench replay``: replay a real trace slice against a fresh live cluster per policy.

For every policy (``--policies plora,baseline``) the same experiment runs: the same base model,
the same K adapters (written once, deterministic from ``--seed``, ranks cycled from
``--ranks``), the same device pool size, the same trace slice and the same seed. Per policy:
``Cluster.start()`` (embedded Redis, predictor when the policy has one, N workers, gateway), the
adapters are registered, a few base-model requests warm the workers up (no adapter is touched),
the cluster settles (every worker's host staging of the registered adapters done, as it is long
before traffic on a deployed cluster; ``--settle-timeout``), then the slice is replayed open
loop (:mod:`plora.replay.client`) while ``GetClusterStatus`` is sampled every second, and
the cluster is stopped.

Pool size (``--pool-bytes auto``): per worker, ``--pool-fraction`` (default 1/4) of the total
bytes of all K adapters (float32, all 7 projections: a rank-r adapter on SmolLM2-135M is
``r * 10176 * 30 * 4`` bytes), rounded up to whole MiB and at least the largest adapter, so a
worker's pool holds only a fraction of the adapter set and eviction and prefetch matter.

Writes ``DIR/report.json``, ``DIR/report.md``, ``DIR/ttft_cdf.png``,
``DIR/cold_starts_over_time.png``, ``DIR/pool_utilization_over_time.png``, and per policy
``DIR/<policy>/requests.jsonl`` (one record per request), ``DIR/<policy>/samples.json``, each
service's Prometheus metrics at the end of the replay ``DIR/<policy>/metrics/*.prom`` and the
cluster's logs ``DIR/<policy>/logs/*.log``. Definitions of every figure:
:mod:`plora.replay.report`.

``--repeats N`` (N > 1) runs N rounds of every policy, the order alternating between rounds
(``plora,baseline``, then ``baseline,plora``, ...) so that neither always meets the machine
first; each round is written as above under ``DIR/round-<i>/``, and ``DIR/report.json`` gives
each policy's figures as the means of its rounds', the comparison between those means, and a
``repeats`` block with every round's own comparison and their spread (mean, min, max, stdev).
On a shared machine one round is one sample of its load.

SIGINT or SIGTERM stops the running policy's cluster (every service and its Redis) and exits
with status 130 without a report; further signals are ignored while it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from plora.policies import POLICIES, get_policy
from plora.replay.report import (
    COMPARISON_KEYS,
    POLICY_KEYS,
    RequestRecord,
    StatusSample,
    build_report,
    comparison_spread,
    compulsory_cold_rate,
    mean_of_rounds,
    records_over_both,
    render_markdown,
    summarize_policy,
    write_json,
    write_plots,
)
from plora.traces import TRACE_FORMATS, Trace, load_trace, map_keys_to_adapters

logger = logging.getLogger(__name__)

MIB = 1 << 20


def _csv(text: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return out


def _ranks(text: str) -> list[int]:
    try:
        out = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"ranks must be integers, got {text!r}") from None
    if any(r < 1 for r in out):
        raise argparse.ArgumentTypeError(f"ranks must be >= 1, got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora bench replay``."""
    parser.add_argument("--trace", required=True, help="trace CSV file")
    parser.add_argument("--format", required=True, choices=TRACE_FORMATS, help="trace format")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=60.0,
        help="compress the trace clock by this factor (default 60)",
    )
    parser.add_argument(
        "--start",
        type=float,
        default=0.0,
        help="slice start, seconds of the compressed clock (default 0)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=300.0,
        help="slice length, seconds of the compressed clock (default 300)",
    )
    parser.add_argument(
        "--drop-top",
        type=int,
        default=0,
        help="drop the N busiest trace keys before slicing (default 0)",
    )
    parser.add_argument(
        "--adapters", type=int, default=32, help="number K of adapters (default 32)"
    )
    parser.add_argument(
        "--ranks",
        type=_ranks,
        default=[8, 16, 32, 64],
        help="adapter ranks, cycled over the K adapters (default 8,16,32,64)",
    )
    parser.add_argument(
        "--policies",
        type=_csv,
        default=["plora", "plora-no-predictor", "baseline"],
        help="comma-separated cluster policies (default plora,plora-no-predictor,baseline: the "
        "predictor's ablation beside the baseline)",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every policy, order alternating (plora,baseline then baseline,plora "
        "...); over 1 the report gives the means and the rounds' spread (default 1)",
    )
    parser.add_argument("--workers", type=int, default=2, help="workers per cluster (default 2)")
    parser.add_argument(
        "--pool-bytes",
        default="auto",
        help="device pool per worker (e.g. 256MiB); auto = --pool-fraction of all adapters' bytes",
    )
    parser.add_argument(
        "--pool-fraction",
        type=float,
        default=0.25,
        help="pool per worker as a share of all adapters' bytes (default 0.25)",
    )
    parser.add_argument(
        "--host-cache-fraction",
        type=float,
        default=None,
        help="host cache per worker as a share of all adapters' bytes (at least the pool), so "
        "cold loads read the source as they do at scale when the working set outgrows host "
        "memory (default: the worker's own host cache size)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per request (8)")
    parser.add_argument(
        "--prompt-token-cap",
        type=int,
        default=64,
        help="prompts are min(trace prompt tokens, this) words (default 64)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="most requests in flight; later arrivals are dropped (default 64)",
    )
    parser.add_argument("--seed", type=int, default=0, help="adapters, mapping and sampling seed")
    parser.add_argument("--model", default=None, help="base model (default SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--adapters-dir",
        default=None,
        help="where the adapters are written (default DIR/adapters; reused when "
        "its manifest matches)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="base-model requests sent before the replay (default 4)",
    )
    parser.add_argument(
        "--ttft-probes",
        type=int,
        default=8,
        help="base-model requests sent one at a time after the warm-up, with prompts from the "
        "slice, to measure the uncontended TTFT no policy can beat (default 8; 0 = none)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=180.0,
        help="deadline of each request, seconds (default 180)",
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=5.0,
        help="seconds between progress lines (default 5)",
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag passed to every worker (repeatable)",
    )
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=120.0,
        help="seconds to wait after registration for every worker's host staging to finish "
        "before the probes and the replay (policies without staging settle at once; "
        "default 120; 0 = do not wait)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)


# ------------------------------------------------------------------------------ adapters
def prepare_adapters(
    out_dir: Path, model: str | None, count: int, ranks: Sequence[int], seed: int
) -> tuple[list[Path], list[int], list[int]]:
    """Write (or reuse) the K adapters; returns their paths, ranks and sizes in bytes.

    The set is reused when ``out_dir/replay_adapters.json`` records the same model, count,
    ranks and seed and every directory exists (generation is deterministic, so the files would
    be identical).
    """
    from plora.make_adapters import make_adapter_set  # noqa: PLC0415
    from services.common.adapters import inspect_adapter  # noqa: PLC0415
    from services.worker.model_loader import default_cache_dir, load_model_spec  # noqa: PLC0415

    spec = load_model_spec(model, default_cache_dir())
    key = {"model": spec.name, "count": count, "ranks": list(ranks), "seed": seed}
    manifest = out_dir / "replay_adapters.json"
    if manifest.is_file():
        old = json.loads(manifest.read_text())
        if old.get("key") == key and all(Path(p).is_dir() for p in old["paths"]):
            logger.info("reusing %d adapters in %s", count, out_dir)
            return [Path(p) for p in old["paths"]], old["ranks"], old["sizes"]
    paths = make_adapter_set(out_dir, spec, count=count, ranks=ranks, seed=seed)
    metas = [inspect_adapter(p, spec) for p in paths]
    paths = [p.resolve() for p in paths]
    adapter_ranks = [int(m.rank) for m in metas]
    sizes = [int(m.size_bytes) for m in metas]
    manifest.write_text(
        json.dumps(
            {"key": key, "paths": [str(p) for p in paths], "ranks": adapter_ranks, "sizes": sizes},
            indent=2,
        )
    )
    return paths, adapter_ranks, sizes


def auto_pool_bytes(sizes: Sequence[int], fraction: float, page_bytes: int = MIB) -> int:
    """``fraction`` of ``sum(sizes)``, rounded up to whole pages, at least the largest adapter."""
    if not sizes or not 0 < fraction:
        raise ValueError("need at least one adapter and fraction > 0")
    want = max(int(np.ceil(sum(sizes) * fraction)), max(sizes))
    return int(-(-want // page_bytes) * page_bytes)


# ------------------------------------------------------------------------------ trace
def trace_info(trace: Trace, adapter_of: dict[str, str]) -> dict[str, Any]:
    """Figures of the replayed slice, including its compulsory cold-start floor."""
    keys = [str(k) for k in trace.adapter_keys]
    adapters = [adapter_of[k] for k in keys]
    per_s = np.bincount(trace.times.astype(np.int64)) if len(trace) else np.zeros(1)
    return {
        "requests": len(trace),
        "keys": len(trace.keys),
        "adapters_used": len(set(adapters)),
        "last_arrival_s": trace.duration,
        "mean_rate_req_s": len(trace) / trace.duration if trace.duration > 0 else None,
        "peak_req_per_s": int(per_s.max()),
        "prompt_tokens_median": float(np.median(trace.prompt_tokens)) if len(trace) else None,
        "compulsory_cold_rate": compulsory_cold_rate(adapters),
        "compulsory_cold_rate_keys": compulsory_cold_rate(keys),
    }


# ------------------------------------------------------------------------------ one policy
def _cluster_args(
    args: argparse.Namespace, policy: str, run_dir: Path, pool_bytes: int, adapters_dir: Path
) -> argparse.Namespace:
    from plora import launcher  # noqa: PLC0415

    flags = [
        "--state-file",
        str(run_dir / "cluster.json"),
        "--gateway-port",
        "0",
        "--policy",
        policy,
        "--workers",
        str(args.workers),
        "--demo-adapters",
        "0",
        "--adapters-dir",
        str(adapters_dir),
        "--pool-bytes",
        str(pool_bytes),
        "--startup-timeout",
        str(args.startup_timeout),
    ]
    if args.model:
        flags += ["--model", args.model]
    for extra in args.worker_arg:
        flags += [f"--worker-arg={extra}"]
    parser = argparse.ArgumentParser(prog="plora up")
    launcher.add_arguments(parser)
    return parser.parse_args(flags)


def run_policy(
    args: argparse.Namespace,
    policy: str,
    run_dir: Path,
    adapter_paths: Sequence[Path],
    requests: Sequence[Any],
    pool_bytes: int,
    adapters_dir: Path,
    label: str = "",
) -> tuple[
    list[RequestRecord],
    list[StatusSample],
    dict[str, float],
    dict[str, dict[str, float]],
    list[float],
    dict[str, float],
]:
    """Start a fresh cluster with ``policy``, register the adapters, warm up, let it settle
    (:func:`wait_settled`), measure the uncontended TTFT (``--ttft-probes``), replay, stop it.

    ``label`` names the run in progress lines (default: the policy).

    Returns:
        The request records, the status samples, the wall seconds of each phase
        (``startup_s``: processes to healthy; ``register_warmup_s``: registration and
        warm-up; ``settle_s``: waiting for host staging; ``probes_s``: the uncontended-TTFT
        probes; ``replay_s``: first send to last completion plus the final sample;
        ``stop_s``), per service its CPU seconds during the replay (``cpu_s``) and resident
        bytes at its end (``rss_bytes``), from its ``process_*`` metrics, and the probes'
        TTFTs in seconds (:meth:`~plora.replay.client.ReplayClient.uncontended_ttft`), and the
        workers' cold starts during the replay by cause (:func:`cold_causes`).
    """
    import grpc  # noqa: PLC0415

    from plora.launcher import Cluster  # noqa: PLC0415
    from plora.replay.client import ClientConfig, ReplayClient, StatusSampler  # noqa: PLC0415
    from plora.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: PLC0415
    from services.common.grpc_util import CHANNEL_OPTIONS  # noqa: PLC0415

    label = label or policy
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(_cluster_args(args, policy, run_dir, pool_bytes, adapters_dir))
    timings: dict[str, float] = {}
    mark = time.monotonic()
    try:
        state = cluster.start()
        timings["startup_s"] = time.monotonic() - mark
        mark = time.monotonic()
        gateway = str(state["gateway"])
        with grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for p in adapter_paths:
                stub.RegisterAdapter(
                    gateway_pb2.RegisterAdapterRequest(adapter_id=p.name, source=str(p)),
                    timeout=120,
                )
            print(f"[{label}] registered {len(adapter_paths)} adapters; warming up", flush=True)
            for i in range(args.warmup):
                list(
                    stub.Generate(
                        gateway_pb2.GenerateRequest(
                            request_id=f"warmup-{i}",
                            prompt="Hello, how are you today?",
                            max_new_tokens=args.max_new_tokens,
                        ),
                        timeout=120,
                    )
                )

        def progress(p: Any) -> None:
            print(
                f"[{label}] t={p.elapsed_s:6.1f}s sent {p.sent}/{p.total} "
                f"completed {p.completed} failed {p.failed} in-flight {p.in_flight}",
                flush=True,
            )

        config = ClientConfig(
            concurrency=args.concurrency,
            request_timeout_s=args.request_timeout,
            progress_interval_s=args.progress_interval,
            seed=args.seed,
        )
        timings["register_warmup_s"] = time.monotonic() - mark
        mark = time.monotonic()
        # Policies without host staging have nothing to settle.
        staging = get_policy(policy).host_staging
        settled = wait_settled(state, args.settle_timeout if staging else 0.0)
        timings["settle_s"] = time.monotonic() - mark
        if staging:
            print(
                f"[{label}] host staging {'done' if settled else 'NOT done'} after "
                f"{timings['settle_s']:.1f} s",
                flush=True,
            )
        mark = time.monotonic()
        with ReplayClient(gateway, config) as client:
            uncontended = client.uncontended_ttft(requests, args.ttft_probes)
            if uncontended:
                print(
                    f"[{label}] uncontended TTFT {sum(uncontended) / len(uncontended):.3f} s "
                    f"(mean of {len(uncontended)} base-model prefills sent one at a time)",
                    flush=True,
                )
            timings["probes_s"] = time.monotonic() - mark
            before = _scrape_metrics(state)
            cpu_before = _process_figures(before)
            cold_before = cold_causes(before)
            t0 = time.monotonic()
            with StatusSampler(gateway, t0) as sampler:
                records = client.replay(requests, t0=t0, on_progress=progress)
                time.sleep(1.5)  # the last heartbeats reach the registry before the final sample
        samples = sampler.samples
        timings["replay_s"] = time.monotonic() - t0
        texts = _scrape_metrics(state)
        _save_metrics(texts, run_dir / "metrics")
        usage = _service_usage(cpu_before, _process_figures(texts))
        cold_after = cold_causes(texts)
        causes = {c: cold_after[c] - cold_before.get(c, 0.0) for c in sorted(cold_after)}
    finally:
        mark = time.monotonic()
        cluster.stop()
        timings["stop_s"] = time.monotonic() - mark
    print(f"[{label}] phases: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()), flush=True)
    with open(run_dir / "requests.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")
    write_json(run_dir / "samples.json", [s.to_dict() for s in samples])
    return records, samples, timings, usage, uncontended, causes


def wait_settled(
    state: Mapping[str, Any],
    timeout_s: float,
    quiet_s: float | None = None,
    poll_s: float = 0.5,
) -> bool:
    """Wait until every worker's background host staging is done: no staging read queued
    (``plora_worker_host_stages_queued`` 0) and no read finished
    (``plora_worker_host_stages_total`` unchanged) for ``quiet_s`` seconds, two staging passes
    (:data:`~services.worker.store.HOST_STAGING_INTERVAL_S`), so a pass that has not yet run
    or a read still in progress is not taken for done.

    On a deployed cluster adapters are registered long before their traffic and staged by
    then; a replay started right after registration would measure the workers reading every
    adapter from its source alongside the first requests (11 s per worker for 32
    adapters). :func:`run_policy` skips the wait (``timeout_s`` 0) for policies without host
    staging.

    Args:
        state: The cluster's state (its ``metrics`` URLs by service name).
        timeout_s: Seconds to wait at most; 0 returns at once.
        quiet_s: Seconds without staging activity that count as settled (default: two
            staging passes).
        poll_s: Seconds between scrapes.

    Returns:
        Whether the cluster settled within ``timeout_s``.
    """
    from services.worker.store import HOST_STAGING_INTERVAL_S  # noqa: PLC0415

    if timeout_s <= 0:
        return True
    if quiet_s is None:
        quiet_s = 2.0 * HOST_STAGING_INTERVAL_S
    deadline = time.monotonic() + timeout_s
    last: dict[str, tuple[float, float]] = {}
    quiet_since = time.monotonic()
    while True:
        now = {
            name: (f.get("plora_worker_host_stages_queued", 0.0),
                   f.get("plora_worker_host_stages_total", 0.0))
            for name, f in _sample_sums(_scrape_metrics(state), _STAGING_SERIES).items()
        }  # fmt: skip
        t = time.monotonic()
        if now != last or any(queued > 0 for queued, _ in now.values()):
            last, quiet_since = now, t
        elif t - quiet_since >= quiet_s:
            return True
        if t >= deadline:
            logger.warning(
                "cluster did not settle within %.0f s (host staging still running: %s)",
                timeout_s,
                now,
            )
            return False
        time.sleep(poll_s)


def _scrape_metrics(state: Mapping[str, Any]) -> dict[str, str]:
    """Every service's Prometheus text, by service name (one that cannot be reached is
    logged and left out)."""
    import urllib.request  # noqa: PLC0415

    texts: dict[str, str] = {}
    for name, url in dict(state.get("metrics") or {}).items():
        try:
            with urllib.request.urlopen(str(url), timeout=10) as resp:  # noqa: S310 - loopback
                texts[name] = resp.read().decode("utf-8")
        except OSError as exc:
            logger.warning("could not scrape %s metrics at %s: %s", name, url, exc)
    return texts


def _save_metrics(texts: dict[str, str], out_dir: Path) -> None:
    """Save every service's Prometheus text (``DIR/<policy>/metrics/<name>.prom``) before the
    cluster stops: prefetches, loads by tier and forecasts are there, not in the logs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out_dir / f"{name}.prom").write_text(text, encoding="utf-8")


#: The worker series :func:`wait_settled` reads.
_STAGING_SERIES = frozenset({"plora_worker_host_stages_queued", "plora_worker_host_stages_total"})


def _sample_sums(texts: dict[str, str], wanted: frozenset[str]) -> dict[str, dict[str, float]]:
    """Per service (of those exporting any), the sum over labels of each ``wanted`` sample
    name in its Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    out: dict[str, dict[str, float]] = {}
    for name, text in texts.items():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    figures = out.setdefault(name, {})
                    figures[sample.name] = figures.get(sample.name, 0.0) + float(sample.value)
    return out


def cold_causes(texts: dict[str, str]) -> dict[str, float]:
    """The workers' cold starts so far by cause (``plora_worker_cold_starts_total{cause}``,
    :mod:`services.worker.cold`), summed over the workers."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    out: dict[str, float] = {}
    for text in texts.values():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "plora_worker_cold_starts_total" and "cause" in sample.labels:
                    cause = sample.labels["cause"]
                    out[cause] = out.get(cause, 0.0) + float(sample.value)
    return out


def _process_figures(texts: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per service, ``process_cpu_seconds_total`` and ``process_resident_memory_bytes``."""
    return _sample_sums(
        texts, frozenset({"process_cpu_seconds_total", "process_resident_memory_bytes"})
    )


def _service_usage(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per service, CPU seconds spent during the replay and resident memory at its end: where
    a shared host's cores went (workers' generation against the predictor, gateway, ...)."""
    out: dict[str, dict[str, float]] = {}
    for name, figures in after.items():
        cpu = figures.get("process_cpu_seconds_total")
        rss = figures.get("process_resident_memory_bytes")
        row: dict[str, float] = {}
        if cpu is not None and "process_cpu_seconds_total" in before.get(name, {}):
            row["cpu_s"] = cpu - before[name]["process_cpu_seconds_total"]
        if rss is not None:
            row["rss_bytes"] = rss
        out[name] = row
    return out


# ------------------------------------------------------------------------------ the verb
@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While inside, the first SIGINT or SIGTERM raises ``KeyboardInterrupt`` in the main
    thread (so ``run_policy``'s ``finally`` stops the cluster it started: a killed benchmark
    must not leave services and a Redis server running) and later ones are ignored until the
    stop is done. Python's default SIGTERM ends the process without running ``finally``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in sigs}

    def interrupt(signum: int, _frame: object) -> None:
        for sig in sigs:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in sigs:
        signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    """``plora bench replay``: see the module docstring. Returns 0, or 1 when a policy failed."""
    from plora.replay.client import build_requests  # noqa: PLC0415

    started = time.monotonic()
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        print(
            f"plora bench replay: unknown policies {unknown}; choose from {sorted(POLICIES)}",
            file=sys.stderr,
        )
        return 2
    if args.repeats < 1:
        print(f"plora bench replay: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if args.ttft_probes < 0:
        print(
            f"plora bench replay: --ttft-probes must be >= 0, got {args.ttft_probes}",
            file=sys.stderr,
        )
        return 2
    if not args.settle_timeout >= 0:
        print(
            f"plora bench replay: --settle-timeout must be >= 0 seconds, got {args.settle_timeout}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    trace = load_trace(
        args.trace,
        args.format,
        time_scale=args.time_scale,
        seed=args.seed,
        drop_top=args.drop_top,
        start=args.start,
        duration=args.duration,
    )
    if len(trace) == 0:
        print(
            "plora bench replay: the slice holds no requests; choose another --start/--duration",
            file=sys.stderr,
        )
        return 2

    adapters_dir = Path(args.adapters_dir) if args.adapters_dir else out / "adapters"
    print(
        f"writing/reusing {args.adapters} adapters (ranks {args.ranks}) in {adapters_dir}",
        flush=True,
    )
    paths, ranks, sizes = prepare_adapters(
        adapters_dir, args.model, args.adapters, args.ranks, args.seed
    )
    if args.pool_bytes == "auto":
        pool_bytes = auto_pool_bytes(sizes, args.pool_fraction)
    else:
        from services.common.config import parse_bytes  # noqa: PLC0415

        pool_bytes = parse_bytes(args.pool_bytes)
    if args.host_cache_fraction is not None:
        if args.host_cache_fraction <= 0:
            print("plora bench replay: --host-cache-fraction must be > 0", file=sys.stderr)
            return 2
        host_bytes = max(pool_bytes, auto_pool_bytes(sizes, args.host_cache_fraction))
        args.worker_arg = [*args.worker_arg, f"--host-cache-bytes={host_bytes}"]
        print(f"host cache {host_bytes} B/worker", flush=True)

    ids = [p.name for p in paths]
    adapter_of = map_keys_to_adapters(trace.keys_by_popularity(), ids, seed=args.seed)
    keys = [str(k) for k in trace.adapter_keys]
    requests = build_requests(
        trace.times.tolist(),
        [adapter_of[k] for k in keys],
        keys,
        trace.prompt_tokens.tolist(),
        max_new_tokens=args.max_new_tokens,
        prompt_token_cap=args.prompt_token_cap,
        seed=args.seed,
    )
    info = trace_info(trace, adapter_of)
    print(
        f"slice: {info['requests']} requests, {info['keys']} keys -> {info['adapters_used']} "
        f"adapters, last arrival {info['last_arrival_s']:.1f}s, peak {info['peak_req_per_s']}/s,"
        f" compulsory cold rate {info['compulsory_cold_rate']:.3f}; pool {pool_bytes} B/worker "
        f"({pool_bytes / sum(sizes):.3f} of {sum(sizes)} B of adapters)",
        flush=True,
    )

    compare_pair = _compare_pair(args.policies)
    rounds: list[_Round] = []
    for i in range(args.repeats):
        # Rounds alternate the order (ABBA...): neither policy always runs first, on a machine
        # whose load drifts.
        order = list(args.policies) if i % 2 == 0 else list(reversed(args.policies))
        if args.repeats == 1:
            round_dir, tag = out, ""
        else:
            round_dir, tag = out / f"round-{i + 1}", f"r{i + 1} "
            print(f"round {i + 1}/{args.repeats}: {', '.join(order)}", flush=True)
        try:
            rnd = _run_round(args, order, round_dir, tag, paths, requests, pool_bytes, adapters_dir)
        except KeyboardInterrupt:
            if rounds:
                print(
                    f"the {len(rounds)} finished round(s) are reported in "
                    + ", ".join(str(out / f"round-{j + 1}") for j in range(len(rounds))),
                    file=sys.stderr,
                    flush=True,
                )
            return 130
        rnd.report = build_report(
            _settings(args, ranks, sizes, pool_bytes, started, round_index=i + 1),
            info,
            rnd.summaries,
            compare_pair=compare_pair,
            completed_by_both=_completed_by_both([rnd]),
        )
        if args.repeats > 1:
            print(f"round {i + 1}/{args.repeats} results:", flush=True)
        _write_report(round_dir, rnd.report, rnd.records, rnd.samples)
        rounds.append(rnd)

    if args.repeats > 1:
        print(f"means over the {args.repeats} rounds:", flush=True)
        _write_report(
            out,
            _combine_rounds(
                args, rounds, info, compare_pair, _settings(args, ranks, sizes, pool_bytes, started)
            ),
            {f"{p} r{i + 1}": recs for i, r in enumerate(rounds) for p, recs in r.records.items()},
            {f"{p} r{i + 1}": ss for i, r in enumerate(rounds) for p, ss in r.samples.items()},
        )
    print(f"wrote {out / 'report.json'}, {out / 'report.md'} and plots", flush=True)
    return 1 if any(r.failed for r in rounds) else 0


@dataclasses.dataclass
class _Round:
    """One round: every policy once, on a fresh cluster each."""

    order: list[str]  # the order the policies ran in
    summaries: dict[str, dict[str, Any]]  # in --policies order
    records: dict[str, list[RequestRecord]]
    samples: dict[str, list[StatusSample]]
    failed: list[str]
    report: dict[str, Any] = dataclasses.field(default_factory=dict)


def _compare_pair(policies: Sequence[str]) -> tuple[str, str]:
    """plora vs baseline; without plora, the first other policy vs baseline; without the
    baseline, plora vs plora-no-predictor (the predictor's ablation alone)."""
    if "baseline" not in policies and {"plora", "plora-no-predictor"} <= set(policies):
        return "plora", "plora-no-predictor"
    others = [p for p in policies if p != "baseline"]
    first = "plora" if "plora" in policies else (others[0] if others else "plora")
    return first, "baseline"


def _run_round(
    args: argparse.Namespace,
    order: Sequence[str],
    round_dir: Path,
    tag: str,
    paths: Sequence[Path],
    requests: Sequence[Any],
    pool_bytes: int,
    adapters_dir: Path,
) -> _Round:
    """Run every policy once in ``order``. A policy that fails is recorded (``{"error": ...}``)
    and the round goes on.

    Raises:
        KeyboardInterrupt: SIGINT or SIGTERM arrived; the running cluster is already stopped.
    """
    done: dict[str, dict[str, Any]] = {}
    rnd = _Round(list(order), {}, {}, {}, [])
    for policy in order:
        label = f"{tag}{policy}"
        print(f"[{label}] starting a fresh cluster ({args.workers} workers)", flush=True)
        try:
            with _signals_interrupt():
                records, samples, timings, usage, uncontended, causes = run_policy(
                    args,
                    policy,
                    round_dir / policy,
                    paths,
                    requests,
                    pool_bytes,
                    adapters_dir,
                    label=label,
                )
        except KeyboardInterrupt as exc:
            print(
                f"[{label}] interrupted ({exc or 'SIGINT'}): its cluster is stopped; "
                "no report written",
                file=sys.stderr,
                flush=True,
            )
            raise
        except Exception as exc:  # noqa: BLE001 - report the failed policy, go on with the next
            logger.exception("policy %s failed", policy)
            print(
                f"[{label}] FAILED: {exc}; logs in {round_dir / policy / 'logs'}",
                file=sys.stderr,
                flush=True,
            )
            done[policy] = {"error": str(exc)[:2000]}
            rnd.failed.append(policy)
            continue
        rnd.records[policy], rnd.samples[policy] = records, samples
        done[policy] = {
            **summarize_policy(records, samples, uncontended),
            "cold_causes": causes,
            "phase_seconds": timings,
            "service_usage": usage,
        }
    rnd.summaries = {p: done[p] for p in args.policies}
    return rnd


def _combine_rounds(
    args: argparse.Namespace,
    rounds: Sequence[_Round],
    info: dict[str, Any],
    compare_pair: tuple[str, str],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """report.json over ``--repeats`` rounds: each policy's figures are the means of its
    rounds' (:func:`mean_of_rounds`; a policy that failed in any round is an error, the
    comparison is then ``None``), plus the ``repeats`` block."""
    summaries: dict[str, dict[str, Any]] = {}
    for p in args.policies:
        errors = [
            f"round {i + 1}: {r.summaries[p]['error']}"
            for i, r in enumerate(rounds)
            if "error" in r.summaries[p]
        ]
        summaries[p] = (
            {"error": "; ".join(errors)[:2000]}
            if errors
            else mean_of_rounds([r.summaries[p] for r in rounds])
        )
    per_round = [r.report.get("comparison") for r in rounds]
    repeats = {
        "rounds": len(rounds),
        "order": [r.order for r in rounds],
        "comparison_per_round": per_round,
        "spread": comparison_spread([c for c in per_round if c is not None]),
    }
    return build_report(
        settings,
        info,
        summaries,
        compare_pair=compare_pair,
        repeats=repeats,
        completed_by_both=_completed_by_both(rounds),
    )


def _completed_by_both(rounds: Sequence[_Round]) -> list[dict[str, Any]]:
    """:func:`records_over_both` of ``plora`` and ``plora-no-predictor`` in each round; empty
    unless both ran in every round."""
    pair = ("plora", "plora-no-predictor")
    if not rounds or not all(all(p in r.records for p in pair) for r in rounds):
        return []
    return [records_over_both(r.records[pair[0]], r.records[pair[1]]) for r in rounds]


def _settings(
    args: argparse.Namespace,
    ranks: Sequence[int],
    sizes: Sequence[int],
    pool_bytes: int,
    started: float,
    round_index: int | None = None,
) -> dict[str, Any]:
    """report.json's ``settings``: what was run, where, and how long it took so far."""
    settings = {
        "trace": str(args.trace),
        "format": args.format,
        "start": args.start,
        "duration": args.duration,
        "time_scale": args.time_scale,
        "drop_top": args.drop_top,
        "adapters": args.adapters,
        "ranks": sorted(set(ranks)),
        "adapter_ranks": list(ranks),
        "adapter_bytes_total": int(sum(sizes)),
        "pool_bytes": pool_bytes,
        "pool_fraction": pool_bytes / sum(sizes),
        "workers": args.workers,
        "policies": list(args.policies),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "prompt_token_cap": args.prompt_token_cap,
        "concurrency": args.concurrency,
        "settle_timeout_s": args.settle_timeout,
        "seed": args.seed,
        "model": args.model or "SmolLM2-135M-Instruct (default)",
        "worker_args": list(args.worker_arg),
        "wall_time_s": time.monotonic() - started,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m_at_end": os.getloadavg()[0],
        },
    }
    if round_index is not None and args.repeats > 1:
        settings["round"] = round_index
    return settings


def _write_report(
    out: Path,
    report: dict[str, Any],
    records: dict[str, list[RequestRecord]],
    samples: dict[str, list[StatusSample]],
) -> None:
    """``out/report.json`` always; ``report.md``, the plots and the printed table when some
    policy ran (one plot line per entry of ``records`` / ``samples``)."""
    write_json(out / "report.json", report)
    ok = [p for p in report["policies"] if "error" not in report[p]]
    if ok:
        (out / "report.md").write_text(
            render_markdown({**report, "policies": ok}), encoding="utf-8"
        )
        write_plots(out, records, samples)
    _print_table(report, ok)


def _print_table(report: dict[str, Any], names: list[str]) -> None:
    # report.json's per-policy keys, less tokens/s (req/s is beside it)
    cols = tuple(k for k in POLICY_KEYS if k != "throughput_tok_s")
    print(f"{'figure':34}" + "".join(f"{n:>14}" for n in names))
    for c in cols:
        row = []
        for n in names:
            v = report[n].get(c)
            row.append("-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v)))
        print(f"{c:34}" + "".join(f"{x:>14}" for x in row))
    print(f"{'compulsory_cold_rate (floor)':34}{report['compulsory_cold_rate']:>14.4f}")
    comp = report.get("comparison")
    if comp:
        rep = report.get("repeats")
        per = (rep or {}).get("comparison_per_round") or []
        if rep:
            print(f"{'comparison (of the means)':34}{'':>14}  per round")
        for k in (*COMPARISON_KEYS, "baseline_cold_wait_share_of_ttft"):
            v = comp.get(k)
            rounds = "  ".join("-" if (x := (c or {}).get(k)) is None else f"{x:.4f}" for c in per)
            print(f"{k:34}{'-' if v is None else f'{v:.4f}':>14}  {rounds}".rstrip())
