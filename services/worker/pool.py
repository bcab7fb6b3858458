"""The worker's device pool: a preallocated flat buffer and the allocators that carve it up.

Two allocators share one interface (:class:`Allocator`), so the paged design and the baseline
run the same store code (the baseline is S-LoRA style):

``paged`` (:class:`PagedAllocator`)
    The Predictive-LoRA design (arXiv 2512.20210, section on the paged adapter pool): the pool
    is ``num_pages`` fixed-size pages; an adapter occupies a *run* of consecutive pages, so its
    A/B tensors are plain views of the flat buffer and the engine computes straight from pool
    memory. Allocation is first-fit over free runs. When no run fits but enough pages are free,
    :meth:`Allocator.plan_compaction` slides movable adapters to lower addresses (never one in
    use: the caller passes them as ``pinned``). When pinned adapters split the free space so
    that compaction cannot join it, :meth:`Allocator.alloc_pieces` with ``split=True`` spreads
    the adapter over several runs (*extents*), as S-LoRA's unified paging does (arXiv
    2311.03285), cutting only between tensors: every A and B stays one contiguous view, and
    compaction moves extents one by one. The page table is a tensor: ``page_table[p]`` is the
    handle owning page ``p`` or ``-1``.
``contiguous`` (:class:`ContiguousAllocator`)
    The S-LoRA-style baseline: exact-size first-fit over bytes (rounded only to a small
    alignment, as ``cudaMalloc`` does), no compaction, so holes left by evictions fragment it.

Both keep their free space as a sorted list of extents (``O(#extents)`` per call, independent of
the number of pages), raise typed errors and never return ``None`` from an allocation.
:class:`DevicePool` owns the tensor: it zeroes freed space (so no adapter can ever read another's
bytes), copies adapters in, and performs compaction moves with overlap-safe copies.

Units: allocators count *units* (pages for ``paged``, alignment quanta for ``contiguous``);
every public byte figure is in bytes.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from services.common.errors import PoolExhaustedError

logger = logging.getLogger(__name__)

#: Default page size, 64 KiB, chosen by measurement (``plora bench pool``, full Alibaba replay,
#: SmolLM2-135M adapters of ranks 8..128 in fp16, pool = 1/4 of the working set): utilization
#: under pressure 0.925 / 0.981 / 0.992 / 0.997 and internal waste 7.3 % / 1.7 % / 0.57 % /
#: 0.15 % with 4 MiB (the paper's) / 1 MiB / 256 KiB / 64 KiB pages. A rank unit is 610,560
#: bytes in fp16, so a rank-8 adapter (4.9 MB) wastes 40 % of its last 4 MiB page; 64 KiB
#: pages cost nothing measurable elsewhere (free lists are per extent, not per page; the page
#: table of a 17 GiB pool is 276 k int64 entries).
DEFAULT_PAGE_BYTES = 64 * 1024

#: Alignment of the contiguous baseline (what CUDA's allocator guarantees), bytes.
DEFAULT_ALIGNMENT_BYTES = 256

#: Allocator kinds understood by :func:`make_allocator`.
ALLOCATOR_KINDS: tuple[str, ...] = ("paged", "contiguous")


class AllocationError(PoolExhaustedError):
    """An allocation cannot be served as the pool stands (RESOURCE_EXHAUSTED)."""


class TooLargeError(AllocationError):
    """The request is bigger than the whole pool; it can never be served."""


class OutOfSpaceError(AllocationError):
    """Fewer free units than requested: something must be evicted first."""


class FragmentationError(AllocationError):
    """Enough units are free in total, but no single free run is long enough.

    Attributes:
        needed_units: Units requested.
        free_units: Units free in total.
        largest_run: Longest free run, units.
    """

    def __init__(self, message: str, needed_units: int, free_units: int, largest_run: int):
        super().__init__(message)
        self.needed_units = needed_units
        self.free_units = free_units
        self.largest_run = largest_run


@dataclass(frozen=True)
class Extent:
    """A run of consecutive units: ``[start, start + length)``."""

    start: int
    length: int

    @property
    def end(self) -> int:
        """One past the last unit."""
        return self.start + self.length


@dataclass(frozen=True)
class Allocation:
    """One allocation: one run of units, or (``paged`` with splitting) several.

    Attributes:
        handle: Allocator-unique id (never reused by the same allocator).
        extents: The runs, in the order the pieces first use them (extent 0 holds piece 0);
            addresses need not increase. One extent unless the allocation was split.
        nbytes: Bytes the caller asked for (live bytes; ``<= units * unit_bytes``).
        unit_bytes: Bytes per unit.
        extent_bytes: Live bytes held by each extent: its pieces are packed from its first
            unit, so they fill its first ``extent_bytes[i]`` bytes.
        pieces: Byte sizes of the caller's pieces, in the caller's order (``(nbytes,)`` for
            :meth:`Allocator.alloc`).
        piece_offsets: ``(extent index, byte offset in that extent)`` of each piece. In one
            run the pieces lie end to end in order; a split places each piece whole in some
            extent (the order of pieces in the pool need not be the caller's).
    """

    handle: int
    extents: tuple[Extent, ...]
    nbytes: int
    unit_bytes: int
    extent_bytes: tuple[int, ...]
    pieces: tuple[int, ...]
    piece_offsets: tuple[tuple[int, int], ...]

    @property
    def start(self) -> int:
        """First unit of the first extent."""
        return self.extents[0].start

    @property
    def units(self) -> int:
        """Units over all extents."""
        return sum(e.length for e in self.extents)

    @property
    def is_split(self) -> bool:
        """Whether the allocation spans more than one run."""
        return len(self.extents) > 1

    @property
    def byte_offset(self) -> int:
        """Offset of the first extent in the pool, bytes."""
        return self.start * self.unit_bytes

    @property
    def byte_length(self) -> int:
        """Allocated bytes (whole units, all extents)."""
        return self.units * self.unit_bytes

    @property
    def extent(self) -> Extent:
        """The run as an :class:`Extent`.

        Raises:
            ValueError: the allocation is split (use :attr:`extents`).
        """
        if self.is_split:
            raise ValueError(f"allocation {self.handle} spans {len(self.extents)} extents")
        return self.extents[0]


@dataclass(frozen=True)
class Move:
    """One compaction step: move the extent of allocation ``handle`` that starts at unit
    ``src`` (``units`` long) to unit ``dst``. A split allocation's extents move one by one."""

    handle: int
    src: int
    dst: int
    units: int


@dataclass(frozen=True)
class SplitPlan:
    """Where :meth:`Allocator.plan_split` would put each piece.

    Attributes:
        extents: One prefix of a free run per run used, in the order pieces first use them.
        extent_bytes: Live bytes placed in each extent.
        piece_offsets: ``(extent index, byte offset in it)`` of each piece, in piece order.
    """

    extents: tuple[Extent, ...]
    extent_bytes: tuple[int, ...]
    piece_offsets: tuple[tuple[int, int], ...]


class Allocator:
    """First-fit allocation of unit runs over a fixed capacity.

    Allocations are made of *extents* (runs of units). :meth:`alloc` always makes one;
    :meth:`alloc_pieces` with ``split=True`` may make several when the allocator supports it
    (``paged``): the caller's bytes are a sequence of *pieces* (tensors) and a split never cuts
    a piece, so every piece stays contiguous in the pool.

    Args:
        capacity_units: Units in the pool (> 0).
        unit_bytes: Bytes per unit (> 0).

    Raises:
        ValueError: a non-positive size.
    """

    #: Name used in configs and reports.
    kind: str = ""
    #: Whether :meth:`plan_compaction` can move allocations.
    supports_compaction: bool = False
    #: Whether :meth:`alloc_pieces` may spread an allocation over several runs.
    supports_split: bool = False

    def __init__(self, capacity_units: int, unit_bytes: int) -> None:
        if capacity_units <= 0 or unit_bytes <= 0:
            raise ValueError(
                f"allocator needs capacity_units > 0 and unit_bytes > 0, "
                f"got {capacity_units}, {unit_bytes}"
            )
        self.capacity_units = capacity_units
        self.unit_bytes = unit_bytes
        self._free_starts: list[int] = [0]  # sorted starts of free extents
        self._free_len: dict[int, int] = {0: capacity_units}  # start -> length
        self._allocs: dict[int, Allocation] = {}
        self._ext_starts: list[int] = []  # sorted starts of allocated extents
        self._ext_owner: dict[int, int] = {}  # allocated extent start -> handle
        self._ext_len: dict[int, int] = {}  # allocated extent start -> length
        self._next_handle = 0
        self._free_units = capacity_units
        self._live_bytes = 0
        self._splits = 0

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        """Pool bytes managed by this allocator."""
        return self.capacity_units * self.unit_bytes

    @property
    def free_units(self) -> int:
        """Units not allocated."""
        return self._free_units

    @property
    def used_units(self) -> int:
        """Units allocated."""
        return self.capacity_units - self._free_units

    @property
    def live_bytes(self) -> int:
        """Bytes requested by the current allocations (<= allocated bytes)."""
        return self._live_bytes

    @property
    def split_allocations(self) -> int:
        """Allocations made over more than one run since the allocator was built."""
        return self._splits

    @property
    def allocated_extents(self) -> int:
        """Extents held by the current allocations (``len(self)`` when none is split)."""
        return len(self._ext_starts)

    def mean_extents(self) -> float:
        """Mean extents per live allocation (0.0 when empty)."""
        return len(self._ext_starts) / len(self._allocs) if self._allocs else 0.0

    def units_for(self, nbytes: int) -> int:
        """Units needed to hold ``nbytes`` (at least one)."""
        return max(1, -(-nbytes // self.unit_bytes))

    def free_extents(self) -> list[Extent]:
        """Free runs in address order."""
        return [Extent(s, self._free_len[s]) for s in self._free_starts]

    def largest_free_run(self) -> int:
        """Longest free run, units (0 when full)."""
        return max(self._free_len.values(), default=0)

    def allocations(self) -> list[Allocation]:
        """Current allocations in address order of their first extent."""
        return sorted(self._allocs.values(), key=lambda a: a.start)

    def extent_spans(self) -> list[tuple[int, int, int]]:
        """Allocated extents in address order: ``(start, units, handle)``."""
        return [(s, self._ext_len[s], self._ext_owner[s]) for s in self._ext_starts]

    def get(self, handle: int) -> Allocation:
        """The allocation with ``handle``.

        Raises:
            KeyError: no such live allocation.
        """
        return self._allocs[handle]

    def __len__(self) -> int:
        return len(self._allocs)

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, nbytes: int) -> Allocation:
        """Allocate the first free run that holds ``nbytes`` bytes (one extent).

        Args:
            nbytes: Bytes to hold (> 0).

        Returns:
            The new allocation.

        Raises:
            ValueError: ``nbytes <= 0``.
            TooLargeError: more units than the pool has.
            OutOfSpaceError: fewer units free than needed.
            FragmentationError: enough units free, no run long enough.
        """
        if nbytes <= 0:
            raise ValueError(f"alloc needs nbytes > 0, got {nbytes}")
        return self.alloc_pieces((nbytes,))

    def alloc_pieces(self, pieces: Sequence[int], *, split: bool = False) -> Allocation:
        """Allocate room for ``pieces`` (byte sizes, in layout order).

        First fit of one run holding ``sum(pieces)`` bytes, the pieces end to end in order.
        When none exists, ``split=True``
        and the allocator :attr:`supports_split`, the pieces are spread over free runs by
        :meth:`plan_split` (S-LoRA's unified paging, arXiv 2311.03285, places an adapter in
        non-contiguous pages; here a cut falls only between pieces, so each piece, a tensor,
        stays contiguous). ``alloc(n)`` is ``alloc_pieces([n])``.

        Args:
            pieces: Byte sizes (each > 0), in the order the caller lays them out.
            split: Allow several extents when no single run fits.

        Returns:
            The new allocation (``piece_offsets`` says where each piece lies).

        Raises:
            ValueError: no pieces, or a piece of ``<= 0`` bytes.
            TooLargeError: more units than the pool has.
            OutOfSpaceError: fewer units free than needed.
            FragmentationError: enough units free, but no run long enough (and, with
                ``split``, the pieces cannot be spread over the free runs either: a piece
                bigger than every remaining run, or page rounding at the cuts).
        """
        if not pieces or min(pieces) <= 0:
            raise ValueError(f"alloc needs pieces of > 0 bytes, got {list(pieces)[:8]}")
        nbytes = sum(pieces)
        units = self.units_for(nbytes)
        if units > self.capacity_units:
            raise TooLargeError(
                f"{nbytes} bytes need {units} {self.kind} units but the pool has only "
                f"{self.capacity_units} ({self.capacity_bytes} bytes); grow the pool"
            )
        if units > self._free_units:
            raise OutOfSpaceError(f"{units} units needed, {self._free_units} free; evict first")
        for s in self._free_starts:
            if self._free_len[s] >= units:
                offsets = tuple((0, o) for o in itertools.accumulate(pieces[:-1], initial=0))
                return self._take(SplitPlan((Extent(s, units),), (nbytes,), offsets), pieces)
        if split and self.supports_split:
            plan = self.plan_split(pieces)
            if plan is not None:
                self._splits += 1
                return self._take(plan, pieces)
        largest = self.largest_free_run()
        raise FragmentationError(
            f"{units} units needed, {self._free_units} free but the longest free run is {largest}"
            + (" and the pieces do not spread over the free runs" if split else ""),
            units,
            self._free_units,
            largest,
        )

    def plan_split(self, pieces: Sequence[int]) -> SplitPlan | None:
        """Where a split allocation of ``pieces`` would go; None if it cannot be placed now.

        Pure. First fit per piece, in the caller's order: each piece goes whole into the first
        free run (address order) with room left for it, packed after the pieces already put
        there; a piece that fits nowhere fails the plan. Every run used becomes one extent
        from its first unit, rounded up to whole units. The baseline never splits (None).

        Args:
            pieces: Byte sizes (each > 0), in layout order.
        """
        return None

    def placeable_bytes(self, pieces: Sequence[int]) -> int:
        """Largest allocation, in bytes, that :meth:`alloc_pieces` with ``split=True`` could
        place now without moving anything, for an allocation laid out like ``pieces``
        repeated as often as needed (a longer adapter of the same shape).

        Exact for that layout: ``alloc_pieces(pieces, split=True)`` succeeds if and only if
        ``sum(pieces) <= placeable_bytes(pieces)`` (the plan is first fit per piece in order,
        so what it places of the repeated layout is a prefix). Without splitting this is the
        bytes of the longest free run; with splitting it is every free byte except what is
        left in each run once no further piece fits there (the rounding at piece boundaries).

        Args:
            pieces: A representative layout, byte sizes (each > 0).

        Raises:
            ValueError: no pieces, or a piece of ``<= 0`` bytes.
        """
        return self._placeable(pieces)[0]

    def placeable_units(self, pieces: Sequence[int]) -> int:
        """Units that the allocation of :meth:`placeable_bytes` would occupy (each extent
        rounded up to whole units; 0 if nothing fits): the *largest allocatable extent* of
        external fragmentation for an allocator that splits (the longest free run if it does not).

        Raises:
            ValueError: as :meth:`placeable_bytes`.
        """
        return self._placeable(pieces)[1]

    def _placeable(self, pieces: Sequence[int]) -> tuple[int, int]:
        if not pieces or min(pieces) <= 0:
            raise ValueError("placeable_bytes needs pieces of > 0 bytes")
        run = self.largest_free_run()
        return run * self.unit_bytes, run

    def _take(self, plan: SplitPlan, pieces: Sequence[int]) -> Allocation:
        """Carve the plan's extents (each inside a free run) out of the free list."""
        for ext in plan.extents:
            self._take_range(ext.start, ext.length)
        handle = self._next_handle
        self._next_handle += 1
        nbytes = sum(pieces)
        a = Allocation(
            handle,
            plan.extents,
            nbytes,
            self.unit_bytes,
            plan.extent_bytes,
            tuple(pieces),
            plan.piece_offsets,
        )
        self._register(a)
        self._free_units -= a.units
        self._live_bytes += nbytes
        return a

    def _take_range(self, start: int, units: int) -> None:
        """Remove ``[start, start + units)`` (inside one free extent) from the free list."""
        s = self._free_extent_containing(start, units)
        length = self._free_len.pop(s)
        idx = bisect.bisect_left(self._free_starts, s)
        del self._free_starts[idx]
        if start > s:
            self._free_starts.insert(idx, s)
            self._free_len[s] = start - s
            idx += 1
        tail = s + length - (start + units)
        if tail > 0:
            self._free_starts.insert(idx, start + units)
            self._free_len[start + units] = tail

    def _register(self, a: Allocation) -> None:
        self._allocs[a.handle] = a
        for e in a.extents:
            self._register_extent(e.start, e.length, a.handle)

    def _register_extent(self, start: int, units: int, handle: int) -> None:
        bisect.insort(self._ext_starts, start)
        self._ext_owner[start] = handle
        self._ext_len[start] = units
        self._mark(start, units, handle)

    def _unregister_extent(self, start: int, units: int) -> None:
        i = bisect.bisect_left(self._ext_starts, start)
        del self._ext_starts[i]
        del self._ext_owner[start]
        del self._ext_len[start]
        self._mark(start, units, -1)

    def _mark(self, start: int, units: int, handle: int) -> None:
        """Hook for page tables (the paged allocator records owners per page)."""

    def free(self, allocation: Allocation | int) -> None:
        """Return every extent of an allocation to the free list (merging with free
        neighbours).

        Raises:
            KeyError: the allocation is not live (double free).
        """
        handle = allocation if isinstance(allocation, int) else allocation.handle
        a = self._allocs.pop(handle)
        for e in a.extents:
            self._unregister_extent(e.start, e.length)
            self._insert_free(e.start, e.length)
        self._free_units += a.units
        self._live_bytes -= a.nbytes

    def _insert_free(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        # merge with the previous free extent
        if i > 0:
            p = self._free_starts[i - 1]
            if p + self._free_len[p] == start:
                start, length = p, length + self._free_len.pop(p)
                del self._free_starts[i - 1]
                i -= 1
        # merge with the next free extent
        if i < len(self._free_starts):
            n = self._free_starts[i]
            if start + length == n:
                length += self._free_len.pop(n)
                del self._free_starts[i]
        self._free_starts.insert(i, start)
        self._free_len[start] = length

    # ------------------------------------------------------------------ compaction
    def plan_compaction(
        self, pinned: Iterable[int] = (), need_units: int | None = None
    ) -> list[Move]:
        """Moves that join free space (none for the baseline).

        Pure: the allocator does not change until :meth:`apply_moves`. Extents of allocations
        in ``pinned`` never move; every move goes to a lower address. A split allocation's
        extents are moved independently (each holds whole pieces, so it can go anywhere).
        Moves are to be applied in the order given (each is valid after the previous ones); a
        move may overlap its own source (a slide), never another extent.

        With ``need_units``, the cheapest of these that yields one free run of that length:

        1. *relocation*: a window of ``need_units`` starting or ending at a free run, whose
           (unpinned) extents move out into free runs elsewhere (best fit, largest first);
           the window with the fewest allocated units that can be cleared wins;
        2. *slide*: the window of consecutive free runs and movable extents gathering
           enough free units with the fewest allocated units inside; its extents slide
           down, joining its free runs at the window's end.

        Without ``need_units``, or when neither works: a full compaction (each extent, in
        address order, moves to the first free position that holds it, its own run counted
        as free).

        Args:
            pinned: Handles that must stay where they are (in use, or being written).
            need_units: Length of the free run wanted.
        """
        return []

    def apply_moves(self, moves: Sequence[Move]) -> None:
        """Record ``moves`` (from :meth:`plan_compaction`) in the free list and page table.

        Raises:
            ValueError: a move does not match the current state.
        """
        for m in moves:
            a = self._allocs.get(m.handle)
            idx = next(
                (
                    i
                    for i, e in enumerate(a.extents if a is not None else ())
                    if e.start == m.src and e.length == m.units
                ),
                None,
            )
            if a is None or idx is None:
                raise ValueError(f"stale compaction move {m}")
            self._unregister_extent(m.src, m.units)
            self._insert_free(m.src, m.units)
            self._take_range(m.dst, m.units)
            self._register_extent(m.dst, m.units, a.handle)
            ext = list(a.extents)
            ext[idx] = Extent(m.dst, m.units)
            self._allocs[a.handle] = replace(a, extents=tuple(ext))

    def _free_extent_containing(self, start: int, units: int) -> int:
        i = bisect.bisect_right(self._free_starts, start) - 1
        if i < 0:
            raise ValueError(f"no free extent holds [{start}, {start + units})")
        s = self._free_starts[i]
        if s + self._free_len[s] < start + units:
            raise ValueError(f"no free extent holds [{start}, {start + units})")
        return s

    def allocatable_units(self, pinned: Iterable[int] = ()) -> int:
        """Longest single run this allocator could serve now without evicting anything.

        For an allocator with compaction this is the longest free run after compacting
        around ``pinned``; for the baseline it is the longest free run. Splitting is not
        counted here (see :meth:`placeable_units`): callers use this figure to decide whether
        compaction can help.
        """
        return self.largest_free_run()

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert the free list and allocated extents tile the pool exactly (tests call this).

        Raises:
            AssertionError: the bookkeeping is inconsistent.
        """
        spans = [(e.start, e.length, -1) for e in self.free_extents()]
        owned = [(e.start, e.length, a.handle) for a in self._allocs.values() for e in a.extents]
        spans += owned
        spans.sort()
        pos = 0
        prev_free = False
        for start, length, h in spans:
            assert start == pos, f"gap or overlap at unit {pos} (next span starts {start})"
            assert length > 0, f"empty span at {start}"
            is_free = h < 0
            assert not (is_free and prev_free), f"unmerged free extents at {start}"
            prev_free = is_free
            pos += length
        assert pos == self.capacity_units, f"spans cover {pos} of {self.capacity_units} units"
        assert self._free_units == sum(self._free_len.values())
        assert self._live_bytes == sum(a.nbytes for a in self._allocs.values())
        assert self.extent_spans() == sorted(owned), "extent index disagrees with allocations"
        for a in self._allocs.values():
            assert len(a.extent_bytes) == len(a.extents) and sum(a.extent_bytes) == a.nbytes
            for e, b in zip(a.extents, a.extent_bytes, strict=True):
                assert 0 < b <= e.length * self.unit_bytes, f"extent {e} of {a.handle} holds {b}"
                assert self.units_for(b) == e.length, f"extent {e} of {a.handle} not tight"
            assert len(a.pieces) == len(a.piece_offsets) and sum(a.pieces) == a.nbytes
            packed = [0] * len(a.extents)  # the pieces of each extent tile its live bytes
            for (i, off), p in sorted(zip(a.piece_offsets, a.pieces, strict=True)):
                assert off == packed[i], f"piece at {off} of extent {i} of {a.handle} overlaps"
                packed[i] += p
            assert tuple(packed) == a.extent_bytes, f"pieces of {a.handle} do not tile"


class _FirstFit:
    """First fit of pieces over runs' remaining bytes (address order): the placement rule of
    :meth:`PagedAllocator.plan_split` and :meth:`PagedAllocator.placeable_bytes`.

    Args:
        caps: Bytes of each free run, in address order.
        pieces: The layout (its smallest piece decides when a run is full).
    """

    def __init__(self, caps: Sequence[int], pieces: Sequence[int]) -> None:
        self.rem = list(caps)
        self.used = [0] * len(caps)
        self.smallest = min(pieces)
        self.active = [i for i, c in enumerate(caps) if c >= self.smallest]

    def take(self, run: int, nbytes: int) -> int:
        """Put ``nbytes`` in ``run`` (which has room); returns their offset in it."""
        off = self.used[run]
        self.used[run] += nbytes
        self.rem[run] -= nbytes
        if self.rem[run] < self.smallest:
            self.active.remove(run)
        return off

    def put(self, piece: int) -> tuple[int, int] | None:
        """``(run, offset)`` of ``piece`` in the first run with room, or None."""
        for run in self.active:
            if self.rem[run] >= piece:
                return run, self.take(run, piece)
        return None
