"""The worker's tiered, paged adapter store: source -> host cache -> device pool.

:class:`AdapterStore` implements :class:`services.worker.adapter_api.AdapterProvider`:

* **Tiers.** An injected ``loader(ref) -> LoRAWeights`` reads the source tier (a PEFT directory).
  The weights are packed once into one flat host tensor (pinned on CUDA) in the layout the
  device uses, kept in a byte-bounded LRU host cache, and copied into a run of the device pool
  (:mod:`services.worker.pool`) with a single copy. The engine gets views of pool memory.
* **Background loads.** ``loader_threads`` threads (each with its own CUDA stream on GPU) take
  jobs from a priority queue: loads a waiting request needs first, then prefetches by expected
  demand. ``acquire`` never blocks on I/O; a request waits only for its own lease. A demand
  load that finds no room (every resident adapter leased) is parked, not waited on: its thread
  takes the next load (one that fits goes ahead), and it is queued again whenever a lease
  drops or space is freed, until ``load_wait_timeout_s``.
* **Reference counts.** A held lease pins its adapter: it is never evicted or moved. Freed
  space is zeroed before reuse.
* **Eviction** (:mod:`services.worker.eviction`): ``lru`` or ``predictive`` ordering over the
  resident adapters that no lease holds. A demand load evicts until its run fits; a prefetch
  (Predictive-LoRA, arXiv 2512.20210, proactive prefetch) evicts only adapters with lower
  expected demand and is dropped when the pool is full of more wanted adapters.
* **Compaction and splitting** (``paged`` only). When enough pages are free but no run fits,
  and the adapters in use do not block it (and the plan is cheap enough:
  ``compaction_max_ratio``), the loader takes :meth:`AdapterStore.compute_guard` exclusively, so
  no forward step is running, slides unpinned extents toward address 0, and re-points their
  views. Otherwise the adapter is split over the free runs (S-LoRA's unified paging, arXiv
  2311.03285): each A and B tensor goes whole, first fit, into some run, so every
  ``weights()`` tensor is still one contiguous view of pool memory; only ``flat()`` of a split
  adapter is a copy. Only when neither works does it evict.
* **Versions.** A lease is for one :class:`AdapterRef` version. A newer version drops the older
  one from every tier (a copy still leased is freed at its last release); asking for an older
  version than one seen raises :class:`AdapterNotFoundError`.

Definitions: *utilization* is live adapter bytes / pool bytes; the store
samples it, with fragmentation and waste, at the end of every device allocation during which it
had to evict or wait (the pool was under pressure) and reports the means. *External
fragmentation* is ``1 - largest allocatable extent / free bytes``, where the allocatable extent
of ``paged`` is the larger of what compaction around pinned adapters can join and the pages
that the largest split allocation it could place now would occupy, for the coarsest tensor
layout loaded so far (:meth:`~services.worker.pool.Allocator.placeable_units`: every free page
except the run tails no further tensor of that layout fits); ``contiguous`` has neither, so its
largest hole. ``free_run_fragmentation`` is the same ratio with the largest free run as it
stands, for both. *Internal waste* is ``(allocated - live) / allocated``. Mean extents per
adapter counts page runs per allocation (1 unless split).

Lock order (deadlock-free): compute guard (exclusive) before the store lock; the store lock is
never held while waiting for the guard or doing I/O. The engine must not wait on a lease while
holding the compute guard, and must not nest the guard.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Self

import torch

from services.common.errors import (
    AdapterNotFoundError,
    ConfigError,
    PLoRAError,
    PoolExhaustedError,
    RequestCancelledError,
)
from services.common.types import LoRAModuleWeights
from services.worker.adapter_api import AdapterRef
from services.worker.allocators import make_allocator
from services.worker.cold import cold_cause, eviction_cause
from services.worker.device_pool import DevicePool
from services.worker.eviction import Candidate, make_policy
from services.worker.packing import (
    HostCache,
    ModuleSlot,
    PackedAdapter,
    flat_checksum,
    module_views,
    pack_weights,
    slot_pieces,
)
from services.worker.pool import Allocation
from services.worker.room import PressureSampler, RoomDecision
from services.worker.store_loading import StoreLoading
from services.worker.store_types import (
    _NO_WAITER,
    DEMAND_PRIORITY,
    DTYPES,
    HOST_STAGING_INTERVAL_S,
    PREFETCH_PRIORITY,
    SOURCE_RETRY_S,
    Loader,
    PrefetchResult,
    ResidentAdapter,
    RWLock,
    StoreConfig,
    StoreEvent,
    StoreStats,
    _Counters,
    _Entry,
    _State,
)

__all__ = [
    "DTYPES",
    "HOST_STAGING_INTERVAL_S",
    "SOURCE_RETRY_S",
    "AdapterStore",
    "HostCache",
    "Loader",
    "ModuleSlot",
    "PackedAdapter",
    "PrefetchResult",
    "ResidentAdapter",
    "RWLock",
    "StoreConfig",
    "StoreEvent",
    "StoreLease",
    "StoreStats",
    "flat_checksum",
    "module_views",
    "pack_weights",
    "slot_pieces",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- entries and leases


class StoreLease:
    """A lease from :class:`AdapterStore` (implements ``AdapterLease``)."""

    def __init__(
        self, store: AdapterStore, entry: _Entry, cold: bool, created: float, cause: str = ""
    ) -> None:
        self._store = store
        self._entry = entry
        self._cold = cold
        self._created = created
        self._released = False
        self.cold_cause = cause
        """Why the lease started cold (:data:`services.worker.cold.COLD_CAUSES`; "" warm)."""

    @property
    def ref(self) -> AdapterRef:
        """The adapter version leased."""
        return self._entry.ref

    def ready(self) -> bool:
        """True once resident (or failed)."""
        return self._entry.event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ready or ``timeout`` seconds; returns :meth:`ready`."""
        return self._entry.event.wait(timeout)

    def error(self) -> Exception | None:
        """The domain error of a failed load, else None."""
        return self._entry.error

    def weights(self) -> dict[tuple[int, str], LoRAModuleWeights]:
        """``(layer, projection) -> weights``; tensors are views of pool memory.

        Raises:
            PLoRAError: the load failed (its domain error).
            RuntimeError: not ready yet, or the lease was released.
        """
        e = self._entry
        if e.error is not None:
            raise e.error
        if self._released:
            raise RuntimeError(f"lease on {e.ref.adapter_id!r} was released")
        if not e.event.is_set():
            raise RuntimeError(f"adapter {e.ref.adapter_id!r} is not resident yet; wait() first")
        with self._store._lock:
            if e.views is None:
                assert e.alloc is not None
                pool = self._store._pool
                views = pool.view(e.alloc) if not e.alloc.is_split else pool.piece_views(e.alloc)
                e.views = module_views(views, e.slots)
            return dict(e.views)

    def flat(self) -> torch.Tensor:
        """``dtype [numel]``: the adapter's packed bytes as laid out in the pool.

        A view of its run when the adapter occupies one run; a *concatenated copy* of its
        extents when its allocation was split (no single view exists then; the engine never
        uses this, only :meth:`weights`, whose tensors are always views). Same validity rules
        as :meth:`weights`.
        """
        self.weights()
        with self._store._lock:
            e = self._entry
            assert e.alloc is not None
            pool = self._store._pool
            if not e.alloc.is_split:
                return pool.view(e.alloc)
            return torch.cat(pool.piece_views(e.alloc))

    @property
    def cold(self) -> bool:
        """Whether the adapter was not resident when the lease was taken."""
        return self._cold

    @property
    def wait_seconds(self) -> float:
        """Seconds from lease creation until ready (0 for warm; elapsed so far if loading)."""
        if not self._cold:
            return 0.0
        e = self._entry
        end = e.ready_at if e.event.is_set() and e.ready_at else time.monotonic()
        return max(0.0, end - self._created)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released

    def release(self) -> None:
        """Drop the claim (idempotent)."""
        self._store._release(self)


# ---------------------------------------------------------------------- the store
class AdapterStore(StoreLoading):
    """Tiered, paged adapter store (see the module doc).

    Args:
        config: Store configuration.
        loader: Reads one adapter version from the source tier; raises domain errors
            (``InvalidAdapterError``, ``IncompatibleAdapterError``, ``AdapterNotFoundError``).
        on_event: Optional hook called (under the store lock; keep it fast, do not call back
            into the store) with every :class:`StoreEvent`.
        on_decision: Optional hook called (under the store lock, same rules) with the adapter
            id and each :class:`~services.worker.room.RoomDecision` of a load that needs room
            (the simulated worker has the same hook; tests compare the two).

    Raises:
        ConfigError: a CUDA device requested without CUDA, or a bad pool size.
    """

    def __init__(
        self,
        config: StoreConfig,
        loader: Loader,
        on_event: Callable[[StoreEvent], None] | None = None,
        on_decision: Callable[[str, RoomDecision], None] | None = None,
    ) -> None:
        self.config = config
        self._loader = loader
        self._on_event = on_event
        self._on_decision = on_decision
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {config.device!r} requested but CUDA is not available")
        pool_bytes = self._pool_bytes(config)
        if config.host_cache_bytes < pool_bytes:
            raise ConfigError(
                f"host_cache_bytes ({config.host_cache_bytes}) must be >= the pool "
                f"({pool_bytes} bytes)"
            )
        allocator = make_allocator(
            config.allocator, pool_bytes, config.page_bytes, config.alignment_bytes
        )
        self._pool = DevicePool(allocator, config.torch_dtype, self.device)
        self._host_device = (
            torch.device("meta") if self.device.type == "meta" else torch.device("cpu")
        )
        self._pin = self.device.type == "cuda"
        self._host = HostCache(config.host_cache_bytes)
        self._policy = make_policy(config.eviction)
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._guard = RWLock()
        self._entries: dict[str, _Entry] = {}  # adapter_id -> current entry (any state)
        self._holders: dict[int, _Entry] = {}  # allocation handle -> entry holding it
        self._latest: dict[str, int] = {}  # adapter_id -> newest version seen
        self._latest_at: dict[str, float] = {}  # adapter_id -> when (monotonic) it was seen
        self._jobs: list[tuple[int, float, int, _Entry]] = []
        self._seq = itertools.count()
        self._parked: list[_Entry] = []  # demand loads waiting for room, oldest first
        self._loads_running = 0  # loads a loader thread is working on
        # host staging (stage()): queued source reads for the staging thread, one at a time
        self._staging: deque[AdapterRef] = deque()
        self._staging_current: AdapterRef | None = None
        # adapter_id -> (version, monotonic time until which background reads skip it) of its
        # last failed source read (_source_failed)
        self._failed_source: dict[str, tuple[int, float]] = {}
        self._closed = False
        self._c = _Counters()
        # utilization and fragmentation sampled under pressure (room.PressureSampler)
        self._pressure = PressureSampler()
        # cold-start causes (services.worker.cold): what this store held, and why each left
        self._ever_held: set[str] = set()
        self._evicted_why: dict[str, str] = {}
        self._threads = [
            threading.Thread(target=self._worker, name=f"adapter-loader-{i}", daemon=True)
            for i in range(config.loader_threads)
        ]
        if config.host_staging:
            self._threads.append(
                threading.Thread(target=self._stager, name="adapter-stager", daemon=True)
            )
        for t in self._threads:
            t.start()
        logger.info(
            "adapter store: %s/%s pool %d bytes (%d x %d-byte units) on %s, %s, host cache %d",
            config.allocator,
            config.eviction,
            allocator.capacity_bytes,
            allocator.capacity_units,
            allocator.unit_bytes,
            self.device,
            config.dtype,
            config.host_cache_bytes,
        )

    @staticmethod
    def _pool_bytes(config: StoreConfig) -> int:
        if config.pool_fraction > 0:
            dev = torch.device(config.device)
            if dev.type != "cuda":
                raise ConfigError("pool_fraction needs a CUDA device; give pool_bytes instead")
            free, _ = torch.cuda.mem_get_info(dev)
            size = int(free * config.pool_fraction)
        else:
            size = config.pool_bytes
        size -= size % config.unit_bytes
        if size < config.unit_bytes:
            raise ConfigError(f"pool of {size} bytes holds no {config.unit_bytes}-byte unit")
        return size

    # ------------------------------------------------------------------ public API
    @property
    def pool(self) -> DevicePool:
        """The device pool (read-only use: tests and benchmarks inspect it)."""
        return self._pool

    def compute_guard(self) -> contextlib.AbstractContextManager[None]:
        """Shared hold around one forward step; compaction holds it exclusively."""
        return self._guard.read()

    def acquire(self, ref: AdapterRef) -> StoreLease:
        """Take a lease on ``ref``; starts a high-priority load if it is not resident.

        Never blocks on I/O.

        Raises:
            PoolExhaustedError: ``ref.size_bytes`` is bigger than the whole pool.
            AdapterNotFoundError: a newer version of the adapter was seen (stale ref).
            PLoRAError: the store is closed.
        """
        now = time.monotonic()
        with self._lock:
            self._check_open()
            self._check_fits(ref)
            self._observe_version(ref)
            e = self._entries.get(ref.adapter_id)
            cause = ""
            if e is None:
                self._policy.note_miss(ref.adapter_id)
                e = _Entry(ref, now, demanded=True)
                e.cause = cause = cold_cause(
                    prefetch_in_flight=False,
                    ever_held=ref.adapter_id in self._ever_held,
                    last_eviction=self._evicted_why.get(ref.adapter_id),
                )
                self._entries[ref.adapter_id] = e
                self._push(e)
                self._preempt_prefetch()
            elif e.state is _State.LOADING and not e.demanded:
                e.demanded = True
                e.cause = cause = "prefetch_late"
                if not e.job_started:
                    self._push(e)  # upgrade a queued prefetch to demand priority
            elif e.state is _State.LOADING:
                cause = e.cause  # it joins a demand load in flight
            cold = e.state is not _State.RESIDENT
            e.refcount += 1
            e.last_used = now
            if e.prefetch and not e.used:
                e.used = True
                self._c.prefetch_used += 1
                self._emit(StoreEvent("prefetch_used", ref.adapter_id, ref.version))
            if cold:
                e.cold_created.append(now)
                self._c.cold_starts += 1
                self._c.cold_causes[cause] = self._c.cold_causes.get(cause, 0) + 1
            else:
                self._c.device_hits += 1
                self._policy.note_hit(ref.adapter_id)
            return StoreLease(self, e, cold, now, cause)

    def prefetch(self, items: Sequence[tuple[AdapterRef, float]]) -> PrefetchResult:
        """Load adapters in the background ahead of demand, at low priority.

        A prefetch never evicts an adapter in use or one with at least its expected demand,
        and is ignored when free space plus such lower-demand adapters cannot hold it. The
        expected counts also update the eviction forecast.

        Args:
            items: ``(ref, expected requests in the forecast horizon)``.

        Returns:
            Counts of accepted, already resident (or loading), and ignored items.
        """
        accepted = already = ignored = 0
        now = time.monotonic()
        with self._lock:
            self._check_open()
            self._policy.update_forecast({r.adapter_id: float(x) for r, x in items})
            for ref, expected in items:
                expected = float(expected)
                latest = self._latest.get(ref.adapter_id)
                if (
                    (latest is not None and ref.version < latest)
                    or ref.size_bytes > self._pool.capacity_bytes
                    or self._source_broken(ref, now)
                ):
                    ignored += 1
                    continue
                self._observe_version(ref)
                e = self._entries.get(ref.adapter_id)
                if e is not None:
                    e.expected = max(e.expected, expected)
                    already += 1
                    continue
                if ref.size_bytes and not self._prefetch_may_fit(ref.size_bytes, expected):
                    ignored += 1
                    self._c.prefetch_ignored += 1
                    self._emit(StoreEvent("prefetch_ignored", ref.adapter_id, ref.version))
                    continue
                e = _Entry(ref, now, demanded=False, expected=expected)
                self._entries[ref.adapter_id] = e
                self._push(e)
                accepted += 1
                self._c.prefetch_issued += 1
                self._emit(StoreEvent("prefetch_issued", ref.adapter_id, ref.version))
        return PrefetchResult(accepted, already, ignored)

    def stage(self, refs: Sequence[AdapterRef]) -> int:
        """Set the host-staging queue (``host_staging``): read ``refs``, in this order, from
        the source tier into the host cache ahead of demand.

        Each call replaces the queue (callers pass every candidate, in the order to read
        them: :func:`~services.worker.store_types.staging_key`). Reads run one at a time on a
        staging thread of their own (never on a loader thread), and only while no demand load
        is queued (a queued prefetch does not hold them back). Only free host-cache space is
        used: staging never evicts a cached adapter. Skipped: adapters already cached (this
        version), resident or loading on the device, being staged now, superseded versions,
        and those that do not fit the free space left by the ones before them. A read that
        fails (a missing, changed or broken source) is logged and not tried again for that
        version for :data:`SOURCE_RETRY_S` seconds; the demand load reports the error.

        Args:
            refs: Adapter versions, in the order to read them.

        Returns:
            The queue's length; 0 when ``host_staging`` is off.
        """
        if not self.config.host_staging:
            return 0
        with self._lock:
            self._check_open()
            current = self._staging_current
            room = self._host.free_bytes - (current.size_bytes if current else 0)
            queue: deque[AdapterRef] = deque()
            seen = {current.adapter_id} if current else set()
            now = time.monotonic()
            for ref in refs:
                latest = self._latest.get(ref.adapter_id)
                if (
                    ref.adapter_id in seen
                    or (latest is not None and ref.version < latest)
                    or self._source_broken(ref, now)
                    or not self._stage_needed(ref, room)
                ):
                    continue
                self._observe_version(ref)
                queue.append(ref)
                seen.add(ref.adapter_id)
                room -= ref.size_bytes
            self._staging = queue
            if queue:
                self._cv.notify_all()
            return len(queue)

    def set_forecast(self, forecast: Mapping[str, float]) -> None:
        """Replace the demand forecast (``adapter_id -> expected requests``) used by
        ``predictive`` eviction and prefetch admission."""
        with self._lock:
            self._policy.set_forecast(forecast)

    def unload(self, adapter_id: str, below_version: int = 0) -> bool:
        """Drop ``adapter_id`` from every tier (a leased copy is freed at its last release;
        a pending load fails its leases with ``AdapterNotFoundError``; a queued host staging
        read is cancelled).

        Args:
            adapter_id: The adapter.
            below_version: 0 drops every version (deleted, or forgotten by the registry).
                ``N > 0`` says version ``N`` was registered: only older versions are dropped
                (evicted as ``"superseded"``) and refused from now on, as if a request for
                ``N`` had been seen, so an unload that arrives after ``N`` started loading
                leaves it alone.

        Returns:
            Whether anything was dropped.
        """
        with self._lock:
            return self._unload(adapter_id, below_version)

    def _unload(self, adapter_id: str, below_version: int) -> bool:
        """:meth:`unload` with the lock held."""
        if below_version <= 0:
            self._latest.pop(adapter_id, None)
            self._latest_at.pop(adapter_id, None)
            return self._drop(adapter_id, "unload")
        latest = self._latest.get(adapter_id)
        if latest is not None and latest >= below_version:
            return False  # that version or a newer one was seen here: older ones are gone
        self._latest[adapter_id] = below_version
        self._latest_at[adapter_id] = time.monotonic()
        return self._drop(adapter_id, "superseded")

    def reconcile(self, registered: Mapping[str, int], as_of: float) -> int:
        """Drop what the registry no longer has: every adapter this store holds or has seen
        whose id is not registered any more (deleted: evicted as ``"unload"``), or whose
        registered version is newer than the newest seen here (``"superseded"``), as the
        gateway's :meth:`unload` would have. That call is best effort: a worker frozen or
        unreachable while it was made (deleted, or registered again) kept the old copy
        resident, listed in its status, until the pool needed the room.

        Only adapters whose newest version was seen before ``as_of`` are judged, so one
        registered (or loaded) after the listing was read is never taken for deleted.

        Args:
            registered: ``adapter_id -> version`` of every registered adapter, read from the
                registry after ``as_of``.
            as_of: ``time.monotonic()`` just before the registry was read.

        Returns:
            How many adapters were dropped from a tier or queue.
        """
        dropped = 0
        with self._lock:
            held = set(self._latest) | set(self._entries) | set(self._host.ids())
            for adapter_id in sorted(held):
                seen = self._latest_at.get(adapter_id)
                if seen is None or seen >= as_of:
                    continue
                # deleted: every version; registered again: the versions below the new one
                dropped += self._unload(adapter_id, registered.get(adapter_id, 0))
        return dropped

    def _drop(self, adapter_id: str, reason: str) -> bool:
        """Remove every tier's copy and queued staging read of ``adapter_id`` (lock held)."""
        dropped = self._host.drop(adapter_id)
        self._failed_source.pop(adapter_id, None)
        queued = len(self._staging)
        self._staging = deque(r for r in self._staging if r.adapter_id != adapter_id)
        dropped = dropped or len(self._staging) < queued
        e = self._entries.get(adapter_id)
        if e is not None:
            self._detach(e, reason)
            dropped = True
        return dropped

    def unload_all(self) -> int:
        """:meth:`unload` every adapter this store holds in any tier, queues or has seen a
        version of (the registry forgot them all: versions restart at 1).

        Returns:
            How many adapters were dropped from a tier or queue.
        """
        with self._lock:
            ids = (
                set(self._latest)
                | set(self._entries)
                | set(self._host.ids())
                | {r.adapter_id for r in self._staging}
            )
        return sum(self.unload(a) for a in sorted(ids))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no device load is queued or running (parked loads, which wait for a
        lease to drop, do not count), or ``timeout`` seconds pass.

        Returns:
            True when idle; False on timeout.
        """
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs and not self._loads_running, timeout)

    def resident_adapters(self) -> list[ResidentAdapter]:
        """Adapters in the device pool now, in address order."""
        with self._lock:
            out = []
            for e in self._entries.values():
                if e.state is _State.RESIDENT and e.alloc is not None:
                    a = e.alloc
                    out.append(
                        ResidentAdapter(
                            e.ref.adapter_id,
                            e.ref.version,
                            a.nbytes,
                            a.byte_length,
                            a.start,
                            a.units,
                            e.refcount,
                            e.prefetch,
                            tuple(
                                (x.start, x.length, b)
                                for x, b in zip(a.extents, a.extent_bytes, strict=True)
                            ),
                            a.handle,
                        )
                    )
            return sorted(out, key=lambda r: r.first_page)

    def loading_adapters(self) -> list[str]:
        """Sorted ids of the adapters with a load in flight (queued or running; demand or
        prefetch), not counting loads parked for want of room. A request for one of them waits
        only for the rest of that load."""
        with self._lock:
            parked = {id(e) for e in self._parked}
            return sorted(
                {
                    e.ref.adapter_id
                    for e in self._entries.values()
                    if e.state is _State.LOADING and not e.detached and id(e) not in parked
                }
            )

    def host_cached_adapters(self) -> list[str]:
        """Sorted ids of the adapters whose packed weights are in the host cache (any
        version): a load of one reads host memory, not the source tier."""
        with self._lock:
            return sorted(self._host.ids())

    def room_bytes(self) -> int:
        """Bytes a new load could take now without waiting for a lease to drop: the free pool
        bytes plus those of the resident adapters no lease holds (eviction frees them). An
        upper bound for ``contiguous`` (a hole may still be too small)."""
        with self._lock:
            al = self._pool.allocator
            room = al.free_units + sum(alloc.units for _, alloc in self._unleased())
            return room * al.unit_bytes

    def stats(self) -> StoreStats:
        """A consistent snapshot of the store's figures."""
        with self._lock:
            al = self._pool.allocator
            c = self._c
            allocated = al.used_units * al.unit_bytes
            live = al.live_bytes
            free = al.free_units * al.unit_bytes
            p = self._pressure
            now = p.measure(al, self._pinned())
            under = p.means()
            return StoreStats(
                allocator=al.kind,
                eviction=self._policy.name,
                device=str(self.device),
                dtype=self.config.dtype,
                pool_bytes=al.capacity_bytes,
                page_bytes=al.unit_bytes,
                pages_total=al.capacity_units,
                pages_used=al.used_units,
                pages_free=al.free_units,
                allocated_bytes=allocated,
                live_bytes=live,
                free_bytes=free,
                utilization=live / al.capacity_bytes,
                utilization_under_pressure=under.utilization,
                pressure_samples=p.samples,
                external_fragmentation=now.external_fragmentation,
                external_fragmentation_under_pressure=under.external_fragmentation,
                free_run_fragmentation=now.free_run_fragmentation,
                free_run_fragmentation_under_pressure=under.free_run_fragmentation,
                internal_waste=now.internal_waste,
                internal_waste_under_pressure=under.internal_waste,
                resident_adapters=sum(
                    1 for e in self._entries.values() if e.state is _State.RESIDENT
                ),
                loading_adapters=sum(
                    1 for e in self._entries.values() if e.state is _State.LOADING
                ),
                waiting_loads=len(self._parked),
                host_cache_bytes=self._host.capacity_bytes,
                host_cache_used_bytes=self._host.used_bytes,
                host_cache_adapters=len(self._host),
                device_hits=c.device_hits,
                loads_by_tier=dict(c.loads_by_tier),
                load_seconds_by_tier=dict(c.load_seconds_by_tier),
                failed_loads=c.failed_loads,
                cold_starts=c.cold_starts,
                cold_start_wait_seconds=c.cold_wait_total,
                cold_start_wait_max_seconds=c.cold_wait_max,
                evictions_by_reason=dict(c.evictions),
                compactions=c.compactions,
                bytes_moved=c.bytes_moved,
                split_allocations=c.splits,
                mean_extents_per_adapter=now.mean_extents,
                mean_extents_per_adapter_under_pressure=under.mean_extents,
                prefetches_issued=c.prefetch_issued,
                prefetches_used=c.prefetch_used,
                prefetches_wasted=c.prefetch_wasted,
                prefetches_ignored=c.prefetch_ignored,
                host_stages=c.stages,
                host_stage_seconds=c.stage_seconds,
                host_stages_queued=len(self._staging),
                cold_starts_by_cause=dict(c.cold_causes),
                prefetches_cancelled=c.prefetch_cancelled,
            )

    def close(self) -> None:
        """Stop the loader threads and fail pending loads (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for e in list(self._entries.values()):
                if e.state is _State.LOADING:
                    e.detached = True
                    self._fail(e, PLoRAError("the adapter store was closed"), free=False)
            self._jobs.clear()
            self._parked.clear()
            self._staging.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers (lock held)
    def _check_open(self) -> None:
        if self._closed:
            raise PLoRAError("the adapter store is closed")

    def _check_fits(self, ref: AdapterRef) -> None:
        cap = self._pool.capacity_bytes
        if ref.size_bytes > cap:
            raise PoolExhaustedError(
                f"adapter {ref.adapter_id!r} needs {ref.size_bytes} bytes but the device pool "
                f"holds {cap}; use a smaller rank or a bigger pool"
            )

    def _observe_version(self, ref: AdapterRef) -> None:
        latest = self._latest.get(ref.adapter_id)
        if latest is not None and ref.version < latest:
            raise AdapterNotFoundError(
                f"adapter {ref.adapter_id!r} version {ref.version} was superseded by version "
                f"{latest}; refresh the adapter metadata and retry"
            )
        if latest is None or ref.version > latest:
            self._latest[ref.adapter_id] = ref.version
            self._latest_at[ref.adapter_id] = time.monotonic()
            e = self._entries.get(ref.adapter_id)
            if e is not None and e.ref.version != ref.version:
                self._detach(e, "superseded")
            cached = self._host.get(ref.adapter_id, ref.version)
            if cached is None:
                self._host.drop(ref.adapter_id)

    def _push(self, e: _Entry) -> None:
        prio = DEMAND_PRIORITY if e.demanded else PREFETCH_PRIORITY
        heapq.heappush(self._jobs, (prio, -e.expected, next(self._seq), e))
        self._cv.notify_all()

    def _emit(self, event: StoreEvent) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # a metrics hook must never break the store
            logger.exception("adapter store event hook failed on %s", event.kind)

    def _free_alloc(self, e: _Entry) -> None:
        if e.alloc is not None:
            self._holders.pop(e.alloc.handle, None)
            self._pool.free(e.alloc)
            e.alloc = None
            e.views = None
            self._unpark()
            self._cv.notify_all()

    def _unpark(self) -> None:
        """Room may have appeared (space freed, an adapter no longer leased, or a load landed
        that no lease holds): queue the parked demand loads again, oldest first (lock held)."""
        parked, self._parked = self._parked, []
        for e in parked:
            if not e.detached and e.state is _State.LOADING:
                self._push(e)

    def _expire_parked(self) -> float | None:
        """Queue the parked loads whose room deadline has passed (they fail with
        ``PoolExhaustedError`` unless room appeared); return the seconds until the next
        deadline, ``None`` if none is parked (lock held)."""
        if not self._parked:
            return None
        now = time.monotonic()
        keep = []
        for e in self._parked:
            if e.detached or e.state is not _State.LOADING:
                continue
            if e.room_deadline is not None and e.room_deadline <= now:
                self._push(e)
            else:
                keep.append(e)
        self._parked = keep
        deadlines = [e.room_deadline for e in keep if e.room_deadline is not None]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _detach(self, e: _Entry, reason: str) -> None:
        """Remove ``e`` from the index; free it now or at its last release."""
        if self._entries.get(e.ref.adapter_id) is e:
            del self._entries[e.ref.adapter_id]
        if e.detached:
            return
        e.detached = True
        if e.state is _State.LOADING:
            msg = (
                f"adapter {e.ref.adapter_id!r} version {e.ref.version} was "
                f"{'unloaded' if reason == 'unload' else 'superseded'} while loading"
            )
            self._fail(e, AdapterNotFoundError(msg), count=False, free=False)
        elif e.state is _State.RESIDENT:
            self._count_eviction(e, reason)
            if e.refcount == 0:
                self._free_alloc(e)

    def _count_eviction(self, e: _Entry, reason: str) -> None:
        self._evicted_why[e.ref.adapter_id] = (
            eviction_cause(for_demand=reason == "demand", by_forecast=self._policy.last_by_forecast)
            if reason in ("demand", "prefetch")
            else "unloaded"
        )
        c = self._c
        c.evictions[reason] = c.evictions.get(reason, 0) + 1
        if e.prefetch and not e.used:
            c.prefetch_wasted += 1
            self._emit(StoreEvent("prefetch_wasted", e.ref.adapter_id, e.ref.version))
        nbytes = e.alloc.byte_length if e.alloc else 0
        self._emit(
            StoreEvent("evict", e.ref.adapter_id, e.ref.version, reason=reason, nbytes=nbytes)
        )

    def _evict(self, e: _Entry, reason: str) -> None:
        assert e.refcount == 0 and e.state is _State.RESIDENT
        del self._entries[e.ref.adapter_id]
        e.detached = True
        self._count_eviction(e, reason)
        self._free_alloc(e)

    def _fail(self, e: _Entry, err: Exception, count: bool = True, free: bool = True) -> None:
        """Fail a load. ``free=False`` when a loader thread may still be writing its run: the
        thread frees it once it sees ``detached``."""
        if self._entries.get(e.ref.adapter_id) is e:
            del self._entries[e.ref.adapter_id]
        e.state = _State.FAILED
        e.error = err
        e.packed = None  # a parked load's host copy (the host cache keeps its own)
        if free:
            self._free_alloc(e)
        e.event.set()
        if count:
            self._c.failed_loads += 1
            self._emit(
                StoreEvent(
                    "load_failed", e.ref.adapter_id, e.ref.version, reason=type(err).__name__
                )
            )

    def _release(self, lease: StoreLease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            e = lease._entry
            e.refcount -= 1
            if e.refcount == 0:
                if e.detached and e.state is _State.RESIDENT:
                    self._free_alloc(e)
                elif e.state is _State.RESIDENT:
                    self._unpark()  # it can be evicted now
                elif any(p is e for p in self._parked):
                    # every request that waited for it is gone (cancelled, deadline): drop it,
                    # uncounted, rather than wait out load_wait_timeout_s and log a failure
                    # nobody waits on (its source read stays in the host cache)
                    self._parked = [p for p in self._parked if p is not e]
                    self._fail(e, RequestCancelledError(_NO_WAITER), count=False)
                self._cv.notify_all()

    def _pinned(self) -> set[int]:
        return {
            h for h, e in self._holders.items() if e.refcount > 0 or e.state is not _State.RESIDENT
        }

    def _unleased(self) -> Iterator[tuple[_Entry, Allocation]]:
        """Resident entries no lease holds (eviction may free them), with their runs."""
        for e in self._entries.values():
            if e.state is _State.RESIDENT and e.refcount == 0 and e.alloc is not None:
                yield e, e.alloc

    def _prefetch_may_fit(self, nbytes: int, expected: float) -> bool:
        al = self._pool.allocator
        return self._policy.prefetch_fits(
            al.units_for(nbytes) * al.unit_bytes,
            al.free_units * al.unit_bytes,
            ((e.ref.adapter_id, alloc.byte_length) for e, alloc in self._unleased()),
            incoming_expected=expected,
            min_gain=self.config.prefetch_min_gain,
        )

    def _pick_victim(self, e: _Entry) -> str | None:
        """The eviction policy's victim for ``e`` among the resident adapters no lease holds
        (lock held)."""
        return self._policy.choose_victim(
            (
                Candidate(x.ref.adapter_id, alloc.byte_length, x.last_used)
                for x, alloc in self._unleased()
                if x is not e
            ),
            demanded=e.demanded,
            incoming_expected=e.expected,
            min_gain=self.config.prefetch_min_gain,
        )

    # ------------------------------------------------------------------ loader threads
