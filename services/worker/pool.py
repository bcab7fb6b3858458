"""The worker's device pool: a preallocated flat buffer and the allocators that carve it up.

Two allocators share one interface (:class:`Allocator`), so the paged design and the baseline
run the same store code (ARCHITECTURE.md "Baseline policy"):

``paged`` (:class:`PagedAllocator`)
    The Predictive-LoRA design (arXiv 2512.20210, section on the paged adapter pool): the pool
    is ``num_pages`` fixed-size pages; an adapter occupies a *run* of consecutive pages, so its
    A/B tensors are plain views of the flat buffer and the engine computes straight from pool
    memory. Allocation is first-fit over free runs. When no run fits but enough pages are free,
    :meth:`Allocator.plan_compaction` slides movable adapters to lower addresses (never one in
    use: the caller passes them as ``pinned``). The page table is a tensor: ``page_table[p]`` is
    the handle owning page ``p`` or ``-1``.
``contiguous`` (:class:`ContiguousAllocator`)
    The S-LoRA-style baseline: exact-size first-fit over bytes (rounded only to a small
    alignment, as ``cudaMalloc`` does), no compaction, so holes left by evictions fragment it.

Both keep their free space as a sorted list of extents (``O(#extents)`` per call, independent of
the number of pages), raise typed errors and never return ``None``. :class:`DevicePool` owns the
tensor: it zeroes freed space (so no adapter can ever read another's bytes), copies adapters in,
and performs compaction moves with overlap-safe copies.

Units: allocators count *units* (pages for ``paged``, alignment quanta for ``contiguous``);
every public byte figure is in bytes.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
    """One allocated run.

    Attributes:
        handle: Allocator-unique id (never reused by the same allocator).
        start: First unit.
        units: Units in the run.
        nbytes: Bytes the caller asked for (live bytes; ``<= units * unit_bytes``).
        unit_bytes: Bytes per unit.
    """

    handle: int
    start: int
    units: int
    nbytes: int
    unit_bytes: int

    @property
    def byte_offset(self) -> int:
        """Offset of the run in the pool, bytes."""
        return self.start * self.unit_bytes

    @property
    def byte_length(self) -> int:
        """Allocated bytes (whole units)."""
        return self.units * self.unit_bytes

    @property
    def extent(self) -> Extent:
        """The run as an :class:`Extent`."""
        return Extent(self.start, self.units)


@dataclass(frozen=True)
class Move:
    """One compaction step: move allocation ``handle`` from unit ``src`` to unit ``dst``."""

    handle: int
    src: int
    dst: int
    units: int


class Allocator:
    """First-fit allocation of unit runs over a fixed capacity.

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
        self._alloc_starts: list[int] = []  # sorted starts of allocations
        self._by_start: dict[int, int] = {}  # start -> handle
        self._next_handle = 0
        self._free_units = capacity_units
        self._live_bytes = 0

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
        """Current allocations in address order."""
        return [self._allocs[self._by_start[s]] for s in self._alloc_starts]

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
        """Allocate the first free run that holds ``nbytes`` bytes.

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
                return self._take(s, units, nbytes)
        largest = self.largest_free_run()
        raise FragmentationError(
            f"{units} units needed, {self._free_units} free but the longest free run is {largest}",
            units,
            self._free_units,
            largest,
        )

    def _take(self, start: int, units: int, nbytes: int) -> Allocation:
        length = self._free_len.pop(start)
        i = bisect.bisect_left(self._free_starts, start)
        del self._free_starts[i]
        if length > units:
            rest = start + units
            self._free_len[rest] = length - units
            self._free_starts.insert(i, rest)
        handle = self._next_handle
        self._next_handle += 1
        a = Allocation(handle, start, units, nbytes, self.unit_bytes)
        self._register(a)
        self._free_units -= units
        self._live_bytes += nbytes
        return a

    def _register(self, a: Allocation) -> None:
        self._allocs[a.handle] = a
        bisect.insort(self._alloc_starts, a.start)
        self._by_start[a.start] = a.handle
        self._mark(a.start, a.units, a.handle)

    def _unregister(self, a: Allocation) -> None:
        del self._allocs[a.handle]
        i = bisect.bisect_left(self._alloc_starts, a.start)
        del self._alloc_starts[i]
        del self._by_start[a.start]
        self._mark(a.start, a.units, -1)

    def _mark(self, start: int, units: int, handle: int) -> None:
        """Hook for page tables (the paged allocator records owners per page)."""

    def free(self, allocation: Allocation | int) -> None:
        """Return a run to the free list (merging with free neighbours).

        Raises:
            KeyError: the allocation is not live (double free).
        """
        handle = allocation if isinstance(allocation, int) else allocation.handle
        a = self._allocs[handle]
        self._unregister(a)
        self._free_units += a.units
        self._live_bytes -= a.nbytes
        self._insert_free(a.start, a.units)

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

        Pure: the allocator does not change until :meth:`apply_moves`. Allocations in
        ``pinned`` never move; every move goes to a lower address. Moves are to be applied in
        the order given (each is valid after the previous ones); a move may overlap its own
        source (a slide), never another allocation.

        With ``need_units``, the cheapest of these that yields one free run of that length:

        1. *relocation*: a window of ``need_units`` starting or ending at a free run, whose
           (unpinned) allocations move out into free runs elsewhere (best fit, largest
           first); the window with the fewest allocated units that can be cleared wins;
        2. *slide*: the window of consecutive free runs and movable allocations gathering
           enough free units with the fewest allocated units inside; its allocations slide
           down, joining its free runs at the window's end.

        Without ``need_units``, or when neither works: a full compaction (each allocation, in
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
            if a is None or a.start != m.src or a.units != m.units:
                raise ValueError(f"stale compaction move {m}")
            self._unregister(a)
            self._insert_free(a.start, a.units)
            # take [dst, dst + units) out of the free list
            s = self._free_extent_containing(m.dst, m.units)
            length = self._free_len.pop(s)
            idx = bisect.bisect_left(self._free_starts, s)
            del self._free_starts[idx]
            if m.dst > s:
                self._free_starts.insert(idx, s)
                self._free_len[s] = m.dst - s
                idx += 1
            tail = s + length - (m.dst + m.units)
            if tail > 0:
                self._free_starts.insert(idx, m.dst + m.units)
                self._free_len[m.dst + m.units] = tail
            self._register(Allocation(a.handle, m.dst, a.units, a.nbytes, a.unit_bytes))

    def _free_extent_containing(self, start: int, units: int) -> int:
        i = bisect.bisect_right(self._free_starts, start) - 1
        if i < 0:
            raise ValueError(f"no free extent holds [{start}, {start + units})")
        s = self._free_starts[i]
        if s + self._free_len[s] < start + units:
            raise ValueError(f"no free extent holds [{start}, {start + units})")
        return s

    def allocatable_units(self, pinned: Iterable[int] = ()) -> int:
        """Longest run this allocator could serve now without evicting anything.

        For an allocator with compaction this is the longest free run after compacting
        around ``pinned``; for the baseline it is the longest free run.
        """
        return self.largest_free_run()

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert the free list and allocations tile the pool exactly (tests call this).

        Raises:
            AssertionError: the bookkeeping is inconsistent.
        """
        spans = [(e.start, e.length, -1) for e in self.free_extents()]
        spans += [(a.start, a.units, a.handle) for a in self._allocs.values()]
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
        assert self._alloc_starts == sorted(a.start for a in self._allocs.values())


class PagedAllocator(Allocator):
    """Fixed-size pages, first-fit over free runs, compaction around pinned allocations.

    Args:
        num_pages: Pages in the pool.
        page_bytes: Bytes per page.

    Attributes:
        page_table: ``int64 [num_pages]`` (CPU): owning handle of each page, ``-1`` if free.
    """

    kind = "paged"
    supports_compaction = True

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
        """``int64 [units]`` page indices of an allocation, in order (its page table row).

        Raises:
            KeyError: no such live allocation.
        """
        a = self._allocs[handle]
        return torch.arange(a.start, a.start + a.units, dtype=torch.int64)

    def _simulate(self, pinned: set[int]) -> tuple[list[Move], list[tuple[int, int]]]:
        """First-fit compaction around pinned runs; returns the moves and the final free runs."""
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

        for a in self.allocations():
            if a.handle in pinned:
                continue
            # only runs below the allocation can improve on its current place
            if not free or free[0][0] > a.start:
                continue
            release(a.start, a.units)
            dst = next(s for s, ln in free if ln >= a.units)  # its own run always fits
            take(dst, a.units)
            if dst != a.start:
                moves.append(Move(a.handle, a.start, dst, a.units))
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
        """Clear the cheapest clearable window of ``need`` units by moving its allocations out."""
        cap = self.capacity_units
        windows = set()
        for e in self.free_extents():
            if e.start + need <= cap:
                windows.add(e.start)
            if e.end - need >= 0:
                windows.add(e.end - need)
        scored: list[tuple[int, int, list[Allocation]]] = []
        for ws in windows:
            we = ws + need
            i = bisect.bisect_right(self._alloc_starts, ws) - 1
            if (
                i < 0
                or self._alloc_starts[i] + self._allocs[self._by_start[self._alloc_starts[i]]].units
                <= ws
            ):
                i += 1
            inside: list[Allocation] = []
            ok = True
            while i < len(self._alloc_starts) and self._alloc_starts[i] < we:
                a = self._allocs[self._by_start[self._alloc_starts[i]]]
                if a.handle in pinned:
                    ok = False
                    break
                inside.append(a)
                i += 1
            if ok:
                scored.append((sum(a.units for a in inside), ws, inside))
        scored.sort(key=lambda x: (x[0], x[1]))
        for _, ws, inside in scored:
            lo = min([ws] + [a.start for a in inside])
            hi = max([ws + need] + [a.start + a.units for a in inside])
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
            for a in sorted(inside, key=lambda a: (-a.units, a.start)):
                fits = [h for h in holes if h[1] >= a.units]
                if not fits:
                    break
                h = min(fits, key=lambda h: (h[1], h[0]))  # best fit
                moves.append(Move(a.handle, a.start, h[0], a.units))
                h[0] += a.units
                h[1] -= a.units
            else:
                return moves
        return None

    def _cheapest_window(self, pinned: set[int], need: int) -> list[Move] | None:
        """Slide plan of the cheapest window gathering ``need`` free units (None if none)."""
        # spans in address order: (start, length, handle or -1 for free)
        spans = [(e.start, e.length, -1) for e in self.free_extents()]
        spans += [(a.start, a.units, a.handle) for a in self._allocs.values()]
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
        """Free units of the richest stretch between pinned allocations: sliding that
        stretch's movable allocations together (the slide plan) joins all of them."""
        pins = set(pinned)
        if self._free_units == 0:
            return 0
        if len(self._free_starts) <= 1:
            return self.largest_free_run()
        best = seg = 0
        fi = ai = 0
        fs, as_ = self._free_starts, self._alloc_starts
        # merge free runs and allocations in address order
        while fi < len(fs) or ai < len(as_):
            if ai >= len(as_) or (fi < len(fs) and fs[fi] < as_[ai]):
                seg += self._free_len[fs[fi]]
                fi += 1
            else:
                if self._by_start[as_[ai]] in pins:
                    best, seg = max(best, seg), 0
                ai += 1
        return max(best, seg)

    def check_invariants(self) -> None:
        super().check_invariants()
        expect = torch.full((self.capacity_units,), -1, dtype=torch.int64)
        for a in self._allocs.values():
            expect[a.start : a.start + a.units] = a.handle
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
        """Allocate (see :meth:`Allocator.alloc`; same errors). The run reads as zeros."""
        return self.allocator.alloc(nbytes)

    def free(self, allocation: Allocation) -> None:
        """Zero the run, then return it to the allocator.

        Raises:
            KeyError: double free.
        """
        a = self.allocator.get(allocation.handle)
        self._run(a.start, a.units).zero_()
        self.allocator.free(a)

    def view(self, allocation: Allocation) -> torch.Tensor:
        """``dtype [nbytes // element_size]`` view of an allocation's live bytes (no copy)."""
        a = self.allocator.get(allocation.handle)
        n = a.nbytes // self.element_size
        start = a.start * self._unit_elems
        return self.buffer[start : start + n]

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
