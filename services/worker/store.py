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

Definitions (ARCHITECTURE.md): *utilization* is live adapter bytes / pool bytes; the store
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

import bisect
import contextlib
import enum
import hashlib
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Self

import torch

from services.common.errors import (
    AdapterNotFoundError,
    ConfigError,
    InvalidAdapterError,
    PLoRAError,
    PoolExhaustedError,
    RequestCancelledError,
)
from services.common.lifecycle import lower_thread_priority
from services.common.types import LoRAModuleWeights, LoRAWeights
from services.worker.adapter_api import AdapterRef
from services.worker.eviction import (
    EVICTION_KINDS,
    Candidate,
    make_policy,
)
from services.worker.pool import (
    ALLOCATOR_KINDS,
    DEFAULT_ALIGNMENT_BYTES,
    DEFAULT_PAGE_BYTES,
    Allocation,
    DevicePool,
    make_allocator,
)
from services.worker.room import PressureSampler, RoomAction, RoomDecision, RoomSearch

logger = logging.getLogger(__name__)

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

#: Seconds before host staging or a prefetch reads again an adapter version whose source read
#: failed (a missing, changed or broken source): each failure is logged once, not every pass or
#: tick. Demand loads still read it (their request gets the error).
SOURCE_RETRY_S = 300.0

#: Loader signature: read one adapter version from the source tier (raises domain errors).
Loader = Callable[[AdapterRef], LoRAWeights]


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
            the S-LoRA-style baseline, which loads on demand (ARCHITECTURE.md).

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


# ---------------------------------------------------------------------- packing
@dataclass(frozen=True)
class ModuleSlot:
    """Where one module's A and B live inside an adapter's flat buffer (element offsets)."""

    key: tuple[int, str]
    a_offset: int
    a_shape: tuple[int, int]  # [r, in_features]
    b_offset: int
    b_shape: tuple[int, int]  # [out_features, r]
    scaling: float


@dataclass(frozen=True, eq=False)
class PackedAdapter:
    """One adapter version packed into one flat host tensor in the device layout.

    Attributes:
        adapter_id: Registry id.
        version: Registry version.
        flat: ``dtype [numel]`` on the host (pinned on CUDA): every A then B, module by module.
        slots: Offsets of each module's tensors in ``flat`` (sorted by layer, projection).
        sha256: From the loaded weights.
    """

    adapter_id: str
    version: int
    flat: torch.Tensor
    slots: tuple[ModuleSlot, ...]
    sha256: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer (= live bytes in the pool)."""
        return self.flat.numel() * self.flat.element_size()


def pack_weights(
    weights: LoRAWeights, dtype: torch.dtype, device: torch.device | str = "cpu", pin: bool = False
) -> PackedAdapter:
    """Pack every module's A (``[r, in]``) and B (``[out, r]``) into one flat tensor.

    Args:
        weights: Host weights from the loader.
        dtype: Serving dtype (weights are converted).
        device: Host device (``"cpu"``; ``"meta"`` for byte accounting).
        pin: Allocate page-locked memory (for async copies to CUDA).

    Raises:
        InvalidAdapterError: no modules, or a tensor that is not 2-D.
    """
    if not weights.modules:
        raise InvalidAdapterError(f"adapter {weights.adapter_id!r} has no LoRA modules")
    slots: list[ModuleSlot] = []
    off = 0
    for key in sorted(weights.modules):
        m = weights.modules[key]
        if m.lora_a.dim() != 2 or m.lora_b.dim() != 2:
            raise InvalidAdapterError(
                f"adapter {weights.adapter_id!r} module {key}: LoRA A and B must be 2-D"
            )
        a_shape = (int(m.lora_a.shape[0]), int(m.lora_a.shape[1]))
        b_shape = (int(m.lora_b.shape[0]), int(m.lora_b.shape[1]))
        a_off = off
        b_off = a_off + a_shape[0] * a_shape[1]
        off = b_off + b_shape[0] * b_shape[1]
        slots.append(ModuleSlot(key, a_off, a_shape, b_off, b_shape, float(m.scaling)))
    flat = torch.empty(off, dtype=dtype, device=device, pin_memory=pin)  # [numel]
    if flat.is_meta:  # byte accounting: no storage to fill
        return PackedAdapter(
            weights.adapter_id, weights.version, flat, tuple(slots), weights.sha256
        )
    for s in slots:
        m = weights.modules[s.key]
        flat[s.a_offset : s.b_offset].view(s.a_shape).copy_(m.lora_a)
        flat[s.b_offset : s.b_offset + s.b_shape[0] * s.b_shape[1]].view(s.b_shape).copy_(m.lora_b)
    return PackedAdapter(weights.adapter_id, weights.version, flat, tuple(slots), weights.sha256)


def slot_pieces(slots: Sequence[ModuleSlot], element_size: int) -> list[int]:
    """Byte sizes of the packed tensors in layout order (A then B of each module): the pieces
    a split allocation may be cut between (:meth:`services.worker.pool.Allocator.alloc_pieces`).
    """
    out: list[int] = []
    for s in slots:
        out.append(s.a_shape[0] * s.a_shape[1] * element_size)
        out.append(s.b_shape[0] * s.b_shape[1] * element_size)
    return out


def module_views(
    flat: torch.Tensor | Sequence[torch.Tensor], slots: Sequence[ModuleSlot]
) -> dict[tuple[int, str], LoRAModuleWeights]:
    """``(layer, projection) -> LoRAModuleWeights`` whose tensors are views of ``flat``.

    Args:
        flat: The packed buffer (``dtype [numel]``), or its consecutive parts (the extents
            of a split allocation, :meth:`DevicePool.extent_views`): part ``i`` holds
            elements ``[sum(numel of parts before i), ... + its numel)`` of the layout.
        slots: Element offsets of each module's A and B in the layout.

    Raises:
        ValueError: a tensor crosses a boundary between parts (the split was not made at
            tensor boundaries).
    """
    parts = [flat] if isinstance(flat, torch.Tensor) else list(flat)
    bounds = list(itertools.accumulate((p.numel() for p in parts), initial=0))

    def piece(offset: int, shape: tuple[int, int]) -> torch.Tensor:
        n = shape[0] * shape[1]
        i = bisect.bisect_right(bounds, offset) - 1
        local = offset - bounds[i]
        if i >= len(parts) or local + n > parts[i].numel():
            raise ValueError(f"tensor at element {offset} ({n} elements) crosses a part boundary")
        return parts[i][local : local + n].view(shape)

    out: dict[tuple[int, str], LoRAModuleWeights] = {}
    for s in slots:
        a = piece(s.a_offset, s.a_shape)
        b = piece(s.b_offset, s.b_shape)
        out[s.key] = LoRAModuleWeights(lora_a=a, lora_b=b, scaling=s.scaling)
    return out


class HostCache:
    """Byte-bounded LRU of packed adapters, one version per adapter id.

    Args:
        capacity_bytes: Bound on the bytes of the cached flat tensors.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, PackedAdapter] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def ids(self) -> list[str]:
        """The cached adapter ids, least recently used first."""
        return list(self._items)

    def get(self, adapter_id: str, version: int) -> PackedAdapter | None:
        """The cached copy of exactly this version (marked recently used), else None."""
        p = self._items.get(adapter_id)
        if p is None or p.version != version:
            return None
        self._items.move_to_end(adapter_id)
        return p

    def holds(self, adapter_id: str, version: int) -> bool:
        """Whether exactly this version is cached (its recency is left as it is)."""
        p = self._items.get(adapter_id)
        return p is not None and p.version == version

    @property
    def free_bytes(self) -> int:
        """Bytes the cache can take without evicting."""
        return self.capacity_bytes - self.used_bytes

    def put(self, packed: PackedAdapter) -> None:
        """Cache ``packed`` (replacing any other version), evicting LRU entries to fit.

        An adapter bigger than the whole cache is not cached.
        """
        self.drop(packed.adapter_id)
        if packed.nbytes > self.capacity_bytes:
            return
        while self.used_bytes + packed.nbytes > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self.used_bytes -= old.nbytes
        self._items[packed.adapter_id] = packed
        self.used_bytes += packed.nbytes

    def drop(self, adapter_id: str) -> bool:
        """Remove any version of ``adapter_id``; returns whether one was cached."""
        p = self._items.pop(adapter_id, None)
        if p is None:
            return False
        self.used_bytes -= p.nbytes
        return True


# ---------------------------------------------------------------------- guard
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


# ---------------------------------------------------------------------- stats and events
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
        tier: For loads: ``"source"`` or ``"host"``.
        reason: For evictions: ``"demand"``, ``"prefetch"``, ``"superseded"``, ``"unload"``;
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


# ---------------------------------------------------------------------- entries and leases
class _State(enum.Enum):
    LOADING = "loading"
    RESIDENT = "resident"
    FAILED = "failed"


class _Entry:
    """Device-tier record of one adapter version (guarded by the store lock)."""

    __slots__ = (
        "alloc",
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
        # a demand load parked while the pool has no room: its host copy, the tier and read
        # time it came from, and when it gives up (PoolExhaustedError)
        self.packed: PackedAdapter | None = None
        self.tier = ""
        self.read_s = 0.0
        self.room_deadline: float | None = None
        self.room: RoomSearch | None = None  # its search for pool room, kept while parked


class StoreLease:
    """A lease from :class:`AdapterStore` (implements ``AdapterLease``)."""

    def __init__(self, store: AdapterStore, entry: _Entry, cold: bool, created: float) -> None:
        self._store = store
        self._entry = entry
        self._cold = cold
        self._created = created
        self._released = False

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
    loads_by_tier: dict[str, int] = field(default_factory=lambda: {"source": 0, "host": 0})
    load_seconds_by_tier: dict[str, float] = field(
        default_factory=lambda: {"source": 0.0, "host": 0.0}
    )
    failed_loads: int = 0
    cold_starts: int = 0
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
    stages: int = 0
    stage_seconds: float = 0.0


# ---------------------------------------------------------------------- the store
class AdapterStore:
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
            if e is None:
                e = _Entry(ref, now, demanded=True)
                self._entries[ref.adapter_id] = e
                self._push(e)
            elif e.state is _State.LOADING and not e.demanded:
                e.demanded = True
                if not e.job_started:
                    self._push(e)  # upgrade a queued prefetch to demand priority
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
            else:
                self._c.device_hits += 1
            return StoreLease(self, e, cold, now)

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

        Each call replaces the queue (callers pass every candidate, most wanted first, e.g.
        by current forecast demand, so the order follows the forecast). Reads run one at a
        time on a staging thread of their own (never on a loader thread), and only while no
        device load (demand or prefetch) is queued. Only free host-cache space is used:
        staging never evicts a cached adapter. Skipped: adapters already cached (this
        version), resident or loading on the device, being staged now, superseded versions,
        and those that do not fit the free space left by the ones before them. A read that
        fails (a missing, changed or broken source) is logged and not tried again for that
        version for :data:`SOURCE_RETRY_S` seconds; the demand load reports the error.

        Args:
            refs: Adapter versions, most wanted first.

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

    def _stage_needed(self, ref: AdapterRef, room: int) -> bool:
        """Whether a staging read of ``ref`` is wanted and fits ``room`` host bytes: not
        cached (this version), not resident or loading on the device (that load reads it
        itself), and of known size (lock held)."""
        return (
            ref.adapter_id not in self._entries
            and not self._host.holds(ref.adapter_id, ref.version)
            and 0 < ref.size_bytes <= room
        )

    def _stage_one(self, ref: AdapterRef) -> None:
        """One staging read (the staging thread, no lock held): source -> host cache."""
        try:
            with self._lock:
                skip = (
                    self._closed
                    or self._latest.get(ref.adapter_id) != ref.version  # unloaded, superseded
                    # cached, or on the device, or the space went to loads since it was queued
                    or not self._stage_needed(ref, self._host.free_bytes)
                )
            if skip:
                return
            t0 = time.monotonic()
            packed, tier, _ = self._host_copy(ref)
            if tier == "source":
                seconds = time.monotonic() - t0
                with self._lock:
                    self._c.stages += 1
                    self._c.stage_seconds += seconds
                    self._emit(
                        StoreEvent(
                            "host_stage",
                            ref.adapter_id,
                            ref.version,
                            seconds=seconds,
                            nbytes=packed.nbytes,
                        )
                    )
        except Exception as err:  # noqa: BLE001 - the demand load reports it to the request
            with self._lock:
                self._source_failed(ref, err, "host staging")
                self._emit(StoreEvent("host_stage_failed", ref.adapter_id, ref.version))
        finally:
            with self._cv:
                self._staging_current = None
                self._cv.notify_all()

    def _source_broken(self, ref: AdapterRef, now: float) -> bool:
        """Whether background reads (staging, prefetch) skip ``ref``: its source read failed
        less than :data:`SOURCE_RETRY_S` ago (lock held)."""
        failed = self._failed_source.get(ref.adapter_id)
        return failed is not None and failed[0] == ref.version and now < failed[1]

    def _source_failed(self, ref: AdapterRef, err: BaseException, what: str) -> None:
        """Note a failed source read of ``ref`` (lock held): background reads skip it for
        :data:`SOURCE_RETRY_S`; logged as a warning the first time for this version, at DEBUG
        after (a broken adapter used to fill the log every pass and every prefetch tick)."""
        again = self._failed_source.get(ref.adapter_id, (0, 0.0))[0] == ref.version
        self._failed_source[ref.adapter_id] = (ref.version, time.monotonic() + SOURCE_RETRY_S)
        log = logger.debug if again else logger.warning
        if isinstance(err, PLoRAError):
            log(
                "%s of %s v%d failed (not read in the background again for %.0f s): %s",
                what, ref.adapter_id, ref.version, SOURCE_RETRY_S, err,
            )  # fmt: skip
        else:
            log("%s of %s v%d failed", what, ref.adapter_id, ref.version, exc_info=err)

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
        prio = 0 if e.demanded else 1
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
        """Room may have appeared (space freed, or an adapter no longer leased): queue the
        parked demand loads again, oldest first (lock held)."""
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
    def _stager(self) -> None:
        """The host-staging thread: one read at a time, only while no device load (demand or
        prefetch) is queued for a loader thread. Its own thread, so a staging read (as slow
        as any source read: seconds from remote storage) never holds a loader thread.
        Staging is speculative, so the thread runs at background priority: on a CPU host it
        must not take cores from the decode steps (demand loads read the source themselves)."""
        torch.set_num_threads(1)
        lower_thread_priority()
        while True:
            with self._cv:
                while not self._closed and (self._jobs or not self._staging):
                    self._cv.wait()
                if self._closed:
                    return
                ref = self._staging_current = self._staging.popleft()
            self._stage_one(ref)

    def _worker(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Background loads must not take the cores from the decode step: on CPU each loader
        # thread runs its tensor work on one intra-op thread (the setting is per thread).
        torch.set_num_threads(1)
        while True:
            with self._cv:
                while True:
                    timeout = self._expire_parked()
                    if self._closed or self._jobs:
                        break
                    self._cv.wait(timeout)
                if self._closed:
                    return
                _, _, _, e = heapq.heappop(self._jobs)
                if not self._jobs and self._staging:
                    self._cv.notify_all()  # the stager waits for the device queue to empty
                if e.detached or e.state is not _State.LOADING or e.job_started:
                    continue
                e.job_started = True
                self._loads_running += 1
            try:
                self._load(e, stream)
            except (_PrefetchIgnored, _Detached, _NoRoom):
                pass
            except PLoRAError as err:
                with self._lock:
                    if isinstance(err, PoolExhaustedError):
                        logger.warning(
                            "load of %s v%d failed: %s", e.ref.adapter_id, e.ref.version, err
                        )
                    else:  # the source: its files, their values, their shapes
                        self._source_failed(e.ref, err, "load")
                    self._fail(e, err)
            except Exception as err:
                with self._lock:
                    self._source_failed(e.ref, err, "load")
                    self._fail(e, PLoRAError(f"loading adapter {e.ref.adapter_id!r} failed: {err}"))
            finally:
                with self._cv:
                    self._loads_running -= 1
                    self._cv.notify_all()

    def _host_copy(self, ref: AdapterRef) -> tuple[PackedAdapter, str, float]:
        with self._lock:
            cached = self._host.get(ref.adapter_id, ref.version)
        if cached is not None:
            return cached, "host", 0.0
        t0 = time.monotonic()
        try:
            weights = self._loader(ref)
        except PLoRAError:
            raise
        except FileNotFoundError as err:
            raise AdapterNotFoundError(
                f"adapter {ref.adapter_id!r} source {ref.source!r} is missing: {err}"
            ) from err
        if ref.sha256 and weights.sha256 and ref.sha256 != weights.sha256:
            raise InvalidAdapterError(
                f"adapter {ref.adapter_id!r} version {ref.version}: files changed since "
                f"registration (sha256 {weights.sha256[:12]} != {ref.sha256[:12]}); re-register it"
            )
        packed = pack_weights(weights, self.config.torch_dtype, self._host_device, self._pin)
        packed = PackedAdapter(
            ref.adapter_id, ref.version, packed.flat, packed.slots, packed.sha256
        )
        with self._lock:
            if self._latest.get(ref.adapter_id) == ref.version:
                self._host.put(packed)
        return packed, "source", time.monotonic() - t0

    def _load(self, e: _Entry, stream: torch.cuda.Stream | None) -> None:
        ref = e.ref
        if e.packed is None:
            packed, tier, read_s = self._host_copy(ref)
        else:  # a parked load retried: its bytes are already in host memory
            packed, tier, read_s = e.packed, e.tier, e.read_s
        if packed.nbytes > self._pool.capacity_bytes:
            raise PoolExhaustedError(
                f"adapter {ref.adapter_id!r} holds {packed.nbytes} bytes but the device pool "
                f"holds {self._pool.capacity_bytes}; use a smaller rank or a bigger pool"
            )
        t0 = time.monotonic()
        e.packed, e.tier, e.read_s = packed, tier, read_s  # kept if it is parked (_NoRoom)
        a = self._allocate(e, slot_pieces(packed.slots, packed.flat.element_size()))
        e.packed = None
        self._copy_in(self._pool.segments(a), packed.flat, stream)
        t1 = time.monotonic()
        with self._lock:
            if e.detached:
                self._free_alloc(e)
                return
            e.slots = packed.slots
            e.views = None  # built on the first weights() call
            e.state = _State.RESIDENT
            e.ready_at = t1
            e.event.set()
            seconds = read_s + (t1 - t0)
            self._c.loads_by_tier[tier] += 1
            self._c.load_seconds_by_tier[tier] += seconds
            self._emit(
                StoreEvent(
                    "load",
                    ref.adapter_id,
                    ref.version,
                    tier=tier,
                    seconds=seconds,
                    nbytes=packed.nbytes,
                )
            )
            for created in e.cold_created:
                w = max(0.0, t1 - created)
                self._c.cold_wait_total += w
                self._c.cold_wait_max = max(self._c.cold_wait_max, w)
                self._emit(StoreEvent("cold_start", ref.adapter_id, ref.version, seconds=w))
            e.cold_created = []
            self._cv.notify_all()

    def _copy_in(
        self,
        segments: Sequence[tuple[torch.Tensor, int, int]],
        src: torch.Tensor,
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Copy the packed ``src`` into the pool (:meth:`DevicePool.segments`: one copy per
        run of tensors that lie together; one for an adapter in one run)."""
        parts = [(d, src[lo:hi]) for d, lo, hi in segments]
        if stream is None:
            for d, s in parts:
                d.copy_(s)
            return
        # the destination was zeroed on the default stream: order the copy after it
        stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(stream):
            for d, s in parts:
                d.copy_(s, non_blocking=True)
        stream.synchronize()

    def _allocate(self, e: _Entry, pieces: Sequence[int]) -> Allocation:
        """Find room for ``e``, whose packed tensors have byte sizes ``pieces`` (layout order),
        by the rule of :class:`~services.worker.room.RoomSearch` (place, compact, split, evict,
        drop, wait); returns its allocation. A demand load with no room is parked (its loader
        thread takes other loads) and queued again whenever room may appear (:meth:`_unpark`),
        until ``load_wait_timeout_s``.

        Raises:
            PoolExhaustedError: bigger than the pool, or no room before the wait timeout.
            _PrefetchIgnored: a prefetch found only more-wanted adapters to evict.
            _Detached: the entry was unloaded or superseded meanwhile, or nobody waits for it.
            _NoRoom: the load is parked.
        """
        nbytes = sum(pieces)
        search = e.room
        if search is None or search.pieces != tuple(pieces):
            search = e.room = RoomSearch(pieces, demanded=e.demanded)
        search.demanded = e.demanded
        with self._lock:
            self._pressure.note_layout(pieces)
        while True:
            with self._cv:
                if e.detached:
                    raise _Detached()
                now = time.monotonic()
                d = search.next(
                    self._pool.allocator,
                    alloc=lambda p, split: self._pool.alloc_pieces(p, split=split),
                    pinned=self._pinned,
                    victim=lambda: self._pick_victim(e),
                    compaction_max_ratio=self.config.compaction_max_ratio,
                    has_waiters=e.refcount > 0,
                    wait_expired=e.room_deadline is not None and now >= e.room_deadline,
                )
                if self._on_decision is not None:
                    self._on_decision(e.ref.adapter_id, d)
                if d.sample_pressure:
                    self._pressure.sample(self._pool.allocator, self._pinned())
                a = d.allocation
                if d.action is RoomAction.PLACE and a is not None:
                    e.alloc = a
                    e.room = None
                    self._holders[a.handle] = e
                    if a.is_split:
                        self._c.splits += 1
                        self._emit(
                            StoreEvent("split", e.ref.adapter_id, e.ref.version, nbytes=nbytes)
                        )
                    return a
                if d.action is RoomAction.EVICT:
                    assert d.victim is not None
                    self._evict(self._entries[d.victim], "demand" if e.demanded else "prefetch")
                    continue
                if d.action is RoomAction.DROP:
                    if self._entries.get(e.ref.adapter_id) is e:
                        del self._entries[e.ref.adapter_id]
                    e.detached = True
                    e.state = _State.FAILED
                    e.event.set()
                    self._c.prefetch_ignored += 1
                    self._emit(StoreEvent("prefetch_ignored", e.ref.adapter_id, e.ref.version))
                    raise _PrefetchIgnored()
                if d.action is RoomAction.CANCEL:  # its requests ended while it was queued
                    self._fail(e, RequestCancelledError(_NO_WAITER), count=False)
                    raise _Detached()
                if d.action is RoomAction.FAIL:
                    if d.reason == "too_large":
                        raise PoolExhaustedError(d.message)
                    raise PoolExhaustedError(
                        f"no room in the device pool for adapter {e.ref.adapter_id!r} "
                        f"({nbytes} bytes): every resident adapter stayed in use for "
                        f"{self.config.load_wait_timeout_s:g} s; retry later"
                    )
                if d.action is RoomAction.WAIT:
                    if e.room_deadline is None:
                        e.room_deadline = now + self.config.load_wait_timeout_s
                    # Park it and free this loader thread for loads that fit (no head-of-line
                    # blocking); it is queued again whenever room may appear (_unpark).
                    e.job_started = False
                    self._parked.append(e)
                    raise _NoRoom()
            self._compact(d.compact_units)

    def _compact(self, need_units: int) -> None:
        """Compact the pool with the compute guard held exclusively (no step running)."""
        with self._guard.write(), self._lock:
            ctx = (
                torch.cuda.stream(torch.cuda.default_stream(self.device))
                if self.device.type == "cuda"
                else contextlib.nullcontext()
            )
            with ctx:
                res = self._pool.compact(self._pinned(), need_units)
            if self.device.type == "cuda":
                torch.cuda.default_stream(self.device).synchronize()
            for m in res.moves:
                holder = self._holders[m.handle]
                holder.alloc = self._pool.allocator.get(m.handle)
                holder.views = None  # re-pointed: rebuilt from the new run on next use
            self._c.compactions += 1
            self._c.bytes_moved += res.bytes_moved
            self._emit(StoreEvent("compact", nbytes=res.bytes_moved))


def flat_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (for integrity checks in tests and tools)."""
    data = t.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
