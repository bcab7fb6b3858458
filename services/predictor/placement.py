"""Rank-aware placement of adapters across workers, request routing, and prefetch choice.

Pure policy code (no I/O), shared by the predictor service, the gateway and the simulator so a
policy change shows up in all three.

* **Placement** (LoRAServe, arXiv 2511.22880, sections 4-5): the serving cost of an adapter is its
  expected demand times a rank-dependent cost per request, :func:`rank_cost`; adapters are
  assigned to workers greedily, heaviest first (longest-processing-time), so the expected load is
  balanced; an adapter whose load exceeds one worker's fair share is replicated; pool capacity is
  respected; a previous assignment is kept while it stays within the balance tolerance, so the
  placement does not churn (the number of changed assignments is reported as *moves*).
* **Routing**: ``rank_aware`` sends a request to a worker that holds the adapter resident with the
  shortest queue, else to one already loading it, else to a worker the placement assigns it to,
  else to the least-loaded worker, weighing pending prefills against a cold start and sending
  cold starts where the pool has room for the adapter's bytes now;
  ``round_robin`` is the residency- and rank-oblivious baseline.
* **Prefetch choice** (Predictive-LoRA, arXiv 2512.20210, section 3): adapters whose forecast
  demand crosses a threshold are prefetched onto their placed workers, with hysteresis (an adapter
  stays chosen until its forecast falls below a lower threshold) so residency does not thrash.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.registry import WorkerRecord

#: Seconds a worker's heartbeat must postdate a request routed to it before the heartbeat's
#: ``loading`` list is trusted to show that request's adapter; until then the router counts
#: the adapter as loading there on its own record (the worker's engine asks its store for the
#: adapter at its next step, well within this). Used by the gateway and the simulator.
ROUTED_GRACE_S = 1.0
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


@dataclass(slots=True)
class WorkerView:
    """What placement and routing know of a worker (from its heartbeat); read-only by
    convention (not frozen: the gateway and the simulator build one per worker per request,
    and a frozen dataclass costs 9x more to build).

    Attributes:
        worker_id: Registry id.
        pool_bytes: Device adapter pool size.
        free_bytes: Pool bytes not holding live adapters.
        resident: Adapter ids resident in its pool.
        loading: Adapter ids on their way into its pool: a load in flight at its last
            heartbeat, or a request for them routed there since (the gateway's own record).
            Any collection (the gateway and the simulator add to a set in place).
        room_bytes: Pool bytes a load could take now without waiting for a lease to drop
            (free plus unleased resident adapters); -1 = unknown (assume room).
        queue_length: Requests queued or running on it.
        pending: Requests sent to it that have not had their first token yet (waiting for an
            adapter, queued, or in prefill): the work a new request's first token waits behind.
            The gateway counts its own; 0 where unknown (placement does not use it).
        prefill_s: The worker's recent mean prefill time per request, seconds (0 = unknown).
        cold_wait_s: The worker's recent mean adapter wait of a cold request, seconds
            (0 = unknown).
    """

    worker_id: str
    pool_bytes: int = 0
    free_bytes: int = 0
    resident: frozenset[str] = field(default_factory=frozenset)
    queue_length: int = 0
    pending: int = 0
    prefill_s: float = 0.0
    cold_wait_s: float = 0.0
    loading: Collection[str] = field(default_factory=frozenset)
    room_bytes: int = -1


def worker_view(
    record: WorkerRecord,
    *,
    queue_length: int | None = None,
    pending: int = 0,
    loading: Collection[str] | None = None,
    room_bytes: int | None = None,
) -> WorkerView:
    """The view of a worker's last heartbeat (``services.common.registry.WorkerRecord``).

    Args:
        record: The heartbeat.
        queue_length: Override of its queued + running requests (the gateway counts its own
            in flight between heartbeats).
        pending: Requests awaiting their first token (the gateway's count).
        loading: Override of the heartbeat's ``loading`` list.
        room_bytes: Override of the heartbeat's ``room_bytes``.
    """
    pool_bytes = int(record.pool.get("pool_bytes", 0))
    return WorkerView(
        worker_id=record.worker_id,
        pool_bytes=pool_bytes,
        free_bytes=max(0, pool_bytes - int(record.pool.get("live_bytes", 0))),
        resident=frozenset(record.resident),
        queue_length=record.queue_length + record.running if queue_length is None else queue_length,
        pending=pending,
        prefill_s=record.prefill_s,
        cold_wait_s=record.cold_wait_s,
        loading=frozenset(record.loading) if loading is None else loading,
        room_bytes=record.room_bytes if room_bytes is None else room_bytes,
    )


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


def route_rank_aware(
    adapter_id: str,
    workers: Sequence[WorkerView],
    placement: Mapping[str, Sequence[str]],
    *,
    size_bytes: int = 0,
    pending_slack: int = 1,
    queue_slack: int = 4,
    turn: int = 0,
) -> tuple[str, str]:
    """Choose a worker for one request (LoRAServe-style routing, expected-delay rule).

    Load order: fewest requests awaiting their first token (``pending``), then shortest queue
    (queued + running). A request's TTFT waits behind the prefills ahead of it more than
    behind sequences already decoding (continuous batching adds one row to a step for each of
    those; a prefill is a whole prompt's worth of work). Ties go to the earlier worker in
    ``workers`` rotated by ``turn``: the gateway (and the simulator) pass a count of the
    requests routed, so equally loaded workers take turns (always the first would load one
    worker more than the others whenever the cluster is idle, which on a CPU host costs every
    one of its requests time in each decode step). Ordering by an expected first-token delay
    that also weighs each decoding sequence
    (``pending * prefill_s + decoding * decode_row_s * (pending + 1)``, from the workers'
    published ``ServiceEstimates``) measured no better on the live CPU replay (TTFT -19.0 and
    -19.5 % against the baseline, -19.4 % with this order) and worse in the GPU-scale
    simulations (Alibaba hour 5.04 s mean TTFT against 4.97 s, Azure 4 h 47 timeouts against
    26; with each worker's own figures rather than their means, 6.4 s): README, "How a
    request finds its worker".

    Size-aware: with ``size_bytes`` given, a worker whose pool has no room for the adapter now
    (``room_bytes``: every resident adapter it could evict is leased) is not chosen for a cold
    start (placed or least loaded) while another has the room: a load there would wait for
    running requests to finish, however short its queue. ``l`` below is then the least-loaded
    worker with room. When no worker has the room, a resident or loading copy is left only for
    its queue: a cold start elsewhere would wait for a running request to end (seconds under
    load, 9.6 s in one live replay) before its load began, which the worker's measured
    ``cold_wait_s`` (a mean over mostly loads that found room: tens of ms) does not show.

    Order: the least-loaded worker holding the adapter resident; else the least-loaded worker
    loading it (``WorkerView.loading``: the request waits only for the rest of that load, where
    another worker would start a whole second one and hold a second copy), among the workers
    the placement assigns it to if it has any (a load elsewhere is one the placement does not
    keep: the request goes where the copy will stay); else the least-loaded worker the
    placement assigns it to; else the least-loaded worker. A resident or loading (or placed)
    worker ``w`` is passed over for the least-loaded worker ``l`` when its queue is more than
    ``queue_slack`` longer, or when the prefills it has pending beyond ``l``'s would delay the
    first token longer than a cold start on ``l``:
    ``(w.pending - l.pending) * w.prefill_s > l.cold_wait_s``. A placed, not resident, ``w``
    is passed over only for its queue: the request is cold on either worker, and loading the
    adapter where the placement put it keeps one copy that later requests find, instead of
    copies on every worker that happened to be idle. Where a worker has not measured those
    yet (0), ``pending_slack`` extra pending requests are tolerated. Staying saves a load (a
    cold start on ``l``), leaving saves waiting behind ``w``'s prefills: the
    rule takes whichever is expected to be shorter, using each worker's own recent figures,
    so the same code is right where loads are slow against prefill (remote adapter storage)
    and where they are fast (host memory to GPU). Decoding sequences do not, by themselves,
    move a request off its resident worker: weighing them there too (a resident worker left
    when its expected delay exceeded another's by a cold start) spread adapters over both
    workers of the CPU replay and cost it more cold starts (126 against 110 per run) than the
    balance won (README, "How a request finds its worker").

    Args:
        adapter_id: Requested adapter ("" = base model).
        workers: Healthy candidate workers (non-empty).
        placement: ``adapter_id -> [worker_id, ...]``.
        size_bytes: The adapter's pool bytes (its rank decides them); 0 = unknown.
        pending_slack: Extra pending requests tolerated on a resident worker while either
            worker's figures are unknown.
        queue_slack: Queue difference tolerated to stay on a resident/placed worker.
        turn: Ties are broken in the order of ``workers`` starting at
            ``workers[turn % len(workers)]``.

    Returns:
        ``(worker_id, reason)`` with reason ``"resident"``, ``"loading"``, ``"placed"``,
        ``"least_loaded"``.

    Raises:
        ValueError: ``workers`` is empty.
    """
    if not workers:
        raise ValueError("no workers to route to")
    k = turn % len(workers)
    if k:
        workers = [*workers[k:], *workers[:k]]
    least = min(workers, key=_load_key)
    roomy = workers
    if adapter_id and size_bytes > 0:
        # A load where every resident adapter is leased waits for a lease to drop: while
        # some worker has the room now, cold starts go there (placed or least loaded) and
        # the resident worker is weighed against a cold start there.
        roomy = [w for w in workers if _has_room(w, size_bytes)]
        if roomy and len(roomy) < len(workers):
            least = min(roomy, key=_load_key)
        else:
            roomy = workers
    if adapter_id:
        # No worker has the room: a cold start on the least-loaded one waits for one of its
        # running requests to end (seconds under load) before the load itself, so a copy
        # that is resident or loading is not left for it on account of pending prefills.
        least_waits = size_bytes > 0 and not _has_room(least, size_bytes)

        def stay(w: WorkerView, saves_load: bool) -> bool:
            # (saves_load=False leaves only the queue test.)
            return _worth_staying(
                w, least, pending_slack, queue_slack, saves_load=saves_load and not least_waits
            )

        resident = [w for w in workers if adapter_id in w.resident]
        if resident:
            best = min(resident, key=_load_key)
            if stay(best, True):
                return best.worker_id, "resident"
        placed_ids = set(placement.get(adapter_id, ()))
        loading = [
            w
            for w in workers
            if adapter_id in w.loading
            and adapter_id not in w.resident
            and (not placed_ids or w.worker_id in placed_ids)
        ]
        if loading:
            best = min(loading, key=_load_key)
            if stay(best, True):
                return best.worker_id, "loading"
        placed = [w for w in roomy if w.worker_id in placed_ids and adapter_id not in w.resident]
        if placed:
            best = min(placed, key=_load_key)
            if stay(best, False):
                return best.worker_id, "placed"
    return least.worker_id, "least_loaded"


def _has_room(w: WorkerView, size_bytes: int) -> bool:
    """Whether a load of ``size_bytes`` could start on ``w`` now (unknown room counts)."""
    return w.room_bytes < 0 or w.room_bytes >= size_bytes


def _load_key(w: WorkerView) -> tuple[int, int]:
    return (w.pending, w.queue_length)


def _worth_staying(
    w: WorkerView, least: WorkerView, pending_slack: int, queue_slack: int, *, saves_load: bool
) -> bool:
    """Whether a request should go to ``w`` rather than the least-loaded worker (see
    :func:`route_rank_aware`)."""
    if w.queue_length > least.queue_length + queue_slack:
        return False
    extra = w.pending - least.pending
    if extra <= 0 or not saves_load:
        return True
    if w.prefill_s > 0.0 and least.cold_wait_s > 0.0:
        return extra * w.prefill_s <= least.cold_wait_s
    return extra <= pending_slack


class RoundRobinRouter:
    """The rank- and residency-oblivious baseline: workers in id order, one after another."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def route(self, workers: Sequence[WorkerView]) -> str:
        """Next worker id in turn.

        Raises:
            ValueError: ``workers`` is empty.
        """
        if not workers:
            raise ValueError("no workers to route to")
        ordered = sorted(w.worker_id for w in workers)
        with self._lock:
            chosen = ordered[self._next % len(ordered)]
            self._next += 1
        return chosen


class PrefetchSelector:
    """Chooses which adapters each worker should prefetch, with hysteresis.

    An adapter is *hot* once its expected count over the horizon reaches ``high`` and stays hot
    until it drops below ``low`` (``low <= high``), so an adapter hovering at the threshold is not
    loaded and evicted in turn.

    Args:
        high: Expected count at which an adapter becomes hot.
        low: Expected count below which a hot adapter stops being hot.
    """

    def __init__(self, high: float = 0.5, low: float = 0.25) -> None:
        if not 0 <= low <= high:
            raise ValueError("need 0 <= low <= high")
        self.high = high
        self.low = low
        self.hot: set[str] = set()

    def update(self, demand: Mapping[str, AdapterDemand]) -> set[str]:
        """Update and return the hot set from the latest forecast."""
        hot = set()
        for a, d in demand.items():
            threshold = self.low if a in self.hot else self.high
            if d.expected >= threshold:
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
        most its pool (the worker itself decides whether to evict for them).

        Returns:
            ``worker_id -> [(adapter_id, expected), ...]``.
        """
        hot = self.update(demand)
        by_id = {w.worker_id: w for w in workers}
        plan: dict[str, list[tuple[str, float]]] = {w.worker_id: [] for w in workers}
        budget = {w.worker_id: w.pool_bytes if w.pool_bytes > 0 else math.inf for w in workers}
        for a in sorted(hot, key=lambda a: (-demand[a].expected, a)):
            for w in placement.get(a, ()):
                view = by_id.get(w)
                if view is None or a in view.resident or len(plan[w]) >= max_per_worker:
                    continue
                if demand[a].size_bytes > budget[w]:
                    continue
                budget[w] -= demand[a].size_bytes
                plan[w].append((a, demand[a].expected))
        return plan
