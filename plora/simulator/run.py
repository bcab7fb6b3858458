"""``plora simulate``: run a trace through the simulated cluster under several policies.

Writes ``DIR/report.json``, ``DIR/report.md`` (settings, trace, one block per policy with
:data:`plora.simulator.report.POLICY_KEYS`, ``comparison``, ``papers``, optional
``validation`` against a replay report) and the plots, and prints a short table.

Example::

    plora simulate --trace azure_functions_2019_500fn_first4h.csv \\
        --format azure2019 --workers 4 --preset h100-8b --policies plora,baseline \\
        --adapters 500 --out bench-out/sim-azure
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from plora.policies import POLICIES, SIM_POLICIES, get_policy
from plora.replay.report import completed_by_both_block
from plora.simulator.calibrate import fit_replay, read_records
from plora.simulator.engine import (
    AdapterSet,
    SimConfig,
    SimResult,
    build_adapter_set,
    make_feed,
    simulate,
)
from plora.simulator.feed import DemandFeed
from plora.simulator.presets import PRESET_NAMES, RANK_MODES, Preset, get_preset
from plora.simulator.presets import source_latencies as preset_source_latencies
from plora.simulator.report import (
    POLICY_KEYS,
    ablation_text,
    compare_to_replay,
    comparison_block,
    completed_by_both,
    load_replay_report,
    mean_over_seeds,
    paper_comparison,
    render_markdown,
    search_min_workers,
    slo_attainment,
    slo_vs_load,
    summarize,
    write_plots,
)
from plora.traces import TRACE_FORMATS, Trace, load_trace
from services.common.config import parse_bytes
from services.common.errors import ConfigError
from services.predictor.config import PredictorConfig
from services.predictor.forecast import DEFAULT_FORECASTER, FORECASTER_NAMES
from services.worker.config import WorkerConfig

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora simulate``."""
    parser.add_argument(
        "--trace", default=None, help="trace CSV (required unless --replay-report alone)"
    )
    parser.add_argument(
        "--format",
        default=None,
        choices=TRACE_FORMATS,
        help="trace format (required with --trace)",
    )
    parser.add_argument("--workers", type=int, default=4, help="workers (default 4)")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="cpu", help="hardware preset")
    parser.add_argument(
        "--rank-mode",
        choices=RANK_MODES,
        default=None,
        help="multi-LoRA step cost: 'max' (padded kernels, every row at the batch's largest "
        "rank: S-LoRA, Punica) or 'sum' (one matmul per adapter segment at its own rank); "
        "default: the preset's (docs/benchmarks.md, the step-time model)",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated policies from {','.join([*POLICIES, *SIM_POLICIES])} "
        f"(default {DEFAULT_POLICIES}: the predictor's ablation and its bound beside the "
        "baseline)",
    )
    parser.add_argument("--out", required=True, help="output directory (report.json, plots)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="t' = t / X (default 1)")
    parser.add_argument("--start", type=float, default=0.0, help="slice start, scaled seconds")
    parser.add_argument("--duration", type=float, default=None, help="slice length, scaled s")
    parser.add_argument("--drop-top", type=int, default=0, help="drop the N busiest keys")
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT SLO, s (default 1)")
    parser.add_argument("--adapters", type=int, default=100, help="adapters K (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="simulate every policy N times, with seeds --seed .. --seed+N-1 for the random "
        "draws (source latencies, forecaster weights) and the trace slice and adapter mapping "
        "of --seed, and report the mean of each figure with every run's under seed_runs; the "
        "worker-count search and the plots use the first seed's runs (default 1)",
    )
    parser.add_argument(
        "--forecaster",
        default=DEFAULT_FORECASTER,
        help=f"forecaster of the predictor ({', '.join(FORECASTER_NAMES)}; default "
        f"{DEFAULT_FORECASTER})",
    )
    parser.add_argument(
        "--train-every", type=int, default=1, help="train the forecaster every N ticks"
    )
    parser.add_argument(
        "--prefetch-min-probability",
        type=_probability,
        default=PredictorConfig.prefetch_min_probability,
        help="calibrated probability of a request within the horizon an adapter needs to be "
        "prefetched, as the predictor's flag of the same name; 0 prefetches every adapter the "
        f"forecast makes hot (default {PredictorConfig.prefetch_min_probability})",
    )
    parser.add_argument(
        "--search-max-workers",
        type=int,
        default=64,
        help="upper bound of the min_workers_for_slo search; 0 = no search (default 64)",
    )
    parser.add_argument(
        "--search-duration",
        type=float,
        default=None,
        help="run the worker-count search on the first S seconds of the slice (default all)",
    )
    parser.add_argument(
        "--replay-report",
        default=None,
        help="a `plora bench replay` report.json: its slice (trace, time scale, start, "
        "duration, adapters, pool, workers, from the report's settings) is simulated with the "
        "cpu preset, fitted per policy to the machine as it was during the replay (from the "
        "replay's solo requests, DIR/<policy>/requests.jsonl beside the report), and both are "
        "written side by side under 'validation' and printed. Alone (no --trace) that is all "
        "it runs, unless --policies is given: then those policies are simulated on the "
        "replay's slice, adapters, pool, host cache and workers with --preset (e.g. the oracle "
        "beside the replay's policies); with --trace the --trace simulation runs too",
    )
    parser.add_argument(
        "--view-refresh",
        type=float,
        default=1.0,
        help="seconds between the workers' heartbeats that routing sees (default 1; 0 = exact)",
    )
    parser.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateways in front of the workers, arrivals split over them in turn, each routing "
        "on its own in-flight counts and the shared heartbeats (default 1)",
    )
    parser.add_argument(
        "--forecast-process",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the forecaster in a child process ahead of the simulations (auto: when the "
        f"trace has at least {FEED_PROCESS_MIN_TICKS} predictor ticks; default auto)",
    )
    parser.add_argument(
        "--source-latencies",
        default=None,
        help="presets with an 'alibaba' source (h100-8b): draw load latencies from the samples "
        "of this CSV (column 'value', ms; e.g. alibaba_genai2026_lora_load_latency_ms.csv) "
        "instead of the distribution fitted to them that ships with the preset",
    )


def _probability(text: str) -> float:
    """``--prefetch-min-probability``: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a probability in [0, 1]")
    return value


def _preset(args: argparse.Namespace, preset: Preset) -> Preset:
    """``preset`` with ``--rank-mode`` applied, when given."""
    if args.rank_mode is None or args.rank_mode == preset.step.rank_mode:
        return preset
    return replace(preset, step=replace(preset.step, rank_mode=args.rank_mode))


def _config(args: argparse.Namespace, workers: int, seed: int) -> SimConfig:
    preset = _preset(args, get_preset(args.preset))
    lat = preset_source_latencies(preset, args.source_latencies)
    return SimConfig(
        preset=preset,
        workers=workers,
        seed=seed,
        forecaster=args.forecaster,
        train_every=args.train_every,
        prefetch_min_probability=args.prefetch_min_probability,
        view_refresh_s=args.view_refresh,
        source_latencies_s=lat,
        gateways=args.gateways,
    )


#: ``--policies`` when not given (with ``--trace``): the predictor's ablation and its bound
#: beside the baseline.
DEFAULT_POLICIES = "plora,plora-no-predictor,oracle,baseline"


#: ``--forecast-process auto`` uses a child process from this many predictor ticks on (below
#: it, starting the process costs more than it saves).
FEED_PROCESS_MIN_TICKS = 600


def _use_process(mode: str, trace: Trace, config: SimConfig) -> bool:
    if mode in ("on", "off"):
        return mode == "on"
    last = float(trace.times[-1]) if len(trace) else 0.0
    return last / config.tick_s >= FEED_PROCESS_MIN_TICKS


#: ``progress(policy, stage)``, called by :func:`run_simulations` as it goes: ``stage`` is
#: ``"simulate"`` when the policy's simulation starts, ``"search N workers"`` when its
#: worker-count search starts a simulation with N workers, and ``"done"`` when the policy's
#: simulations are over.
ProgressHook = Callable[[str, str], None]


def run_simulations(
    trace: Trace,
    adapters: AdapterSet,
    policies: list[str],
    config: SimConfig,
    slo_ttft_s: float,
    search_max_workers: int = 64,
    search_trace: Trace | None = None,
    search_adapters: AdapterSet | None = None,
    forecast_process: str = "auto",
    progress: ProgressHook | None = None,
) -> tuple[dict[str, SimResult], dict[str, dict[str, Any]]]:
    """Simulate every policy, summarize, and search the worker count meeting the SLO.

    The production forecaster runs once per trace (:func:`make_feed`; in a child process that
    runs ahead of the simulations when ``forecast_process`` says so) and every simulation of
    that trace with a predictor policy reads its forecasts. ``progress`` hears of every
    simulation as it starts (:data:`ProgressHook`).

    Returns:
        ``(results, summaries)`` keyed by policy name, in the order given; each summary's
        ``forecast`` block gives the forecaster's compute time (shared by the policies).
    """
    results: dict[str, SimResult] = {}
    summaries: dict[str, dict[str, Any]] = {}
    feeds: dict[tuple[int, int], DemandFeed] = {}
    needs_feed = any(get_policy(p, simulated=True).predictor for p in policies)

    def feed_for(tr: Trace, ad: AdapterSet) -> DemandFeed:
        key = (id(tr), id(ad))
        if key not in feeds:
            feeds[key] = make_feed(tr, ad, config, _use_process(forecast_process, tr, config))
        return feeds[key]

    def tell(policy: str, stage: str) -> None:
        if progress is not None:
            progress(policy, stage)

    if needs_feed:
        feed_for(trace, adapters)  # start it now: a child process runs ahead meanwhile
    for name in policies:
        spec = get_policy(name, simulated=True)
        feed = feed_for(trace, adapters) if spec.predictor else None
        tell(name, "simulate")
        res = simulate(trace, adapters, spec, config, feed)
        logger.info("%s: %d requests in %.1f s wall", name, len(trace), res.wall_s)
        results[name] = res
        s = summarize(res, slo_ttft_s)
        if search_max_workers > 0:
            st = search_trace if search_trace is not None else trace
            sa = search_adapters if search_adapters is not None else adapters
            cache = {config.workers: res} if st is trace else {}
            sfeed = feed_for(st, sa) if spec.predictor else None
            t0 = time.perf_counter()

            def attainment_at(
                n: int, name=name, spec=spec, st=st, sa=sa, cache=cache, sfeed=sfeed
            ) -> float | None:
                r = cache.get(n)
                if r is None:
                    tell(name, f"search {n} workers")
                    cfg = SimConfig(**{**config.__dict__, "workers": n})
                    r = simulate(st, sa, spec, cfg, sfeed)
                return slo_attainment(r, slo_ttft_s)

            best, tried = search_min_workers(attainment_at, 0.99, search_max_workers)
            s["min_workers_for_slo"] = best
            s["workers_search"] = {
                "tried": {str(k): v for k, v in sorted(tried.items())},
                "requests": len(st),
                "wall_s": time.perf_counter() - t0,
            }
        summaries[name] = s
        tell(name, "done")
    main = feeds.get((id(trace), id(adapters)))
    for name, s in summaries.items():
        s["forecast"] = (
            {
                "compute_s": main.compute_s,
                "compute_cpu_s": main.compute_cpu_s,
                "ticks": len(main),
                "child_process": main.child_process,
                "shared_by": [p for p in policies if get_policy(p, simulated=True).predictor],
            }
            if main is not None and get_policy(name, simulated=True).predictor
            else None
        )
    for f in feeds.values():
        f.close()
    return results, summaries


#: Tokens added to a replayed prompt of ``w`` words: the replay's records show ``w`` words of
#: its synthetic prompts plus the chat template come to about ``w`` tokens (e.g. 57 tokens for
#: 64 words), so none.
REPLAY_PROMPT_OVERHEAD_TOKENS = 0


def replay_host_cache_bytes(worker_args: Sequence[str]) -> int | None:
    """The host cache a replay's workers ran with: ``--host-cache-bytes`` among the report's
    ``worker_args`` (what ``plora bench replay --host-cache-fraction`` adds), read by the
    worker's own flag parser (:meth:`services.worker.config.WorkerConfig.add_arguments`), so
    every form the worker accepted is read alike; None where the workers had the default.

    Raises:
        ConfigError: The worker arguments do not parse, or the value is not a byte size.
    """
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    WorkerConfig.add_arguments(parser)
    try:
        value = parser.parse_known_args(list(worker_args))[0].host_cache_bytes
    except argparse.ArgumentError as exc:  # a flag the worker would have refused
        raise ConfigError(f"{exc.argument_name}: {exc.message}") from None
    if value in (None, ""):
        return None
    try:
        return parse_bytes(value)
    except ConfigError as exc:
        raise ConfigError(f"--host-cache-bytes: {exc}") from None


def replay_matched_inputs(
    replay_report: dict[str, Any],
    preset_name: str = "cpu",
    trace_path: str | None = None,
    source_latencies: str | None = None,
    preset: Preset | None = None,
) -> tuple[Trace, AdapterSet, SimConfig]:
    """The trace slice, adapters and cluster size a ``plora bench replay`` report ran with.

    Uses the replay's settings: trace, format, start, duration, time scale, drop-top, seed,
    adapter count and ranks, pool bytes per worker, host cache per worker
    (:func:`replay_host_cache_bytes`; at least the pool), workers, ``max_new_tokens`` (every
    request's output length) and ``prompt_token_cap`` (prompts capped, plus
    :data:`REPLAY_PROMPT_OVERHEAD_TOKENS` of chat template). ``preset`` (e.g. one fitted to
    the replay by :func:`plora.simulator.calibrate.fit_replay`) replaces the named one.
    ``source_latencies`` (a latency CSV) replaces an ``alibaba`` source's fitted distribution
    with that file's samples (:func:`plora.simulator.presets.source_latencies`).

    Raises:
        KeyError: A setting the match needs is missing from the report.
        ConfigError: A ``--host-cache-bytes`` among its worker arguments is not a byte size.
    """
    s = replay_report["settings"]
    path = trace_path or s["trace"]
    trace = load_trace(
        path,
        s["format"],
        time_scale=float(s["time_scale"]),
        seed=int(s["seed"]),
        drop_top=int(s.get("drop_top", 0)),
        start=float(s.get("start", 0.0)),
        duration=s.get("duration"),
    )
    prompt = np.minimum(trace.prompt_tokens, int(s["prompt_token_cap"]))
    trace = Trace(
        trace.times,
        trace.key_index,
        trace.keys,
        (prompt + REPLAY_PROMPT_OVERHEAD_TOKENS).astype(np.int32),
        np.full(len(trace), int(s["max_new_tokens"]), dtype=np.int32),
        trace.fmt,
        trace.source,
    )
    base = preset if preset is not None else get_preset(preset_name)
    ranks = tuple(int(r) for r in s.get("adapter_ranks") or s.get("ranks") or base.ranks)
    pool = int(s["pool_bytes"])
    host = replay_host_cache_bytes(s.get("worker_args") or [])
    preset = base.with_overrides(
        ranks=ranks,  # per adapter (cycled by index, so a K-long list is exact)
        pool_bytes=pool,
        host_cache_bytes=max(base.host_cache_bytes if host is None else host, pool),
    )
    adapters = build_adapter_set(trace, preset, int(s["adapters"]), int(s["seed"]))
    config = SimConfig(
        preset=preset,
        workers=int(s["workers"]),
        seed=int(s["seed"]),
        source_latencies_s=preset_source_latencies(preset, source_latencies),
    )
    return trace, adapters, config


def fit_presets_to_replay(
    replay_report: dict[str, Any], replay_dir: str | Path, base: Preset | None = None
) -> tuple[dict[str, Preset], dict[str, dict[str, Any]]]:
    """Per policy of a replay, the cpu preset fitted to the machine as it was during that
    policy's run (:func:`plora.simulator.calibrate.fit_replay` on
    ``replay_dir/<policy>/requests.jsonl``); adapter sizes and ranks are those the simulator
    gives the replay's adapters (:func:`replay_matched_inputs`).

    Returns:
        ``(presets, fits)`` keyed by policy (only policies with records).
    """
    base = base or get_preset("cpu")
    _, adapters, _ = replay_matched_inputs(replay_report, preset=base)
    sizes = dict(zip(adapters.names, adapters.nbytes.tolist(), strict=True))
    ranks = dict(zip(adapters.names, adapters.ranks.tolist(), strict=True))
    presets: dict[str, Preset] = {}
    fits: dict[str, dict[str, Any]] = {}
    for p in replay_report.get("policies", []):
        if p in POLICIES and (Path(replay_dir) / p / "requests.jsonl").is_file():
            presets[p], fits[p] = fit_replay(read_records(replay_dir, [p]), sizes, ranks, base)
    return presets, fits


def validate_against_replay(
    replay_report: dict[str, Any],
    preset_name: str = "cpu",
    tolerance: float = 0.25,
    trace_path: str | None = None,
    preset: Preset | Mapping[str, Preset] | None = None,
) -> dict[str, Any]:
    """Simulate the replay's slice under its policies and compare (see
    :func:`plora.simulator.report.compare_to_replay`); the simulated summaries are included
    under ``"sim"``, the step and load figures used per policy under ``"presets"``.

    ``preset`` replaces the named preset, for every policy or (a mapping) per policy: each
    policy's replay ran on a fresh cluster at another time, on a host whose speed drifts (see
    :mod:`plora.simulator.calibrate`)."""
    names = [p for p in replay_report.get("policies", []) if p in POLICIES]
    sim: dict[str, Any] = {"policies": names}
    used: dict[str, Preset] = {}
    feed = None
    for name in names:
        pr = preset.get(name) if isinstance(preset, Mapping) else preset
        trace, adapters, config = replay_matched_inputs(
            replay_report, preset_name, trace_path, preset=pr
        )
        used[name] = config.preset
        f = None
        if POLICIES[name].predictor:
            feed = feed or make_feed(trace, adapters, config)
            f = feed
        sim[name] = summarize(simulate(trace, adapters, name, config, f), 1.0)
    out = compare_to_replay(sim, replay_report, tolerance)
    out["sim"] = {n: {k: sim[n].get(k) for k in POLICY_KEYS} for n in names}
    out["replay"] = {
        n: {k: replay_report[n].get(k) for k in POLICY_KEYS if k in replay_report[n]}
        for n in names
        if isinstance(replay_report.get(n), dict)
    }
    out["presets"] = {
        n: {"name": p.name, "step": p.step.__dict__, "source_fixed_s": p.source_fixed_s,
            "source_bytes_per_s": p.source_bytes_per_s, "page_bytes": p.page_bytes,
            "shared_compute": p.shared_compute, "network_s": p.network_s}
        for n, p in used.items()
    }  # fmt: skip
    return out


def _replay_slice(args: argparse.Namespace, seed: int) -> tuple[Trace, AdapterSet, SimConfig]:
    """``--replay-report`` with ``--policies`` and no ``--trace``: the replay's slice, adapters
    and cluster (:func:`replay_matched_inputs`) with ``--preset`` and the forecaster flags.
    The replay's settings replace ``args``' slice, adapter and worker figures, so the report's
    settings say what was simulated."""
    replay = load_replay_report(args.replay_report)
    trace, adapters, config = replay_matched_inputs(
        replay, args.preset, source_latencies=args.source_latencies
    )
    s = replay["settings"]
    args.trace, args.format = s["trace"], s["format"]
    args.time_scale, args.start = float(s["time_scale"]), float(s.get("start", 0.0))
    args.duration, args.drop_top = s.get("duration"), int(s.get("drop_top", 0))
    args.adapters, args.workers = int(s["adapters"]), int(s["workers"])
    own = _config(args, config.workers, seed)
    return (
        trace,
        adapters,
        replace(
            own, preset=_preset(args, config.preset), source_latencies_s=config.source_latencies_s
        ),
    )


#: Settings of a replay report that :func:`replay_matched_inputs` reads.
REPLAY_SETTINGS = (
    "trace", "format", "time_scale", "seed", "adapters", "pool_bytes", "workers",
    "max_new_tokens", "prompt_token_cap",
)  # fmt: skip


def replay_report_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot serve as ``--replay-report`` (a sentence), or None when it can: it
    must be a ``plora bench replay`` report.json whose settings hold :data:`REPLAY_SETTINGS`,
    whose trace file exists, and whose worker arguments parse as the worker's flags with a
    ``--host-cache-bytes``, if any, that is a byte size."""
    try:
        replay = load_replay_report(path)
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at line {exc.lineno}): not a plora bench replay report.json"
    except ValueError:  # JSON without a 'policies' list
        return "no 'policies' list: not a plora bench replay report.json"
    s = replay.get("settings")
    if not isinstance(s, dict):
        return "its 'settings' are missing: not a plora bench replay report.json"
    missing = [k for k in REPLAY_SETTINGS if k not in s]
    if missing:
        return f"its settings lack {', '.join(missing)}: not a plora bench replay report.json"
    if not Path(str(s["trace"])).is_file():
        return f"the trace it replayed, {s['trace']}, is not a file here"
    try:
        replay_host_cache_bytes(s.get("worker_args") or [])
    except ConfigError as exc:
        return f"its worker argument {exc}"
    return None


def _validation(replay_report: str | Path) -> dict[str, Any]:
    """:func:`validate_against_replay` of a replay report file, with the per-policy fits."""
    replay = load_replay_report(replay_report)
    presets, fits = fit_presets_to_replay(replay, Path(replay_report).parent)
    validation = validate_against_replay(replay, "cpu", preset=presets)
    validation["fits"] = fits
    return validation


def _print_validation(validation: dict[str, Any]) -> None:
    print(f"{'validation':<28}{'sim':>10}{'live':>10}{'rel.err':>10}  within")
    for policy, block in validation["policies"].items():
        for key, v in block.items():
            print(
                f"{policy + ' ' + key:<28}{v['sim']:>10.4f}{v['replay']:>10.4f}"
                f"{v['rel_error']:>10.3f}  {'yes' if v['within'] else 'NO'}"
            )


def environment() -> dict[str, Any]:
    """Where the simulation ran: versions and the CPU's vector capability torch dispatches to.

    The figures of the policies with a forecaster depend on the LSTM's floating-point results,
    which differ with the CPU's vector units (AVX2 or AVX-512 kernels) and the torch build, and
    the simulation carries any such difference on as another seed would; so compare ``plora``
    figures measured in the same environment. Returns ``python``, ``torch``, ``numpy``,
    ``torch_cpu_capability`` (``torch.backends.cpu.get_cpu_capability()``, e.g. ``AVX512``)
    and ``machine``.
    """
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``plora simulate``."""
    replay_slice = bool(args.replay_report) and args.trace is None and args.format is None
    if not replay_slice and (args.trace is None or args.format is None):
        print(
            "plora simulate: give --trace and --format (or --replay-report alone, to simulate "
            "a replay's own slice)",
            file=sys.stderr,
        )
        return 2
    if args.replay_report:
        problem = replay_report_problem(args.replay_report)
        if problem is not None:
            print(
                f"plora simulate: --replay-report {args.replay_report}: {problem}", file=sys.stderr
            )
            return 2
    if replay_slice and args.policies is None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        validation = _validation(args.replay_report)
        (out / "report.json").write_text(
            json.dumps({"validation": validation}, indent=2, default=_json_default) + "\n"
        )
        _print_validation(validation)
        print(f"wrote {out / 'report.json'}")
        return 0
    policies = [p.strip() for p in (args.policies or DEFAULT_POLICIES).split(",") if p.strip()]
    for p in policies:
        get_policy(p, simulated=True)  # fail fast on a typo
    if args.seeds < 1:
        print(f"plora simulate: --seeds {args.seeds}: give 1 or more", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    seeds = list(range(args.seed, args.seed + args.seeds))
    if replay_slice:
        trace, adapters, config = _replay_slice(args, seeds[0])
    else:
        trace = load_trace(
            args.trace,
            args.format,
            time_scale=args.time_scale,
            seed=args.seed,
            drop_top=args.drop_top,
            start=args.start,
            duration=args.duration,
        )
        config = _config(args, args.workers, seeds[0])
        adapters = build_adapter_set(trace, config.preset, args.adapters, args.seed)
    load_s = time.perf_counter() - t0
    search_trace = search_adapters = None
    if args.search_duration is not None:
        search_trace = trace.sliced(0.0, args.search_duration)
        search_adapters = build_adapter_set(search_trace, config.preset, args.adapters, args.seed)
    # A progress bar on stderr, only when it is a terminal; log lines print above it.
    with (
        tqdm(
            total=len(policies) * len(seeds), desc="simulate", unit="run", disable=None, leave=False
        ) as bar,
        logging_redirect_tqdm(),
    ):
        runs: list[dict[str, dict[str, Any]]] = []
        pairs: list[dict[str, Any]] = []  # the ablation over requests both completed, per seed
        results: dict[str, SimResult] = {}
        for seed in seeds:

            def progress(policy: str, stage: str, seed: int = seed) -> None:
                if stage == "done":
                    bar.update(1)
                else:
                    label = f"{policy} seed {seed}" if len(seeds) > 1 else policy
                    bar.set_postfix_str(f"{label}: {stage}")

            seed_results, seed_summaries = run_simulations(
                trace,
                adapters,
                policies,
                SimConfig(**{**config.__dict__, "seed": seed}),
                args.slo_ttft,
                args.search_max_workers if seed == seeds[0] else 0,
                search_trace,
                search_adapters,
                args.forecast_process,
                progress,
            )
            if seed == seeds[0]:
                results = seed_results
            runs.append(seed_summaries)
            if "plora" in seed_results and "plora-no-predictor" in seed_results:
                pairs.append(
                    completed_by_both(seed_results["plora"], seed_results["plora-no-predictor"])
                )
    summaries = {n: mean_over_seeds([r[n] for r in runs], seeds) for n in policies}
    curves = {n: slo_vs_load(r, args.slo_ttft) for n, r in results.items()}
    for n in summaries:
        summaries[n]["slo_vs_load"] = curves[n]
    report: dict[str, Any] = {
        "environment": environment(),
        "settings": {
            "preset": args.preset,
            "rank_mode": config.preset.step.rank_mode,
            "workers": args.workers,
            "gateways": args.gateways,
            "policies": policies,
            "adapters": args.adapters,
            "seed": args.seed,
            "seeds": seeds,
            "slo_ttft_s": args.slo_ttft,
            "forecaster": args.forecaster,
            "train_every": args.train_every,
            "prefetch_min_probability": args.prefetch_min_probability,
            "view_refresh_s": args.view_refresh,
            "time_scale": args.time_scale,
            "start": args.start,
            "duration": args.duration,
            "drop_top": args.drop_top,
            "search_max_workers": args.search_max_workers,
            "search_duration": args.search_duration,
            "source_latencies": args.source_latencies,
            "preset_figures": {
                k: v for k, v in config.preset.__dict__.items() if k not in ("model", "step")
            }
            | {"step": config.preset.step.__dict__, "model": config.preset.model.name},
        },
        "trace": {
            "path": str(args.trace),
            "format": args.format,
            "requests": len(trace),
            "keys": len(trace.keys),
            "duration_s": trace.duration,
            "load_wall_s": load_s,
        },
        "policies": policies,
    }
    for n, s in summaries.items():
        report[n] = s
    report["comparison"] = comparison_block(summaries)
    if pairs and report["comparison"] is not None:
        report["comparison"]["predictor_completed_by_both"] = completed_by_both_block(pairs)
    report["papers"] = paper_comparison(summaries)
    if args.replay_report:
        report["validation"] = _validation(args.replay_report)
    report["plots"] = write_plots(out, results, summaries, args.slo_ttft, curves)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    _print_table(report, policies)
    if args.replay_report:
        _print_validation(report["validation"])
    print(f"wrote {out / 'report.json'}")
    return 0


def _json_default(o: object) -> object:
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _print_table(report: dict[str, Any], policies: list[str]) -> None:
    cols = [
        ("completed", "done"),
        ("failed", "failed"),
        ("ttft_mean_s", "ttft_mean"),
        ("ttft_p99_s", "ttft_p99"),
        ("throughput_req_s", "req/s"),
        ("cold_start_rate", "cold_rate"),
        ("cold_start_wait_mean_s", "cold_wait"),
        ("pool_utilization_under_pressure", "util"),
        ("external_fragmentation", "frag"),
        ("slo_attainment", "slo"),
        ("worker_requests_max_over_min", "w_max/min"),
        ("min_workers_for_slo", "min_w"),
        ("sim_wall_s", "wall_s"),
        ("sim_cpu_s", "cpu_s"),
    ]
    head = f"{'policy':<20}" + "".join(f"{h:>11}" for _, h in cols)
    print(head)
    for p in policies:
        s = report[p]
        print(f"{p:<20}" + "".join(f"{_fmt(s.get(k)):>11}" for k, _ in cols))
    ablation = ablation_text(report.get("comparison"))
    if ablation:
        print(ablation)
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m plora.simulator.run``)."""
    parser = argparse.ArgumentParser(prog="plora simulate", description=__doc__)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
