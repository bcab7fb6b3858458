"""Rank-aware placement of adapters across workers, and prefetch choice.

Pure policy code (no I/O), run by the predictor service and the simulator so a policy change
shows up in both. Request routing, which reads the same :class:`WorkerView` s, is in
:mod:`services.common.routing`.

* **Placement** (LoRAServe, arXiv 2511.22880, sections 4-5): the serving cost of an adapter is its
  expected demand times a rank-dependent cost per request, :func:`rank_cost`; adapters are
  assigned to workers greedily, heaviest first (longest-processing-time), so the expected load is
  balanced; an adapter whose load exceeds one worker's fair share is replicated; pool capacity is
  respected; a previous assignment is kept while it stays within the balance tolerance, so the
  placement does not churn (the number of changed assignments is reported as *moves*).
* **Prefetch choice** (Predictive-LoRA, arXiv 2512.20210, section 3): adapters whose forecast
  demand crosses a threshold are prefetched onto their placed workers, with hysteresis (an adapter
  stays chosen until its forecast falls below a lower threshold) so residency does not thrash.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.routing import WorkerView as WorkerView
from services.common.routing import worker_view as worker_view
from services.predictor.calibration import ForecastCalibrator

#: Reference rank of :func:`rank_cost` (cost 1 + beta at this rank).
RANK_REF = 64
#: Extra cost of a rank-``RANK_REF`` adapter relative to a base-model request.
RANK_BETA = 0.5


def rank_cost(rank: int, beta: float = RANK_BETA, rank_ref: int = RANK_REF) -> float:
    """Relative serving cost of one request for an adapter of ``rank``.

    ``1 + beta * rank / rank_ref``: the base model's work plus the LoRA work, which grows
    linearly in the rank (the shrink/expand matmuls are ``O(r * (d_in + d_out))`` per token;
    LoRAServe section 3 measures the same linear trend). ``rank = 0`` (the base model) costs 1.
    """
    return 1.0 + beta * max(0, rank) / rank_ref


@dataclass(frozen=True)
class AdapterDemand:
    """Forecast demand of one adapter.

    Attributes:
        rank: Largest LoRA rank (cost model input).
        size_bytes: Device bytes when resident.
        expected: Expected requests over the forecast horizon.
    """

    rank: int
    size_bytes: int
    expected: float

    @property
    def load(self) -> float:
        """Expected demand times the rank-dependent cost."""
        return self.expected * rank_cost(self.rank)


def plan_placement(
    demand: Mapping[str, AdapterDemand],
    workers: Sequence[WorkerView],
    previous: Mapping[str, Sequence[str]] | None = None,
    *,
    tolerance: float = 0.25,
) -> tuple[dict[str, list[str]], int]:
    """Assign adapters with positive demand to workers, balancing rank-weighted load.

    Args:
        demand: ``adapter_id -> AdapterDemand``; adapters with ``expected <= 0`` are not placed.
        workers: Healthy workers.
        previous: The last placement. A worker that holds the adapter resident or is loading
            it, then one of the last placement, keeps it while it stays within
            ``(1 + tolerance)`` of the fair share and has pool room.
        tolerance: Allowed overshoot of the fair share before a kept assignment is moved.

    Returns:
        ``(placement, moves)``: ``adapter_id -> [worker_id, ...]`` (replicas, heaviest first) and
        the number of (adapter, worker) assignments that are new compared with ``previous``
        for adapters placed in both.
    """
    if not workers:
        return {}, 0
    previous = previous or {}
    n_workers = len(workers)
    costs: dict[int, float] = {}  # rank -> rank_cost (a handful of distinct ranks)
    loads: dict[str, float] = {}
    for a, d in demand.items():
        if d.expected > 0:
            c = costs.get(d.rank)
            if c is None:
                c = costs[d.rank] = rank_cost(d.rank)
            loads[a] = d.expected * c
    total = sum(loads.values())
    share = total / n_workers if total > 0 else 0.0
    cap = share * (1 + tolerance) + 1e-9
    load = {w.worker_id: 0.0 for w in workers}
    room = {w.worker_id: w.pool_bytes if w.pool_bytes > 0 else math.inf for w in workers}
    resident_on: dict[str, list[str]] = {}
    for w in workers:
        for a in w.resident:
            if a in loads:
                resident_on.setdefault(a, []).append(w.worker_id)
    for w in workers:  # then the workers loading it (after every resident copy)
        for a in w.loading:
            if a in loads and a not in w.resident:
                resident_on.setdefault(a, []).append(w.worker_id)
    placement: dict[str, list[str]] = {}
    for a in sorted(loads, key=lambda a: (-loads[a], a)):
        size = demand[a].size_bytes
        a_load = loads[a]
        if share <= 0 or a_load <= share:
            replicas = 1
        else:
            replicas = max(1, min(n_workers, math.ceil(a_load / share - 1e-9)))
        per_replica = a_load / replicas
        chosen: list[str] = []
        # Keep what already serves the adapter: workers holding it resident or loading it first
        # (moving it would cost a load and waste the copy the router is using), then the last
        # placement.
        res = resident_on.get(a)
        prev = previous.get(a)
        if res and prev:
            kept: Sequence[str] = list(dict.fromkeys([*res, *(w for w in prev if w in load)]))
        elif res:
            kept = res
        elif prev:
            kept = [w for w in prev if w in load]
        else:
            kept = ()
        for wid in kept:
            if len(chosen) == replicas:
                break
            if load[wid] + per_replica <= cap and room[wid] >= size:
                chosen.append(wid)
        while len(chosen) < replicas:
            best = None
            for wid, lw in load.items():
                if room[wid] >= size and wid not in chosen:
                    if best is None or (lw, wid) < best:
                        best = (lw, wid)
            if best is None:
                break
            chosen.append(best[1])
        for wid in chosen:
            load[wid] += per_replica
            room[wid] -= size
        if chosen:
            placement[a] = chosen
    moves = sum(len(set(ws) - set(previous[a])) for a, ws in placement.items() if a in previous)
    return placement, moves


class PrefetchSelector:
    """Chooses which adapters each worker should prefetch, with hysteresis.

    An adapter is *hot* once its expected count over the horizon reaches ``high`` and stays hot
    until it drops below ``low`` (``low <= high``), so an adapter hovering at the threshold is not
    loaded and evicted in turn. With a ``calibrator``, it must also be likely to be requested:
    its calibrated probability (:class:`~services.predictor.calibration.ForecastCalibrator`)
    must reach ``min_probability`` (three quarters of it once hot: the same hysteresis), so
    prefetch volume follows the forecast's measured precision.

    Args:
        high: Expected count at which an adapter becomes hot.
        low: Expected count below which a hot adapter stops being hot.
        calibrator: Calibrated probabilities of the forecast (None: expected counts alone).
        min_probability: Calibrated probability at which a prefetch pays (with a calibrator).
    """

    def __init__(
        self,
        high: float = 0.5,
        low: float = 0.25,
        *,
        calibrator: ForecastCalibrator | None = None,
        min_probability: float = 0.0,
    ) -> None:
        if not 0 <= low <= high:
            raise ValueError("need 0 <= low <= high")
        if not 0 <= min_probability <= 1:
            raise ValueError("need 0 <= min_probability <= 1")
        self.high = high
        self.low = low
        self.calibrator = calibrator
        self.min_probability = min_probability
        self.hot: set[str] = set()

    def update(self, demand: Mapping[str, AdapterDemand]) -> set[str]:
        """Update and return the hot set from the latest forecast."""
        hot = set()
        cal = self.calibrator
        for a, d in demand.items():
            was = a in self.hot
            if d.expected < (self.low if was else self.high):
                continue
            if cal is not None:
                floor = self.min_probability * (0.75 if was else 1.0)
                if cal.probability(d.expected) < floor:
                    continue
            hot.add(a)
        self.hot = hot
        return hot

    def select(
        self,
        demand: Mapping[str, AdapterDemand],
        placement: Mapping[str, Sequence[str]],
        workers: Sequence[WorkerView],
        *,
        max_per_worker: int = 8,
    ) -> dict[str, list[tuple[str, float]]]:
        """Per worker, the hot adapters placed on it and not resident there, best first.

        Each worker's list holds at most ``max_per_worker`` adapters whose sizes add up to at
        most its pool (the worker itself decides whether to evict for them). An adapter some
        worker holds in its host cache (``WorkerView.host_cached``) is prefetched only onto
        a worker that holds it: the placed ones that do, else (when no worker has it resident
        or loading) the holder with the fewest prefetches planned so far. A load there is a
        host copy of milliseconds, and routing sends the adapter's requests to the copy;
        a source read onto a worker without it would take seconds and draw its requests to
        that slow load (in the simulator, such prefetches make the oracle 4 % slower than no
        forecast on the Alibaba trace).

        Returns:
            ``worker_id -> [(adapter_id, expected), ...]``.
        """
        hot = self.update(demand)
        by_id = {w.worker_id: w for w in workers}
        plan: dict[str, list[tuple[str, float]]] = {w.worker_id: [] for w in workers}
        budget = {w.worker_id: w.pool_bytes if w.pool_bytes > 0 else math.inf for w in workers}
        holders: dict[str, list[str]] = {}  # hot adapter -> workers holding it in host memory
        for wv in workers:
            for a in wv.host_cached:
                if a in hot:
                    holders.setdefault(a, []).append(wv.worker_id)
        for a in sorted(hot, key=lambda a: (-demand[a].expected, a)):
            targets: Sequence[str] = placement.get(a, ())
            held = holders.get(a)
            if held:
                targets = [w for w in targets if w in held]
                if not targets and not any(a in v.resident or a in v.loading for v in workers):
                    targets = [min(held, key=lambda w: (len(plan[w]), w))]
            for w in targets:
                view = by_id.get(w)
                if view is None or a in view.resident or len(plan[w]) >= max_per_worker:
                    continue
                if demand[a].size_bytes > budget[w]:
                    continue
                budget[w] -= demand[a].size_bytes
                plan[w].append((a, demand[a].expected))
        return plan
