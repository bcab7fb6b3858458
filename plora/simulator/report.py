"""Statistics, comparisons and plots of ``plora simulate`` reports (pure functions + plotting).

Definitions match the replay benchmark (:mod:`plora.replay.report`) so the two reports can
be put side by side:

- **TTFT**: gateway receipt -> first token at the client, over completed requests.
- **Cold start**: a completed request whose adapter was not resident when it reached its
  worker; ``cold_start_rate = cold_starts / completed``; ``cold_start_wait_mean_s`` is the
  adapter wait averaged over *all* completed requests (0 for warm ones),
  ``cold_start_wait_mean_cold_s`` over the cold ones only.
- **Throughput**: completed requests (output tokens) / makespan (first arrival -> last
  completion).
- **Pool utilization under pressure** / **external fragmentation**: means over the pressure
  samples of every worker (taken, as the store does, at the end of each allocation that had to
  evict or wait).
- **SLO attainment**: share of *all* requests (failed ones count as misses) whose TTFT is at
  most the SLO. **min_workers_for_slo**: the smallest worker count whose attainment is at least
  99 % (searched by doubling then bisection; attainment is treated as monotone in the count).
- **requests_per_worker**: requests each worker accepted (rejected ones excluded);
  ``worker_requests_max_over_min`` their largest over their smallest (``None`` when a worker
  got none): how evenly the gateways spread the load.
- Comparisons: ``reduction = 1 - a / b``, ``ratio = a / b`` (``None`` when undefined).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plora.replay.report import POLICY_KEYS as REPLAY_POLICY_KEYS
from plora.replay.report import (
    RUN_REDUCTIONS,
    mean_of_rounds,
    predictor_reductions,
    reduction,
    ttft_over_both,
)
from plora.simulator.engine import SimResult
from services.worker.cold import COLD_CAUSES

logger = logging.getLogger(__name__)

#: Per-policy keys of report.json: the live replay's keys plus the simulator's SLO figures.
POLICY_KEYS: tuple[str, ...] = (*REPLAY_POLICY_KEYS, "slo_attainment", "min_workers_for_slo")

#: Published figures the report puts the simulated ones beside.
PAPER_FIGURES: dict[str, dict[str, Any]] = {
    "predictive_lora_vs_slora": {
        "source": "Predictive-LoRA, arXiv 2512.20210 (vs S-LoRA, Azure Functions traces)",
        "throughput_ratio": 1.52,
        "ttft_mean_reduction": 0.35,
        "cold_start_latency_reduction": 0.68,
        "fragmentation_baseline": 0.22,
        "fragmentation_plora_below": 0.05,
        "pool_utilization_above": 0.87,
    },
    "loraserve_vs_rank_oblivious": {
        "source": "LoRAServe, arXiv 2511.22880 (vs rank-oblivious routing)",
        "throughput_ratio": 2.0,
        "ttft_p99_ratio": 9.0,
        "workers_needed_reduction": 0.5,
    },
}


def _f(x: float | np.floating | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` (None when either is missing or ``b`` is 0)."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def summarize(result: SimResult, slo_ttft_s: float) -> dict[str, Any]:
    """Every per-policy figure of report.json except ``min_workers_for_slo`` (see module doc).

    Args:
        result: One simulation.
        slo_ttft_s: TTFT objective, seconds.
    """
    ok = ~result.failed
    n = len(result.arrival_s)
    done = int(ok.sum())
    ttft = result.ttft_s[ok]
    ends = result.done_s[ok]
    makespan = float(ends.max() - result.arrival_s.min()) if done else 0.0
    tokens = int(result.output_tokens[ok].sum())
    cold = result.cold & ok
    waits = np.where(cold, result.cold_wait_s, 0.0)[ok]
    c = result.counters
    samples = c.get("pressure_samples", 0)
    per_worker = np.bincount(result.worker[result.worker >= 0], minlength=result.workers)
    return {
        "requests": n,
        "completed": done,
        "failed": n - done,
        "failed_by_reason": c.get("failed_by_reason", {}),
        "workers": result.workers,
        "requests_per_worker": per_worker.tolist(),
        "worker_requests_max_over_min": float(per_worker.max() / per_worker.min())
        if per_worker.min() > 0
        else None,
        "ttft_mean_s": _f(ttft.mean()) if done else None,
        "ttft_p50_s": _f(np.percentile(ttft, 50)) if done else None,
        "ttft_p99_s": _f(np.percentile(ttft, 99)) if done else None,
        "makespan_s": makespan,
        "throughput_req_s": done / makespan if makespan > 0 else 0.0,
        "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "completion_tokens": tokens,
        "cold_starts": int(cold.sum()),
        "cold_start_rate": float(cold.sum()) / done if done else None,
        "cold_start_wait_mean_s": _f(waits.mean()) if done else None,
        "cold_start_wait_mean_cold_s": _f(result.cold_wait_s[cold].mean()) if cold.any() else None,
        "cold_start_wait_p99_cold_s": _f(np.percentile(result.cold_wait_s[cold], 99))
        if cold.any()
        else None,
        **cold_cause_figures(result),
        "pool_utilization_under_pressure": c["util_sum"] / samples if samples else None,
        "external_fragmentation": c["frag_sum"] / samples if samples else None,
        "free_run_fragmentation": c["raw_frag_sum"] / samples if samples else None,
        "pressure_samples": samples,
        "peak_concurrency": peak_concurrency(result),
        "slo_ttft_s": slo_ttft_s,
        "slo_attainment": slo_attainment(result, slo_ttft_s),
        "min_workers_for_slo": None,
        "counters": {k: v for k, v in c.items() if k not in ("failed_by_reason",)},
        "sim_wall_s": result.wall_s,
        "sim_cpu_s": result.cpu_s,
        "sim_events": result.events,
    }


def cold_cause_figures(result: SimResult) -> dict[str, Any]:
    """Where the cold starts come from (:mod:`services.worker.cold`), over completed requests.

    Returns:
        ``cold_causes`` (count per cause), ``cold_start_wait_by_cause_s`` (mean wait of the
        cold starts of each cause), ``first_appearance_cold_starts`` (cold starts that were the
        first request of their adapter in the trace: no policy avoids them), and where the
        demand loads' time went (``cold_load_phase_s``: mean seconds per demand load in the
        loader queue, reading the source or host tier, and finding room plus the copy), with
        ``demand_loads_behind_prefetch`` (demand loads queued while prefetches held the loader
        threads) and their mean queue wait.
    """
    ok = ~result.failed
    codes = result.cold_cause if result.cold_cause is not None else result.cold.astype(np.uint8)
    counts: dict[str, int] = {}
    waits: dict[str, float | None] = {}
    for i, cause in enumerate(COLD_CAUSES):
        mask = ok & (codes == i + 1)
        counts[cause] = int(mask.sum())
        waits[cause] = _f(result.cold_wait_s[mask].mean()) if mask.any() else None
    first = result.first_appearance
    c = result.counters
    loads = c.get("demand_loads", 0)
    behind = c.get("demand_behind_prefetch", 0)
    return {
        "cold_causes": counts,
        "cold_start_wait_by_cause_s": waits,
        "first_appearance_cold_starts": int((first & ok & (codes > 0)).sum())
        if first is not None
        else None,
        "cold_load_phase_s": {
            "queue": c.get("cold_queue_s", 0.0) / loads if loads else None,
            "read": c.get("cold_read_s", 0.0) / loads if loads else None,
            "room_copy": c.get("cold_room_copy_s", 0.0) / loads if loads else None,
        },
        "demand_loads_behind_prefetch": behind,
        "demand_behind_prefetch_wait_s": c.get("demand_behind_prefetch_s", 0.0) / behind
        if behind
        else None,
    }


def peak_concurrency(result: SimResult) -> int:
    """Most requests in flight at once (gateway receipt -> last token; a failed request counts
    until it failed, e.g. a wait for its adapter that timed out, or its arrival when that time
    is unknown)."""
    t = result.arrival_s
    if len(t) == 0:
        return 0
    fail = result.failed_s if result.failed_s is not None else t
    end = np.where(result.failed, np.where(np.isnan(fail), t, fail), result.done_s)
    times = np.concatenate([t, end])
    delta = np.concatenate([np.ones(len(t), np.int64), -np.ones(len(t), np.int64)])
    order = np.lexsort((delta, times))  # at equal times, departures first
    return int(np.cumsum(delta[order]).max())


def slo_attainment(result: SimResult, slo_ttft_s: float) -> float | None:
    """Share of all requests whose TTFT is at most ``slo_ttft_s`` (failed = miss)."""
    n = len(result.arrival_s)
    if n == 0:
        return None
    ttft = result.ttft_s
    met = (~result.failed) & (ttft <= slo_ttft_s)
    return float(met.sum()) / n


def slo_vs_load(
    result: SimResult, slo_ttft_s: float, window_s: float = 60.0, bins: int = 8
) -> dict[str, list[float]]:
    """SLO attainment against offered load, from one run.

    The run is cut into ``window_s`` windows of arrival time; each window's offered load is its
    arrival rate (requests/s) and its attainment the share of its requests meeting the SLO.
    Windows are grouped into ``bins`` load quantiles (request-weighted attainment per bin).

    Returns:
        ``{"load_req_s": [...], "slo_attainment": [...], "requests": [...]}`` by rising load.
    """
    t = result.arrival_s
    if len(t) == 0:
        return {"load_req_s": [], "slo_attainment": [], "requests": []}
    win = np.floor((t - t.min()) / window_s).astype(np.int64)
    met = ((~result.failed) & (result.ttft_s <= slo_ttft_s)).astype(np.float64)
    count = np.bincount(win).astype(np.float64)
    good = np.bincount(win, weights=met)
    keep = count > 0
    load = count[keep] / window_s
    good, count = good[keep], count[keep]
    order = np.argsort(load, kind="stable")
    groups = np.array_split(order, min(bins, len(order)))
    out: dict[str, list[float]] = {"load_req_s": [], "slo_attainment": [], "requests": []}
    for g in groups:
        c = float(count[g].sum())
        out["load_req_s"].append(float((load[g] * count[g]).sum() / c))
        out["slo_attainment"].append(float(good[g].sum() / c))
        out["requests"].append(c)
    return out


def ttft_cdf(result: SimResult, points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """``(ttft_s [k], fraction [k])``: the empirical CDF of completed requests' TTFT."""
    ttft = np.sort(result.ttft_s[~result.failed])
    if len(ttft) == 0:
        return np.zeros(0), np.zeros(0)
    idx = np.unique(np.linspace(0, len(ttft) - 1, min(points, len(ttft))).astype(np.int64))
    return ttft[idx], (idx + 1) / len(ttft)


def search_min_workers(
    attainment_at: Callable[[int], float | None],
    target: float = 0.99,
    max_workers: int = 64,
) -> tuple[int | None, dict[int, float | None]]:
    """Smallest worker count ``n <= max_workers`` with ``attainment_at(n) >= target``.

    Doubling (1, 2, 4, ...) until the target is met, then bisection between the last miss and
    the first hit; assumes attainment does not fall as workers are added.

    Returns:
        ``(n or None if even max_workers misses, {n: attainment} of every count tried)``.
    """
    tried: dict[int, float | None] = {}

    def meets(n: int) -> bool:
        if n not in tried:
            tried[n] = attainment_at(n)
        v = tried[n]
        return v is not None and v >= target

    lo, hi = 0, 1
    while not meets(hi):
        if hi >= max_workers:
            return None, tried
        lo, hi = hi, min(2 * hi, max_workers)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi, tried


def compare_pair(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float | None]:
    """``a`` vs ``b``: reductions (1 - a/b) of latencies, ratios (a/b) of throughput."""
    return {
        "ttft_mean_reduction": reduction(a.get("ttft_mean_s"), b.get("ttft_mean_s")),
        "ttft_p99_reduction": reduction(a.get("ttft_p99_s"), b.get("ttft_p99_s")),
        "cold_start_wait_reduction": reduction(
            a.get("cold_start_wait_mean_s"), b.get("cold_start_wait_mean_s")
        ),
        "cold_start_wait_cold_reduction": reduction(
            a.get("cold_start_wait_mean_cold_s"), b.get("cold_start_wait_mean_cold_s")
        ),
        "cold_start_count_reduction": reduction(a.get("cold_starts"), b.get("cold_starts")),
        "throughput_ratio": ratio(a.get("throughput_req_s"), b.get("throughput_req_s")),
        "throughput_tok_ratio": ratio(a.get("throughput_tok_s"), b.get("throughput_tok_s")),
        "slo_attainment_delta": (
            a["slo_attainment"] - b["slo_attainment"]
            if a.get("slo_attainment") is not None and b.get("slo_attainment") is not None
            else None
        ),
    }


def gap_closed(
    plora: float | None, no_predictor: float | None, oracle: float | None
) -> float | None:
    """Share of the gap between ``plora-no-predictor`` and ``oracle`` that ``plora`` closes:
    ``(no_predictor - plora) / (no_predictor - oracle)`` (1 = as good as knowing the future,
    0 = no better than no forecast, < 0 = worse). None when a figure is missing or the oracle
    leaves no gap."""
    if plora is None or no_predictor is None or oracle is None or no_predictor <= oracle:
        return None
    return (no_predictor - plora) / (no_predictor - oracle)


#: Per-policy keys :func:`mean_over_seeds` takes from the first seed's run instead of averaging:
#: the worker-count search runs for the first seed only, and the forecaster's compute figures
#: belong to that run.
FIRST_SEED_KEYS: tuple[str, ...] = ("min_workers_for_slo", "workers_search", "forecast")

#: Figures whose value in every seed's run ``mean_over_seeds`` also lists (``seed_runs``), so
#: a report shows the spread its means come from.
SEED_RUN_KEYS: tuple[str, ...] = (
    "ttft_mean_s",
    "ttft_p99_s",
    "cold_start_rate",
    "cold_start_wait_mean_s",
    "failed",
)


def mean_over_seeds(runs: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """One policy's summary averaged over simulations that differ only in their seed.

    Figures are averaged as :func:`plora.replay.report.mean_of_rounds` averages rounds (every
    number, nested blocks key by key, lists of numbers element by element; a figure every run
    agrees on keeps its value and type, so a single run is returned as it is), so
    ``ttft_p99_s`` is the mean of the runs' p99s; :data:`FIRST_SEED_KEYS` are the first run's.
    ``seed_runs`` lists the :data:`SEED_RUN_KEYS` figures of every run, in ``seeds`` order.

    Why: one simulation's TTFT p99 moves by several percent from one seed to the next (the
    source-latency draws, the forecaster's initial weights), more than the differences between
    policies a report is read for; the mean over seeds is what a comparison can rely on.

    Raises:
        ValueError: No runs, or not one seed per run.
    """
    if not runs or len(runs) != len(seeds):
        raise ValueError(f"{len(runs)} runs for {len(seeds)} seeds: give one seed per run")
    out = mean_of_rounds(runs)
    del out["rounds"]
    out |= {k: runs[0][k] for k in FIRST_SEED_KEYS if k in runs[0]}
    out["seed_runs"] = {"seeds": list(seeds)} | {
        k: [r.get(k) for r in runs] for k in SEED_RUN_KEYS if k in runs[0]
    }
    return out


def standard_error(values: Sequence[float | None]) -> float | None:
    """Standard error of the mean of per-seed figures: sample standard deviation / sqrt(n).

    None with fewer than two figures or a missing one. With seeds as independent draws of the
    simulation, a mean reduction within about two standard errors of 0 is not a difference.
    """
    if len(values) < 2 or any(v is None for v in values):
        return None
    return float(np.std(np.asarray(values, dtype=np.float64), ddof=1) / math.sqrt(len(values)))


def comparison_block(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """report.json's ``comparison``: ``plora`` vs ``baseline`` (:func:`compare_pair`), plus the
    predictor's ablation: ``predictor_ttft_reduction`` (and ``_p99_``, and the cold-start wait)
    of ``plora`` vs ``plora-no-predictor``; when ``oracle`` ran, ``oracle_ttft_reduction`` (the
    room a perfect forecast of repeat requests finds: ``oracle`` vs ``plora-no-predictor`` on
    TTFT mean) and ``predictor_gap_closed`` (:func:`gap_closed`, on TTFT mean).

    With several seeds (:func:`mean_over_seeds`) the figures compare the means,
    ``predictor_seed_runs`` gives each seed's mean and p99 reductions (and
    ``oracle_ttft_reduction`` when the oracle ran), and ``predictor_ttft_reduction_se``,
    ``predictor_ttft_p99_reduction_se`` and ``oracle_ttft_reduction_se`` the standard errors
    of those per-seed figures' means (:func:`standard_error`): ``predictor_gap_closed`` divides
    one difference by another, and means nothing where the oracle's room is within its noise.
    None when ``plora`` did not run.
    """
    p = summaries.get("plora")
    if p is None:
        return None
    b = summaries.get("baseline")
    out: dict[str, Any] = dict(compare_pair(p, b)) if b is not None else {}
    n = summaries.get("plora-no-predictor")
    o = summaries.get("oracle")
    if n is not None:
        out |= predictor_reductions(p, n)
        if o is not None:
            out["oracle_ttft_reduction"] = reduction(o.get("ttft_mean_s"), n.get("ttft_mean_s"))
        out["predictor_gap_closed"] = (
            gap_closed(p.get("ttft_mean_s"), n.get("ttft_mean_s"), o.get("ttft_mean_s"))
            if o is not None
            else None
        )
    runs = [s.get("seed_runs") or {} for s in (p, n)] if n is not None else []
    if runs and all(len(r.get("ttft_mean_s", ())) > 1 for r in runs):
        per_seed = {
            name: [reduction(a, b) for a, b in zip(runs[0][key], runs[1][key], strict=True)]
            for name, key in RUN_REDUCTIONS
        }
        for name, _ in RUN_REDUCTIONS:
            out[f"predictor_{name}_se"] = standard_error(per_seed[name])
        oracle_runs = (o.get("seed_runs") or {}).get("ttft_mean_s") if o is not None else None
        if oracle_runs:
            room = [
                reduction(a, b) for a, b in zip(oracle_runs, runs[1]["ttft_mean_s"], strict=True)
            ]
            per_seed["oracle_ttft_reduction"] = room
            out["oracle_ttft_reduction_se"] = standard_error(room)
        out["predictor_seed_runs"] = per_seed
    return out or None


def completed_by_both(plora: SimResult, no_predictor: SimResult) -> dict[str, Any]:
    """TTFT of ``plora`` and ``plora-no-predictor`` over the requests both runs completed
    (:func:`plora.replay.report.ttft_over_both`).

    TTFT figures count completed requests only. Where a burst leaves loads waiting for room
    until ``load_wait_timeout_s``, a request one policy serves late and the other fails counts
    in the first's mean and p99 alone, so the policy that fails fewer requests looks slower.
    On the same requests it does not.

    Args:
        plora: The ``plora`` run.
        no_predictor: The ``plora-no-predictor`` run of the same trace slice and seed.

    Raises:
        ValueError: The runs are of different request counts.
    """
    return ttft_over_both(
        np.where(plora.failed, np.nan, plora.ttft_s),
        np.where(no_predictor.failed, np.nan, no_predictor.ttft_s),
    )


def paper_comparison(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The simulated figures beside the papers' (:data:`PAPER_FIGURES`).

    Predictive-LoRA vs S-LoRA is ``plora`` vs ``baseline``; LoRAServe vs rank-oblivious routing
    is ``plora`` vs ``plora-round-robin``. A block is ``None`` when a policy of its pair did not
    run.
    """
    out: dict[str, Any] = {}
    p, b = summaries.get("plora"), summaries.get("baseline")
    fig = PAPER_FIGURES["predictive_lora_vs_slora"]
    if p is not None and b is not None:
        out["predictive_lora_vs_slora"] = {
            "pair": ["plora", "baseline"],
            "source": fig["source"],
            "throughput_ratio": {
                "paper": fig["throughput_ratio"],
                "sim": ratio(p.get("throughput_req_s"), b.get("throughput_req_s")),
            },
            "ttft_mean_reduction": {
                "paper": fig["ttft_mean_reduction"],
                "sim": reduction(p.get("ttft_mean_s"), b.get("ttft_mean_s")),
            },
            "cold_start_latency_reduction": {
                "paper": fig["cold_start_latency_reduction"],
                "sim": reduction(p.get("cold_start_wait_mean_s"), b.get("cold_start_wait_mean_s")),
                "sim_per_cold_start": reduction(
                    p.get("cold_start_wait_mean_cold_s"), b.get("cold_start_wait_mean_cold_s")
                ),
            },
            "fragmentation": {
                "paper": {
                    "baseline": fig["fragmentation_baseline"],
                    "plora_below": fig["fragmentation_plora_below"],
                },
                "sim": {
                    "baseline": b.get("external_fragmentation"),
                    "plora": p.get("external_fragmentation"),
                },
            },
            "pool_utilization": {
                "paper_above": fig["pool_utilization_above"],
                "sim": p.get("pool_utilization_under_pressure"),
            },
        }
    else:
        out["predictive_lora_vs_slora"] = None
    r = summaries.get("plora-round-robin")
    fig = PAPER_FIGURES["loraserve_vs_rank_oblivious"]
    if p is not None and r is not None:
        wp, wr = p.get("min_workers_for_slo"), r.get("min_workers_for_slo")
        out["loraserve_vs_rank_oblivious"] = {
            "pair": ["plora", "plora-round-robin"],
            "source": fig["source"],
            "throughput_ratio": {
                "paper": fig["throughput_ratio"],
                "sim": ratio(p.get("throughput_req_s"), r.get("throughput_req_s")),
            },
            "ttft_p99_ratio": {
                "paper": fig["ttft_p99_ratio"],
                "sim": ratio(r.get("ttft_p99_s"), p.get("ttft_p99_s")),
            },
            "workers_needed_reduction": {
                "paper": fig["workers_needed_reduction"],
                "sim": reduction(wp, wr) if wp is not None and wr is not None else None,
                "workers": {"plora": wp, "plora-round-robin": wr},
            },
        }
    else:
        out["loraserve_vs_rank_oblivious"] = None
    return out


# ------------------------------------------------------------------------------ validation
VALIDATED_KEYS: tuple[str, ...] = ("ttft_mean_s", "cold_start_rate")


def compare_to_replay(
    sim_report: Mapping[str, Any],
    replay_report: Mapping[str, Any],
    tolerance: float = 0.25,
    keys: Sequence[str] = VALIDATED_KEYS,
) -> dict[str, Any]:
    """Put a simulator report beside a ``plora bench replay`` report of the same trace slice.

    For every policy present in both (top-level blocks named in each report's ``policies``
    list) and every key: the two values, ``rel_error = |sim - replay| / |replay|`` and
    ``within`` (``rel_error <= tolerance``; ``None`` when the replay value is missing or 0 and
    the simulated one is not).

    Returns:
        ``{"tolerance", "policies": {name: {key: {...}}}, "all_within": bool | None,
        "replay_settings", "replay_trace"}``.
    """
    sim_pols = list(sim_report.get("policies", []))
    rep_pols = list(replay_report.get("policies", []))
    out: dict[str, Any] = {
        "tolerance": tolerance,
        "replay_settings": replay_report.get("settings"),
        "replay_trace": replay_report.get("trace"),
        "policies": {},
    }
    verdicts: list[bool] = []
    for name in sim_pols:
        if name not in rep_pols or name not in sim_report or name not in replay_report:
            continue
        s, r = sim_report[name], replay_report[name]
        block = {}
        for k in keys:
            sv, rv = s.get(k), r.get(k)
            if sv is None or rv is None:
                rel, within = None, None
            elif rv == 0:
                rel = 0.0 if sv == 0 else None
                within = sv == 0 if sv == 0 else None
            else:
                rel = abs(sv - rv) / abs(rv)
                within = rel <= tolerance
            if within is not None:
                verdicts.append(bool(within))
            block[k] = {"sim": sv, "replay": rv, "rel_error": rel, "within": within}
        out["policies"][name] = block
    out["all_within"] = all(verdicts) if verdicts else None
    return out


def load_replay_report(path: str | Path) -> dict[str, Any]:
    """Read a replay ``report.json``.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not a replay report (no ``policies`` list).
    """
    data = json.loads(Path(path).read_text("utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("policies"), list):
        raise ValueError(f"{path}: not a replay report (no 'policies' list)")
    return data


# ------------------------------------------------------------------------------ plots
def write_plots(
    out_dir: Path,
    results: Mapping[str, SimResult],
    summaries: Mapping[str, Mapping[str, Any]],
    slo_ttft_s: float,
    load_curves: Mapping[str, Mapping[str, list[float]]],
) -> dict[str, str]:
    """TTFT CDF, SLO attainment against load, and workers needed per policy, as PNGs.

    Returns:
        ``{plot name: file name}`` of the files written under ``out_dir``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in results.items():
        x, y = ttft_cdf(res)
        if len(x):
            ax.plot(np.maximum(x, 1e-4), y, label=name)
    ax.axvline(slo_ttft_s, color="grey", linestyle=":", label=f"SLO {slo_ttft_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title("TTFT CDF")
    ax.legend(fontsize=8)
    files["ttft_cdf"] = _save(fig, out_dir / "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in load_curves.items():
        if curve["load_req_s"]:
            ax.plot(curve["load_req_s"], curve["slo_attainment"], marker="o", label=name)
    ax.axhline(0.99, color="grey", linestyle=":", label="99 %")
    ax.set_xlabel("offered load in the window (requests/s)")
    ax.set_ylabel(f"SLO attainment (TTFT <= {slo_ttft_s:g} s)")
    ax.set_ylim(0, 1.02)
    ax.set_title("SLO attainment against load")
    ax.legend(fontsize=8)
    files["slo_vs_load"] = _save(fig, out_dir / "slo_vs_load.png")

    names = [n for n in summaries if summaries[n].get("min_workers_for_slo") is not None]
    if names:
        fig, ax = plt.subplots(figsize=(6, 4))
        vals = [summaries[n]["min_workers_for_slo"] for n in names]
        ax.bar(names, vals)
        ax.set_ylabel("workers for 99 % SLO attainment")
        ax.set_title("Workers needed per policy")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        files["workers_needed"] = _save(fig, out_dir / "workers_needed.png")
    return files


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# ------------------------------------------------------------------------------ markdown
def _md(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _signed_pct(v: float) -> str:
    return f"{100 * v:+.1f} %"


def ablation_text(comparison: Mapping[str, Any] | None) -> str | None:
    """The forecast's ablation in one paragraph, for report.md and the terminal: ``plora``
    against ``plora-no-predictor`` on TTFT mean and p99 (positive: ``plora`` faster), the
    oracle's room and ``predictor_gap_closed``, each with its standard error over the seeds
    the comparison lists (``predictor_seed_runs``; one seed without it; see
    :func:`comparison_block`). Says when the oracle's room is within two standard errors of 0,
    where ``predictor_gap_closed`` is a ratio of noise, and when the oracle leaves no gap at
    all. None without the ablation."""
    c = comparison or {}
    mean, p99 = c.get("predictor_ttft_reduction"), c.get("predictor_ttft_p99_reduction")
    if mean is None or p99 is None:
        return None
    seeds = len((c.get("predictor_seed_runs") or {}).get("ttft_reduction") or [None])

    def figure(name: str, key: str, se_key: str) -> str:
        se = c.get(se_key)
        return f"{name} {_signed_pct(c[key])}" + (
            f" (standard error {100 * se:.1f} %)" if se is not None else ""
        )

    parts = [
        figure("`predictor_ttft_reduction`", "predictor_ttft_reduction",
               "predictor_ttft_reduction_se"),
        figure("p99", "predictor_ttft_p99_reduction", "predictor_ttft_p99_reduction_se"),
    ]  # fmt: skip
    room, room_se = c.get("oracle_ttft_reduction"), c.get("oracle_ttft_reduction_se")
    if room is not None:
        parts.append(
            figure("the oracle's room (`oracle_ttft_reduction`)", "oracle_ttft_reduction",
                   "oracle_ttft_reduction_se")
            + f", `predictor_gap_closed` {_md(c.get('predictor_gap_closed'))}"
        )  # fmt: skip
    text = (
        "The forecast's ablation (`plora` against `plora-no-predictor`; positive: `plora` "
        f"faster), over {seeds} seed{'s' if seeds != 1 else ''}: " + "; ".join(parts) + "."
    )
    if room is not None and c.get("predictor_gap_closed") is None:
        text += " The oracle is no faster than `plora-no-predictor`: there is no gap to close."
    elif seeds >= 2 and room is not None and room_se and abs(room) < 2 * room_se:
        text += (
            " The oracle's room is within two standard errors of 0, so `predictor_gap_closed`"
            " divides by noise."
        )
    if seeds < 2:
        text += " One run is one draw: `--seeds N` gives standard errors."
    return text


def paper_rows(papers: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(figure, paper, simulated)`` rows of a report's ``papers`` block (see
    :func:`paper_comparison`), as text, for report.md."""
    rows: list[tuple[str, str, str]] = []
    p = papers.get("predictive_lora_vs_slora")
    if p:
        rows += [
            ("P-LoRA vs S-LoRA: throughput ratio", f"{p['throughput_ratio']['paper']}x",
             f"{_md(p['throughput_ratio']['sim'])}x"),
            ("P-LoRA vs S-LoRA: mean TTFT reduction", _pct(p["ttft_mean_reduction"]["paper"]),
             _pct(p["ttft_mean_reduction"]["sim"])),
            ("P-LoRA vs S-LoRA: cold-start latency reduction (per request / per cold start)",
             _pct(p["cold_start_latency_reduction"]["paper"]),
             f"{_pct(p['cold_start_latency_reduction']['sim'])} / "
             f"{_pct(p['cold_start_latency_reduction']['sim_per_cold_start'])}"),
            ("fragmentation, baseline -> plora",
             f"{_pct(p['fragmentation']['paper']['baseline'])} -> "
             f"< {_pct(p['fragmentation']['paper']['plora_below'])}",
             f"{_pct(p['fragmentation']['sim']['baseline'])} -> "
             f"{_pct(p['fragmentation']['sim']['plora'])}"),
            ("plora pool utilization under pressure",
             f"> {_pct(p['pool_utilization']['paper_above'])}",
             _pct(p["pool_utilization"]["sim"])),
        ]  # fmt: skip
    q = papers.get("loraserve_vs_rank_oblivious")
    if q:
        w = q["workers_needed_reduction"]["workers"]
        rows += [
            ("LoRAServe vs rank-oblivious: throughput ratio", f"{q['throughput_ratio']['paper']}x",
             f"{_md(q['throughput_ratio']['sim'])}x"),
            ("LoRAServe vs rank-oblivious: p99 TTFT ratio", f"{q['ttft_p99_ratio']['paper']}x",
             f"{_md(q['ttft_p99_ratio']['sim'])}x"),
            ("LoRAServe vs rank-oblivious: fewer workers under SLO",
             _pct(q["workers_needed_reduction"]["paper"]),
             f"{_pct(q['workers_needed_reduction']['sim'])} ({w['plora']} vs "
             f"{w['plora-round-robin']})"),
        ]  # fmt: skip
    return rows


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _seeds_text(settings: Mapping[str, Any]) -> str:
    seeds = settings.get("seeds") or [settings["seed"]]
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"figures are means over seeds {seeds[0]}..{seeds[-1]} (each run's under `seed_runs`)"


def render_markdown(report: Mapping[str, Any]) -> str:
    """report.md of ``plora simulate``: settings, the per-policy table, the papers' figures
    beside the simulated ones, and the live-replay validation when present."""
    s, tr = report["settings"], report["trace"]
    names = list(report["policies"])
    lines = [
        "# Trace-driven cluster simulation",
        "",
        f"Trace `{tr['path']}` ({tr['format']}): {tr['requests']} requests, {tr['keys']} keys, "
        f"{_md(tr['duration_s'], 5)} s (time scale {s['time_scale']}, start {s['start']}, "
        f"duration {s['duration']}); {s['adapters']} adapters; preset `{s['preset']}`, "
        f"{s['workers']} workers; {_seeds_text(s)}; TTFT SLO {s['slo_ttft_s']} s; forecaster "
        f"{s['forecaster']}.",
        "",
        "| figure | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for key in (*POLICY_KEYS, "peak_concurrency", "sim_wall_s", "sim_cpu_s"):
        lines.append(f"| {key} | " + " | ".join(_md(report[n].get(key)) for n in names) + " |")
    fc = next((report[n].get("forecast") for n in names if report[n].get("forecast")), None)
    if fc:
        lines += ["", f"The production forecaster ran once for the trace ({fc['ticks']} ticks, "
                  f"{_md(fc['compute_s'])} s, child process: {fc['child_process']}) and its "
                  f"forecasts were shared by {', '.join(fc['shared_by'])}."]  # fmt: skip
        env = report.get("environment")
        if env:
            lines[-1] += (
                f" Its figures depend on the forecaster's floating-point results: compare them "
                f"with runs on the same torch {env['torch']} and CPU kernels "
                f"({env['torch_cpu_capability']})."
            )
    ablation = ablation_text(report.get("comparison"))
    if ablation:
        lines += ["", ablation]
    rows = paper_rows(report.get("papers") or {})
    if rows:
        lines += ["", "| papers' figure | paper | simulated |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    val = report.get("validation")
    if val:
        head = "| policy | figure | simulated | live | rel. error |"
        lines += [
            "",
            f"Validation against the live replay (tolerance {_pct(val['tolerance'])}):",
            "",
            head,
            "|---|---|---|---|---|",
        ]
        for p, block in val["policies"].items():
            for k, v in block.items():
                lines.append(f"| {p} | {k} | {_md(v['sim'])} | {_md(v['replay'])} | "
                             f"{_pct(v['rel_error'])} |")  # fmt: skip
    lines += ["", "Definitions: `plora/simulator/report.py` (module docstring).", ""]
    return "\n".join(lines)
