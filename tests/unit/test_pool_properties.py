"""Property tests: random operation sequences on the device pool and on the whole store.

Checked after every operation: the allocator tiles the pool exactly (no page owned twice,
accounting adds up), every resident adapter's bytes are intact (compaction included, and split
allocations, whose extents move one by one), nothing in use was moved or evicted, and every
byte outside live runs is zero.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from services.worker.adapter_api import AdapterRef
from services.worker.allocators import make_allocator
from services.worker.device_pool import DevicePool
from services.worker.pool import Allocation, FragmentationError, OutOfSpaceError
from services.worker.store import AdapterStore, StoreConfig, StoreLease

try:
    from tests.unit.test_store import PAGE, UNIT, Source, expected_flat
except ImportError:  # rootdir not on sys.path (plain `pytest` without package __init__ files)
    from test_store import PAGE, UNIT, Source, expected_flat  # type: ignore[no-redef]

# Derandomized: the same examples every run, so the coverage guard below
# (evictions, compactions, failed loads and prefetches were all exercised) cannot flake.
SETTINGS = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------------- pool level
class PoolMachine(RuleBasedStateMachine):
    """Random alloc / split alloc / free / pin / compact on a DevicePool with real bytes."""

    allocs = Bundle("allocs")

    kind = "paged"

    @initialize()
    def setup(self) -> None:
        self.pool = DevicePool(make_allocator(self.kind, 32 * 64, 64, 16), torch.float32, "cpu")
        self.data: dict[int, torch.Tensor] = {}
        self.pinned: dict[int, tuple] = {}  # handle -> extents when pinned
        self.counter = 0
        self.splits = 0

    def _fill(self, a: Allocation) -> int:
        self.counter += 1
        want = torch.arange(a.nbytes // 4, dtype=torch.float32) * 0.5 + self.counter
        for dst, lo, hi in self.pool.segments(a):
            dst.copy_(want[lo:hi])
        self.data[a.handle] = want
        return a.handle

    @rule(target=allocs, nbytes=st.integers(1, 10 * 64).map(lambda n: n - n % 4 or 4))
    def alloc(self, nbytes: int) -> int:
        try:
            a = self.pool.alloc(nbytes)
        except (OutOfSpaceError, FragmentationError):
            return -1
        assert not a.is_split
        return self._fill(a)

    @rule(target=allocs, pieces=st.lists(st.integers(4, 32).map(lambda n: 4 * n), max_size=8))
    def alloc_split(self, pieces: list[int]) -> int:
        """A split-allowed allocation succeeds exactly when the allocator says it can place it;
        every piece stays whole (one view)."""
        if not pieces:
            return -1
        al = self.pool.allocator
        placeable = al.placeable_bytes(pieces)
        try:
            a = self.pool.alloc_pieces(pieces, split=True)
        except (OutOfSpaceError, FragmentationError):
            assert placeable < sum(pieces), "refused an allocation it said it could place"
            return -1
        assert placeable >= sum(pieces), "placed an allocation it said it could not"
        assert al.supports_split or not a.is_split
        assert [v.numel() * 4 for v in self.pool.piece_views(a)] == pieces
        self.splits += a.is_split
        return self._fill(a)

    @rule(handle=consumes(allocs))
    def free(self, handle: int) -> None:
        if handle < 0 or handle in self.pinned:
            return
        self.pool.free(self.pool.allocator.get(handle))
        del self.data[handle]

    @rule(handle=allocs)
    def toggle_pin(self, handle: int) -> None:
        if handle < 0 or handle not in self.data:
            return
        if handle in self.pinned:
            del self.pinned[handle]
        else:
            self.pinned[handle] = self.pool.allocator.get(handle).extents

    @rule(need=st.none() | st.integers(1, 12))
    def compact(self, need: int | None) -> None:
        al = self.pool.allocator
        before = al.allocatable_units(self.pinned)
        res = self.pool.compact(self.pinned, need)
        if not al.supports_compaction:
            assert res.moves == ()
        elif need is not None and before >= need:
            assert al.largest_free_run() >= need
        elif need is None and not self.pinned:  # a full compaction packs everything down
            assert al.largest_free_run() == al.free_units

    @invariant()
    def consistent(self) -> None:
        al = self.pool.allocator
        al.check_invariants()
        mask = torch.ones(self.pool.buffer.numel(), dtype=torch.bool)
        for h, want in self.data.items():
            a = al.get(h)
            got = torch.cat(self.pool.piece_views(a))
            assert torch.equal(got, want), f"bytes of {h} changed"
            u = al.unit_bytes // 4  # float32 elements per unit
            for e in a.extents:
                mask[e.start * u : e.end * u] = False
        for h, extents in self.pinned.items():
            assert al.get(h).extents == extents, f"pinned {h} moved"
        assert bool((self.pool.buffer[mask] == 0).all()), "free space not zero"

    def teardown(self) -> None:
        if hasattr(self, "pool") and self.kind == "paged":
            POOL_SPLITS.append(self.splits)


class ContiguousPoolMachine(PoolMachine):
    """The same rules on the baseline (which never splits or compacts)."""

    kind = "contiguous"


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(SETTINGS, max_examples=30, stateful_step_count=50)
TestContiguousPoolMachine = ContiguousPoolMachine.TestCase
TestContiguousPoolMachine.settings = settings(SETTINGS, max_examples=15, stateful_step_count=50)
POOL_SPLITS: list[int] = []  # split allocations of every finished pool run


def test_pool_machine_exercised_splits() -> None:
    """The pool runs above must have made split allocations (else they prove little there)."""
    if not POOL_SPLITS:
        pytest.skip("run together with TestPoolMachine")
    assert sum(POOL_SPLITS) > 0


# ---------------------------------------------------------------------- store level
NAMES = [f"a{i}" for i in range(6)]
TOTALS: list = []  # stats of every finished run (for the coverage check below)


def rank_of(name: str, version: int) -> int:
    return 1 + (int(name[1:]) * 3 + version) % 5  # 1..5 rank units: 2..10 pages


def view_ptrs(lease: StoreLease) -> dict:
    """Where each of the lease's A and B views starts in memory."""
    return {k: (m.lora_a.data_ptr(), m.lora_b.data_ptr()) for k, m in lease.weights().items()}


def settle(store: AdapterStore, leases: list[StoreLease]) -> None:
    for lease in leases:
        assert lease.wait(5), "load did not finish"
    deadline = time.monotonic() + 5
    while store.stats().loading_adapters:
        assert time.monotonic() < deadline, "background loads did not settle"
        time.sleep(0.002)


class StoreMachine(RuleBasedStateMachine):
    """Random acquire / release / cancel / unload / re-register / prefetch on a real store."""

    @initialize(ratio=st.sampled_from([float("inf"), 0.0]))
    def setup(self, ratio: float) -> None:
        """``ratio`` 0 never compacts while something can be split or evicted, so the random
        runs reach split allocations; ``inf`` always compacts when pins allow it."""
        self.src = Source()
        self.store = AdapterStore(
            StoreConfig(
                allocator="paged",
                eviction="predictive",
                pool_bytes=24 * PAGE,
                page_bytes=PAGE,
                host_cache_bytes=40 * PAGE,
                load_wait_timeout_s=0.02,
                compaction_max_ratio=ratio,
                # one loader: with two, which load allocates first is a race, so the random
                # runs' allocation order (and whether they ever compact) depended on timing
                loader_threads=1,
            ),
            self.src,
        )
        self.version = dict.fromkeys(NAMES, 1)
        self.max_extents = 0
        # lease, data_ptr of every A and B view at acquire
        self.held: list[tuple[StoreLease, dict]] = []

    def ref(self, name: str, version: int | None = None) -> AdapterRef:
        v = self.version[name] if version is None else version
        r = rank_of(name, v)
        return AdapterRef(name, v, f"rank:{r}", r * UNIT)

    def teardown(self) -> None:
        TOTALS.append((self.store.stats(), self.max_extents))
        self.store.close()

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        lease = self.store.acquire(self.ref(name))
        settle(self.store, [lease])
        if lease.error() is None:
            self.held.append((lease, view_ptrs(lease)))
        else:
            lease.release()

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.held:
            i = data.draw(st.integers(0, len(self.held) - 1))
            self.held.pop(i)[0].release()

    @rule(name=st.sampled_from(NAMES))
    def cancel(self, name: str) -> None:
        """A request that gives up before its adapter is ready."""
        self.store.acquire(self.ref(name)).release()
        settle(self.store, [])

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        self.store.unload(name)
        self.version[name] += 1  # a re-registration after a delete gets a new version
        settle(self.store, [])

    @rule(name=st.sampled_from(NAMES))
    def reregister(self, name: str) -> None:
        self.version[name] += 1
        lease = self.store.acquire(self.ref(name))
        settle(self.store, [lease])
        lease.release()

    @rule(names=st.lists(st.sampled_from(NAMES), max_size=3, unique=True), x=st.floats(0, 5))
    def prefetch(self, names: list[str], x: float) -> None:
        self.store.prefetch([(self.ref(n), x) for n in names])
        settle(self.store, [])

    @rule(weights=st.dictionaries(st.sampled_from(NAMES), st.floats(0, 10), max_size=6))
    def forecast(self, weights: dict[str, float]) -> None:
        self.store.set_forecast(weights)

    @invariant()
    def consistent(self) -> None:
        s = self.store
        pool = s.pool
        al = pool.allocator
        al.check_invariants()
        elem = PAGE // 4
        mask = torch.ones(pool.buffer.numel(), dtype=torch.bool)
        live = 0
        seen_pages: set[int] = set()
        for r in s.resident_adapters():
            assert sum(u for _, u, _ in r.extents) == r.pages and r.first_page == r.extents[0][0]
            got = torch.cat(pool.piece_views(al.get(r.handle)))  # the tensors, in layout order
            assert torch.equal(
                got, expected_flat(r.adapter_id, rank_of(r.adapter_id, r.version), r.version)
            ), f"{r.adapter_id} v{r.version} bytes changed"
            for p, u, _ in r.extents:
                pages = set(range(p, p + u))
                assert not pages & seen_pages, "two adapters share a page"
                seen_pages |= pages
                mask[p * elem : (p + u) * elem] = False
            live += r.nbytes
            self.max_extents = max(self.max_extents, len(r.extents))
        for lease, ptrs in self.held:
            assert lease.ready() and lease.error() is None
            assert view_ptrs(lease) == ptrs, "an adapter in use was moved"
            want = expected_flat(
                lease.ref.adapter_id,
                rank_of(lease.ref.adapter_id, lease.ref.version),
                lease.ref.version,
            )
            assert torch.equal(lease.flat(), want), "an adapter in use changed"
            views = [t for m in lease.weights().values() for t in (m.lora_a, m.lora_b)]
            starts = [(t.data_ptr() - pool.buffer.data_ptr()) // 4 for t in views]
            if mask[starts[0]]:  # superseded but still held: not in resident_adapters
                for start, t in zip(starts, views, strict=True):
                    mask[start : start + t.numel()] = False
                live += sum(t.numel() for t in views) * 4
        st_ = s.stats()
        assert st_.live_bytes == live == al.live_bytes
        assert st_.pages_used + st_.pages_free == st_.pages_total
        assert bool((pool.buffer[mask] == 0).all()), "free pages not zeroed"


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = SETTINGS


def test_store_machine_exercised_evictions_and_compactions() -> None:
    """The random runs above must have hit the interesting paths (else they prove little)."""
    if not TOTALS:
        pytest.skip("run together with TestStoreMachine")
    stats = [t for t, _ in TOTALS]
    assert sum(sum(t.evictions_by_reason.values()) for t in stats) > 0
    assert sum(t.compactions for t in stats) > 0
    assert sum(t.split_allocations for t in stats) > 0
    assert max(m for _, m in TOTALS) > 1, "no split adapter was ever checked while resident"
    assert sum(t.failed_loads for t in stats) > 0
    assert sum(t.prefetches_issued for t in stats) > 0


# ---------------------------------------------------------------------- long run
@pytest.mark.parametrize(
    ("allocator", "ratio"),
    [("paged", float("inf")), ("paged", 0.0), ("contiguous", float("inf"))],
    ids=["paged", "paged-split", "contiguous"],
)
def test_ten_thousand_store_cycles_leave_pool_as_it_started(allocator: str, ratio: float) -> None:
    """10,000 acquire/release cycles (loads, evictions, compactions and, with ``ratio`` 0,
    split allocations) while one other adapter stays leased, then unload: the pool is as new."""
    s = AdapterStore(
        StoreConfig(
            allocator=allocator,
            pool_bytes=24 * PAGE,
            page_bytes=PAGE,
            host_cache_bytes=64 * PAGE,
            alignment_bytes=64,
            loader_threads=1,
            compaction_max_ratio=ratio,
        ),
        Source(),
    )
    al = s.pool.allocator
    start = al.free_extents()
    rng = random.Random(3)
    names = [f"c{i}" for i in range(12)]
    held: StoreLease | None = None
    with s:
        for _ in range(10_000):
            n = rng.choice(names)
            r = 1 + int(n[1:]) % 4
            lease = s.acquire(AdapterRef(n, 1, f"rank:{r}", r * UNIT))
            assert lease.wait(5) and lease.error() is None
            if rng.random() < 0.2:  # keep it leased (pinned) for a while
                if held is not None:
                    held.release()
                held = lease
            else:
                lease.release()
        if held is not None:
            held.release()
        st_ = s.stats()
        assert sum(st_.evictions_by_reason.values()) > 1000
        if allocator == "paged" and ratio == float("inf"):
            assert st_.compactions > 0
        if ratio == 0.0:
            assert st_.split_allocations > 100
        for n in names:
            s.unload(n)
        al.check_invariants()
        assert al.free_extents() == start and al.live_bytes == 0 and len(al) == 0
        assert bool((s.pool.buffer == 0).all())
        if allocator == "paged":
            assert bool((al.page_table == -1).all())
        else:
            assert st_.split_allocations == 0 and st_.compactions == 0
