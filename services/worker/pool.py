"""The worker's device pool: a preallocated flat buffer and the allocators that carve it up.

Two allocators share one interface (:class:`Allocator`), so the paged design and the baseline
run the same store code (ARCHITECTURE.md "Baseline policy"):

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

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
        ARCHITECTURE.md for an allocator that splits (the longest free run if it does not).

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


class PagedAllocator(Allocator):
    """Fixed-size pages, first-fit over free runs, splitting at piece boundaries, and
    compaction around pinned allocations.

    Args:
        num_pages: Pages in the pool.
        page_bytes: Bytes per page.

    Attributes:
        page_table: ``int64 [num_pages]`` (CPU): owning handle of each page, ``-1`` if free.
    """

    kind = "paged"
    supports_compaction = True
    supports_split = True

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        super().__init__(num_pages, page_bytes)
        self.page_table = torch.full((num_pages,), -1, dtype=torch.int64)  # [num_pages]

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.capacity_units

    @property
    def page_bytes(self) -> int:
        """Bytes per page."""
        return self.unit_bytes

    def _mark(self, start: int, units: int, handle: int) -> None:
        self.page_table[start : start + units] = handle

    def pages_of(self, handle: int) -> torch.Tensor:
        """``int64 [units]`` page indices of an allocation, in logical order (its page table
        row; several runs for a split allocation).

        Raises:
            KeyError: no such live allocation.
        """
        a = self._allocs[handle]
        return torch.cat([torch.arange(e.start, e.end, dtype=torch.int64) for e in a.extents])

    # ------------------------------------------------------------------ splitting
    def plan_split(self, pieces: Sequence[int]) -> SplitPlan | None:
        fit = _FirstFit([self._free_len[s] * self.unit_bytes for s in self._free_starts], pieces)
        ext_of_run: dict[int, int] = {}  # run index -> extent index, in first-use order
        offsets = []
        for p in pieces:
            placed = fit.put(p)
            if placed is None:
                return None
            run, off = placed
            offsets.append((ext_of_run.setdefault(run, len(ext_of_run)), off))
        runs = list(ext_of_run)
        return SplitPlan(
            tuple(Extent(self._free_starts[r], self.units_for(fit.used[r])) for r in runs),
            tuple(fit.used[r] for r in runs),
            tuple(offsets),
        )

    def _placeable(self, pieces: Sequence[int]) -> tuple[int, int]:
        if not pieces or min(pieces) <= 0:
            raise ValueError("placeable_bytes needs pieces of > 0 bytes")
        fit = _FirstFit([self._free_len[s] * self.unit_bytes for s in self._free_starts], pieces)
        lap = sum(pieces)
        n = len(pieces)
        j = placed = 0
        while fit.active:
            first = fit.active[0]
            if fit.rem[first] >= lap:  # the first run with room takes whole laps from any phase
                k = fit.rem[first] // lap
                fit.take(first, k * lap)
                placed += k * lap
                continue
            if fit.put(pieces[j]) is None:
                break
            placed += pieces[j]
            j = (j + 1) % n
        return placed, sum(self.units_for(u) for u in fit.used if u)

    # ------------------------------------------------------------------ compaction
    def _simulate(self, pinned: set[int]) -> tuple[list[Move], list[tuple[int, int]]]:
        """First-fit compaction around pinned extents; returns the moves and the final free
        runs."""
        free: list[list[int]] = [[e.start, e.length] for e in self.free_extents()]
        moves: list[Move] = []

        def release(start: int, length: int) -> None:
            i = bisect.bisect_left(free, [start, 0])
            free.insert(i, [start, length])
            if i + 1 < len(free) and start + length == free[i + 1][0]:
                free[i][1] += free[i + 1][1]
                del free[i + 1]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
                free[i - 1][1] += free[i][1]
                del free[i]

        def take(start: int, length: int) -> None:
            i = bisect.bisect_right(free, [start, float("inf")]) - 1
            s, ln = free[i]
            del free[i]
            if start + length < s + ln:
                free.insert(i, [start + length, s + ln - start - length])
            if start > s:
                free.insert(i, [s, start - s])

        for start, units, h in self.extent_spans():
            if h in pinned:
                continue
            # only runs below the extent can improve on its current place
            if not free or free[0][0] > start:
                continue
            release(start, units)
            dst = next(s for s, ln in free if ln >= units)  # its own run always fits
            take(dst, units)
            if dst != start:
                moves.append(Move(h, start, dst, units))
        return moves, [(s, ln) for s, ln in free]

    def plan_compaction(
        self, pinned: Iterable[int] = (), need_units: int | None = None
    ) -> list[Move]:
        pins = set(pinned)
        if need_units is not None:
            for planner in (self._relocation_plan, self._cheapest_window):
                plan = planner(pins, need_units)
                if plan is not None:
                    return plan
        moves, _ = self._simulate(pins)
        return moves

    def _relocation_plan(self, pinned: set[int], need: int) -> list[Move] | None:
        """Clear the cheapest clearable window of ``need`` units by moving its extents out."""
        cap = self.capacity_units
        windows = set()
        for e in self.free_extents():
            if e.start + need <= cap:
                windows.add(e.start)
            if e.end - need >= 0:
                windows.add(e.end - need)
        starts = self._ext_starts
        scored: list[tuple[int, int, list[tuple[int, int, int]]]] = []
        for ws in windows:
            we = ws + need
            i = bisect.bisect_right(starts, ws) - 1
            if i < 0 or starts[i] + self._ext_len[starts[i]] <= ws:
                i += 1
            inside: list[tuple[int, int, int]] = []  # (start, units, handle)
            ok = True
            while i < len(starts) and starts[i] < we:
                s = starts[i]
                h = self._ext_owner[s]
                if h in pinned:
                    ok = False
                    break
                inside.append((s, self._ext_len[s], h))
                i += 1
            if ok:
                scored.append((sum(u for _, u, _ in inside), ws, inside))
        scored.sort(key=lambda x: (x[0], x[1]))
        for _, ws, inside in scored:
            lo = min([ws] + [s for s, _, _ in inside])
            hi = max([ws + need] + [s + u for s, u, _ in inside])
            # free runs outside the cleared span [lo, hi)
            holes: list[list[int]] = []
            for e in self.free_extents():
                if e.end <= lo or e.start >= hi:
                    holes.append([e.start, e.length])
                else:
                    if e.start < lo:
                        holes.append([e.start, lo - e.start])
                    if e.end > hi:
                        holes.append([hi, e.end - hi])
            moves = []
            for s, u, h in sorted(inside, key=lambda x: (-x[1], x[0])):
                fits = [hole for hole in holes if hole[1] >= u]
                if not fits:
                    break
                hole = min(fits, key=lambda x: (x[1], x[0]))  # best fit
                moves.append(Move(h, s, hole[0], u))
                hole[0] += u
                hole[1] -= u
            else:
                return moves
        return None

    def _cheapest_window(self, pinned: set[int], need: int) -> list[Move] | None:
        """Slide plan of the cheapest window gathering ``need`` free units (None if none)."""
        # spans in address order: (start, length, handle or -1 for free)
        spans = [(e.start, e.length, -1) for e in self.free_extents()]
        spans += self.extent_spans()
        spans.sort()
        best: tuple[int, int, int] | None = None  # (cost units, lo index, hi index)
        lo = 0
        gathered = cost = 0
        for hi, (_, length, h) in enumerate(spans):
            if h >= 0 and h in pinned:
                lo, gathered, cost = hi + 1, 0, 0
                continue
            if h < 0:
                gathered += length
            else:
                cost += length
            if h >= 0:
                continue  # a window never needs to end on an allocation
            # drop items from the left while the window still gathers enough
            while lo < hi:
                s_len, s_h = spans[lo][1], spans[lo][2]
                if s_h < 0 and gathered - s_len < need:
                    break
                if s_h < 0:
                    gathered -= s_len
                else:
                    cost -= s_len
                lo += 1
            if gathered >= need and (best is None or cost < best[0]):
                best = (cost, lo, hi)
        if best is None:
            return None
        _, lo, hi = best
        cursor = spans[lo][0]
        moves = []
        for start, length, h in spans[lo : hi + 1]:
            if h < 0:
                continue
            if start != cursor:
                moves.append(Move(h, start, cursor, length))
            cursor += length
        return moves

    def allocatable_units(self, pinned: Iterable[int] = ()) -> int:
        """Free units of the richest stretch between pinned extents: sliding that
        stretch's movable extents together (the slide plan) joins all of them."""
        pins = set(pinned)
        if self._free_units == 0:
            return 0
        if len(self._free_starts) <= 1:
            return self.largest_free_run()
        best = seg = 0
        fi = ai = 0
        fs, as_ = self._free_starts, self._ext_starts
        # merge free runs and allocated extents in address order
        while fi < len(fs) or ai < len(as_):
            if ai >= len(as_) or (fi < len(fs) and fs[fi] < as_[ai]):
                seg += self._free_len[fs[fi]]
                fi += 1
            else:
                if self._ext_owner[as_[ai]] in pins:
                    best, seg = max(best, seg), 0
                ai += 1
        return max(best, seg)

    def check_invariants(self) -> None:
        super().check_invariants()
        expect = torch.full((self.capacity_units,), -1, dtype=torch.int64)
        for a in self._allocs.values():
            for e in a.extents:
                expect[e.start : e.end] = a.handle
        assert torch.equal(expect, self.page_table), "page table disagrees with allocations"


class ContiguousAllocator(Allocator):
    """The baseline: exact-size (alignment-rounded) first-fit over bytes, no compaction.

    Args:
        capacity_bytes: Pool bytes (rounded down to the alignment).
        alignment_bytes: Allocation granularity.
    """

    kind = "contiguous"
    supports_compaction = False

    def __init__(self, capacity_bytes: int, alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> None:
        super().__init__(capacity_bytes // alignment_bytes, alignment_bytes)


def external_fragmentation(
    allocator: Allocator, pinned: Iterable[int] = (), ref_pieces: Sequence[int] = ()
) -> float:
    """``1 - largest allocatable extent / free units`` (ARCHITECTURE.md), in [0, 1].

    The allocatable extent is what compaction around ``pinned`` can join
    (:meth:`Allocator.allocatable_units`) and, for an allocator that splits, the better of that
    and the units a split allocation of the layout ``ref_pieces`` would occupy
    (:meth:`Allocator.placeable_units`; callers pass the coarsest layout seen). 0 when nothing
    is free.
    """
    if allocator.free_units == 0:
        return 0.0
    run = allocator.allocatable_units(pinned)
    if allocator.supports_split and ref_pieces:
        run = max(run, allocator.placeable_units(ref_pieces))
    return 1.0 - run / allocator.free_units


def compact_or_split(
    allocator: Allocator,
    pinned: Iterable[int],
    pieces: Sequence[int],
    need_units: int,
    *,
    compaction_max_ratio: float,
    can_evict: Callable[[], bool],
    alloc_split: Callable[[Sequence[int]], Allocation] | None = None,
) -> tuple[int, Allocation | None]:
    """What to do when enough units are free but no single run fits (``FragmentationError``).

    The one policy both the worker's store and the simulator run: compact when pinned
    allocations do not block it and the cheapest plan moves at most ``compaction_max_ratio``
    units per unit needed; else split ``pieces`` over the free runs (S-LoRA-style, cut only
    between pieces; :meth:`Allocator.alloc_pieces`); else compact anyway when it can join the
    space and nothing can be evicted; else nothing (the caller evicts or waits).

    Args:
        allocator: The pool's allocator (``contiguous`` never compacts nor splits).
        pinned: Handles that must not move (leased or loading).
        pieces: Byte sizes of the allocation's pieces, in layout order.
        need_units: Units the allocation needs (``FragmentationError.needed_units``).
        compaction_max_ratio: Budget of units moved per unit needed (``inf``: always compact).
        can_evict: Whether an eviction victim exists (asked only when it matters).
        alloc_split: Makes the split allocation (default: ``allocator.alloc_pieces`` with
            ``split=True``; the store passes its pool's, which also checks element alignment).

    Returns:
        ``(units to compact for, None)`` to compact, ``(0, allocation)`` when split, or
        ``(0, None)`` when neither applies.
    """
    if not allocator.supports_compaction:
        return 0, None
    pins = set(pinned)
    joinable = allocator.allocatable_units(pins) >= need_units
    if joinable:
        limit = compaction_max_ratio * need_units
        if limit == float("inf") or limit >= sum(
            m.units for m in allocator.plan_compaction(pins, need_units)
        ):
            return need_units, None
    split = alloc_split or (lambda p: allocator.alloc_pieces(p, split=True))
    try:
        return 0, split(pieces)
    except FragmentationError:
        pass
    if joinable and not can_evict():
        return need_units, None
    return 0, None


def make_allocator(
    kind: str,
    pool_bytes: int,
    page_bytes: int = DEFAULT_PAGE_BYTES,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
) -> Allocator:
    """Build an allocator by name.

    Args:
        kind: ``"paged"`` or ``"contiguous"``.
        pool_bytes: Pool bytes; ``paged`` uses ``pool_bytes // page_bytes`` pages.
        page_bytes: Page size for ``paged``.
        alignment_bytes: Granularity of ``contiguous``.

    Raises:
        ValueError: unknown kind or a pool smaller than one unit.
    """
    if kind == "paged":
        return PagedAllocator(pool_bytes // page_bytes, page_bytes)
    if kind == "contiguous":
        return ContiguousAllocator(pool_bytes, alignment_bytes)
    raise ValueError(f"unknown allocator {kind!r}; expected one of {ALLOCATOR_KINDS}")


@dataclass(frozen=True)
class CompactionResult:
    """What one compaction did: the moves applied and the bytes copied."""

    moves: tuple[Move, ...]
    bytes_moved: int


class DevicePool:
    """A preallocated flat tensor on a device, carved up by an :class:`Allocator`.

    Invariant: every byte outside a live allocation's run is zero (freed runs are zeroed at
    free time, compaction zeroes what it vacates), so a new adapter never sees old bytes.

    Args:
        allocator: Decides placement; its ``unit_bytes`` must be a multiple of the dtype size.
        dtype: Element type of the pool (the serving dtype of adapter weights).
        device: Where the buffer lives (``"cpu"``, ``"cuda:0"``, or ``"meta"`` for
            byte-accounting runs without storage).

    Attributes:
        buffer: ``dtype [capacity_bytes // element_size]`` on ``device``, zero-initialised.

    Raises:
        ValueError: unit size not a multiple of the element size.
    """

    def __init__(self, allocator: Allocator, dtype: torch.dtype, device: torch.device | str):
        self.allocator = allocator
        self.dtype = dtype
        self.device = torch.device(device)
        self.element_size = torch.empty((), dtype=dtype).element_size()
        if allocator.unit_bytes % self.element_size:
            raise ValueError(
                f"unit of {allocator.unit_bytes} bytes is not a multiple of the "
                f"{self.element_size}-byte {dtype}"
            )
        self.buffer = torch.zeros(
            allocator.capacity_bytes // self.element_size, dtype=dtype, device=self.device
        )  # [capacity elements]
        self._unit_elems = allocator.unit_bytes // self.element_size

    @property
    def capacity_bytes(self) -> int:
        """Pool bytes."""
        return self.allocator.capacity_bytes

    def _run(self, start: int, units: int) -> torch.Tensor:
        u = self._unit_elems
        return self.buffer[start * u : (start + units) * u]

    def alloc(self, nbytes: int) -> Allocation:
        """Allocate one run (see :meth:`Allocator.alloc`; same errors). It reads as zeros."""
        return self.allocator.alloc(nbytes)

    def alloc_pieces(self, pieces: Sequence[int], *, split: bool = False) -> Allocation:
        """Allocate room for ``pieces`` (see :meth:`Allocator.alloc_pieces`; same errors).

        Every extent reads as zeros. Pieces must be whole elements, so each extent's views
        (:meth:`extent_views`) are whole elements too.

        Raises:
            ValueError: a piece that is not a multiple of the element size.
        """
        if any(p % self.element_size for p in pieces):
            raise ValueError(f"pieces must be multiples of the {self.element_size}-byte dtype")
        return self.allocator.alloc_pieces(pieces, split=split)

    def free(self, allocation: Allocation) -> None:
        """Zero every extent, then return the allocation to the allocator.

        Raises:
            KeyError: double free.
        """
        a = self.allocator.get(allocation.handle)
        for e in a.extents:
            self._run(e.start, e.length).zero_()
        self.allocator.free(a)

    def view(self, allocation: Allocation) -> torch.Tensor:
        """``dtype [nbytes // element_size]`` view of an allocation's live bytes (no copy).

        Raises:
            ValueError: the allocation is split (use :meth:`extent_views`).
        """
        a = self.allocator.get(allocation.handle)
        if a.is_split:
            raise ValueError(f"allocation {a.handle} is split over {len(a.extents)} extents")
        return self.extent_views(a)[0]

    def extent_views(self, allocation: Allocation) -> list[torch.Tensor]:
        """Views (no copies) of each extent's live bytes: view ``i`` is
        ``dtype [extent_bytes[i] // element_size]``."""
        a = self.allocator.get(allocation.handle)
        u = self._unit_elems
        return [
            self.buffer[e.start * u : e.start * u + b // self.element_size]
            for e, b in zip(a.extents, a.extent_bytes, strict=True)
        ]

    def piece_views(self, allocation: Allocation) -> list[torch.Tensor]:
        """Views (no copies) of each piece, in the caller's order: view ``i`` is
        ``dtype [pieces[i] // element_size]``."""
        return [dst for dst, _, _ in self.segments(allocation, merge=False)]

    def segments(
        self, allocation: Allocation, merge: bool = True
    ) -> list[tuple[torch.Tensor, int, int]]:
        """``(pool view, first element, end element)``: where elements ``[first, end)`` of the
        caller's layout (its pieces end to end) live in the pool, in layout order.

        With ``merge``, consecutive pieces that are also adjacent in the pool form one
        segment (one copy to load them; a single run is one segment).
        """
        a = self.allocator.get(allocation.handle)
        u, es = self._unit_elems, self.element_size
        out: list[tuple[int, int, int]] = []  # (pool element, layout element, elements)
        src = 0
        for p, (i, off) in zip(a.pieces, a.piece_offsets, strict=True):
            dst, n = a.extents[i].start * u + off // es, p // es
            if merge and out and out[-1][0] + out[-1][2] == dst:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((dst, src, n))
            src += n
        return [(self.buffer[d : d + n], s, s + n) for d, s, n in out]

    def compact(
        self, pinned: Iterable[int] = (), need_units: int | None = None
    ) -> CompactionResult:
        """Plan and apply a compaction, moving bytes with it; zeroes what is vacated.

        The caller must guarantee that nothing reads the pool meanwhile (the store holds the
        engine's compute guard exclusively) and pass every allocation in use or being written
        as ``pinned``. ``need_units``: see :meth:`Allocator.plan_compaction`.
        """
        moves = self.allocator.plan_compaction(pinned, need_units)
        moved = 0
        for m in moves:
            self._move_bytes(m)
            moved += m.units * self.allocator.unit_bytes
        self.allocator.apply_moves(moves)
        if moves:
            logger.debug("compacted: %d moves, %d bytes", len(moves), moved)
        return CompactionResult(tuple(moves), moved)

    def _move_bytes(self, m: Move) -> None:
        u = self._unit_elems
        src, dst, n = m.src * u, m.dst * u, m.units * u
        shift = src - dst
        buf = self.buffer
        if abs(shift) >= n:  # disjoint: one copy, then the whole source is vacated
            buf[dst : dst + n].copy_(buf[src : src + n])
            buf[src : src + n].zero_()
            return
        if shift <= 0:
            raise ValueError(f"an overlapping move must go to a lower address, got {m}")
        if n // shift <= 16:
            # overlapping slide to lower addresses: copy front to back in chunks <= shift
            for i in range(0, n, shift):
                c = min(shift, n - i)
                buf[dst + i : dst + i + c].copy_(buf[src + i : src + i + c])
        else:
            buf[dst : dst + n].copy_(buf[src : src + n].clone())
        # zero the part of the source that the destination does not cover
        lo = max(src, dst + n)
        if lo < src + n:
            buf[lo : src + n].zero_()
