"""Discrete-event simulator of the cluster (gateway, N workers, predictor) on a virtual clock.

Nothing here re-implements a policy: the simulated workers drive the production allocators
(:mod:`services.worker.pool`), eviction policies (:mod:`services.worker.eviction`) and host
cache (:class:`services.worker.store.HostCache`) directly, the simulated predictor runs the
production forecaster (:mod:`services.predictor.forecast`; once per trace, shared by every
simulation of it, see :mod:`plora.simulator.feed`) and the LoRAServe placement and
prefetch choice (:mod:`services.predictor.placement`), the simulated gateway routes with the
gateway's own routing state (:class:`services.common.routing.RoutingState`), and arrivals come
from the production trace loaders (:mod:`plora.traces`). The :class:`AdapterStore` itself runs
loader threads on the wall clock, so the simulator replays its decisions (the same order of
alloc, compaction, victim choice, prefetch admission) on the virtual clock instead; see
:class:`SimWorker`.

Model of one worker (the engine of :mod:`services.worker.engine`):

* A request routed to a worker takes a lease at once (so its adapter is pinned); if the adapter
  is resident it is *ready*, otherwise it is a **cold start**: it waits for its adapter's load
  (a demand load at high priority), while every other request keeps running. A cold request
  still waiting ``load_wait_timeout_s`` after it arrived fails (``DeadlineExceededError``),
  as the worker's engine fails it, and its load is cancelled if nobody else waits for it.
* Continuous batching: at each step boundary, ready requests are admitted in arrival order up
  to ``max_batch_size`` running sequences and a prefill budget of ``max_num_batched_tokens``
  prompt tokens. A step that prefills emits the first token of the admitted requests at its end
  (their **TTFT** = that time + the network overhead - the gateway receipt); each later step
  emits one token per running sequence; a sequence leaves the batch at the step of its last
  output token. Step durations come from the preset's :class:`StepTimeModel` (batch rows,
  prefill tokens, adapters and ranks in the batch).
* Steps with an unchanged batch are merged: a worker schedules one event at the next
  completion, and an arrival that can join the batch moves that event to the next step
  boundary. Per-request work is O(log n), independent of the number of steps.
* Routing inputs: the workers publish the live ones' service figures that routing weighs
  (``ServiceEstimates``: each prefill's share of its step, each cold start's adapter wait), and
  the simulated gateway routes as the gateway does, through the same
  :class:`~services.common.routing.RoutingState`.
* Several gateways (``SimConfig.gateways``): arrivals are split over them in turn, and each
  routes with a :class:`~services.common.routing.RoutingState` of its own that counts only the
  requests it sent (in flight, awaiting their first token) and the loads it started, on top
  of the heartbeats they all read, as live gateways do.
* Loads: ``loader_threads`` at once, demand before prefetch (by expected demand): the source
  tier (a draw from the real Alibaba load latencies, or a fixed cost plus bytes / bandwidth)
  unless the host cache holds the adapter, then the allocation (first fit; compaction of the
  paged pool when enough pages are free but no run fits; eviction by the policy otherwise;
  waiting while every resident adapter is leased, without holding a loader thread), then the
  host-to-device copy (bytes / bandwidth, plus the bytes moved by compaction / device copy
  bandwidth).

Determinism: every random draw comes from ``numpy.random.default_rng`` seeded from
``SimConfig.seed``; ties of the event queue are broken by insertion order and events run before
arrivals of the same instant. The same inputs give the same result, bit for bit.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from plora.policies import PolicySpec, get_policy
from plora.simulator.feed import DemandFeed, FeedSettings
from plora.simulator.oracle import LOOKAHEAD_S, BeladyPolicy, FutureArrivals
from plora.simulator.presets import Preset
from plora.traces import Trace, map_keys_to_adapters
from services.common.errors import PoolExhaustedError
from services.common.routing import RANK_AWARE, RoutingState, WorkerView
from services.predictor.calibration import ForecastCalibrator
from services.predictor.config import PredictorConfig
from services.predictor.forecast import DEFAULT_FORECASTER
from services.predictor.placement import AdapterDemand, PrefetchSelector, plan_placement
from services.worker.allocators import make_allocator
from services.worker.cold import CAUSE_INDEX, cold_cause, eviction_cause
from services.worker.estimates import ServiceEstimates
from services.worker.eviction import (
    Candidate,
    EvictionPolicy,
    make_policy,
)
from services.worker.pool import Allocator
from services.worker.room import PressureSampler, RoomAction, RoomDecision, RoomSearch
from services.worker.store import HostCache, PackedAdapter, StoreConfig
from services.worker.store_types import (
    DEMAND_PRIORITY,
    PREFETCH_PRIORITY,
    demand_queued,
    staging_key,
)

logger = logging.getLogger(__name__)

_NAN = float("nan")
_INF = float("inf")

# event kinds
_EV_BOUNDARY = 0  # a worker's planned step boundary
_EV_READ = 1  # a load's source/host read finished
_EV_LOADED = 2  # a load's copy finished: adapter resident
_EV_RETRY = 3  # a demand load's wait for pool space timed out: retry once more
_EV_TICK = 4  # predictor tick
_EV_STAGED = 5  # a host staging read finished (AdapterStore.stage)
_EV_DEADLINE = 6  # a cold request's wait for its adapter reached the bound (the engine's check)

# request status
_PENDING, _OK, _FAILED = 0, 1, 2


# ------------------------------------------------------------------------------ inputs
#: The predictor service's defaults (the simulated predictor uses the same).
_PREDICTOR = PredictorConfig()


@dataclass(frozen=True, eq=False)
class SimConfig:
    """Settings of one simulation.

    Attributes:
        preset: Worker hardware and sizes.
        workers: Number of workers (>= 1).
        seed: Seed of every random draw (source latencies, forecaster init).
        tick_s: Predictor tick, seconds (1 s as in the paper).
        horizon_s: Forecast horizon, seconds.
        forecaster: Forecaster name for :func:`make_forecaster`.
        train_every: Train the forecaster every this many ticks (1 = every tick, as the
            predictor service does).
        train_budget_s: Wall-clock budget per ``train`` call (the LSTM runs one step anyway).
        prefetch_min_expected: Prefetch threshold.
        prefetch_min_probability: Calibrated probability a prefetch needs
            (:class:`~services.predictor.calibration.ForecastCalibrator`).
        max_prefetch_per_worker: Prefetch items per worker per tick.
        compaction_max_ratio: The store's compaction budget (units moved per unit needed;
            default the worker's, ``StoreConfig.compaction_max_ratio``).
        prefetch_min_gain: The store's prefetch displacement margin (default the worker's,
            ``StoreConfig.prefetch_min_gain``).
        view_refresh_s: How often the gateway's and predictor's view of the workers (queue
            length, residency, free pool bytes) is refreshed, seconds: the workers publish it
            with their heartbeat (``WorkerConfig.heartbeat_interval_s`` = 1 s) and the gateway
            reuses it between heartbeats, so routing sees state up to this old. 0 = exact state
            at every request.
        source_latencies_s: ``float64 [m]`` real load latencies to draw from (preset source
            ``"alibaba"``); required for that source.
        gateways: Gateways in front of the workers (>= 1); arrival ``i`` goes to gateway
            ``i % gateways``.

    The predictor settings (tick, horizon, training budget, prefetch threshold and cap) default
    to the predictor service's own defaults (:class:`services.predictor.config.PredictorConfig`).

    Raises:
        ValueError: workers or gateways < 1, a tick or horizon <= 0, ``train_every`` < 1, a
            negative ``view_refresh_s``, ``prefetch_min_probability`` outside [0, 1], or an
            ``alibaba`` source without latencies.
    """

    preset: Preset
    workers: int = 4
    seed: int = 0
    tick_s: float = _PREDICTOR.tick_s
    horizon_s: float = _PREDICTOR.horizon_s
    forecaster: str = DEFAULT_FORECASTER
    train_every: int = 1
    train_budget_s: float = _PREDICTOR.train_budget_s
    prefetch_min_expected: float = _PREDICTOR.prefetch_min_expected
    prefetch_min_probability: float = _PREDICTOR.prefetch_min_probability
    max_prefetch_per_worker: int = _PREDICTOR.max_prefetch_per_worker
    compaction_max_ratio: float = StoreConfig.compaction_max_ratio
    prefetch_min_gain: float = StoreConfig.prefetch_min_gain
    view_refresh_s: float = 1.0
    source_latencies_s: np.ndarray | None = field(default=None, repr=False)
    gateways: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.gateways < 1:
            raise ValueError(f"gateways must be >= 1, got {self.gateways}")
        if self.tick_s <= 0 or self.horizon_s <= 0 or self.train_every < 1:
            raise ValueError("tick_s, horizon_s must be > 0 and train_every >= 1")
        if self.view_refresh_s < 0:
            raise ValueError(f"view_refresh_s must be >= 0, got {self.view_refresh_s}")
        if not 0.0 <= self.prefetch_min_probability <= 1.0:
            raise ValueError(
                f"prefetch_min_probability must be in [0, 1], got {self.prefetch_min_probability}"
            )
        if self.preset.source == "alibaba" and (
            self.source_latencies_s is None or len(self.source_latencies_s) == 0
        ):
            raise ValueError("preset source 'alibaba' needs source_latencies_s")

    def feed_settings(self) -> FeedSettings:
        """What the forecasts depend on (two configs with equal settings can share a feed)."""
        names = ("forecaster", "horizon_s", "seed", "tick_s", "train_every", "train_budget_s")
        return FeedSettings(**{k: getattr(self, k) for k in names})


@dataclass(frozen=True, eq=False)
class AdapterSet:
    """The adapters a simulated trace requests.

    Attributes:
        names: Adapter ids, ``[K]``.
        ranks: ``int64 [K]`` LoRA rank of each.
        nbytes: ``int64 [K]`` pool bytes of each.
        key_adapter: ``int64 [len(trace.keys)]`` adapter index of each trace key.
    """

    names: tuple[str, ...]
    ranks: np.ndarray
    nbytes: np.ndarray
    key_adapter: np.ndarray

    def __len__(self) -> int:
        return len(self.names)


def build_adapter_set(trace: Trace, preset: Preset, num_adapters: int, seed: int = 0) -> AdapterSet:
    """K adapters of the preset's ranks (cycled, as ``plora make-adapters`` names them), with
    trace keys mapped onto them by :func:`map_keys_to_adapters` (popularity rank, seeded).

    Args:
        trace: The trace (its keys, most popular first, are mapped).
        preset: Gives ranks and sizes.
        num_adapters: K (>= 1).
        seed: Seed of the key -> adapter mapping.

    Raises:
        ValueError: ``num_adapters < 1``.
    """
    if num_adapters < 1:
        raise ValueError(f"num_adapters must be >= 1, got {num_adapters}")
    ranks = [preset.ranks[i % len(preset.ranks)] for i in range(num_adapters)]
    names = tuple(f"adapter-{i:03d}-r{r}" for i, r in enumerate(ranks))
    mapping = map_keys_to_adapters(trace.keys_by_popularity(), names, seed)
    index = {n: i for i, n in enumerate(names)}
    key_adapter = np.array([index[mapping[k]] for k in trace.keys], dtype=np.int64)
    return AdapterSet(
        names,
        np.asarray(ranks, dtype=np.int64),
        np.array([preset.adapter_bytes(r) for r in ranks], dtype=np.int64),
        key_adapter,
    )


# ------------------------------------------------------------------------------ results
@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-request outcomes and counters of one simulation (times in seconds, virtual clock).

    Attributes:
        policy: Policy name.
        workers: Worker count.
        arrival_s: ``float64 [n]`` gateway receipt.
        first_token_s: ``float64 [n]`` first token at the client (NaN if failed).
        done_s: ``float64 [n]`` last token (NaN if failed).
        output_tokens: ``int64 [n]``.
        cold: ``bool [n]`` the adapter was not resident when the request reached its worker.
        cold_wait_s: ``float64 [n]`` wait for the adapter (0 when warm).
        failed: ``bool [n]``.
        worker: ``int64 [n]`` worker that served it (-1 if none).
        counters: Pool, load, prefetch and routing counters (JSON-ready); ``predictor_wall_s``
            is the wall time of the per-tick placement and prefetch round, ``forecast_wait_s``
            the time spent waiting for (or computing) the shared forecasts.
        wall_s: Wall-clock seconds the simulation took.
        events: Events processed (arrivals included).
        cpu_s: CPU seconds of this process during the simulation.
        failed_s: ``float64 [n]`` when a failed request failed (its arrival if rejected; NaN
            for completed requests, and for requests still unfinished when the trace ended).
        cold_cause: ``uint8 [n]`` 0 for a warm request, else 1 + the index of its cause in
            :data:`services.worker.cold.COLD_CAUSES`.
        first_appearance: ``bool [n]`` the first request of its adapter in the trace (a cold
            start no policy avoids).
    """

    policy: str
    workers: int
    arrival_s: np.ndarray
    first_token_s: np.ndarray
    done_s: np.ndarray
    output_tokens: np.ndarray
    cold: np.ndarray
    cold_wait_s: np.ndarray
    failed: np.ndarray
    worker: np.ndarray
    counters: dict[str, Any]
    wall_s: float
    events: int
    cpu_s: float = 0.0
    failed_s: np.ndarray | None = None
    cold_cause: np.ndarray | None = None
    first_appearance: np.ndarray | None = None

    @property
    def ttft_s(self) -> np.ndarray:
        """``float64 [n]`` TTFT per request (NaN if failed)."""
        return self.first_token_s - self.arrival_s


# ------------------------------------------------------------------------------ loads
class _Load:
    """One adapter load in flight on a worker."""

    __slots__ = (
        "a", "demanded", "expected", "started", "tier", "handle", "units", "wait_t0",
        "room", "used", "prefetch", "compact_s", "cause", "queued_t", "started_t", "read_t",
        "behind",
    )  # fmt: skip

    def __init__(self, a: int, demanded: bool, expected: float) -> None:
        self.a = a
        self.demanded = demanded
        self.prefetch = not demanded
        self.used = False
        self.expected = expected
        self.started = False
        self.tier = ""
        self.handle = -1
        self.units = 0
        self.wait_t0 = -1.0
        self.room: RoomSearch | None = None
        self.cause = ""  # a demand load: the cold-start cause of the request that started it
        self.queued_t = 0.0  # when it was queued (a prefetch: when a request first needed it)
        self.started_t = -1.0  # when a loader thread first took it
        self.read_t = -1.0  # when its bytes were in host memory
        self.behind = False  # a demand load queued while prefetches held the loader threads
        self.compact_s = 0.0


# ------------------------------------------------------------------------------ a worker
class SimWorker:
    """One simulated worker: engine queue and batch, plus the adapter store's decisions.

    Uses the production :class:`~services.worker.pool.Allocator` (byte accounting: no tensor
    is touched), :class:`~services.worker.eviction.EvictionPolicy` and
    :class:`~services.worker.store.HostCache`; decision order follows
    ``AdapterStore.acquire / prefetch / _allocate``.
    """

    def __init__(self, wid: int, sim: ClusterSimulation) -> None:
        p = sim.preset
        self.wid = wid
        self.name = f"worker-{wid}"
        self.sim = sim
        self.allocator: Allocator = make_allocator(
            sim.policy.allocator, p.pool_bytes, p.page_bytes, p.alignment_bytes
        )
        self.evictor: EvictionPolicy = (
            BeladyPolicy(sim.future, sim.name_index, lambda: sim.now)
            if sim.future is not None
            else make_policy(sim.policy.eviction)
        )
        self.host = HostCache(p.host_cache_bytes)
        self.host_puts = 0  # adapters put in the host cache (each put may evict others)
        self._host_names: frozenset[str] = frozenset()
        self._host_names_version = 0
        self.rng = np.random.default_rng([sim.config.seed, wid])
        k = len(sim.adapters)
        self.refcount = [0] * k
        self.resident: dict[int, int] = {}  # adapter -> allocation handle
        self.res_bytes: dict[int, int] = {}  # adapter -> allocated bytes
        self.last_used: dict[int, float] = {}
        self.prefetched_unused: set[int] = set()
        self.jobs: dict[int, _Load] = {}  # adapter -> load in flight
        # adapter -> time the gateway first routed a request for it here since the heartbeat
        # before last (WorkerView.loading)
        self.routed_at: dict[int, float] = {}
        self.job_heap: list[tuple[int, float, int, _Load]] = []
        self.loading_handles: set[int] = set()
        self.active = 0
        # host staging (AdapterStore.stage): the registered adapters read into free host-cache
        # space one at a time, on a thread of its own, while no demand load is queued, in the
        # order of staging_key (the worker's passes every HOST_STAGING_INTERVAL_S list the same
        # adapters in the same order, so one queue read once stands for them)
        self.staging: deque[int] = deque(
            sorted(range(k), key=lambda a: staging_key(sim.adapters.names[a], self.name))
            if sim.policy.host_staging
            else ()
        )
        self.staging_active = False
        self.alloc_wait: deque[_Load] = deque()
        self.waiters: dict[int, list[int]] = {}
        self.ready: list[int] = []  # heap of request indices (arrival order)
        self.n_waiting = 0
        self.first_due: list[float] = []  # heap: first-token times (at the gateway) to come
        self.estimates = ServiceEstimates()  # what the worker publishes with its heartbeat
        self.running: list[tuple[int, int]] = []  # heap of (finish step, request)
        self.n_run = 0
        self.steps = 0  # steps completed
        self.busy = False
        self.seg_t0 = 0.0
        self.seg_dt = 0.0
        self.seg_k = 0
        self.version = 0
        self.rank_sum = 0
        self.rank_count: dict[int, int] = {}
        self.ad_count: dict[int, int] = {}
        self.res_version = 0
        self._view: WorkerView | None = None
        self._view_key: tuple[int | float, ...] = (-1,)
        self._res_names: frozenset[str] = frozenset()
        self._res_names_version = -1
        # counters
        self.c = {
            "device_hits": 0, "cold_starts": 0, "loads_source": 0, "loads_host": 0,
            "load_seconds": 0.0, "evictions": 0, "compactions": 0, "bytes_moved": 0,
            "failed_loads": 0, "prefetch_issued": 0, "prefetch_used": 0, "prefetch_wasted": 0,
            "prefetch_ignored": 0, "prefetch_already": 0, "rejected": 0, "steps": 0,
            "splits": 0, "host_stages": 0, "demand_loads": 0, "cold_queue_s": 0.0,
            "cold_read_s": 0.0, "cold_room_copy_s": 0.0, "demand_behind_prefetch": 0,
            "demand_behind_prefetch_s": 0.0, "prefetch_cancelled": 0,
        }  # fmt: skip
        self.pressure = PressureSampler()  # utilization and fragmentation under pressure
        self.ever_held: set[int] = set()  # adapters this worker has held (cold-start causes)
        self.evicted_why: dict[int, str] = {}  # adapter -> cause of its last eviction
        # the adapter id and each room decision of a load (AdapterStore's on_decision)
        self.on_decision: Callable[[str, RoomDecision], None] | None = None

    # ---------------------------------------------------------------- routing view
    def view(self) -> WorkerView:
        """This worker as the gateway and predictor see it (cached while unchanged)."""
        al = self.allocator
        est = self.estimates
        key = (
            self.res_version,
            self.n_waiting + self.n_run,
            al.live_bytes,
            est.prefill_s,
            est.cold_wait_s,
            est.source_load_s,
        )
        if key != self._view_key:
            if self._res_names_version != self.res_version:
                names = self.sim.adapters.names
                self._res_names = frozenset(names[a] for a in self.resident)
                self._res_names_version = self.res_version
            self._view = WorkerView(
                worker_id=self.name,
                pool_bytes=al.capacity_bytes,
                free_bytes=al.capacity_bytes - al.live_bytes,
                resident=self._res_names,
                queue_length=key[1],
                prefill_s=est.prefill_s,
                cold_wait_s=est.cold_wait_s,
                source_load_s=est.source_load_s,
            )
            self._view_key = key
        assert self._view is not None
        return self._view

    def host_cached(self) -> frozenset[str]:
        """Adapters in this worker's host cache (the heartbeat's ``host_cached``,
        ``AdapterStore.host_cached_adapters``)."""
        if self._host_names_version != self.host_puts:
            self._host_names = frozenset(self.host.ids())
            self._host_names_version = self.host_puts
        return self._host_names

    def loading(self) -> frozenset[str]:
        """Adapters with a load in flight here (demand or prefetch; the heartbeat's
        ``loading``, ``AdapterStore.loading_adapters``)."""
        if not self.jobs:
            return frozenset()
        names = self.sim.adapters.names
        return frozenset(names[a] for a in self.jobs)

    def room_bytes(self) -> int:
        """Pool bytes a load could take now without waiting: free plus the resident adapters
        no request holds (``AdapterStore.room_bytes``)."""
        al = self.allocator
        rc = self.refcount
        res = self.res_bytes
        return al.free_units * al.unit_bytes + sum(res[a] for a in self.resident if rc[a] == 0)

    def pending(self, t: float) -> int:
        """Requests routed here without their first token at the gateway by ``t`` (the
        gateway's own count, ``WorkerView.pending``)."""
        due = self.first_due
        while due and due[0] <= t:
            heapq.heappop(due)
        return self.n_waiting + len(due)

    # ---------------------------------------------------------------- requests
    def accept(self, r: int, a: int, t: float) -> bool:
        """A request arrives from the gateway; False if the queue is full (rejected)."""
        sim = self.sim
        if self.n_waiting >= sim.preset.max_queue:
            self.c["rejected"] += 1
            return False
        self.n_waiting += 1
        self.refcount[a] += 1
        self.last_used[a] = t
        sim.worker_of[r] = self.wid
        if a in self.resident:
            self.c["device_hits"] += 1
            self.evictor.note_hit(sim.adapters.names[a])
            if a in self.prefetched_unused:
                self.prefetched_unused.discard(a)
                self.c["prefetch_used"] += 1
            heapq.heappush(self.ready, r)
            self.wake(t)
            return True
        self.c["cold_starts"] += 1
        job = self.jobs.get(a)
        if job is not None and job.demanded:
            cause = job.cause  # it joins a demand load in flight
        else:
            cause = cold_cause(
                prefetch_in_flight=job is not None,
                ever_held=a in self.ever_held,
                last_eviction=self.evicted_why.get(a),
            )
        sim.cold[r] = CAUSE_INDEX[cause] + 1
        if job is None:
            self.evictor.note_miss(sim.adapters.names[a])
            job = _Load(a, True, 0.0)
            job.cause = cause
            job.queued_t = t
            self.jobs[a] = job
            heapq.heappush(self.job_heap, (DEMAND_PRIORITY, 0.0, sim.next_seq(), job))
        elif not job.demanded:
            job.demanded = True
            job.cause = cause
            job.queued_t = t
            if not job.used:
                job.used = True
                self.c["prefetch_used"] += 1
            if not job.started:
                heapq.heappush(self.job_heap, (DEMAND_PRIORITY, -job.expected, sim.next_seq(), job))
        self.waiters.setdefault(a, []).append(r)
        sim.push(t + sim.preset.load_wait_timeout_s, _EV_DEADLINE, self.wid, r)
        if not job.started and self.active >= sim.preset.loader_threads:
            # every loader thread is busy: a prefetch still reading yields its thread
            job.behind = not self._preempt_prefetch(t) and any(
                j.started and not j.demanded for j in self.jobs.values()
            )
        self.start_jobs(t)
        return True

    def adapter_deadline(self, r: int, t: float) -> None:
        """Cold request ``r`` has waited ``load_wait_timeout_s`` for its adapter: if it is still
        waiting, it fails with ``DeadlineExceededError`` and drops its lease, as the engine fails
        it at its next step (``Engine._admit``; the worker gives its engine that bound). Its load
        goes on; one nobody waits for any more is cancelled when it next looks for room."""
        a = self.sim.req_adapter[r]
        waiters = self.waiters.get(a)
        if not waiters or r not in waiters:
            return  # its adapter landed, or its load failed
        waiters.remove(r)
        if not waiters:
            del self.waiters[a]
        self.fail_request(r, a, t, "DeadlineExceededError")

    def _preempt_prefetch(self, t: float) -> bool:
        """Demand before prefetch (``AdapterStore`` does the same): cancel the prefetch with the
        least expected demand among those still reading from the source or host tier, so a
        waiting request's load takes its loader thread now. False when none is reading (the
        demand load then waits for a thread)."""
        reading = [j for j in self.jobs.values() if j.started and not j.demanded and j.read_t < 0]
        if not reading:
            return False
        job = min(reading, key=lambda j: (j.expected, -j.started_t))
        del self.jobs[job.a]
        self.active -= 1
        self.c["prefetch_cancelled"] += 1
        return True

    def wake(self, t: float) -> None:
        """A request became ready: start a step now, or join at the next step boundary."""
        if not self.busy:
            self.plan(t)
            return
        if self.seg_k == 1 or self.n_run >= self.sim.preset.max_batch_size:
            return  # the next boundary is the next step's end / no room before a completion
        dt = self.seg_dt
        j = max(1, math.ceil((t - self.seg_t0) / dt - 1e-9))
        if j < self.seg_k:
            self.seg_k = j
            self.version += 1
            self.sim.push(self.seg_t0 + j * dt, _EV_BOUNDARY, self.wid, self.version)

    def plan(self, t: float) -> None:
        """At a step boundary: admit ready requests, then schedule the next boundary."""
        sim = self.sim
        p = sim.preset
        ready = self.ready
        room = p.max_batch_size - self.n_run
        budget = p.max_num_batched_tokens
        prompt = sim.prompt
        ranks = sim.req_rank
        adapter = sim.req_adapter
        admitted: list[int] = []
        prefill = 0
        rank_tokens_new = 0
        rank_new = 0
        while room > 0 and ready:
            r = ready[0]
            pt = prompt[r]
            if admitted and prefill + pt > budget:
                break
            heapq.heappop(ready)
            admitted.append(r)
            prefill += pt
            rk = ranks[r]
            rank_tokens_new += pt * rk
            rank_new += rk
            room -= 1
            a = adapter[r]
            self.ad_count[a] = self.ad_count.get(a, 0) + 1
            self.rank_count[rk] = self.rank_count.get(rk, 0) + 1
        if admitted:
            self.n_run += len(admitted)
            self.n_waiting -= len(admitted)
            self.rank_sum += rank_new
        if self.n_run == 0:
            if self.busy:
                self.busy = False
                sim.busy_workers -= 1
            return
        if not self.busy:
            self.busy = True
            sim.busy_workers += 1
        st = sim.step_model
        n = self.n_run
        rows = n - len(admitted)  # decode rows of the first step
        segs = len(self.ad_count)
        if st.rank_mode == "max":
            mr = max(self.rank_count)
            common = st.base_s + st.lora_segment_s * segs * mr
            per_row = st.per_row_s + st.lora_token_rank_s * mr
            dt_d = common + per_row * n
            dt = (
                common
                + per_row * rows
                + (st.per_prefill_token_s + st.lora_token_rank_s * mr) * prefill
            )
        else:
            common = st.base_s + st.lora_segment_s * segs
            dt_d = common + st.per_row_s * n + st.lora_token_rank_s * self.rank_sum
            dt = (
                common
                + st.per_row_s * rows
                + st.per_prefill_token_s * prefill
                + st.lora_token_rank_s * (self.rank_sum - rank_new + rank_tokens_new)
            )
        if p.shared_compute:
            # the workers share one processor: a step slows down with every other busy worker
            share = max(1.0, sim.busy_workers / p.shared_compute)
            dt *= share
            dt_d *= share
        self.version += 1
        if admitted:
            # The prefill step ends at t + dt and every later (decode) step takes dt_d, so the
            # boundaries are seg_t0 + j * dt_d (j >= 1) from a virtual start seg_t0.
            tend = t + dt
            first = sim.first_token
            out = sim.out
            s0 = self.steps
            net = p.network_s
            running = self.running
            first_due = self.first_due
            per_token = dt / (prefill + rows)  # the engine's split of a step over its tokens
            est = self.estimates
            for r in admitted:
                first[r] = tend + net
                heapq.heappush(running, (s0 + out[r], r))
                heapq.heappush(first_due, tend + net)
                est.observe_prefill(per_token * prompt[r])
            self.seg_t0 = tend - dt_d
        else:
            self.seg_t0 = t
        self.seg_dt = dt_d
        k = self.running[0][0] - self.steps
        if ready and n < p.max_batch_size:
            k = 1  # prompts left over by the prefill budget join at the next step
        self.seg_k = k
        sim.push(self.seg_t0 + k * dt_d, _EV_BOUNDARY, self.wid, self.version)

    def boundary(self, t: float, version: int) -> None:
        """The planned step boundary: complete finished sequences and plan again."""
        if version != self.version:
            return  # superseded by an earlier boundary
        self.steps += self.seg_k
        self.c["steps"] += self.seg_k
        running = self.running
        sim = self.sim
        done = sim.done
        first = sim.first_token
        adapter = sim.req_adapter
        ranks = sim.req_rank
        net = sim.preset.network_s
        while running and running[0][0] <= self.steps:
            _, r = heapq.heappop(running)
            done[r] = max(t + net, first[r])  # = first[r] (one token) up to rounding
            sim.status[r] = _OK
            sim.n_done += 1
            self.n_run -= 1
            a = adapter[r]
            rk = ranks[r]
            self.rank_sum -= rk
            n = self.ad_count[a] - 1
            if n:
                self.ad_count[a] = n
            else:
                del self.ad_count[a]
            n = self.rank_count[rk] - 1
            if n:
                self.rank_count[rk] = n
            else:
                del self.rank_count[rk]
            self.release(a, t)
        self.plan(t)

    def release(self, a: int, t: float) -> None:
        """Drop one lease on adapter ``a``; a freed adapter may unblock a waiting load."""
        self.refcount[a] -= 1
        if self.refcount[a] == 0 and a in self.resident and self.alloc_wait:
            self.unpark()  # it can be evicted now
            self.start_jobs(t)

    def fail_request(self, r: int, a: int, t: float, reason: str) -> None:
        """A request waiting for its adapter fails (load failed or waited too long)."""
        sim = self.sim
        sim.status[r] = _FAILED
        sim.done[r] = t  # the failure time (SimResult.failed_s)
        sim.fail_reason[reason] = sim.fail_reason.get(reason, 0) + 1
        sim.n_done += 1
        self.n_waiting -= 1
        self.release(a, t)

    # ---------------------------------------------------------------- loads
    def start_jobs(self, t: float) -> None:
        """Start queued loads while a loader thread is free (demand first)."""
        sim = self.sim
        while self.active < sim.preset.loader_threads and self.job_heap:
            _, _, _, job = heapq.heappop(self.job_heap)
            if job.started or self.jobs.get(job.a) is not job:
                continue
            job.started = True
            if job.started_t < 0:
                job.started_t = t
            self.active += 1
            if job.room is not None:  # a parked load: its bytes are in host memory already
                self.try_allocate(job, t)
                continue
            name = sim.adapters.names[job.a]
            if self.host.get(name, 0) is not None:
                job.tier = "host"
                read = 0.0
            else:
                job.tier = "source"
                read = sim.source_read_s(job.a, self.rng)
            sim.push(t + read, _EV_READ, self.wid, job)
        self._start_staging(t)

    def _start_staging(self, t: float) -> None:
        """The next staging read that is still needed and fits the free host space, unless
        one is running or a demand load is queued (``AdapterStore._stager``)."""
        if self.staging_active or demand_queued(self.job_heap):
            return
        sim = self.sim
        names = sim.adapters.names
        nbytes = sim.adapters.nbytes
        host = self.host
        if len(host) >= len(names):
            return  # every adapter is in host memory
        while self.staging:
            a = self.staging.popleft()
            if a in self.jobs or a in self.resident or host.holds(names[a], 0):
                continue
            if int(nbytes[a]) > host.free_bytes:
                continue
            self.staging_active = True
            sim.push(t + sim.source_read_s(a, self.rng), _EV_STAGED, self.wid, a)
            return

    def staged(self, a: int, t: float) -> None:
        """A staging read finished: the adapter is in host memory (unless a load beat it)."""
        name = self.sim.adapters.names[a]
        if not self.host.holds(name, 0):
            self.host.put(self.sim.packed(a))
            self.host_puts += 1
            self.c["host_stages"] += 1
        self.staging_active = False
        self.start_jobs(t)

    def read_done(self, job: _Load, t: float) -> None:
        """The adapter's bytes are in host memory: cache them and find pool space."""
        if self.jobs.get(job.a) is not job:
            return  # a prefetch cancelled for a demand load (_preempt_prefetch)
        if job.tier == "source":
            self.host.put(self.sim.packed(job.a))
            self.host_puts += 1
        job.read_t = t
        self.try_allocate(job, t)

    def _pinned(self) -> set[int]:
        pins = set(self.loading_handles)
        rc = self.refcount
        for a, h in self.resident.items():
            if rc[a] > 0:
                pins.add(h)
        return pins

    def _victim(self, job: _Load) -> str | None:
        names = self.sim.adapters.names
        rc = self.refcount
        last = self.last_used
        return self.evictor.choose_victim(
            (
                Candidate(names[a], self.res_bytes[a], last.get(a, 0.0))
                for a in self.resident
                if not rc[a]
            ),
            demanded=job.demanded,
            incoming_expected=job.expected,
            min_gain=self.sim.config.prefetch_min_gain,
        )

    def evict(self, a: int, why: str) -> None:
        """Free adapter ``a``'s run (it is resident and unleased); ``why`` is the cause a later
        cold start of it gets (:func:`services.worker.cold.eviction_cause`)."""
        self.evicted_why[a] = why
        h = self.resident.pop(a)
        del self.res_bytes[a]
        self.allocator.free(h)
        self.unpark()  # space freed
        self.res_version += 1
        self.c["evictions"] += 1
        if a in self.prefetched_unused:
            self.prefetched_unused.discard(a)
            self.c["prefetch_wasted"] += 1

    def try_allocate(self, job: _Load, t: float) -> None:
        """``AdapterStore._allocate`` on the virtual clock: the same :class:`RoomSearch`
        decisions (place, compact, evict, drop, wait, fail), carried out in virtual time."""
        sim = self.sim
        al = self.allocator
        nbytes = int(sim.adapters.nbytes[job.a])
        search = job.room
        if search is None:
            pieces = sim.pieces(job.a)
            search = job.room = RoomSearch(pieces, demanded=job.demanded)
            self.pressure.note_layout(pieces)
        search.demanded = job.demanded
        while True:
            d = search.next(
                al,
                alloc=lambda p, split: al.alloc_pieces(p, split=split),
                pinned=self._pinned,
                victim=lambda: self._victim(job),
                compaction_max_ratio=sim.config.compaction_max_ratio,
                has_waiters=bool(self.waiters.get(job.a)) or not job.demanded,
                wait_expired=(
                    job.wait_t0 >= 0 and t - job.wait_t0 >= sim.preset.load_wait_timeout_s - 1e-9
                ),
            )
            if self.on_decision is not None:
                self.on_decision(sim.adapters.names[job.a], d)
            if d.sample_pressure:
                self.pressure.sample(al, self._pinned())
            action = d.action
            if action is RoomAction.PLACE:
                alloc = d.allocation
                assert alloc is not None
                if alloc.is_split:
                    self.c["splits"] += 1
                job.handle = alloc.handle
                job.units = alloc.units
                self.loading_handles.add(alloc.handle)
                copy_s = nbytes / sim.preset.h2d_bytes_per_s + job.compact_s
                sim.push(t + copy_s, _EV_LOADED, self.wid, job)
                return
            if action is RoomAction.COMPACT:
                moves = al.plan_compaction(self._pinned(), d.compact_units)
                al.apply_moves(moves)
                moved = sum(m.units for m in moves) * al.unit_bytes
                self.c["compactions"] += 1
                self.c["bytes_moved"] += moved
                job.compact_s += moved / sim.preset.device_copy_bytes_per_s
                continue
            if action is RoomAction.EVICT:
                assert d.victim is not None
                why = eviction_cause(
                    for_demand=job.demanded, by_forecast=self.evictor.last_by_forecast
                )
                self.evict(sim.name_index[d.victim], why)
                continue
            if action is RoomAction.DROP:  # a prefetch never waits: dropped
                del self.jobs[job.a]
                self.c["prefetch_ignored"] += 1
                self.active -= 1
                self.start_jobs(t)
                return
            if action in (RoomAction.FAIL, RoomAction.CANCEL):
                self._fail_load(job, t, PoolExhaustedError("no room in the device pool"))
                return
            if job.wait_t0 < 0:  # WAIT
                job.wait_t0 = t
                sim.push(t + sim.preset.load_wait_timeout_s, _EV_RETRY, self.wid, job)
            # parked: its loader thread takes other loads meanwhile (AdapterStore._NoRoom)
            job.started = False
            self.alloc_wait.append(job)
            self.active -= 1
            self.start_jobs(t)
            return

    def unpark(self) -> None:
        """Room may have appeared (space freed, an adapter no longer leased, or a load landed
        that no lease holds): queue the demand loads waiting for room again, oldest first, at
        demand priority (``AdapterStore._unpark``); a free loader thread takes them."""
        while self.alloc_wait:
            job = self.alloc_wait.popleft()
            if self.jobs.get(job.a) is job and job.handle < 0:
                heapq.heappush(
                    self.job_heap, (DEMAND_PRIORITY, -job.expected, self.sim.next_seq(), job)
                )

    def retry_timeout(self, job: _Load, t: float) -> None:
        """A waiting load's deadline: queue it once more (it fails unless room appeared)."""
        if self.jobs.get(job.a) is not job or job.handle >= 0:
            return
        try:
            self.alloc_wait.remove(job)
        except ValueError:
            return
        heapq.heappush(self.job_heap, (DEMAND_PRIORITY, -job.expected, self.sim.next_seq(), job))
        self.start_jobs(t)

    def _fail_load(self, job: _Load, t: float, err: Exception) -> None:
        del self.jobs[job.a]
        self.c["failed_loads"] += 1
        self.active -= 1
        for r in self.waiters.pop(job.a, []):
            self.fail_request(r, job.a, t, type(err).__name__)
        self.start_jobs(t)

    def loaded(self, job: _Load, t: float) -> None:
        """The copy finished: the adapter is resident; its waiting requests become ready."""
        sim = self.sim
        a = job.a
        self.loading_handles.discard(job.handle)
        del self.jobs[a]
        self.resident[a] = job.handle
        self.res_bytes[a] = job.units * self.allocator.unit_bytes
        self.res_version += 1
        self.c["loads_" + job.tier] += 1
        if job.tier == "source":  # as the worker's store reports a load: read, room and copy
            self.estimates.observe_source_load(t - job.started_t)
        self.ever_held.add(a)
        if job.prefetch and not job.used:
            self.prefetched_unused.add(a)
        if job.demanded:  # where a cold start's wait went: loader queue, read, room and copy
            c = self.c
            q0 = job.queued_t
            c["demand_loads"] += 1
            c["cold_queue_s"] += max(0.0, job.started_t - q0)
            c["cold_read_s"] += max(0.0, job.read_t - max(job.started_t, q0))
            c["cold_room_copy_s"] += t - max(job.read_t, q0)
            if job.behind:
                c["demand_behind_prefetch"] += 1
                c["demand_behind_prefetch_s"] += max(0.0, job.started_t - q0)
        self.active -= 1
        waiters = self.waiters.pop(a, None)
        if waiters:
            arrival = sim.arrival
            limit = sim.preset.load_wait_timeout_s
            cold_wait = sim.cold_wait
            for r in waiters:
                w = t - arrival[r]
                if w > limit:
                    self.fail_request(r, a, t, "DeadlineExceededError")
                else:
                    cold_wait[r] = w
                    self.estimates.observe_cold_wait(w)
                    heapq.heappush(self.ready, r)
            self.wake(t)
        if self.refcount[a] == 0 and self.alloc_wait:
            self.unpark()  # it landed unleased (a prefetch): a parked demand load may evict it
        self.start_jobs(t)

    # ---------------------------------------------------------------- prefetch
    def _may_fit(self, nbytes: int, expected: float) -> bool:
        al = self.allocator
        names = self.sim.adapters.names
        rc = self.refcount
        return self.evictor.prefetch_fits(
            al.units_for(nbytes) * al.unit_bytes,
            al.free_units * al.unit_bytes,
            ((names[a], b) for a, b in self.res_bytes.items() if rc[a] == 0),
            incoming_expected=expected,
            min_gain=self.sim.config.prefetch_min_gain,
        )

    def prefetch(self, items: list[tuple[int, float]], t: float) -> None:
        """``AdapterStore.prefetch``: low-priority loads that never evict more-wanted adapters."""
        sim = self.sim
        names = sim.adapters.names
        self.evictor.update_forecast({names[a]: e for a, e in items})
        for a, expected in items:
            job = self.jobs.get(a)
            if job is not None or a in self.resident:
                if job is not None:
                    job.expected = max(job.expected, expected)
                self.c["prefetch_already"] += 1
                continue
            if not self._may_fit(int(sim.adapters.nbytes[a]), expected):
                self.c["prefetch_ignored"] += 1
                continue
            job = _Load(a, False, expected)
            self.jobs[a] = job
            self.last_used[a] = t  # as the store's entry: issued counts as used for recency
            heapq.heappush(self.job_heap, (PREFETCH_PRIORITY, -expected, sim.next_seq(), job))
            self.c["prefetch_issued"] += 1
        self.start_jobs(t)


# ------------------------------------------------------------------------------ the cluster
class ClusterSimulation:
    """Gateway + workers + predictor on one virtual clock (see the module doc).

    Args:
        trace: Arrivals (gateway receipt times, keys, prompt and output tokens).
        adapters: The adapters and the key -> adapter map.
        policy: The serving policy.
        config: Sizes, seed, predictor settings.
        feed: The forecasts of this trace and adapter map (:func:`make_feed`), shared by every
            simulation of them; made here, in this process, when ``None`` and the policy runs
            the predictor.

    Raises:
        ValueError: The adapter map does not cover the trace, or ``feed`` was made with other
            forecaster settings or for a trace with another tick count.
    """

    def __init__(
        self,
        trace: Trace,
        adapters: AdapterSet,
        policy: PolicySpec,
        config: SimConfig,
        feed: DemandFeed | None = None,
    ) -> None:
        if len(adapters.key_adapter) != len(trace.keys):
            raise ValueError("adapters.key_adapter must map every key of the trace")
        self.trace = trace
        self.adapters = adapters
        self.policy = policy
        self.config = config
        self.preset = config.preset
        self.step_model = config.preset.step
        self.name_index = {n: i for i, n in enumerate(adapters.names)}
        n = len(trace)
        ad = adapters.key_adapter[trace.key_index] if n else np.zeros(0, dtype=np.int64)
        self._req_adapter_np = ad.astype(np.int64)
        self.req_adapter: list[int] = ad.tolist()
        self.req_rank: list[int] = adapters.ranks[ad].tolist() if n else []
        self.arrival: list[float] = trace.times.tolist()
        self.prompt: list[int] = trace.prompt_tokens.tolist()
        self.out: list[int] = trace.output_tokens.tolist()
        self.first_token = [_NAN] * n
        self.done = [_NAN] * n
        self.cold = bytearray(n)
        self.cold_wait = [0.0] * n
        self.status = bytearray(n)
        self.worker_of = [-1] * n
        self.fail_reason: dict[str, int] = {}
        self.n_done = 0
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._packed: dict[int, PackedAdapter] = {}
        self._dtype = {4: torch.float32, 2: torch.bfloat16}[self.preset.dtype_bytes]
        self._src = config.source_latencies_s
        self.now = 0.0  # the virtual clock at the event being handled
        self.future = (
            FutureArrivals(trace.times, self._req_adapter_np, len(adapters))
            if policy.oracle
            else None
        )
        self.workers = [SimWorker(w, self) for w in range(config.workers)]
        self.by_name = {w.name: w for w in self.workers}
        # the simulated gateways' routing states; each counts only its own requests
        # (each breaking ties from a turn of its own, as live gateways do)
        self.gateways = [RoutingState(policy.routing, first_turn=g) for g in range(config.gateways)]
        self.routing = self.gateways[0]
        # with several gateways: [gateway][worker] -> requests it sent there, not yet ended
        self._sent: list[list[list[int]]] = [
            [[] for _ in range(config.workers)] for _ in range(config.gateways)
        ]
        self._gv_srcs: list[list[WorkerView] | None] = [None] * config.gateways
        self.placement: dict[str, list[str]] = {}
        self.placement_moves = 0
        self.routed: dict[str, int] = {}
        self.feed: DemandFeed | None = None
        self.selector: PrefetchSelector | None = None
        self._names_arr = np.asarray(adapters.names, dtype=object)
        self._ranks_l: list[int] = adapters.ranks.tolist()
        self._sizes_l: list[int] = adapters.nbytes.tolist()
        self._pieces: dict[int, list[int]] = {}
        if policy.predictor:
            if feed is None:
                feed = make_feed(trace, adapters, config)
            elif feed.settings != config.feed_settings() or feed.trace_key != trace_key(trace):
                raise ValueError("feed was made for other forecaster settings or another trace")
            self.feed = feed
        self.calibrator: ForecastCalibrator | None = None
        if policy.predictor:
            self.calibrator = ForecastCalibrator(config.horizon_s)
        if policy.predictor or policy.oracle:
            self.selector = PrefetchSelector(
                high=config.prefetch_min_expected,
                low=config.prefetch_min_expected / 2,
                calibrator=self.calibrator,
                min_probability=config.prefetch_min_probability,
            )
        self._arrivals_seen = 0  # requests the simulated predictor has heard of
        self.ticks = 0
        self.predictor_wall_s = 0.0
        self._feed_wait0 = feed.wait_s if feed is not None else 0.0
        self.busy_workers = 0
        self._views: list[WorkerView] = []
        self._gv_src: list[WorkerView] | None = None  # the heartbeat views routing last read
        self._gv_heartbeats: list[tuple[WorkerView, float]] = []  # the same with their time
        self._views_next = -_INF
        self._views_t = -_INF  # time of the heartbeat the views are from

    # ---------------------------------------------------------------- helpers
    def next_seq(self) -> int:
        """A fresh tie-breaker."""
        self._seq += 1
        return self._seq

    def push(self, t: float, kind: int, wid: int, payload: Any) -> None:
        """Schedule an event."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, wid, payload))

    def pieces(self, a: int) -> list[int]:
        """Byte sizes of adapter ``a``'s tensors in the store's packed order (split points)."""
        p = self._pieces.get(a)
        if p is None:
            p = self._pieces[a] = self.preset.adapter_pieces(int(self.adapters.ranks[a]))
        return p

    def packed(self, a: int) -> PackedAdapter:
        """Adapter ``a`` as the host cache holds it (a meta tensor: bytes, no storage)."""
        p = self._packed.get(a)
        if p is None:
            numel = int(self.adapters.nbytes[a]) // self.preset.dtype_bytes
            flat = torch.empty(numel, dtype=self._dtype, device="meta")
            p = PackedAdapter(self.adapters.names[a], 0, flat, ())
            self._packed[a] = p
        return p

    def source_read_s(self, a: int, rng: np.random.Generator) -> float:
        """Seconds to read adapter ``a`` from the source tier."""
        p = self.preset
        if p.source == "alibaba":
            src = self._src
            assert src is not None
            return float(src[int(rng.integers(len(src)))])
        return p.source_fixed_s + float(self.adapters.nbytes[a]) / p.source_bytes_per_s

    # ---------------------------------------------------------------- gateway
    def views(self, t: float) -> list[WorkerView]:
        """The workers as published at their last heartbeat before ``t`` (see
        ``SimConfig.view_refresh_s``)."""
        hb = self.config.view_refresh_s
        if hb <= 0:
            self._views_t = t
        elif t >= self._views_next:
            self._views_t = math.floor(t / hb) * hb
            self._views_next = self._views_t + hb
        else:
            return self._views
        views = []
        for w in self.workers:
            v = w.view()  # cached while its key is unchanged; these three are not in the key
            v.loading = w.loading()
            v.room_bytes = w.room_bytes()
            v.host_cached = w.host_cached()
            views.append(v)
        if hb > 0:
            self._views = views
        return views

    def gateway_views(self, t: float) -> list[WorkerView]:
        """What the gateway routes on (:meth:`RoutingState.views`): the heartbeat views
        (:meth:`views`) with each worker's queue at least the requests the gateway has in
        flight there, its pending requests (no first token yet), and the loads the gateway
        started there since the heartbeat. The simulated gateway reads its in-flight and
        pending counts off the workers: requests queued or running there, and those whose
        first token has not reached it by ``t``.

        The returned views are the routing state's own, updated in place on the next call:
        valid for one routing decision (hot path: one call per request).
        """
        stale = self.views(t)
        refresh = stale is not self._gv_src
        if refresh:
            self._gv_src = stale
            self._gv_heartbeats = [(v, self._views_t) for v in stale]
        return self.routing.views(
            self._gv_heartbeats,
            counts=[(w.n_waiting + w.n_run, w.pending(t)) for w in self.workers],
            refresh=refresh,
        )

    def gateway_views_of(self, g: int, t: float) -> list[WorkerView]:
        """:meth:`gateway_views` for gateway ``g`` of several: the heartbeat views with the
        counts of the requests that gateway sent (in flight: not ended; pending: no first
        token at the gateway by ``t``)."""
        stale = self.views(t)
        if stale is not self._gv_src:
            self._gv_src = stale
            self._gv_heartbeats = [(v, self._views_t) for v in stale]
        refresh = stale is not self._gv_srcs[g]
        self._gv_srcs[g] = stale
        status, first = self.status, self.first_token
        counts = []
        for sent in self._sent[g]:
            sent[:] = [r for r in sent if status[r] == _PENDING]
            pending = sum(1 for r in sent if not first[r] <= t)  # NaN: not admitted yet
            counts.append((len(sent), pending))
        return self.gateways[g].views(self._gv_heartbeats, counts=counts, refresh=refresh)

    def _dispatch(self, r: int, t: float) -> None:
        a = self.req_adapter[r]
        rank_aware = self.policy.routing == RANK_AWARE
        g = r % len(self.gateways)
        routing = self.gateways[g]
        # round robin reads only the worker ids: the heartbeat views do
        if not rank_aware:
            views = self.views(t)
        elif len(self.gateways) == 1:
            views = self.gateway_views(t)
        else:
            views = self.gateway_views_of(g, t)
        name = self.adapters.names[a]
        size = int(self.adapters.nbytes[a])
        by_name = self.by_name
        while views:
            chosen, reason = routing.pick(name, views, self.placement, size_bytes=size)
            self.routed[reason] = self.routed.get(reason, 0) + 1
            worker = by_name[chosen]
            if worker.accept(r, a, t):
                if rank_aware:
                    routing.record(chosen, name, size, t)
                    if len(self.gateways) > 1:
                        self._sent[g][worker.wid].append(r)
                return
            # A full queue refuses the request and the simulated gateway tries the next
            # worker. (The gateway does not: a worker's RESOURCE_EXHAUSTED is the request's
            # answer, services.gateway.retry.should_retry.)
            views = [v for v in views if v.worker_id != chosen]
        self.status[r] = _FAILED
        self.done[r] = t  # rejected on arrival
        self.fail_reason["OverloadedError"] = self.fail_reason.get("OverloadedError", 0) + 1
        self.n_done += 1

    # ---------------------------------------------------------------- predictor
    def _tick(self, t: float) -> None:
        """One predictor round (``PredictorCore.tick``): the forecast of this tick (from the
        shared feed), then eviction forecasts, placement and prefetch."""
        feed = self.feed
        assert self.selector is not None
        k = self.ticks
        if self.future is not None:  # the oracle: the exact counts ahead (repeat requests)
            seen_only = not self.policy.clairvoyant
            ads, exps = self.future.counts(t, t + LOOKAHEAD_S, seen_only=seen_only)
        else:
            assert feed is not None
            if feed.ticks[k] != t:
                raise RuntimeError(f"tick {k} at {t} s, the feed has it at {feed.ticks[k]} s")
            ads, exps = feed.get(k)
        self.ticks += 1
        names = self._names_arr[ads].tolist()
        exp_l = exps.tolist()
        expected = dict(zip(names, exp_l, strict=True))
        if self.calibrator is not None:  # the requests since the last tick, then the forecast
            hi = bisect.bisect_right(self.arrival, t)
            arrived = self._names_arr[self._req_adapter_np[self._arrivals_seen : hi]].tolist()
            self._arrivals_seen = hi
            self.calibrator.observe(t, expected, arrived)
        for w in self.workers:
            w.evictor.set_forecast(expected)
        ranks = self._ranks_l
        sizes = self._sizes_l
        demand = {
            a: AdapterDemand(ranks[i], sizes[i], e)
            for a, i, e in zip(names, ads.tolist(), exp_l, strict=True)
        }
        idx = self.name_index
        views = self.views(t)
        placement, moves = plan_placement(demand, views, self.placement)
        self.placement = placement
        self.placement_moves += moves
        if not self.policy.prefetch:
            return
        plan = self.selector.select(
            demand, placement, views, max_per_worker=self.config.max_prefetch_per_worker
        )
        for wname, items in plan.items():
            if items:
                self.by_name[wname].prefetch([(idx[a], float(e)) for a, e in items], t)

    # ---------------------------------------------------------------- main loop
    def run(self) -> SimResult:
        """Run every arrival to completion or failure; returns the outcomes.

        Torch runs single-threaded meanwhile (a forecaster computed in this process: its tiny
        LSTM steps gain nothing from threads, and oversubscribed cores make them 40x slower);
        the previous thread count is restored afterwards.
        """
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._run()
        finally:
            torch.set_num_threads(threads)

    def _run(self) -> SimResult:
        started = time.perf_counter()
        self._cpu0 = time.process_time()
        arrival = self.arrival
        n = len(arrival)
        heap = self._heap
        pop = heapq.heappop
        workers = self.workers
        dispatch = self._dispatch
        tick_s = self.config.tick_s
        next_tick = tick_s if (self.feed is not None or self.future is not None) and n else _INF
        if next_tick < _INF:
            self.push(next_tick, _EV_TICK, -1, None)
        for w in workers:  # the adapters are registered before the first request
            w.start_jobs(0.0)
        i = 0
        events = 0
        while True:
            ta = arrival[i] if i < n else _INF
            if heap and heap[0][0] <= ta:
                t, _, kind, wid, payload = pop(heap)
                self.now = t
                events += 1
                if kind == _EV_BOUNDARY:
                    workers[wid].boundary(t, payload)
                elif kind == _EV_READ:
                    workers[wid].read_done(payload, t)
                elif kind == _EV_LOADED:
                    workers[wid].loaded(payload, t)
                elif kind == _EV_RETRY:
                    workers[wid].retry_timeout(payload, t)
                elif kind == _EV_STAGED:
                    workers[wid].staged(payload, t)
                elif kind == _EV_DEADLINE:
                    workers[wid].adapter_deadline(payload, t)
                else:  # tick
                    t0 = time.perf_counter()
                    self._tick(t)
                    self.predictor_wall_s += time.perf_counter() - t0
                    if i < n:
                        self.push(t + tick_s, _EV_TICK, -1, None)
                continue
            if i >= n:
                break
            self.now = ta
            dispatch(i, ta)
            i += 1
            events += 1
        # anything still pending (a load that never got room) failed
        stuck = [r for r in range(n) if self.status[r] == _PENDING]
        for r in stuck:
            self.status[r] = _FAILED
            self.fail_reason["Unfinished"] = self.fail_reason.get("Unfinished", 0) + 1
        return self._result(time.perf_counter() - started, events)

    def _result(self, wall_s: float, events: int) -> SimResult:
        status = np.frombuffer(bytes(self.status), dtype=np.uint8)
        failed = status != _OK
        first = np.asarray(self.first_token, dtype=np.float64)
        done = np.asarray(self.done, dtype=np.float64)
        failed_s = np.where(failed, done, _NAN)
        first[failed] = _NAN
        done[failed] = _NAN
        counters: dict[str, Any] = {}
        for w in self.workers:
            for k, v in w.c.items():
                counters[k] = counters.get(k, 0) + v
            p = w.pressure
            for k, v in (
                ("pressure_samples", p.samples),
                ("util_sum", p.utilization),
                ("frag_sum", p.external_fragmentation),
                ("raw_frag_sum", p.free_run_fragmentation),
                ("waste_sum", p.internal_waste),
            ):
                counters[k] = counters.get(k, 0) + v
        counters["failed_by_reason"] = dict(sorted(self.fail_reason.items()))
        counters["routed_by_reason"] = dict(sorted(self.routed.items()))
        counters["placement_moves"] = self.placement_moves
        counters["predictor_ticks"] = self.ticks
        wait = self.feed.wait_s - self._feed_wait0 if self.feed is not None else 0.0
        counters["forecast_wait_s"] = wait
        counters["predictor_wall_s"] = self.predictor_wall_s - wait
        counters["pool_bytes_per_worker"] = self.workers[0].allocator.capacity_bytes
        codes = np.frombuffer(bytes(self.cold), dtype=np.uint8).copy()
        first_seen = np.zeros(len(self.arrival), dtype=bool)
        if len(first_seen):
            first_seen[np.unique(self._req_adapter_np, return_index=True)[1]] = True
        return SimResult(
            policy=self.policy.name,
            workers=len(self.workers),
            arrival_s=np.asarray(self.arrival, dtype=np.float64),
            first_token_s=first,
            done_s=done,
            output_tokens=np.asarray(self.out, dtype=np.int64),
            cold=codes > 0,
            cold_wait_s=np.asarray(self.cold_wait, dtype=np.float64),
            failed=failed,
            worker=np.asarray(self.worker_of, dtype=np.int64),
            counters=counters,
            wall_s=wall_s,
            events=events,
            cpu_s=time.process_time() - self._cpu0,
            failed_s=failed_s,
            cold_cause=codes,
            first_appearance=first_seen,
        )


def trace_key(trace: Trace) -> tuple[int, float, float]:
    """``(arrivals, first, last arrival time)``: what a feed checks it was made for."""
    if len(trace) == 0:
        return (0, 0.0, 0.0)
    return (len(trace), float(trace.times[0]), float(trace.times[-1]))


def make_feed(
    trace: Trace, adapters: AdapterSet, config: SimConfig, process: bool = False
) -> DemandFeed:
    """The production forecaster's output for every predictor tick of ``trace`` (see
    :mod:`plora.simulator.feed`), to share between simulations of the same trace, adapter
    map and forecaster settings.

    Args:
        trace: Arrivals.
        adapters: Its key -> adapter map.
        config: Forecaster and tick settings (:meth:`SimConfig.feed_settings`).
        process: Compute it in a child process that runs ahead of the simulations.
    """
    ad = adapters.key_adapter[trace.key_index] if len(trace) else np.zeros(0, np.int64)
    feed = DemandFeed(trace.times, ad, adapters.names, config.feed_settings(), process)
    feed.trace_key = trace_key(trace)
    return feed


def simulate(
    trace: Trace,
    adapters: AdapterSet,
    policy: PolicySpec | str,
    config: SimConfig,
    feed: DemandFeed | None = None,
) -> SimResult:
    """Simulate ``trace`` under ``policy`` (see :class:`ClusterSimulation`)."""
    spec = get_policy(policy, simulated=True) if isinstance(policy, str) else policy
    return ClusterSimulation(trace, adapters, spec, config, feed).run()
