"""The two allocators of the device pool, and the decisions both the store and the simulator
take on them: :class:`PagedAllocator` (fixed-size pages, first fit, compaction and split
allocations: Predictive-LoRA, arXiv 2512.20210; S-LoRA's unified paging, arXiv 2311.03285),
:class:`ContiguousAllocator` (exact-size extents without compaction: the S-LoRA-style
baseline), :func:`external_fragmentation`, :func:`compact_or_split` and :func:`make_allocator`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Sequence

import torch

from services.worker.pool import (
    ALLOCATOR_KINDS,
    DEFAULT_ALIGNMENT_BYTES,
    DEFAULT_PAGE_BYTES,
    Allocation,
    Allocator,
    Extent,
    FragmentationError,
    Move,
    SplitPlan,
    _FirstFit,
)

logger = logging.getLogger("services.worker.pool")


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
    """``1 - largest allocatable extent / free units`` (external fragmentation), in [0, 1].

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
