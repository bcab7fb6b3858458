"""Request routing: the rule that picks a worker for a request, and the bookkeeping it reads.

Pure code (no I/O, no clock: times are passed in), shared by the gateway
(:mod:`services.gateway.core`) and the simulated gateway (``plora.simulator.engine``), so a
change of the rule or of what it is fed shows up in both.

* :func:`route_rank_aware` sends a request to a worker that holds the adapter resident with the
  shortest queue, else to one already loading it, else to one holding it in host memory, else
  to a worker the placement assigns it to,
  else to the least-loaded worker, weighing pending prefills against a cold start and sending
  cold starts where the pool has room for the adapter's bytes now;
  :class:`RoundRobinRouter` is the residency- and rank-oblivious baseline.
* :class:`RoutingState` is what one gateway knows of the workers between their heartbeats: the
  requests it has in flight on each, those still waiting for their first token, the adapter
  loads it started since each worker's last heartbeat (and the pool bytes they take), the
  workers whose call failed; it builds the :class:`WorkerView` s the rule reads from the
  heartbeats and that record, and rotates the order ties are broken in.

Placement and prefetch choice stay with the predictor (:mod:`services.predictor.placement`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from services.common.registry import WorkerRecord

#: Seconds a worker's heartbeat must postdate a request routed to it before the heartbeat's
#: ``loading`` list is trusted to show that request's adapter; until then the router counts
#: the adapter as loading there on its own record (the worker's engine asks its store for the
#: adapter at its next step, well within this).
ROUTED_GRACE_S = 1.0

#: The routing policies (``GatewayConfig.routing``).
RANK_AWARE = "rank_aware"
ROUND_ROBIN = "round_robin"


@dataclass(slots=True)
class WorkerView:
    """What placement and routing know of a worker (from its heartbeat); read-only by
    convention outside :class:`RoutingState`, which updates its own views in place between
    heartbeats (so not frozen; a frozen dataclass also costs 9x more to build).

    Attributes:
        worker_id: Registry id.
        pool_bytes: Device adapter pool size.
        free_bytes: Pool bytes not holding live adapters.
        resident: Adapter ids resident in its pool.
        loading: Adapter ids on their way into its pool: a load in flight at its last
            heartbeat, or a request for them routed there since (:class:`RoutingState`).
            Any collection (the routing state adds to a set in place).
        room_bytes: Pool bytes a load could take now without waiting for a lease to drop
            (free plus unleased resident adapters); -1 = unknown (assume room).
        host_cached: Adapter ids in its host cache: a load of one reads host memory, not the
            source tier.
        queue_length: Requests queued or running on it.
        pending: Requests sent to it that have not had their first token yet (waiting for an
            adapter, queued, or in prefill): the work a new request's first token waits behind.
            The gateway counts its own; 0 where unknown (placement does not use it).
        prefill_s: The worker's recent mean prefill time per request, seconds (0 = unknown).
        cold_wait_s: The worker's recent mean adapter wait of a cold request, seconds
            (0 = unknown).
        source_load_s: The worker's recent mean time of a load from the source tier
            (read, room and copy), seconds (0 = unknown): what a cold start of an adapter it
            does not hold in its host cache costs there.
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
    host_cached: Collection[str] = field(default_factory=frozenset)
    source_load_s: float = 0.0


def worker_view(record: WorkerRecord) -> WorkerView:
    """The view of a worker's last heartbeat (``services.common.registry.WorkerRecord``): its
    queue is its queued plus running requests."""
    pool_bytes = int(record.pool.get("pool_bytes", 0))
    return WorkerView(
        worker_id=record.worker_id,
        pool_bytes=pool_bytes,
        free_bytes=max(0, pool_bytes - int(record.pool.get("live_bytes", 0))),
        resident=frozenset(record.resident),
        queue_length=record.queue_length + record.running,
        prefill_s=record.prefill_s,
        cold_wait_s=record.cold_wait_s,
        loading=frozenset(record.loading),
        room_bytes=record.room_bytes,
        host_cached=frozenset(record.host_cached),
        source_load_s=record.source_load_s,
    )


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
    ``workers`` rotated by ``turn``: :class:`RoutingState` passes a count of the requests
    routed, so equally loaded workers take turns (always the first would load one worker more
    than the others whenever the cluster is idle). docs/architecture.md ("How a request finds
    its worker") gives the reasons for this order.

    Size-aware: with ``size_bytes`` given, a worker whose pool has no room for the adapter now
    (``room_bytes``: every resident adapter it could evict is leased) is not chosen for a cold
    start (placed or least loaded) while another has the room: a load there would wait for
    running requests to finish, however short its queue. ``l`` below is then the least-loaded
    worker with room. When no worker has the room, a resident or loading copy is left only for
    its queue: a cold start elsewhere would wait for a running request to end (seconds under
    load) before its load began, which the worker's measured ``cold_wait_s`` (a mean over
    mostly loads that found room) does not show.

    Order: the least-loaded worker holding the adapter resident; else the least-loaded worker
    loading it (``WorkerView.loading``: the request waits only for the rest of that load, where
    another worker would start a whole second one and hold a second copy; the placement does not
    move a request off a load in flight: on the Alibaba trace in ``plora simulate`` that made
    one cold request in six a duplicate load); else, when some but not all of the candidates
    hold it in their host cache (``WorkerView.host_cached``), the least-loaded of those (its
    load reads host memory, where another worker would read the source: seconds from remote
    storage; workers stage different adapters, :func:`services.worker.store_types.staging_key`);
    else the least-loaded worker the placement assigns it to; else the least-loaded worker. A
    resident, loading or host-caching worker ``w`` is passed over for the least-loaded worker
    ``l`` when its queue is more than ``queue_slack`` longer, or when the prefills it has
    pending beyond ``l``'s would delay the first token longer than a cold start on ``l``:
    ``(w.pending - l.pending) * w.prefill_s > l.cold_wait_s``. Where the load on ``l`` would
    read the source tier (``l`` does not hold the adapter in its host cache) and ``l`` has
    measured such reads (``source_load_s``), ``w`` is passed over only when ``(w.pending -
    l.pending) * w.prefill_s > l.source_load_s``: neither the queue difference (the requests
    waiting for the same load are queued on ``w`` too) nor ``l.cold_wait_s`` (a mean over mostly
    host copies where host caches serve most loads) weighs a read of seconds (``plora
    simulate``, h100-8b, 4 workers, ``plora-no-predictor``: mean TTFT 0.97 s against 1.54 s on
    the Alibaba trace over 5 seeds, 0.0391 s against 0.0408 s on the Azure 2019 trace). A
    placed, not resident, worker is chosen only when it is as lightly loaded as ``l`` (pending,
    then queue): the placement breaks ties among the least-loaded workers and never adds a wait.
    The request is cold on either worker, so nothing is saved by waiting behind a placed
    worker's prefills, and the placement is the predictor's guess while the queue is measured.
    Where a worker has not measured those yet (0), ``pending_slack`` extra pending requests are
    tolerated. Staying saves a load (a cold start on ``l``), leaving saves waiting behind
    ``w``'s prefills: the rule takes whichever is expected to be shorter, using each worker's
    own recent figures, so the same code is right where loads are slow against prefill (remote
    adapter storage) and where they are fast (host memory to GPU). Decoding sequences do not, by
    themselves, move a request off its resident worker: that would spread adapters over more
    workers and cost more cold starts than the balance wins.

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
        ``(worker_id, reason)`` with reason ``"resident"``, ``"loading"``, ``"host"``,
        ``"placed"``, ``"least_loaded"``.

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

        # Leaving for `least` starts a read from the source tier there (seconds from remote
        # storage), not a copy from its host memory.
        source_read = adapter_id not in least.host_cached

        def stay(w: WorkerView, saves_load: bool) -> bool:
            # (saves_load=False leaves only the queue test.)
            return _worth_staying(
                w,
                least,
                pending_slack,
                queue_slack,
                saves_load=saves_load and not least_waits,
                source_read=source_read,
            )

        resident = [w for w in workers if adapter_id in w.resident]
        if resident:
            best = min(resident, key=_load_key)
            if stay(best, True):
                return best.worker_id, "resident"
        placed_ids = set(placement.get(adapter_id, ()))
        loading = [w for w in workers if adapter_id in w.loading and adapter_id not in w.resident]
        if loading:
            best = min(loading, key=_load_key)
            if stay(best, True):
                return best.worker_id, "loading"
        hosts = [w for w in roomy if adapter_id in w.host_cached and adapter_id not in w.resident]
        if hosts and len(hosts) < len(roomy):
            best = min(hosts, key=_load_key)
            if stay(best, True):
                return best.worker_id, "host"
        placed = [w for w in roomy if w.worker_id in placed_ids and adapter_id not in w.resident]
        if placed:
            best = min(placed, key=_load_key)
            if _load_key(best) <= _load_key(least):  # the placement breaks ties only
                return best.worker_id, "placed"
    return least.worker_id, "least_loaded"


def _has_room(w: WorkerView, size_bytes: int) -> bool:
    """Whether a load of ``size_bytes`` could start on ``w`` now (unknown room counts)."""
    return w.room_bytes < 0 or w.room_bytes >= size_bytes


def _load_key(w: WorkerView) -> tuple[int, int]:
    return (w.pending, w.queue_length)


def _worth_staying(
    w: WorkerView,
    least: WorkerView,
    pending_slack: int,
    queue_slack: int,
    *,
    saves_load: bool,
    source_read: bool = False,
) -> bool:
    """Whether a request should go to ``w`` rather than the least-loaded worker (see
    :func:`route_rank_aware`); ``source_read``: the load on ``least`` would read the source
    tier."""
    # Leaving for a read from the source costs that read (the measured mean on `least`), which
    # neither the queue difference nor `least.cold_wait_s` (a mean over mostly host copies
    # where a host cache serves most loads) weighs: the pending prefills alone are set against it.
    by_source = saves_load and source_read and least.source_load_s > 0.0
    if not by_source and w.queue_length > least.queue_length + queue_slack:
        return False
    extra = w.pending - least.pending
    if extra <= 0 or not saves_load:
        return True
    cold_s = least.source_load_s if by_source else least.cold_wait_s
    if w.prefill_s > 0.0 and cold_s > 0.0:
        return extra * w.prefill_s <= cold_s
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


class Heartbeated(Protocol):
    """A worker as :meth:`RoutingState.usable` reads it (a registry ``WorkerRecord``)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def heartbeat_unix(self) -> float: ...


H = TypeVar("H", bound=Heartbeated)


class RoutingState:
    """One gateway's routing rule and the per-worker bookkeeping it reads between heartbeats;
    thread-safe.

    Heartbeats are up to a second old, so the gateway counts its own requests on top of each:

    * *in flight*: requests sent to a worker and not finished; a worker's queue is taken as at
      least this (a burst is not all sent to the worker that looked idle at its heartbeat);
    * *pending*: those of them without their first token yet (``WorkerView.pending``);
    * *routed*: the adapters it sent a request for to a worker that neither held nor was
      loading them; each counts as loading there and takes its bytes from the worker's room
      until a heartbeat taken ``grace_s`` after the routing speaks for it;
    * *failed*: a worker whose call failed before the first token is left out of routing until
      a heartbeat newer than the one it had then (:meth:`usable`).

    The gateway view of a worker is built once per heartbeat (:meth:`views`) and kept up to
    date in place as requests are routed, so a decision costs a few attribute writes per
    worker. A simulated gateway, which has no request streams to count, passes its workers'
    in-flight and pending counts in (``counts``) and records only the loads it started
    (:meth:`record`).

    Args:
        routing: ``"rank_aware"`` (:func:`route_rank_aware`) or ``"round_robin"``.
        grace_s: :data:`ROUTED_GRACE_S`.
        on_pending: Called with a worker id and its new pending count whenever it changes
            (under the state's lock, so calls arrive in order): a gauge.
        first_turn: Where the rotation of the order ties are broken in starts. Gateways in
            front of the same workers each count only their own requests, so two that
            rotated alike would break every tie alike and send their first requests for cold
            adapters to the same idle worker (herding, kept afterwards by the adapters'
            residency: max / min requests per worker 1.5 for two live gateways); each starts
            at its own turn instead (the gateway's start index,
            :meth:`services.common.registry.Registry.next_gateway_index`).
    """

    def __init__(
        self,
        routing: str = RANK_AWARE,
        *,
        grace_s: float = ROUTED_GRACE_S,
        on_pending: Callable[[str, int], None] | None = None,
        first_turn: int = 0,
    ) -> None:
        if routing not in (RANK_AWARE, ROUND_ROBIN):
            raise ValueError(f"routing must be {RANK_AWARE!r} or {ROUND_ROBIN!r}, got {routing!r}")
        self.routing = routing
        self.grace_s = grace_s
        self._on_pending = on_pending
        self._lock = threading.Lock()
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._pending: collections.Counter[str] = collections.Counter()
        # worker id -> adapter id -> (time first routed there, its bytes)
        self._routed: dict[str, dict[str, tuple[float, int]]] = {}
        # worker id -> (heartbeat time, the gateway view built from that heartbeat)
        self._views: dict[str, tuple[float, WorkerView]] = {}
        # (the heartbeats of the last views call, its views) while no view was rebuilt since
        self._last: tuple[object, list[WorkerView]] | None = None
        # worker id -> its heartbeat time when a call to it failed
        self._failed: dict[str, float] = {}
        # rank-aware decisions made (from first_turn): rotates the order ties are broken in
        self._turn = first_turn
        self._round_robin = RoundRobinRouter()

    # -- what the gateway counts per request ---------------------------------------------

    def first_token(self, worker_id: str) -> None:
        """A request on ``worker_id`` had its first token."""
        with self._lock:
            self._add_pending(worker_id, -1)

    def done(self, worker_id: str, *, pending: bool) -> None:
        """A request on ``worker_id`` ended (``pending``: before its first token)."""
        with self._lock:
            self._in_flight[worker_id] -= 1
            if pending:
                self._add_pending(worker_id, -1)

    def failed(self, worker_id: str, heartbeat_t: float) -> None:
        """A call to ``worker_id`` failed before its first token; ``heartbeat_t`` is the
        heartbeat the worker was chosen on."""
        with self._lock:
            self._failed[worker_id] = heartbeat_t

    def usable(self, workers: Sequence[H]) -> list[H]:
        """``workers`` less those whose call failed, until a heartbeat newer than the one they
        had then speaks for them (killed: its liveness key outlives it for a few seconds;
        restarted: it heartbeats again); all of them if every one failed."""
        with self._lock:
            kept = [w for w in workers if self._failed.get(w.worker_id) != w.heartbeat_unix]
        return kept or list(workers)

    def in_flight(self, worker_id: str) -> tuple[int, int]:
        """``(in flight, pending)`` on ``worker_id``."""
        with self._lock:
            return self._in_flight[worker_id], self._pending[worker_id]

    # -- views and decisions -------------------------------------------------------------

    def views(
        self,
        heartbeats: Iterable[tuple[WorkerView, float]],
        *,
        counts: Sequence[tuple[int, int]] | None = None,
        refresh: bool = False,
    ) -> list[WorkerView]:
        """The gateway's view of each worker: its heartbeat's, with the queue at least the
        requests in flight there, the pending requests, and the loads routed there since the
        heartbeat added to ``loading`` (each taking its bytes from ``room_bytes``).

        The views are this state's own, updated in place by the next call: valid for one
        routing decision.

        Args:
            heartbeats: ``(view of the worker's last heartbeat, the heartbeat's time)`` per
                worker. A worker's view is rebuilt when the time is not the one it was built
                from; the heartbeat is otherwise assumed unchanged.
            counts: ``(in flight, pending)`` per worker, in the order of ``heartbeats``,
                instead of this state's own counts.
            refresh: Rebuild every view (the heartbeats changed, their times did not).
        """
        with self._lock:
            return self._views_locked(heartbeats, counts, refresh)

    def since_heartbeat(self, heartbeat: WorkerView, heartbeat_t: float) -> tuple[set[str], int]:
        """``(loading, room_bytes)`` of the worker's gateway view (see :meth:`views`)."""
        with self._lock:
            (view,) = self._views_locked([(heartbeat, heartbeat_t)], None, False)
            return set(view.loading), view.room_bytes

    def pick(
        self,
        adapter_id: str,
        views: Sequence[WorkerView],
        placement: Mapping[str, Sequence[str]],
        *,
        size_bytes: int = 0,
    ) -> tuple[str, str]:
        """One routing decision over ``views`` (:meth:`views`; round robin reads only their
        ids): ``(worker_id, reason)``. Rank-aware decisions rotate the order ties are broken
        in.

        Raises:
            ValueError: ``views`` is empty.
        """
        with self._lock:
            return self._pick_locked(adapter_id, views, placement, size_bytes)

    def record(self, worker_id: str, adapter_id: str, size_bytes: int, now: float) -> None:
        """A request for ``adapter_id`` was sent to ``worker_id`` at ``now``: unless the
        worker holds or is loading it, it counts as loading there (taking ``size_bytes`` from
        its room) until a heartbeat taken ``grace_s`` later speaks for it."""
        with self._lock:
            self._record_locked(worker_id, adapter_id, size_bytes, now)

    def route(
        self,
        adapter_id: str,
        heartbeats: Sequence[tuple[WorkerView, float]],
        placement: Mapping[str, Sequence[str]],
        *,
        size_bytes: int,
        now: float,
    ) -> tuple[str, str]:
        """:meth:`views`, :meth:`pick` and the bookkeeping of sending the request there, as
        one step (a concurrent request sees this one counted): the chosen worker's in-flight
        and pending counts go up by one, and :meth:`record` notes the adapter's load.

        Returns:
            ``(worker_id, reason)``.

        Raises:
            ValueError: ``heartbeats`` is empty.
        """
        with self._lock:
            views = self._views_locked(heartbeats, None, False)
            chosen, reason = self._pick_locked(adapter_id, views, placement, size_bytes)
            self._in_flight[chosen] += 1
            self._add_pending(chosen, 1)
            if adapter_id:
                self._record_locked(chosen, adapter_id, size_bytes, now)
        return chosen, reason

    def note_peer_load(
        self,
        heartbeats: Sequence[tuple[WorkerView, float]],
        worker_id: str,
        adapter_id: str,
        size_bytes: int,
        now: float,
    ) -> None:
        """Count ``adapter_id`` as loading on ``worker_id`` because another gateway sent it
        there (``Registry.cold_route``), as if this gateway had routed it: the next request
        for it joins that load (``"loading"``) instead of starting a second copy on the
        worker that looks least loaded from here. Ignored for a worker not in
        ``heartbeats``."""
        with self._lock:
            views = self._views_locked(heartbeats, None, False)
            if any(v.worker_id == worker_id for v in views):
                self._record_locked(worker_id, adapter_id, size_bytes, now)

    # -- internals (lock held) -----------------------------------------------------------

    def _add_pending(self, worker_id: str, delta: int) -> None:
        self._pending[worker_id] += delta
        if self._on_pending is not None:
            self._on_pending(worker_id, self._pending[worker_id])

    def _views_locked(
        self,
        heartbeats: Iterable[tuple[WorkerView, float]],
        counts: Sequence[tuple[int, int]] | None,
        refresh: bool,
    ) -> list[WorkerView]:
        if counts is None:
            heartbeats = list(heartbeats)
            own_in_flight, own_pending = self._in_flight, self._pending
            counts = [
                (own_in_flight[hb.worker_id], own_pending[hb.worker_id]) for hb, _ in heartbeats
            ]
        last = self._last
        if not refresh and last is not None and last[0] is heartbeats:
            out = last[1]  # the same heartbeats as the last call, no view rebuilt since
        else:
            cached = self._views
            out = []
            for hb, hb_t in heartbeats:
                known = None if refresh else cached.get(hb.worker_id)
                ok = known is not None and known[0] == hb_t
                out.append(known[1] if ok else self._rebuild(hb, hb_t))  # type: ignore[index]
            self._last = (heartbeats, out)
        for view, (hb, _), (in_flight, pending) in zip(out, heartbeats, counts, strict=True):
            queue = hb.queue_length
            view.queue_length = in_flight if in_flight > queue else queue
            view.pending = pending
        return out

    def _rebuild(self, hb: WorkerView, hb_t: float) -> WorkerView:
        """The gateway view of a new heartbeat: loads routed less than ``grace_s`` before it
        may not have reached the worker's store when it was taken; older ones are the
        heartbeat's to report and are forgotten."""
        loading = set(hb.loading)
        room = hb.room_bytes
        routed = self._routed.get(hb.worker_id)
        if routed:
            cutoff = hb_t - self.grace_s
            for a, (t, size) in list(routed.items()):
                if t < cutoff:
                    del routed[a]
                elif a not in loading and a not in hb.resident:
                    loading.add(a)
                    if room >= 0:
                        room = max(0, room - size)
        view = WorkerView(
            hb.worker_id,
            hb.pool_bytes,
            hb.free_bytes,
            hb.resident,
            hb.queue_length,
            0,
            hb.prefill_s,
            hb.cold_wait_s,
            loading,
            room,
            hb.host_cached,
            hb.source_load_s,
        )
        self._views[hb.worker_id] = (hb_t, view)
        self._last = None
        return view

    def _pick_locked(
        self,
        adapter_id: str,
        views: Sequence[WorkerView],
        placement: Mapping[str, Sequence[str]],
        size_bytes: int,
    ) -> tuple[str, str]:
        if self.routing == ROUND_ROBIN:
            return self._round_robin.route(views), ROUND_ROBIN
        turn = self._turn
        self._turn += 1
        return route_rank_aware(adapter_id, views, placement, size_bytes=size_bytes, turn=turn)

    def _record_locked(self, worker_id: str, adapter_id: str, size_bytes: int, now: float) -> None:
        routed = self._routed.setdefault(worker_id, {})
        known = self._views.get(worker_id)
        cutoff = known[0] - self.grace_s if known is not None else -float("inf")
        first = routed.get(adapter_id)
        if first is not None and first[0] >= cutoff:
            return  # already counted since this heartbeat
        routed[adapter_id] = (now, size_bytes)
        if known is None or now < cutoff:
            return  # the next view built counts it (or forgets it)
        view = known[1]
        if adapter_id not in view.loading and adapter_id not in view.resident:
            view.loading.add(adapter_id)  # type: ignore[attr-defined]  # the set _rebuild made
            if view.room_bytes >= 0:
                view.room_bytes = max(0, view.room_bytes - size_bytes)
