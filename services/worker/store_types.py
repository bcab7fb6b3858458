"""The adapter store's configuration, records and figures: :class:`StoreConfig`, the
readers-writer compute guard, the events and statistics it reports, and the device-tier entry
of one adapter version (guarded by the store lock)."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch

from services.common.errors import ConfigError
from services.common.types import LoRAModuleWeights, LoRAWeights
from services.worker.adapter_api import AdapterRef
from services.worker.eviction import EVICTION_KINDS
from services.worker.packing import ModuleSlot, PackedAdapter
from services.worker.pool import (
    ALLOCATOR_KINDS,
    DEFAULT_ALIGNMENT_BYTES,
    DEFAULT_PAGE_BYTES,
    Allocation,
)
from services.worker.room import RoomSearch

MiB = 1 << 20

#: Pool dtypes by config name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

#: Seconds between two host-staging passes of a worker over the registered adapters
#: (:meth:`AdapterStore.stage`; one Redis listing each); the simulator uses the same period.
HOST_STAGING_INTERVAL_S = 2.0


def staging_key(adapter_id: str, worker_id: str) -> bytes:
    """Sort key of worker ``worker_id``'s host-staging order: the registered adapters in the
    order of their rendezvous (highest-random-weight) hash with the worker's id, whatever the
    forecast says.

    Each worker's order is fixed (a stable order fills the host cache with a set that stays)
    and independent of the others' (rendezvous hashing: Thaler and Ravishankar, "Using
    name-based mappings to increase hit rates", IEEE/ACM ToN 1998): where a host cache holds a
    fraction ``f`` of the registered bytes, ``n`` workers together hold about ``1 - (1 - f)^n``
    of the adapters, where one order for all (by id) held ``f`` ``n`` times over. Routing
    sends a cold start to a worker whose host cache holds the adapter
    (:func:`services.common.routing.route_rank_aware`, step ``host``), so it reads host memory
    instead of the source (measured with ``plora simulate`` on the Alibaba trace, h100-8b, 4
    workers, seed 0: ``plora-no-predictor`` TTFT mean 3.35 s by id, 3.18 s by this order,
    1.53 s by this order with host-aware routing). Putting the forecast's hot adapters first
    does harm: they are the ones demand loads are about to read anyway, so staging them
    spends the staging thread on reads that demand duplicates, and leaves cold the adapters
    whose next request is further off, which staging could have cached (same trace: ``plora``
    TTFT mean 3.57 s over five seeds with hot adapters first against 3.19 s over three in id
    order).

    Returns:
        16 bytes; smaller sorts first.
    """
    return hashlib.blake2b(
        adapter_id.encode(), digest_size=16, key=worker_id.encode()[:64]
    ).digest()


#: Seconds before host staging or a prefetch reads again an adapter version whose source read
#: failed (a missing, changed or broken source): each failure is logged once, not every pass or
#: tick. Demand loads still read it (their request gets the error).
SOURCE_RETRY_S = 300.0

#: Queue priorities of the loader threads' heap (lower first): demand before prefetch. Host
#: staging pauses only while a :data:`DEMAND_PRIORITY` load is queued. The simulator's
#: workers use the same two.
DEMAND_PRIORITY = 0
PREFETCH_PRIORITY = 1


def demand_queued(jobs: list[tuple[Any, ...]]) -> bool:
    """Whether a demand load waits in the loader heap ``jobs`` (entries ``(priority, ...)``):
    its head is at :data:`DEMAND_PRIORITY`. A stale head (a load already started or
    detached) counts until the next free loader thread pops it."""
    return bool(jobs) and jobs[0][0] == DEMAND_PRIORITY


#: Loader signature: read one adapter version from the source tier (raises domain errors).
Loader = Callable[[AdapterRef], LoRAWeights]


#: ``StoreEvent.reason`` of an eviction: for a demand load, for a prefetch, a newer version
#: registered, an unload (deleted, or dropped after Redis lost its data).
EVICTION_REASONS = ("demand", "prefetch", "superseded", "unload")
#: ``StoreEvent.tier`` of a load: read from the adapter's source, or copied from the host cache.
LOAD_TIERS = ("source", "host")


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of the adapter store (built by the worker's config from flags/env).

    Attributes:
        allocator: ``"paged"`` (the design) or ``"contiguous"`` (the S-LoRA-style baseline).
        eviction: ``"lru"`` (baseline) or ``"predictive"``.
        pool_bytes: Device pool size, bytes (rounded down to whole pages). Ignored when
            ``pool_fraction > 0``.
        pool_fraction: If > 0 (CUDA only): the pool takes this fraction of the device's free
            memory at start.
        page_bytes: Page size of ``paged``, bytes (a multiple of the dtype size).
        host_cache_bytes: Host cache bound, bytes; must be >= the pool bytes.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, or ``"meta"`` (byte accounting only,
            for benchmarks of the allocator at sizes that do not fit in RAM).
        dtype: Pool dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        load_wait_timeout_s: How long a demand load waits for space while every resident
            adapter is in use, before its leases fail with ``PoolExhaustedError``.
        loader_threads: Background load threads (>= 1).
        alignment_bytes: Allocation granularity of ``contiguous``.
        compaction_max_ratio: Compact only when the cheapest plan moves at most this many
            bytes per byte needed; otherwise evict one more adapter (by policy) and retry.
            Compaction is always used when nothing else can be evicted. Default 4.0: on the
            full Alibaba replay (``plora bench pool``) it reached the same utilization and a
            lower external fragmentation than always compacting (``inf``, the paper's design)
            while moving 65x fewer bytes, because a split over free runs costs no copy.
        prefetch_min_gain: A prefetch evicts an unleased adapter only when the swap raises the
            probability of use within the horizon by at least this much
            (:func:`services.worker.eviction.prefetch_victim_limit`); free space is always
            used.
        host_staging: Accept :meth:`AdapterStore.stage` requests: read registered adapters
            from the source tier into free host-cache space ahead of demand, so a cold start
            copies from host memory instead of reading and converting the source files on
            the request's path (S-LoRA keeps every adapter in host memory, Sec. 4). Off for
            the S-LoRA-style baseline, which loads on demand.

    Raises:
        ConfigError: an unknown name or an inconsistent size (host cache < pool, ...).
    """

    allocator: str = "paged"
    eviction: str = "lru"
    pool_bytes: int = 256 * MiB
    pool_fraction: float = 0.0
    page_bytes: int = DEFAULT_PAGE_BYTES
    host_cache_bytes: int = 512 * MiB
    device: str = "cpu"
    dtype: str = "float32"
    load_wait_timeout_s: float = 30.0
    loader_threads: int = 2
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES
    compaction_max_ratio: float = 4.0
    prefetch_min_gain: float = 0.2
    host_staging: bool = False

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATOR_KINDS:
            raise ConfigError(f"allocator must be one of {ALLOCATOR_KINDS}, got {self.allocator!r}")
        if self.eviction not in EVICTION_KINDS:
            raise ConfigError(f"eviction must be one of {EVICTION_KINDS}, got {self.eviction!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        esize = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        if self.page_bytes <= 0 or self.page_bytes % esize:
            raise ConfigError(
                f"page_bytes must be a positive multiple of {esize} ({self.dtype}), "
                f"got {self.page_bytes}"
            )
        if self.alignment_bytes <= 0 or self.alignment_bytes % esize:
            raise ConfigError(f"alignment_bytes must be a positive multiple of {esize}")
        if not 0.0 <= self.pool_fraction < 1.0:
            raise ConfigError(f"pool_fraction must be in [0, 1), got {self.pool_fraction}")
        if self.pool_fraction == 0.0:
            if self.pool_bytes < self.unit_bytes:
                raise ConfigError(
                    f"pool_bytes ({self.pool_bytes}) must hold at least one "
                    f"{self.unit_bytes}-byte unit"
                )
            if self.host_cache_bytes < self.pool_bytes:
                raise ConfigError(
                    f"host_cache_bytes ({self.host_cache_bytes}) must be >= pool_bytes "
                    f"({self.pool_bytes}) so every resident adapter can be re-read from host"
                )
        if self.load_wait_timeout_s < 0:
            raise ConfigError(f"load_wait_timeout_s must be >= 0, got {self.load_wait_timeout_s}")
        if self.compaction_max_ratio < 0:
            raise ConfigError(f"compaction_max_ratio must be >= 0, got {self.compaction_max_ratio}")
        if not 0.0 <= self.prefetch_min_gain < 1.0:
            raise ConfigError(f"prefetch_min_gain must be in [0, 1), got {self.prefetch_min_gain}")
        if self.loader_threads < 1:
            raise ConfigError(f"loader_threads must be >= 1, got {self.loader_threads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The pool dtype as a ``torch.dtype``."""
        return DTYPES[self.dtype]

    @property
    def unit_bytes(self) -> int:
        """Allocation unit of the chosen allocator, bytes."""
        return self.page_bytes if self.allocator == "paged" else self.alignment_bytes


class RWLock:
    """A readers-writer lock that prefers writers (steps share it; compaction excludes them).

    Not reentrant: a thread holding it must not take it again.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        """Shared hold (one forward step)."""
        with self._cv:
            while self._writer or self._writers_waiting:
                self._cv.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                self._readers -= 1
                if self._readers == 0:
                    self._cv.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """Exclusive hold (compaction)."""
        with self._cv:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cv.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


@dataclass(frozen=True)
class StoreEvent:
    """One thing the store did, for metric hooks.

    Attributes:
        kind: ``"load"``, ``"load_failed"``, ``"evict"``, ``"compact"``, ``"split"`` (an
            allocation spread over several runs; ``nbytes`` its live bytes),
            ``"cold_start"``, ``"prefetch_issued"``, ``"prefetch_used"``,
            ``"prefetch_wasted"``, ``"prefetch_ignored"``, ``"host_stage"`` (a staging read
            finished, :meth:`AdapterStore.stage`), ``"host_stage_failed"`` (one failed).
        adapter_id: The adapter ("" for compaction).
        version: Its version (0 when not applicable).
        tier: For loads: one of :data:`LOAD_TIERS`.
        reason: For evictions: one of :data:`EVICTION_REASONS`;
            for failed loads: the error's class name (``"AdapterSourceError"``, ...).
        seconds: Load latency, or cold-start wait.
        nbytes: Bytes loaded, evicted, or moved.
    """

    kind: str
    adapter_id: str = ""
    version: int = 0
    tier: str = ""
    reason: str = ""
    seconds: float = 0.0
    nbytes: int = 0


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store for metrics and reports (definitions in the module doc).

    Byte figures in bytes, times in seconds. For ``contiguous``, "pages" are its alignment units.
    """

    allocator: str
    eviction: str
    device: str
    dtype: str
    pool_bytes: int
    page_bytes: int
    pages_total: int
    pages_used: int
    pages_free: int
    allocated_bytes: int
    live_bytes: int
    free_bytes: int
    utilization: float
    utilization_under_pressure: float
    pressure_samples: int
    external_fragmentation: float
    external_fragmentation_under_pressure: float
    free_run_fragmentation: float
    free_run_fragmentation_under_pressure: float
    internal_waste: float
    internal_waste_under_pressure: float
    resident_adapters: int
    loading_adapters: int
    waiting_loads: int
    host_cache_bytes: int
    host_cache_used_bytes: int
    host_cache_adapters: int
    device_hits: int
    loads_by_tier: dict[str, int]
    load_seconds_by_tier: dict[str, float]
    failed_loads: int
    cold_starts: int
    cold_start_wait_seconds: float
    cold_start_wait_max_seconds: float
    evictions_by_reason: dict[str, int]
    compactions: int
    bytes_moved: int
    split_allocations: int
    mean_extents_per_adapter: float
    mean_extents_per_adapter_under_pressure: float
    prefetches_issued: int
    prefetches_used: int
    prefetches_wasted: int
    prefetches_ignored: int
    host_stages: int = 0
    host_stage_seconds: float = 0.0
    host_stages_queued: int = 0
    cold_starts_by_cause: dict[str, int] = field(default_factory=dict)
    prefetches_cancelled: int = 0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class ResidentAdapter:
    """One adapter in the device pool.

    Attributes:
        adapter_id: Registry id.
        version: Registry version.
        nbytes: Live bytes.
        allocated_bytes: Bytes of its run.
        first_page: First unit of its (first) run.
        pages: Units over all its runs.
        leases: Leases held now.
        prefetched: Loaded by a prefetch.
        extents: ``(first unit, units, live bytes)`` of each run (one unless its allocation
            was split), in the order its tensors first use them.
        handle: Its allocation in ``pool.allocator`` (pieces: ``pool.piece_views``).
    """

    adapter_id: str
    version: int
    nbytes: int
    allocated_bytes: int
    first_page: int
    pages: int
    leases: int
    prefetched: bool
    extents: tuple[tuple[int, int, int], ...] = ()
    handle: int = -1


class PrefetchResult(NamedTuple):
    """Outcome of :meth:`AdapterStore.prefetch`: counts of items."""

    accepted: int
    already_resident: int
    ignored: int


class _State(enum.Enum):
    LOADING = "loading"
    RESIDENT = "resident"
    FAILED = "failed"


class _Entry:
    """Device-tier record of one adapter version (guarded by the store lock)."""

    __slots__ = (
        "alloc",
        "cause",
        "cold_created",
        "demanded",
        "detached",
        "error",
        "event",
        "expected",
        "job_started",
        "last_used",
        "packed",
        "prefetch",
        "read_s",
        "ready_at",
        "ref",
        "refcount",
        "room",
        "room_deadline",
        "slots",
        "state",
        "tier",
        "used",
        "views",
        "yielding",
    )

    def __init__(self, ref: AdapterRef, now: float, *, demanded: bool, expected: float = 0.0):
        self.ref = ref
        self.state = _State.LOADING
        self.alloc: Allocation | None = None
        self.slots: tuple[ModuleSlot, ...] = ()
        self.views: dict[tuple[int, str], LoRAModuleWeights] | None = None  # built lazily
        self.refcount = 0
        self.last_used = now
        self.prefetch = not demanded
        self.used = False
        self.demanded = demanded
        self.expected = expected
        self.job_started = False
        self.detached = False
        self.event = threading.Event()
        self.error: Exception | None = None
        self.ready_at = 0.0
        self.cold_created: list[float] = []
        self.cause = ""  # a demand load: the cold-start cause of the request that started it
        self.yielding = False  # a running prefetch asked to give its thread to a demand load
        # a demand load parked while the pool has no room: its host copy, the tier and read
        # time it came from, and when it gives up (PoolExhaustedError)
        self.packed: PackedAdapter | None = None
        self.tier = ""
        self.read_s = 0.0
        self.room_deadline: float | None = None
        self.room: RoomSearch | None = None  # its search for pool room, kept while parked


class _PrefetchIgnored(Exception):
    pass


class _Detached(Exception):
    pass


class _NoRoom(Exception):
    """A demand load found no room: every resident adapter is leased (it is parked)."""


#: Why a demand load is dropped when every request that waited for it ended.
_NO_WAITER = "every request waiting for this adapter load ended"


@dataclass
class _Counters:
    device_hits: int = 0
    loads_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOAD_TIERS, 0))
    load_seconds_by_tier: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(LOAD_TIERS, 0.0)
    )
    failed_loads: int = 0
    cold_starts: int = 0
    cold_causes: dict[str, int] = field(default_factory=dict)
    cold_wait_total: float = 0.0
    cold_wait_max: float = 0.0
    evictions: dict[str, int] = field(default_factory=dict)
    compactions: int = 0
    bytes_moved: int = 0
    splits: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_ignored: int = 0
    prefetch_cancelled: int = 0
    stages: int = 0
    stage_seconds: float = 0.0
