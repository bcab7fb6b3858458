"""Records of a trace replay and the pure statistics over them (``plora bench replay``).

Definitions (docs/architecture.md; times in seconds):

- **TTFT** here is measured by the client: send of the ``Generate`` call -> the first response
  message that carries a token. It includes the gateway, the queue and the adapter wait.
- **End-to-end latency**: send -> the last message of the stream.
- **Cold start**: a completed request whose last message says ``adapter_cold``. ``cold_starts``
  counts them, ``cold_start_rate = cold_starts / completed``. **Cold-start latency** is the
  request's ``adapter_wait_seconds`` (0 for a warm request); ``cold_start_wait_mean_s`` is its
  mean over *all* completed requests (so it falls when either the count or the wait falls), and
  ``cold_start_wait_mean_cold_s`` / ``cold_start_wait_p99_cold_s`` are over the cold ones only.
- **Throughput**: completed requests (completion tokens) / makespan, where the makespan runs
  from the first send to the last completion. In an open-loop replay both policies see the same
  arrivals, so the ratio departs from 1 only when one policy falls behind the arrivals (its
  makespan stretches) or fails requests.
- **Failed**: every request that did not complete: gRPC errors (by status code name) and
  ``CLIENT_DROPPED`` — requests the client refused to send because ``concurrency`` calls were
  already in flight (open-loop arrivals are never delayed; an arrival beyond the bound is
  dropped and counted here).
- **Pool utilization under pressure**: the workers' own figure
  (``PoolStats.utilization_under_pressure``: live bytes / pool bytes averaged over the store's
  pressure samples), taken from the last status sample and averaged over the workers that saw
  pressure. ``pool_utilization_under_pressure_sampled`` is the client's cross-check: mean of
  ``utilization`` over the 1 s status samples in which the worker's eviction counter rose.
- **External fragmentation**: ``PoolStats.external_fragmentation`` (1 - largest allocatable
  extent / free bytes) averaged over the same pressure samples (all samples with pages in use
  when no sample saw pressure).
- **Compulsory cold rate** (the trace's floor): the share of requests whose adapter never
  appeared earlier in the slice. The pool starts empty and no predictor can forecast an adapter
  it has never seen, so no policy can serve those warm.
- **Comparison** (plora vs baseline): ``reduction = 1 - plora / baseline``,
  ``ratio = plora / baseline``; ``null`` when the baseline figure is 0 or missing.
  ``baseline_cold_wait_share_of_ttft`` = the baseline's ``cold_start_wait_mean_s /
  ttft_mean_s``: the mean-TTFT reduction a policy would get from removing every cold-start
  wait and changing nothing else (where prefill and queueing, not adapter loads, make most of
  the TTFT, a TTFT target above it needs faster serving, not fewer or shorter cold starts).
- **Uncontended TTFT** (the machine's floor): ``ttft_uncontended_s`` is the mean TTFT of
  ``--ttft-probes`` base-model requests sent one at a time to the idle cluster before the
  replay, with prompts of requests spread over the slice (so the slice's prompt lengths): one
  prefill each, no queue, no batch to share, no adapter load. No policy serves the slice's
  requests faster on average (an adapter adds LoRA work), so
  ``ttft_mean_reduction_ceiling = 1 - floor / baseline ttft_mean_s`` (floor = the mean of the
  two policies' figures) is the largest ``ttft_mean_reduction`` any policy could reach on this
  machine, and ``ttft_gap_closed = ttft_mean_reduction / ttft_mean_reduction_ceiling`` the
  share of the baseline's TTFT above that floor the compared policy removed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Status of a request the client did not send because the in-flight bound was reached.
CLIENT_DROPPED = "CLIENT_DROPPED"
#: Status of a request that completed.
OK = "OK"

#: Per-policy keys of report.json (the issue's contract).
POLICY_KEYS: tuple[str, ...] = (
    "requests",
    "completed",
    "failed",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "throughput_req_s",
    "throughput_tok_s",
    "cold_starts",
    "cold_start_rate",
    "cold_start_wait_mean_s",
    "pool_utilization_under_pressure",
    "external_fragmentation",
)
#: Keys of the ``comparison`` block.
COMPARISON_KEYS: tuple[str, ...] = (
    "ttft_mean_reduction",
    "cold_start_wait_reduction",
    "cold_start_count_reduction",
    "throughput_ratio",
)


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one replayed request.

    Attributes:
        index: Position of the arrival in the replayed slice.
        adapter_id: Adapter the request named.
        trace_key: The trace's key (tenant, function) the adapter stands for.
        scheduled_s: Arrival time in the slice, seconds (scaled clock, replay start = 0).
        sent_s: When the call was sent, seconds since the replay start; ``None`` if never sent.
        first_token_s: When the first token arrived; ``None`` if none did.
        end_s: When the stream ended (or failed); ``None`` if never sent.
        status: ``"OK"``, a gRPC status code name (``"UNAVAILABLE"``...), or ``CLIENT_DROPPED``.
        prompt_tokens: ``usage.prompt_tokens`` of the response (0 if it failed).
        completion_tokens: ``usage.completion_tokens`` (0 if it failed).
        adapter_cold: The worker had to wait for the adapter to load.
        adapter_wait_s: Seconds the request waited for its adapter (0 when warm).
        worker_id: Worker that served it ("" if none).
        worker_ttft_s: Worker receipt -> first token, as the worker measured it.
        error: The error message of a failed request.
    """

    index: int
    adapter_id: str
    trace_key: str
    scheduled_s: float
    sent_s: float | None
    first_token_s: float | None
    end_s: float | None
    status: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter_cold: bool = False
    adapter_wait_s: float = 0.0
    worker_id: str = ""
    worker_ttft_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def ttft_s(self) -> float | None:
        """Client-measured TTFT (send -> first token), ``None`` without a token."""
        if self.sent_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def latency_s(self) -> float | None:
        """Send -> end of stream, ``None`` if never sent."""
        if self.sent_s is None or self.end_s is None:
            return None
        return self.end_s - self.sent_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class WorkerSample:
    """One worker's pool figures in one status sample (``PoolStats`` + queue)."""

    worker_id: str
    utilization: float
    utilization_under_pressure: float
    external_fragmentation: float
    loads: int
    evictions: int
    cold_starts: int
    pages_used: int = 0
    pages_total: int = 0
    live_bytes: int = 0
    pool_bytes: int = 0
    queue_length: int = 0
    running: int = 0
    resident_adapters: int = 0


@dataclass(frozen=True)
class StatusSample:
    """One ``GetClusterStatus`` sample: ``t`` seconds since the replay start."""

    t: float
    workers: tuple[WorkerSample, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"t": self.t, "workers": [asdict(w) for w in self.workers]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StatusSample:
        return cls(float(d["t"]), tuple(WorkerSample(**w) for w in d["workers"]))


# ------------------------------------------------------------------------- basic statistics
def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear interpolation as numpy); ``None`` when empty."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return None
    return float(np.percentile(arr, q))


def mean(values: Iterable[float]) -> float | None:
    """Arithmetic mean; ``None`` when empty."""
    arr = np.asarray(list(values), dtype=np.float64)
    return float(arr.mean()) if arr.size else None


def reduction(plora: float | None, baseline: float | None) -> float | None:
    """``1 - plora / baseline``; ``None`` when either is missing or the baseline is 0."""
    if plora is None or baseline is None or baseline == 0:
        return None
    return 1.0 - plora / baseline


def ratio(plora: float | None, baseline: float | None) -> float | None:
    """``plora / baseline``; ``None`` when either is missing or the baseline is 0."""
    if plora is None or baseline is None or baseline == 0:
        return None
    return plora / baseline


def compulsory_cold_rate(keys: Sequence[str]) -> float | None:
    """Share of requests whose key never appeared earlier in ``keys`` (first occurrences / n).

    Args:
        keys: The adapter (or trace key) of each request, in arrival order.

    Returns:
        ``distinct(keys) / len(keys)``; ``None`` for an empty sequence.
    """
    if not keys:
        return None
    return len(set(keys)) / len(keys)


# ------------------------------------------------------------------------- per-policy figures
def request_stats(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT, latency, throughput and cold-start figures of one replay (see the module doc)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    by_status: dict[str, int] = {}
    for r in failed:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    ttft = [t for r in done if (t := r.ttft_s) is not None]
    lat = [t for r in done if (t := r.latency_s) is not None]
    sent = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.end_s for r in done if r.end_s is not None]
    makespan = (max(ends) - min(sent)) if ends and sent else 0.0
    tokens = sum(r.completion_tokens for r in done)
    cold = [r for r in done if r.adapter_cold]
    waits = [r.adapter_wait_s if r.adapter_cold else 0.0 for r in done]
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "dropped": by_status.get(CLIENT_DROPPED, 0),
        "failed_by_status": dict(sorted(by_status.items())),
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "latency_mean_s": mean(lat),
        "latency_p99_s": percentile(lat, 99),
        "makespan_s": makespan,
        "throughput_req_s": len(done) / makespan if makespan > 0 else 0.0,
        "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "completion_tokens": tokens,
        "cold_starts": len(cold),
        "cold_start_rate": len(cold) / len(done) if done else None,
        "cold_start_wait_mean_s": mean(waits),
        "cold_start_wait_mean_cold_s": mean(r.adapter_wait_s for r in cold),
        "cold_start_wait_p99_cold_s": percentile((r.adapter_wait_s for r in cold), 99),
        "requests_by_worker": _count(r.worker_id for r in done),
    }


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def pressure_flags(samples: Sequence[StatusSample]) -> list[list[tuple[WorkerSample, bool]]]:
    """Per sample, each worker's figures and whether its eviction counter rose since that
    worker's previous sample (the pool was under pressure in the interval)."""
    prev: dict[str, int] = {}
    out = []
    for s in samples:
        row = []
        for w in s.workers:
            before = prev.get(w.worker_id)
            row.append((w, before is not None and w.evictions > before))
            prev[w.worker_id] = w.evictions
        out.append(row)
    return out


def pool_stats(samples: Sequence[StatusSample]) -> dict[str, Any]:
    """Pool figures of one replay from its 1 s status samples (see the module doc)."""
    flags = pressure_flags(samples)
    pressured = [w for row in flags for w, p in row if p]
    if pressured:
        frag_src = pressured
    else:
        frag_src = [w for row in flags for w, _ in row if w.pages_used > 0]
    last: dict[str, WorkerSample] = {}
    first: dict[str, WorkerSample] = {}
    for s in samples:
        for w in s.workers:
            first.setdefault(w.worker_id, w)
            last[w.worker_id] = w
    reported = [
        w.utilization_under_pressure for w in last.values() if w.utilization_under_pressure > 0
    ]
    return {
        "pool_utilization_under_pressure": mean(reported),
        "pool_utilization_under_pressure_sampled": mean(w.utilization for w in pressured),
        "external_fragmentation": mean(w.external_fragmentation for w in frag_src),
        "external_fragmentation_max": max(
            (w.external_fragmentation for w in frag_src), default=None
        ),
        "pressure_samples": len(pressured),
        "pool_bytes_per_worker": max((w.pool_bytes for w in last.values()), default=0),
        "pool_loads": sum(last[k].loads - first[k].loads for k in last),
        "pool_evictions": sum(last[k].evictions - first[k].evictions for k in last),
        "pool_cold_starts": sum(last[k].cold_starts - first[k].cold_starts for k in last),
        "status_samples": len(samples),
    }


def summarize_policy(
    records: Sequence[RequestRecord],
    samples: Sequence[StatusSample],
    uncontended_ttft: Sequence[float] = (),
) -> dict[str, Any]:
    """Every per-policy figure of report.json (:data:`POLICY_KEYS` and extras);
    ``uncontended_ttft`` (seconds, the probes sent before the replay) gives
    ``ttft_uncontended_s`` (their mean, ``None`` without probes) and ``ttft_uncontended_probes``."""
    return {
        **request_stats(records),
        **pool_stats(samples),
        "ttft_uncontended_s": mean(uncontended_ttft),
        "ttft_uncontended_probes": len(uncontended_ttft),
    }


def compare(plora: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, float | None]:
    """The ``comparison`` block: plora vs baseline (reduction = 1 - p/b; ratio = p/b); the
    TTFT floor is the mean of the two policies' ``ttft_uncontended_s`` (the same engine and
    prompts: they differ only by the machine's noise)."""
    floor = mean(
        v
        for v in (plora.get("ttft_uncontended_s"), baseline.get("ttft_uncontended_s"))
        if v is not None
    )
    ttft_reduction = reduction(plora.get("ttft_mean_s"), baseline.get("ttft_mean_s"))
    ceiling = reduction(floor, baseline.get("ttft_mean_s"))
    return {
        "ttft_mean_reduction": ttft_reduction,
        "ttft_p99_reduction": reduction(plora.get("ttft_p99_s"), baseline.get("ttft_p99_s")),
        "cold_start_wait_reduction": reduction(
            plora.get("cold_start_wait_mean_s"), baseline.get("cold_start_wait_mean_s")
        ),
        "cold_start_count_reduction": reduction(
            plora.get("cold_starts"), baseline.get("cold_starts")
        ),
        "cold_start_rate_reduction": reduction(
            plora.get("cold_start_rate"), baseline.get("cold_start_rate")
        ),
        "throughput_ratio": ratio(plora.get("throughput_req_s"), baseline.get("throughput_req_s")),
        "throughput_tok_ratio": ratio(
            plora.get("throughput_tok_s"), baseline.get("throughput_tok_s")
        ),
        "baseline_cold_wait_share_of_ttft": ratio(
            baseline.get("cold_start_wait_mean_s"), baseline.get("ttft_mean_s")
        ),
        "ttft_mean_reduction_ceiling": ceiling,
        "ttft_gap_closed": ratio(ttft_reduction, ceiling),
    }


def build_report(
    settings: Mapping[str, Any],
    trace_info: Mapping[str, Any],
    summaries: Mapping[str, Mapping[str, Any]],
    compare_pair: tuple[str, str] = ("plora", "baseline"),
    repeats: Mapping[str, Any] | None = None,
    completed_by_both: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Assemble report.json: ``settings``, ``trace``, ``compulsory_cold_rate``, one block per
    policy (keyed by the policy name; a policy that failed holds ``{"error": ...}``),
    ``policies`` (their order) and ``comparison``: ``compare_pair``'s figures when both ran
    without error, and the predictor's ablation (``predictor_ttft_reduction`` and its p99 and
    cold-start-wait kin, ``plora`` against ``plora-no-predictor``) when those two did; ``None``
    when neither holds. Over repeated rounds the policy blocks are
    :func:`mean_of_rounds`, the comparison is taken between those means, and ``repeats``
    (given) holds the rounds' order, their own comparisons and :func:`comparison_spread`.
    ``completed_by_both`` (:func:`records_over_both` of each round) adds the ablation over the
    requests both policies completed, ``comparison.predictor_completed_by_both``
    (:func:`completed_by_both_block`, each round's under ``round_runs``)."""
    a, b = compare_pair
    report: dict[str, Any] = {
        "settings": dict(settings),
        "comparison_pair": [a, b],
        "trace": dict(trace_info),
        "compulsory_cold_rate": trace_info.get("compulsory_cold_rate"),
        "policies": list(summaries),
    }
    for name, s in summaries.items():
        report[name] = dict(s)
    pair = [summaries.get(a), summaries.get(b)]
    report["comparison"] = (
        compare(pair[0], pair[1])
        if pair[0] is not None
        and pair[1] is not None
        and "error" not in pair[0]
        and "error" not in pair[1]
        else None
    )
    p, n = summaries.get("plora"), summaries.get("plora-no-predictor")
    if p is not None and n is not None and "error" not in p and "error" not in n:
        report["comparison"] = (report["comparison"] or {}) | predictor_reductions(p, n)
        if completed_by_both:
            report["comparison"]["predictor_completed_by_both"] = completed_by_both_block(
                completed_by_both, runs_key="round_runs"
            )
    if repeats is not None:
        report["repeats"] = dict(repeats)
    return report


def predictor_reductions(
    plora: Mapping[str, Any], no_predictor: Mapping[str, Any]
) -> dict[str, float | None]:
    """The predictor's ablation: ``predictor_ttft_reduction``, ``predictor_ttft_p99_reduction``
    and ``predictor_cold_start_wait_reduction`` (:func:`reduction` of ``plora``'s figure
    against ``plora-no-predictor``'s; None where either is missing)."""
    return {
        f"predictor_{name}": reduction(plora.get(key), no_predictor.get(key))
        for name, key in (
            ("ttft_reduction", "ttft_mean_s"),
            ("ttft_p99_reduction", "ttft_p99_s"),
            ("cold_start_wait_reduction", "cold_start_wait_mean_s"),
        )
    }


#: The per-run reductions of the predictor's ablation: ``(name, figure it reduces)``.
RUN_REDUCTIONS: tuple[tuple[str, str], ...] = (
    ("ttft_reduction", "ttft_mean_s"),
    ("ttft_p99_reduction", "ttft_p99_s"),
)


def ttft_over_both(plora: np.ndarray, no_predictor: np.ndarray) -> dict[str, Any]:
    """TTFT of ``plora`` and ``plora-no-predictor`` over the requests both runs completed.

    TTFT figures count completed requests only, so where one policy serves late a request the
    other fails, the first looks slower on a request the second never answered; over the
    requests both completed it does not.

    Args:
        plora: ``float64 [n]`` TTFT seconds of the same ``n`` requests under ``plora``, NaN
            where the request failed.
        no_predictor: The same under ``plora-no-predictor``.

    Returns:
        ``{"requests": m, "ttft_mean_s": [plora, no_predictor], "ttft_p99_s": [plora,
        no_predictor]}`` over the ``m`` requests both completed, in seconds (``None`` figures
        when ``m`` is 0).

    Raises:
        ValueError: the arrays differ in length.
    """
    if plora.shape != no_predictor.shape:
        raise ValueError("the runs are of different traces")
    both = ~np.isnan(plora) & ~np.isnan(no_predictor)
    m = int(both.sum())
    runs = (plora[both], no_predictor[both])
    return {
        "requests": m,
        "ttft_mean_s": [float(t.mean()) if m else None for t in runs],
        "ttft_p99_s": [float(np.percentile(t, 99)) if m else None for t in runs],
    }


def records_over_both(
    plora: Sequence[RequestRecord], no_predictor: Sequence[RequestRecord]
) -> dict[str, Any]:
    """:func:`ttft_over_both` of two replays of the same slice (requests paired by
    :attr:`RequestRecord.index`; a request without a first token counts as failed).

    Raises:
        ValueError: the replays hold different requests.
    """

    def ttft(records: Sequence[RequestRecord]) -> dict[int, float]:
        return {r.index: (t if r.ok and (t := r.ttft_s) is not None else math.nan) for r in records}

    a, b = ttft(plora), ttft(no_predictor)
    if a.keys() != b.keys():
        raise ValueError("the replays hold different requests")
    keys = sorted(a)
    return ttft_over_both(
        np.array([a[k] for k in keys], dtype=np.float64),
        np.array([b[k] for k in keys], dtype=np.float64),
    )


def completed_by_both_block(
    runs: Sequence[Mapping[str, Any]], runs_key: str = "seed_runs"
) -> dict[str, Any]:
    """report.json's ``comparison.predictor_completed_by_both``: the predictor's ablation over
    the requests both policies completed (:func:`ttft_over_both`, one per simulated seed or
    replayed round), as ``ttft_reduction`` and ``ttft_p99_reduction`` of the runs' mean
    figures, with each run's under ``runs_key`` and the mean request count under
    ``requests``."""

    def avg(key: str, i: int) -> float | None:
        vals = [r[key][i] for r in runs]
        return None if any(v is None for v in vals) else float(np.mean(vals))

    return {
        "requests": float(np.mean([r["requests"] for r in runs])),
        "ttft_reduction": reduction(avg("ttft_mean_s", 0), avg("ttft_mean_s", 1)),
        "ttft_p99_reduction": reduction(avg("ttft_p99_s", 0), avg("ttft_p99_s", 1)),
        runs_key: {name: [reduction(*r[key]) for r in runs] for name, key in RUN_REDUCTIONS},
    }


def mean_of_rounds(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One policy's figures over repeated rounds (``plora bench replay --repeats N``).

    Every numeric figure is the mean of the rounds' figures (``None`` values left out; ``None``
    when every round has ``None``; a figure every round agrees on keeps its value and type),
    so ``ttft_mean_s`` equals the mean over all the rounds' requests (each round replays the
    same requests) and ``ttft_p99_s`` is the mean of the rounds' p99s. Nested figures
    (``requests_by_worker``, ``failed_by_status``, ``service_usage``, ``phase_seconds``) are
    averaged key by key, a key a round lacks counting as 0 there (they are counts and
    seconds); lists of numbers of one length element by element. Other values are the first
    round's. Adds ``rounds`` (how many were averaged).

    Raises:
        ValueError: ``summaries`` is empty.
    """
    if not summaries:
        raise ValueError("no rounds to average")
    out = _mean_dicts(summaries, missing_is_zero=False)
    out["rounds"] = len(summaries)
    return out


def _mean_dicts(dicts: Sequence[Mapping[str, Any]], *, missing_is_zero: bool) -> dict[str, Any]:
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    out: dict[str, Any] = {}
    for k in keys:
        present = [v for d in dicts if (v := d.get(k)) is not None]
        if present and all(isinstance(v, Mapping) for v in present):
            out[k] = _mean_dicts(present, missing_is_zero=True)
        elif present and all(_is_number(v) for v in present):
            n = len(dicts) if missing_is_zero else len(present)
            same = n == len(present) and all(v == present[0] for v in present)
            out[k] = present[0] if same else float(sum(present) / n)
        elif _number_lists_of_one_length(present):
            same = all(v == present[0] for v in present)
            columns = zip(*present, strict=True)
            out[k] = present[0] if same else [float(sum(c) / len(c)) for c in columns]
        else:
            out[k] = present[0] if present else None
    return out


def _nested(v: Any) -> bool:
    """A comparison entry that is a block of figures, not one figure."""
    return isinstance(v, Mapping)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number_lists_of_one_length(values: Sequence[Any]) -> bool:
    return (
        bool(values)
        and all(isinstance(v, list) and len(v) == len(values[0]) for v in values)
        and all(_is_number(x) for v in values for x in v)
    )


def comparison_spread(
    per_round: Sequence[Mapping[str, float | None]],
) -> dict[str, dict[str, float | None]]:
    """Per comparison key, ``mean``, ``min``, ``max`` and ``stdev`` (sample standard deviation,
    ``None`` under two rounds) over the rounds' own comparisons; rounds where a figure is
    ``None`` are left out of it. The spread says how far one run of the benchmark can be
    trusted on this machine: its load changes from run to run."""
    keys = list(dict.fromkeys(k for c in per_round for k, v in c.items() if not _nested(v)))
    out: dict[str, dict[str, float | None]] = {}
    for k in keys:
        vals = [float(v) for c in per_round if (v := c.get(k)) is not None and not _nested(v)]
        if not vals:
            out[k] = {"mean": None, "min": None, "max": None, "stdev": None}
            continue
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
        out[k] = {"mean": m, "min": min(vals), "max": max(vals), "stdev": sd}
    return out


# ------------------------------------------------------------------------- time series
def series_cold_starts(samples: Sequence[StatusSample]) -> tuple[np.ndarray, np.ndarray]:
    """``(t [n] s, cumulative cold starts [n])`` summed over workers, from the status samples."""
    t = np.array([s.t for s in samples], dtype=np.float64)
    c = np.array([sum(w.cold_starts for w in s.workers) for s in samples], dtype=np.float64)
    return t, c


def series_pool_utilization(samples: Sequence[StatusSample]) -> tuple[np.ndarray, np.ndarray]:
    """``(t [n] s, utilization [n])``: live bytes / pool bytes averaged over the workers."""
    t = np.array([s.t for s in samples], dtype=np.float64)
    u = np.array([mean(w.utilization for w in s.workers) or 0.0 for s in samples], dtype=np.float64)
    return t, u


def ttft_cdf(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """``(sorted TTFT [n] s, cumulative share [n])`` of the completed requests."""
    x = np.sort(np.array([t for r in records if r.ok and (t := r.ttft_s) is not None]))
    y = np.arange(1, len(x) + 1, dtype=np.float64) / max(len(x), 1)
    return x, y


def write_plots(
    out_dir: Path,
    records: Mapping[str, Sequence[RequestRecord]],
    samples: Mapping[str, Sequence[StatusSample]],
) -> list[Path]:
    """Write ``ttft_cdf.png``, ``cold_starts_over_time.png`` and
    ``pool_utilization_over_time.png`` (one line per policy) with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, recs in records.items():
        x, y = ttft_cdf(recs)
        if len(x):
            ax.step(x, y, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, client send -> first token)")
    ax.set_ylabel("share of completed requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, ss in samples.items():
        t, c = series_cold_starts(ss)
        ax.plot(t, c, label=name)
    ax.set_xlabel("replay time (s)")
    ax.set_ylabel("cold starts (cumulative, all workers)")
    ax.set_title("Cold starts over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir / "cold_starts_over_time.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, ss in samples.items():
        t, u = series_pool_utilization(ss)
        ax.plot(t, u, label=name)
    ax.set_xlabel("replay time (s)")
    ax.set_ylabel("pool utilization (live / pool bytes, mean over workers)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Device pool utilization over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir / "pool_utilization_over_time.png"))
    plt.close("all")
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ------------------------------------------------------------------------- Markdown
def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def render_markdown(report: Mapping[str, Any]) -> str:
    """report.md: settings, the per-policy table, the comparison beside the targets and the
    trace floor, and the definitions used."""
    s = report["settings"]
    tr = report["trace"]
    names = list(report["policies"])
    lines = [
        "# Trace replay on the live cluster",
        "",
        f"Trace `{s.get('trace')}` ({s.get('format')}), slice start {s.get('start')} s, "
        f"duration {s.get('duration')} s of the clock compressed {s.get('time_scale')}x: "
        f"{tr.get('requests')} requests over {tr.get('keys')} trace keys mapped onto "
        f"{tr.get('adapters_used')} of {s.get('adapters')} adapters (ranks {s.get('ranks')}).",
        "",
        f"Cluster per policy: {s.get('workers')} workers, device pool {s.get('pool_bytes')} "
        f"bytes per worker ({_fmt(s.get('pool_fraction'), 3)} of the "
        f"{s.get('adapter_bytes_total')} bytes of all adapters), max_new_tokens "
        f"{s.get('max_new_tokens')}, prompts capped at "
        f"{s.get('prompt_token_cap')} tokens, client concurrency {s.get('concurrency')}, "
        f"seed {s.get('seed')}. Wall time {_fmt(s.get('wall_time_s'), 1)} s.",
        "",
        "| figure | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    extra = (
        "dropped",
        "latency_mean_s",
        "cold_start_wait_mean_cold_s",
        "pool_utilization_under_pressure_sampled",
        "pool_loads",
        "pool_evictions",
        "pool_cold_starts",
        "ttft_uncontended_s",
    )
    for key in (*POLICY_KEYS, *extra):
        lines.append(f"| {key} | " + " | ".join(_fmt(report[n].get(key)) for n in names) + " |")
    lines += [
        "",
        f"Trace floor: compulsory_cold_rate = {_fmt(report.get('compulsory_cold_rate'))} "
        "(share of requests whose adapter had not appeared earlier in the slice; no "
        "policy can serve those warm).",
        "",
    ]
    comp = report.get("comparison")
    if comp and comp.get("ttft_mean_reduction_ceiling") is not None:
        lines += [
            "Machine floor: ttft_uncontended_s (one prefill on the idle cluster, prompts from "
            "the slice) bounds ttft_mean_reduction at "
            f"{_fmt(comp.get('ttft_mean_reduction_ceiling'))} (ttft_mean_reduction_ceiling); "
            f"the compared policy closed {_fmt(comp.get('ttft_gap_closed'))} of that gap "
            "(ttft_gap_closed).",
            "",
        ]
    if comp:
        targets = {
            "cold_start_wait_reduction": ">= 0.68",
            "ttft_mean_reduction": ">= 0.35",
            "throughput_ratio": ">= 1.0",
        }
        pa, pb = report.get("comparison_pair") or ("plora", "baseline")
        rep = report.get("repeats")
        if rep:
            spread = rep.get("spread") or {}
            lines += [
                f"Over {rep.get('rounds')} rounds (policy order alternating: "
                + "; ".join(" then ".join(o) for o in rep.get("order") or [])
                + "); the policy figures above are the rounds' means, the comparison is "
                "taken between those means; the rounds' own comparisons beside it:",
                "",
                f"| comparison ({pa} vs {pb}) | of the means | round mean | min | max | stdev "
                "| per round | paper target |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for k, v in _flat(comp):
                sp = spread.get(k) or {}
                per = ", ".join(_fmt(c.get(k)) for c in rep.get("comparison_per_round") or [])
                lines.append(
                    f"| {k} | {_fmt(v)} | {_fmt(sp.get('mean'))} | {_fmt(sp.get('min'))} | "
                    f"{_fmt(sp.get('max'))} | {_fmt(sp.get('stdev'))} | {per} | "
                    f"{targets.get(k, '')} |"
                )
        else:
            lines += [f"| comparison ({pa} vs {pb}) | measured | paper target |", "|---|---|---|"]
            for k, v in _flat(comp):
                lines.append(f"| {k} | {_fmt(v)} | {targets.get(k, '')} |")
        lines.append("")
        both = comp.get("predictor_completed_by_both")
        if both:
            rounds = both.get("round_runs") or {}
            lines += [
                f"Over the {_fmt(both.get('requests'), 1)} requests both plora and "
                "plora-no-predictor completed (predictor_completed_by_both): "
                f"predictor_ttft_reduction {_fmt(both.get('ttft_reduction'))} (per round "
                f"{', '.join(_fmt(v) for v in rounds.get('ttft_reduction', []))}), p99 "
                f"{_fmt(both.get('ttft_p99_reduction'))} (per round "
                f"{', '.join(_fmt(v) for v in rounds.get('ttft_p99_reduction', []))}).",
                "",
            ]
    services = sorted({sv for n in names for sv in report[n].get("service_usage") or {}})
    if services:
        lines += [
            "CPU seconds per service during the replay (resident MiB at its end), from each "
            "service's `process_*` metrics:",
            "",
            "| service | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for sv in services:
            cells = []
            for n in names:
                u = (report[n].get("service_usage") or {}).get(sv) or {}
                rss = u.get("rss_bytes")
                cells.append(
                    f"{_fmt(u.get('cpu_s'), 1)} ({'-' if rss is None else f'{rss / 2**20:.0f}'})"
                )
            lines.append(f"| {sv} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Definitions: see `plora/replay/report.py` (module docstring).", ""]
    return "\n".join(lines)


def _flat(comp: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The comparison's single figures (its nested blocks are written on their own)."""
    return [(k, v) for k, v in comp.items() if not _nested(v)]


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON (NaN is not valid JSON: figures use ``None`` instead)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n", encoding="utf-8")
