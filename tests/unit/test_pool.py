"""Allocators, the device pool and eviction orderings: table-driven tests."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from services.common.errors import PoolExhaustedError
from services.worker.allocators import ContiguousAllocator, PagedAllocator, make_allocator
from services.worker.device_pool import DevicePool
from services.worker.eviction import (
    Candidate,
    LRUPolicy,
    PredictivePolicy,
    lru_order,
    make_policy,
    predictive_order,
    prefetch_victim_limit,
)
from services.worker.pool import Extent, FragmentationError, Move, OutOfSpaceError, TooLargeError

PAGE = 64

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"


def paged(pages: int = 16) -> PagedAllocator:
    return PagedAllocator(pages, PAGE)


# ---------------------------------------------------------------------- allocator basics
@pytest.mark.parametrize(
    ("sizes", "expect_starts"),
    [
        ([64], [0]),
        ([1, 64, 65], [0, 1, 2]),  # 1 byte takes a whole page; 65 bytes take two
        ([128, 64, 192], [0, 2, 3]),
    ],
)
def test_paged_first_fit_rounds_to_pages(sizes: list[int], expect_starts: list[int]) -> None:
    al = paged()
    starts = [al.alloc(n).start for n in sizes]
    assert starts == expect_starts
    al.check_invariants()


def test_paged_reuses_first_hole_that_fits() -> None:
    al = paged(10)
    a, b, c = al.alloc(2 * PAGE), al.alloc(3 * PAGE), al.alloc(2 * PAGE)
    al.free(a)
    al.free(c)  # holes: [0,2) and [5,10)
    assert al.free_extents() == [Extent(0, 2), Extent(5, 5)]
    assert al.alloc(3 * PAGE).start == 5  # [0,2) too short
    assert al.alloc(PAGE).start == 0
    al.free(b)
    al.check_invariants()


def test_free_merges_neighbours_and_restores_pool() -> None:
    al = paged(8)
    allocs = [al.alloc(PAGE * k) for k in (1, 2, 3, 2)]
    for a in (allocs[1], allocs[3], allocs[0], allocs[2]):
        al.free(a)
        al.check_invariants()
    assert al.free_extents() == [Extent(0, 8)]
    assert al.live_bytes == 0 and al.free_units == 8
    assert bool((al.page_table == -1).all())


@pytest.mark.parametrize(
    ("setup", "request_bytes", "error"),
    [
        ([], 17 * PAGE, TooLargeError),
        ([16 * PAGE], PAGE, OutOfSpaceError),
        ([8 * PAGE, 7 * PAGE], 2 * PAGE, OutOfSpaceError),
    ],
)
def test_alloc_errors_are_typed(setup: list[int], request_bytes: int, error: type) -> None:
    al = paged()
    for n in setup:
        al.alloc(n)
    with pytest.raises(error) as info:
        al.alloc(request_bytes)
    assert isinstance(info.value, PoolExhaustedError)
    assert info.value.status_code_name == "RESOURCE_EXHAUSTED"


def test_fragmentation_error_reports_runs() -> None:
    al = paged(6)
    a = [al.alloc(PAGE) for _ in range(6)]
    al.free(a[0])
    al.free(a[2])
    al.free(a[4])
    with pytest.raises(FragmentationError) as info:
        al.alloc(2 * PAGE)
    assert (info.value.needed_units, info.value.free_units, info.value.largest_run) == (2, 3, 1)


def test_alloc_rejects_nonpositive() -> None:
    with pytest.raises(ValueError):
        paged().alloc(0)


def test_double_free_raises() -> None:
    al = paged()
    a = al.alloc(PAGE)
    al.free(a)
    with pytest.raises(KeyError):
        al.free(a)


def test_page_table_rows() -> None:
    al = paged(8)
    al.alloc(PAGE)
    b = al.alloc(3 * PAGE)
    assert al.pages_of(b.handle).tolist() == [1, 2, 3]
    assert al.page_table.tolist() == [0, 1, 1, 1, -1, -1, -1, -1]


def test_contiguous_is_exact_size_with_alignment() -> None:
    al = ContiguousAllocator(4096, alignment_bytes=256)
    a = al.alloc(1000)
    b = al.alloc(256)
    assert (a.byte_offset, a.byte_length, b.byte_offset) == (0, 1024, 1024)
    assert al.plan_compaction() == []
    assert not al.supports_compaction


def test_make_allocator() -> None:
    assert make_allocator("paged", 1000, 100).capacity_units == 10
    assert make_allocator("contiguous", 1000, 100, 8).capacity_units == 125
    with pytest.raises(ValueError):
        make_allocator("buddy", 1000)


# ---------------------------------------------------------------------- split allocations
def holes(pages: int, free: list[int]) -> PagedAllocator:
    """A paged allocator of one-page allocations with ``free`` pages freed again."""
    al = paged(pages)
    allocs = [al.alloc(PAGE) for _ in range(pages)]
    for p in free:
        al.free(allocs[p])
    return al


@pytest.mark.parametrize(
    ("free", "pieces", "extents", "extent_bytes"),
    [
        # runs [1,3) [4,5) [6,9): six one-page pieces fill them in address order
        ([1, 2, 4, 6, 7, 8], [PAGE] * 6, [(1, 2), (4, 1), (6, 3)], [128, 64, 192]),
        # a 96-byte piece skips the one-page run; the last group rounds up to whole pages
        ([1, 2, 4, 6, 7, 8], [96, 96, 96], [(1, 2), (6, 3)], [96, 192]),
        # a piece never straddles runs: 40 in the first, 3 x 40 in the second, 40 in the third
        ([0, 2, 3, 5], [40, 40, 40, 40, 40], [(0, 1), (2, 2), (5, 1)], [40, 120, 40]),
        # first fit per piece: the 32-byte piece after the second 96 goes back to the
        # one-page run the 96s skipped, so extents are in first-use order, not address order
        ([1, 2, 4, 6, 7, 8], [96, 32, 96, 32], [(1, 2), (6, 2), (4, 1)], [128, 96, 32]),
    ],
)
def test_split_alloc_spreads_over_runs_at_piece_boundaries(
    free: list[int], pieces: list[int], extents: list[tuple[int, int]], extent_bytes: list[int]
) -> None:
    al = holes(10, free)
    with pytest.raises(FragmentationError):
        al.alloc_pieces(pieces)  # no single run holds them
    assert al.placeable_bytes(pieces) >= sum(pieces)
    a = al.alloc_pieces(pieces, split=True)
    assert [(e.start, e.length) for e in a.extents] == extents
    assert list(a.extent_bytes) == extent_bytes and a.nbytes == sum(pieces)
    assert a.is_split and a.units == sum(n for _, n in extents)
    assert al.split_allocations == 1
    assert al.pages_of(a.handle).tolist() == [p for s, n in extents for p in range(s, s + n)]
    with pytest.raises(ValueError):
        _ = a.extent
    al.check_invariants()
    al.free(a)
    al.check_invariants()
    assert al.free_units == len(free)


def test_split_fails_when_pieces_do_not_fit_the_runs() -> None:
    # runs [1,3) [4,5) [6,9) = 6 pages, but four 96-byte pieces need 2 + 0 + 3 pages for 3
    al = holes(10, [1, 2, 4, 6, 7, 8])
    pieces = [96] * 4
    assert al.units_for(sum(pieces)) == 6 == al.free_units
    assert al.placeable_bytes(pieces) == 96 + 192 < sum(pieces)
    assert al.plan_split(pieces) is None
    with pytest.raises(FragmentationError):
        al.alloc_pieces(pieces, split=True)
    assert al.split_allocations == 0
    al.check_invariants()


@pytest.mark.parametrize(
    ("free", "pieces", "placeable", "units"),
    [
        ([], [PAGE], 0, 0),
        (list(range(10)), [PAGE], 10 * PAGE, 10),  # one run: everything
        (list(range(10)), [100, 28], 5 * 128, 10),  # whole laps of the layout
        ([1, 2, 4, 6, 7, 8], [PAGE], 6 * PAGE, 6),  # one-page pieces: every free page
        ([1, 2, 4, 6, 7, 8], [96], 96 + 0 + 192, 5),  # rounding at piece boundaries
        # the layout repeats over runs of 128, 64, 192 bytes: 100 28 | 28 | 100, then the
        # next 100 fits nowhere (36 + 92 bytes are left)
        ([1, 2, 4, 6, 7, 8], [100, 28], 256, 5),
    ],
)
def test_placeable_bytes(free: list[int], pieces: list[int], placeable: int, units: int) -> None:
    al = holes(10, free)
    assert al.placeable_bytes(pieces) == placeable
    assert al.placeable_units(pieces) == units


def test_contiguous_never_splits() -> None:
    al = ContiguousAllocator(1024, alignment_bytes=64)
    allocs = [al.alloc(64) for _ in range(16)]
    for i in (1, 2, 5, 6):
        al.free(allocs[i])
    with pytest.raises(FragmentationError):
        al.alloc_pieces([64] * 4, split=True)
    assert not al.supports_split and al.plan_split([64] * 4) is None
    assert al.placeable_bytes([64]) == 128 and al.split_allocations == 0


def test_alloc_pieces_rejects_bad_pieces() -> None:
    al = paged()
    for bad in ([], [64, 0], [-1]):
        with pytest.raises(ValueError):
            al.alloc_pieces(bad, split=True)


def test_compaction_moves_extents_of_split_allocations_and_never_pinned_ones() -> None:
    al = holes(12, [1, 2, 4, 6, 7, 8])
    split = al.alloc_pieces([PAGE] * 5, split=True)  # extents [1,3) [4,5) [6,8)
    assert [(e.start, e.length) for e in split.extents] == [(1, 2), (4, 1), (6, 2)]
    al.free(0)  # handle 0: page 0
    al.free(3)  # page 3
    al.free(5)  # page 5
    # pinned split allocation: none of its extents moves; the rest join around it
    pins = {split.handle}
    al.apply_moves(al.plan_compaction(pins))
    al.check_invariants()
    assert al.get(split.handle).extents == split.extents
    assert al.free_extents() == [Extent(8, 4)]
    al.free(int(al.page_table[0]))  # a hole below the split allocation
    # unpinned: its extents move down one by one, each staying whole
    moves = al.plan_compaction()
    assert {m.handle for m in moves} >= {split.handle}
    al.apply_moves(moves)
    al.check_invariants()
    moved = al.get(split.handle)
    assert [e.length for e in moved.extents] == [2, 1, 2]
    assert moved.extent_bytes == split.extent_bytes
    assert al.largest_free_run() == al.free_units  # one free run at the top


def test_split_pool_bytes_survive_compaction_and_free_zeroes_every_extent() -> None:
    pool = DevicePool(holes(12, [1, 2, 4, 6, 7, 8]), torch.float32, "cpu")
    al = pool.allocator
    pieces = [PAGE, 32, PAGE, 96, PAGE]  # 320 bytes in 5 tensors
    a = pool.alloc_pieces(pieces, split=True)
    assert a.is_split
    with pytest.raises(ValueError):
        pool.view(a)  # a split allocation has no single view
    assert [v.numel() * 4 for v in pool.extent_views(a)] == list(a.extent_bytes)
    assert [v.numel() * 4 for v in pool.piece_views(a)] == pieces
    want = torch.arange(sum(pieces) // 4, dtype=torch.float32) + 1.0
    segments = pool.segments(a)
    assert len(segments) < len(pieces)  # adjacent pieces merge into one copy
    for dst, lo, hi in segments:
        dst.copy_(want[lo:hi])
    for h in (0, 3, 5):  # free the one-page allocations below and between its extents
        pool.free(al.get(h))
    res = pool.compact()
    assert any(m.handle == a.handle for m in res.moves)
    assert torch.equal(torch.cat(pool.piece_views(al.get(a.handle))), want)
    pool.free(al.get(a.handle))
    for h in [x.handle for x in al.allocations()]:
        pool.free(al.get(h))
    assert bool((pool.buffer == 0).all())
    al.check_invariants()


# ---------------------------------------------------------------------- compaction planning
@pytest.mark.parametrize(
    ("layout", "pinned", "moves", "allocatable"),
    [
        # layout: list of (units, keep) in address order; keep=False are freed afterwards
        ([(2, False), (3, True), (1, False), (2, True)], set(), [(1, 2, 0), (3, 6, 3)], 11),
        # the pinned allocation (index 1) stays; the one after it jumps into the first hole
        ([(2, False), (3, True), (1, False), (2, True)], {1}, [(3, 6, 0)], 9),
        # pinned at both ends of a hole: the mover only slides down to the pinned one
        ([(3, True), (1, False), (2, True), (1, True)], {0, 3}, [(2, 4, 3)], 9),
        # a small adapter jumps over a pinned one into an earlier hole
        ([(1, False), (2, True), (1, True)], {1}, [(2, 3, 0)], 12),
        ([(4, True)], set(), [], 12),
    ],
)
def test_plan_compaction(
    layout: list[tuple[int, bool]],
    pinned: set[int],
    moves: list[tuple[int, int, int]],
    allocatable: int,
) -> None:
    al = paged(16)
    allocs = [al.alloc(u * PAGE) for u, _ in layout]
    for a, (_, keep) in zip(allocs, layout, strict=True):
        if not keep:
            al.free(a)
    pins = {allocs[i].handle for i in pinned}
    plan = al.plan_compaction(pins)
    assert [(m.handle, m.src, m.dst) for m in plan] == moves
    assert al.allocatable_units(pins) == allocatable
    al.apply_moves(plan)
    al.check_invariants()
    # a full compaction may also jump allocations over pinned ones: never worse
    assert al.largest_free_run() >= allocatable


def test_apply_stale_move_raises() -> None:
    al = paged(8)
    a = al.alloc(PAGE)
    with pytest.raises(ValueError):
        al.apply_moves([Move(a.handle, 3, 0, 1)])


# ---------------------------------------------------------------------- device pool
def _fill(pool: DevicePool, nbytes: int, value: float) -> tuple:
    a = pool.alloc(nbytes)
    v = pool.view(a)
    v.copy_(torch.arange(v.numel(), dtype=pool.dtype) + value)
    return a, v.clone()


def test_pool_zeroes_freed_space_and_views_alias_buffer() -> None:
    pool = DevicePool(paged(8), torch.float32, "cpu")
    a, _ = _fill(pool, 3 * PAGE, 1.0)
    assert pool.view(a).data_ptr() == pool.buffer.data_ptr()  # a view, not a copy
    pool.free(a)
    assert bool((pool.buffer == 0).all())


@pytest.mark.parametrize("units", [1, 2, 5, 40])  # shift of 1 page: chunked and staged slides
def test_compaction_preserves_bytes_and_zeroes_vacated(units: int) -> None:
    pool = DevicePool(PagedAllocator(1 + 2 * units + 1, PAGE), torch.float16, "cpu")
    gap = pool.alloc(PAGE)
    a, a_bytes = _fill(pool, units * PAGE - 2, 7.0)  # partial last page
    b, b_bytes = _fill(pool, units * PAGE, 100.0)
    pool.free(gap)
    res = pool.compact()
    assert [m.dst for m in res.moves] == [0, units]
    assert res.bytes_moved == 2 * units * PAGE
    assert torch.equal(pool.view(pool.allocator.get(a.handle)), a_bytes)
    assert torch.equal(pool.view(pool.allocator.get(b.handle)), b_bytes)
    tail = pool.buffer[2 * units * PAGE // 2 :]
    assert bool((tail == 0).all())
    pool.allocator.check_invariants()


def test_pool_rejects_unit_not_multiple_of_dtype() -> None:
    with pytest.raises(ValueError):
        DevicePool(PagedAllocator(4, 6), torch.float32, "cpu")


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_ten_thousand_cycles_leave_pool_as_it_started(kind: str) -> None:
    """10,000 alloc/free cycles with mixed sizes, split allocations and compactions around
    pinned allocations included, end at the start state."""
    al = make_allocator(kind, 64 * PAGE, PAGE, alignment_bytes=16)
    pool = DevicePool(al, torch.float32, "cpu")
    start_free = al.free_extents()
    rng = random.Random(7)
    live: list = []
    for i in range(10_000):
        if live and (rng.random() < 0.5 or al.free_units < 8):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            pieces = [4 * rng.randint(1, 2 * PAGE // 4) for _ in range(rng.randint(1, 8))]
            try:
                live.append(pool.alloc_pieces(pieces))
            except FragmentationError:
                pins = {a.handle for a in live if rng.random() < 0.3}
                if al.supports_compaction and al.allocatable_units(pins) >= al.units_for(
                    sum(pieces)
                ):
                    pool.compact(pins)
                    live = [al.get(a.handle) for a in live]
                else:
                    try:
                        live.append(pool.alloc_pieces(pieces, split=True))
                    except FragmentationError:
                        pass
            except OutOfSpaceError:
                pass
        if i % 1000 == 0:
            al.check_invariants()
    for a in live:
        pool.free(a)
    al.check_invariants()
    assert al.free_extents() == start_free
    assert al.live_bytes == 0 and len(al) == 0
    assert bool((pool.buffer == 0).all())
    if isinstance(al, PagedAllocator):
        assert bool((al.page_table == -1).all())
        assert al.split_allocations > 50
    else:
        assert al.split_allocations == 0


# ---------------------------------------------------------------------- eviction orderings
C = Candidate


@pytest.mark.parametrize(
    ("cands", "expect"),
    [
        ([C("a", 10, 3.0), C("b", 10, 1.0), C("c", 10, 2.0)], ["b", "c", "a"]),
        ([C("b", 10, 1.0), C("a", 10, 1.0)], ["a", "b"]),  # ties by id
        ([], []),
    ],
)
def test_lru_order(cands: list[Candidate], expect: list[str]) -> None:
    assert [c.adapter_id for c in lru_order(cands)] == expect


@pytest.mark.parametrize(
    ("cands", "forecast", "expect"),
    [
        # demand per byte: a 5/10, b 1/10, c 0 (absent)
        ([C("a", 10, 1.0), C("b", 10, 2.0), C("c", 10, 3.0)], {"a": 5, "b": 1}, ["c", "b", "a"]),
        # same demand, bigger adapter has lower demand per byte
        ([C("small", 10, 1.0), C("big", 100, 2.0)], {"small": 4, "big": 4}, ["big", "small"]),
        # equal score -> LRU
        ([C("x", 10, 5.0), C("y", 10, 1.0)], {}, ["y", "x"]),
    ],
)
def test_predictive_order(
    cands: list[Candidate], forecast: dict[str, float], expect: list[str]
) -> None:
    assert [c.adapter_id for c in predictive_order(cands, forecast)] == expect


def test_predictive_policy_falls_back_to_lru_without_forecast() -> None:
    p = PredictivePolicy()
    cands = [C("hot", 10, 1.0), C("cold", 10, 2.0)]
    assert [c.adapter_id for c in p.order(cands)] == ["hot", "cold"]  # LRU
    p.set_forecast({"hot": 9.0})
    assert [c.adapter_id for c in p.order(cands)] == ["hot", "cold"]  # recency leads at first
    p.weights = {"recency": 0.3, "forecast": 0.7}
    assert [c.adapter_id for c in p.order(cands)] == ["cold", "hot"]
    assert p.demand("hot") == 9.0 and p.demand("none") == 0.0


@pytest.mark.parametrize(
    ("victim", "incoming", "min_gain", "expect"),
    [
        (0.0, 0.5, 0.2, True),  # 1 - e^-0.5 = 0.39 >= 0.2
        (0.0, 0.2, 0.2, False),  # 0.18 < 0.2: a long shot does not evict anything
        (1.0, 1.2, 0.2, False),  # e^-1 - e^-1.2 = 0.07: forecasts a hair apart never trade
        (0.1, 3.0, 0.2, True),
        (2.0, 2.0, 0.0, False),  # never evict an adapter wanted as much, even with no margin
        (0.3, 0.31, 0.0, True),  # margin 0: the plain "wanted more" rule
        (5.0, 1.0, 0.0, False),
    ],
)
def test_prefetch_victim_limit(victim: float, incoming: float, min_gain: float, expect: bool):
    limit = prefetch_victim_limit(incoming, min_gain)
    assert (victim < limit) is expect
    if expect:  # the rule it implements: the swap gains more than min_gain
        assert math.exp(-victim) - math.exp(-incoming) > min_gain or min_gain == 0.0


def test_victim_and_prefetch_fit_rules() -> None:
    """The one rule the store and the simulator apply: a demand load may evict any unleased
    adapter (in the policy's order), a prefetch only those wanted less than its limit."""
    p = PredictivePolicy()
    p.weights = {"recency": 0.3, "forecast": 0.7}  # the forecast leads
    p.set_forecast({"hot": 3.0, "warm": 0.5, "cold": 0.0})
    evictable = [C("hot", 10, 1.0), C("warm", 10, 2.0), C("cold", 30, 3.0)]
    kw = {"min_gain": 0.2}
    assert p.choose_victim(evictable, demanded=True, incoming_expected=0.0, **kw) == "cold"
    assert p.choose_victim(evictable[:1], demanded=True, incoming_expected=0.0, **kw) == "hot"
    # a prefetch expecting 2 requests may displace "warm" and "cold", never "hot"
    assert p.choose_victim(evictable[:2], demanded=False, incoming_expected=2.0, **kw) == "warm"
    assert p.choose_victim(evictable[:1], demanded=False, incoming_expected=2.0, **kw) is None
    assert p.choose_victim([], demanded=True, incoming_expected=0.0, **kw) is None
    sizes = [(c.adapter_id, c.nbytes) for c in evictable]
    assert p.prefetch_fits(40, 0, sizes, incoming_expected=2.0, **kw)  # warm + cold
    assert not p.prefetch_fits(41, 0, sizes, incoming_expected=2.0, **kw)  # hot stays
    assert p.prefetch_fits(41, 1, sizes, incoming_expected=2.0, **kw)
    assert p.prefetch_fits(5, 5, [], incoming_expected=0.0, **kw)  # free space always counts
    assert not p.prefetch_fits(10, 0, sizes, incoming_expected=0.1, **kw)  # a long shot


def _disagree(p: PredictivePolicy) -> tuple[str, str]:
    """One eviction where recency picks "old" and the forecast "idle"; returns (victim,
    spared)."""
    p.set_forecast({"old": 5.0, "idle": 0.0})
    cands = [C("old", 10, 1.0), C("idle", 10, 2.0)]
    victim = p.choose_victim(cands, demanded=True, incoming_expected=0.0, min_gain=0.2)
    assert victim is not None
    return victim, ({"old", "idle"} - {victim}).pop()


def test_predictive_policy_learns_the_mix_from_both_experts_mistakes() -> None:
    """LeCaR with a counterfactual: recency leads at first; a miss on what the leader evicted
    or a hit on what the other expert would have evicted moves the weights, both ways."""
    p = PredictivePolicy()
    assert p.leader == "recency"
    # recency keeps being wrong: its victim is asked for again (a miss) ...
    victim, spared = _disagree(p)
    assert (victim, p.last_by_forecast) == ("old", False)
    p.note_miss(victim)
    assert p.leader == "recency"  # one regret is not enough
    victim, spared = _disagree(p)
    p.note_miss(victim)
    p.note_hit(spared)  # "idle" asked for: the forecast was wrong once too
    victim, _ = _disagree(p)
    p.note_miss(victim)
    victim, _ = _disagree(p)
    p.note_miss(victim)
    assert p.leader == "forecast"  # net three regrets of recency
    victim, spared = _disagree(p)
    assert (victim, spared, p.last_by_forecast) == ("idle", "old", True)
    # the forecast evicts what is asked for next: recency leads again
    victim, spared = _disagree(p)
    p.note_miss(victim)
    assert (victim, p.leader) == ("idle", "recency")
    # and a hit on what the overruled forecast would have evicted counts against it too
    victim, spared = _disagree(p)
    assert (victim, spared) == ("old", "idle")
    before = p.weights["forecast"]
    p.note_hit(spared)
    assert p.weights["forecast"] < before
    # a request settles a disagreement once; unknown adapters teach nothing
    before = dict(p.weights)
    p.note_hit(spared)
    p.note_miss("never-seen")
    assert p.weights == before
    # neither expert is ever written off
    for _ in range(200):
        victim, spared = _disagree(p)
        p.note_miss(victim)
    assert 0.0 < p.weights["recency"] < 1.0 and abs(sum(p.weights.values()) - 1.0) < 1e-12
    assert p.weights["recency"] >= 0.02 - 1e-12


def test_make_policy() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("predictive"), PredictivePolicy)
    with pytest.raises(ValueError):
        make_policy("fifo")


# ---------------------------------------------------------------------- bench helpers
def test_smollm2_rank_unit_bytes() -> None:
    from plora.bench.pool import adapter_bytes
    from services.common.types import SMOLLM2_135M

    # per layer: q 576+576, k 576+192, v 576+192, o 576+576, gate/up 576+1536, down 1536+576
    assert adapter_bytes(SMOLLM2_135M, 1, 4) == 10176 * 30 * 4 == 1_221_120
    assert adapter_bytes(SMOLLM2_135M, 8, 2) == 8 * 610_560


@pytest.mark.parametrize(
    ("nbytes", "page", "waste"),
    [(4096, 4096, 0.0), (4097, 4096, 4095 / 8192), (1, 64, 63 / 64)],
)
def test_page_waste(nbytes: int, page: int, waste: float) -> None:
    from plora.bench.pool import page_waste

    assert page_waste(nbytes, page) == pytest.approx(waste)


def test_assign_ranks_is_seeded_and_order_independent() -> None:
    from plora.bench.pool import assign_ranks

    keys = [f"G{i:04d}" for i in range(200)]
    a = assign_ranks(keys, (8, 16, 32, 64, 128), seed=0)
    assert a == assign_ranks(list(reversed(keys)), (8, 16, 32, 64, 128), seed=0)
    assert a != assign_ranks(keys, (8, 16, 32, 64, 128), seed=1)
    assert set(a.values()) == {8, 16, 32, 64, 128}


@pytest.mark.slow
def test_bench_pool_small_replay(tmp_path) -> None:  # noqa: ANN001
    import argparse
    import json

    from plora.bench import pool as bench_pool

    trace = TRACES / "alibaba_genai2026_lora_requests_nov.csv"
    if not trace.exists():
        pytest.skip(f"{trace} absent (the public traces are not beside this checkout)")
    parser = argparse.ArgumentParser()
    bench_pool.add_arguments(parser)
    out = tmp_path / "pool.json"
    args = parser.parse_args(
        [
            "--trace",
            str(trace),
            "--out",
            str(out),
            "--max-requests",
            "400",
            "--page-sweep",
            "",
            "--compaction-max-ratio",
            "0",
        ]
    )
    assert bench_pool.run(args) == 0
    res = json.loads(out.read_text())
    keys = {
        "utilization_under_pressure",
        "external_fragmentation",
        "internal_waste",
        "loads",
        "evictions",
        "compactions",
        "bytes_moved",
        "failed_allocations",
    }
    for kind in ("paged", "contiguous"):
        assert keys <= set(res[kind])
        assert res[kind]["loads"] > 0 and res[kind]["evictions"] > 0
        assert 0.5 < res[kind]["utilization_under_pressure"] <= 1.0
    assert res["paged"]["pool_bytes"] <= res["config"]["pool_bytes"]
    assert res["contiguous"]["compactions"] == 0
