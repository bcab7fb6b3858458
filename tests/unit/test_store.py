"""AdapterStore: tiers, leases, versions, prefetch, eviction, compaction, stats, concurrency.

Adapters here are tiny (2 layers x q/v, 16 wide: 512 bytes per rank unit in fp32) so pools of
a few KiB exercise every path in milliseconds; the loader builds real ``LoRAWeights`` whose
values are a deterministic function of (adapter id, version), so integrity checks are exact.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest
import torch

from services.common.errors import (
    AdapterNotFoundError,
    ConfigError,
    InvalidAdapterError,
    PoolExhaustedError,
)
from services.common.lifecycle import BACKGROUND_NICE
from services.common.types import LoRAModuleWeights, LoRAWeights
from services.worker import store_loading
from services.worker.adapter_api import AdapterProvider, AdapterRef
from services.worker.store import (
    AdapterStore,
    StoreConfig,
    StoreEvent,
    module_views,
    pack_weights,
)

PAGE = 256
UNIT = 512  # bytes per rank unit of the tiny adapters in fp32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_weights(adapter_id: str, version: int, rank: int) -> LoRAWeights:
    seed = (sum(map(ord, adapter_id)) * 1009 + version) % (2**31)
    g = torch.Generator().manual_seed(seed)
    mods = {
        (layer, p): LoRAModuleWeights(
            torch.randn(rank, 16, generator=g), torch.randn(16, rank, generator=g), 2.0 / rank
        )
        for layer in range(2)
        for p in ("q_proj", "v_proj")
    }
    return LoRAWeights(adapter_id, version, mods, alpha=2.0)


class Source:
    """Source tier for tests: rank from ``ref.source`` ("rank:N"); counts calls; can gate."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate: threading.Event | None = None
        self.gates: dict[str, threading.Event] = {}  # one adapter's reads held
        self.fail: dict[str, Exception] = {}

    def __call__(self, ref: AdapterRef) -> LoRAWeights:
        self.calls.append(ref.adapter_id)
        if self.gate is not None:
            self.gate.wait(5)
        if ref.adapter_id in self.gates:
            self.gates[ref.adapter_id].wait(5)
        if ref.adapter_id in self.fail:
            raise self.fail[ref.adapter_id]
        return make_weights(ref.adapter_id, ref.version, int(ref.source.split(":")[1]))


def ref(name: str, rank: int = 2, version: int = 1) -> AdapterRef:
    return AdapterRef(name, version, f"rank:{rank}", rank * UNIT)


def expected_flat(name: str, rank: int, version: int = 1) -> torch.Tensor:
    return pack_weights(make_weights(name, version, rank), torch.float32).flat


def store(pages: int = 16, device: str = "cpu", **kw: object) -> tuple[AdapterStore, Source]:
    src = Source()
    cfg = StoreConfig(
        pool_bytes=pages * PAGE,
        page_bytes=PAGE,
        host_cache_bytes=kw.pop("host_cache_bytes", 64 * PAGE),  # type: ignore[arg-type]
        device=device,
        load_wait_timeout_s=kw.pop("load_wait_timeout_s", 0.3),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    return AdapterStore(cfg, src), src


def ready(lease, timeout: float = 5.0):  # noqa: ANN001, ANN201
    assert lease.wait(timeout), "load did not finish"
    return lease


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw",
    [
        {"allocator": "buddy"},
        {"eviction": "fifo"},
        {"dtype": "int8"},
        {"pool_bytes": 1024, "host_cache_bytes": 512},
        {"page_bytes": 6},
        {"load_wait_timeout_s": -1},
        {"loader_threads": 0},
        {"prefetch_min_gain": 1.0},
        {"prefetch_min_gain": -0.1},
        {"pool_bytes": 10, "page_bytes": 256},
    ],
)
def test_config_rejects(kw: dict) -> None:
    with pytest.raises(ConfigError):
        StoreConfig(**kw)


def test_cuda_without_cuda_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError):
        AdapterStore(StoreConfig(device="cuda"), Source())


def test_pack_and_views_roundtrip() -> None:
    w = make_weights("a", 1, 3)
    p = pack_weights(w, torch.float32)
    assert p.nbytes == 3 * UNIT == w.nbytes
    views = module_views(p.flat, p.slots)
    for key, m in w.modules.items():
        assert torch.equal(views[key].lora_a, m.lora_a)
        assert torch.equal(views[key].lora_b, m.lora_b)
        assert views[key].scaling == m.scaling


# ---------------------------------------------------------------------- leases and tiers
@pytest.mark.parametrize("device", DEVICES)
def test_cold_then_warm_lease_serves_pool_views(device: str) -> None:
    s, src = store(device=device)
    with s:
        provider: AdapterProvider = s  # the engine-facing contract (checked by mypy)
        assert provider.compute_guard() is not None
        lease = ready(s.acquire(ref("a", 3)))
        assert lease.cold and lease.error() is None and lease.wait_seconds >= 0
        w = lease.weights()
        base = s.pool.buffer
        lo, hi = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
        for m in w.values():  # views of pool memory, not copies
            assert lo <= m.lora_a.data_ptr() < hi and lo <= m.lora_b.data_ptr() < hi
        assert torch.equal(lease.flat().cpu(), expected_flat("a", 3))
        warm = s.acquire(ref("a", 3))
        assert warm.ready() and not warm.cold and warm.wait_seconds == 0.0
        lease.release()
        lease.release()  # idempotent
        warm.release()
        with pytest.raises(RuntimeError):
            warm.weights()
        st = s.stats()
        assert (st.cold_starts, st.device_hits, st.loads_by_tier["source"]) == (1, 1, 1)
        assert src.calls == ["a"]


def test_reload_after_eviction_comes_from_host_tier() -> None:
    s, src = store(pages=8)
    with s:
        ready(s.acquire(ref("a", 4))).release()  # 8 pages: the whole pool
        ready(s.acquire(ref("b", 4))).release()  # evicts a
        lease = ready(s.acquire(ref("a", 4)))  # back from the host cache
        assert torch.equal(lease.flat(), expected_flat("a", 4))
        lease.release()
        st = s.stats()
        assert st.loads_by_tier == {"source": 2, "host": 1}
        assert st.evictions_by_reason == {"demand": 2}
        assert src.calls == ["a", "b"]


def test_freed_pages_are_zeroed() -> None:
    s, _ = store(pages=8)
    with s:
        ready(s.acquire(ref("a", 4))).release()
        ready(s.acquire(ref("b", 1))).release()  # evicts a; b's 2 pages are rewritten
        assert [r.adapter_id for r in s.resident_adapters()] == ["b"]
        assert bool((s.pool.buffer[2 * PAGE // 4 :] == 0).all())


def test_adapter_bigger_than_pool() -> None:
    s, src = store(pages=4)
    with s:
        with pytest.raises(PoolExhaustedError):
            s.acquire(ref("huge", 8))  # declared size > pool: refused up front
        lease = ready(s.acquire(AdapterRef("huge2", 1, "rank:8", 0)))  # size unknown
        assert isinstance(lease.error(), PoolExhaustedError)
        with pytest.raises(PoolExhaustedError):
            lease.weights()
        assert s.stats().failed_loads == 1


def test_loader_errors_fail_only_that_lease() -> None:
    s, src = store()
    src.fail["bad"] = InvalidAdapterError("bad adapter")
    src.fail["gone"] = FileNotFoundError("no such dir")
    with s:
        bad, gone, good = s.acquire(ref("bad")), s.acquire(ref("gone")), s.acquire(ref("ok"))
        for lease in (bad, gone, good):
            ready(lease)
        assert isinstance(bad.error(), InvalidAdapterError)
        assert isinstance(gone.error(), AdapterNotFoundError)
        assert good.error() is None and len(good.weights()) == 4


def test_sha_mismatch_is_refused() -> None:
    s, _ = store()
    with s:
        r = AdapterRef("a", 1, "rank:2", 2 * UNIT, sha256="f" * 64)

        def loader(x: AdapterRef) -> LoRAWeights:
            w = make_weights("a", 1, 2)
            w.sha256 = "0" * 64
            return w

        s._loader = loader
        assert isinstance(ready(s.acquire(r)).error(), InvalidAdapterError)


# ---------------------------------------------------------------------- versions and unload
def test_new_version_drops_old_from_every_tier() -> None:
    s, src = store()
    with s:
        old = ready(s.acquire(ref("a", 2, version=1)))
        new = ready(s.acquire(ref("a", 2, version=2)))
        assert torch.equal(new.flat(), expected_flat("a", 2, version=2))
        assert not torch.equal(new.flat(), expected_flat("a", 2, version=1))
        # the old copy stays intact for its holder until released, then is freed
        assert torch.equal(old.flat(), expected_flat("a", 2, version=1))
        used = s.stats().pages_used
        old.release()
        assert s.stats().pages_used == used - 4
        with pytest.raises(AdapterNotFoundError):
            s.acquire(ref("a", 2, version=1))
        new.release()
        # evict v2 from the device, then reload: must come from source or host as v2
        ready(s.acquire(ref("b", 8))).release()
        again = ready(s.acquire(ref("a", 2, version=2)))
        assert torch.equal(again.flat(), expected_flat("a", 2, version=2))
        assert s.stats().evictions_by_reason.get("superseded") == 1


def test_unload_drops_all_tiers_and_pending_loads() -> None:
    s, src = store()
    with s:
        ready(s.acquire(ref("a"))).release()
        assert s.unload("a")
        assert s.resident_adapters() == [] and s.stats().host_cache_adapters == 0
        assert not s.unload("a")
        src.gate = threading.Event()
        pending = s.acquire(ref("p"))
        time.sleep(0.05)
        s.unload("p")
        src.gate.set()
        ready(pending)
        assert isinstance(pending.error(), AdapterNotFoundError)
        time.sleep(0.05)
        assert s.stats().pages_used == 0


def test_unload_all_forgets_every_copy_and_version_so_a_restarted_registry_is_served() -> None:
    """After Redis lost its data, versions restart at 1: a store that had seen version 3
    refused the new version 1 as superseded until :meth:`unload_all`."""
    s, _ = store()
    with s:
        ready(s.acquire(ref("a", version=3))).release()
        held = ready(s.acquire(ref("b")))  # leased: dropped at its release
        with pytest.raises(AdapterNotFoundError, match="superseded by version 3"):
            s.acquire(ref("a", version=1))
        assert s.unload_all() == 2
        assert s.resident_adapters() == [] and s.stats().host_cache_adapters == 0
        held.release()
        assert ready(s.acquire(ref("a", version=1))).error() is None
        assert s.unload_all() == 1 and s.unload_all() == 0


def test_unload_below_a_version_spares_that_version_even_while_it_loads() -> None:
    """Re-registration (new-user trial): the gateway's unload of the old copies reached a
    worker after a request for the new version had started loading it there, and dropped it
    ("version 23 was unloaded while loading", NOT_FOUND to the request). An unload below
    version N drops only older versions and refuses them from then on."""
    s, src = store()
    with s:
        ready(s.acquire(ref("a", version=1))).release()
        src.gate = threading.Event()
        loading = s.acquire(ref("a", version=2))  # supersedes v1 and loads v2
        time.sleep(0.05)
        assert not s.unload("a", below_version=2)  # late: v2 is known here, v1 already gone
        src.gate.set()
        assert ready(loading).error() is None
        loading.release()
        assert [r.version for r in s.resident_adapters()] == [2]
        # reaching a worker that still holds v2 only: drops it, and v2 is refused from then on
        ready(s.acquire(ref("b", version=2))).release()
        assert s.unload("b", below_version=3)
        assert [r.adapter_id for r in s.resident_adapters()] == ["a"]
        assert s.stats().host_cache_adapters == 1
        with pytest.raises(AdapterNotFoundError, match="superseded by version 3"):
            s.acquire(ref("b", version=2))
        assert ready(s.acquire(ref("b", version=3))).error() is None
        assert s.stats().evictions_by_reason.get("superseded") == 2


# ---------------------------------------------------------------------- waiting for space
def test_load_waits_for_a_release_then_succeeds() -> None:
    s, _ = store(pages=8, load_wait_timeout_s=5.0)
    with s:
        a = ready(s.acquire(ref("a", 4)))  # whole pool, in use
        b = s.acquire(ref("b", 2))
        time.sleep(0.1)
        assert not b.ready() and s.stats().waiting_loads == 1
        a.release()
        assert ready(b).error() is None
        assert s.stats().evictions_by_reason == {"demand": 1}


def test_a_load_waiting_for_room_is_dropped_when_no_request_waits_for_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request whose client gave up (deadline, cancel) released its lease, but its load
    stayed parked for the whole load_wait_timeout_s and then logged "no room" with nobody
    waiting. It is dropped at the last release, quietly; a later request
    loads it afresh."""
    s, _ = store(pages=8, load_wait_timeout_s=5.0)
    events: list[StoreEvent] = []
    s._on_event = events.append
    with s, caplog.at_level(logging.WARNING, logger="services.worker.store"):
        a = ready(s.acquire(ref("a", 4)))  # whole pool, in use
        b1, b2 = s.acquire(ref("b", 2)), s.acquire(ref("b", 2))
        _wait_for(lambda: s.stats().waiting_loads == 1)
        b1.release()
        assert s.stats().waiting_loads == 1  # another request still waits for it
        b2.release()
        assert s.stats().waiting_loads == 0 and s.loading_adapters() == []
        a.release()
        time.sleep(0.2)
        assert [r.adapter_id for r in s.resident_adapters()] == ["a"]  # b was not loaded
        assert ready(s.acquire(ref("b", 2))).error() is None  # a new request loads it
    assert not caplog.records and not [e for e in events if e.kind == "load_failed"]


def test_a_load_waiting_for_room_does_not_block_loads_that_fit() -> None:
    # one loader thread: "b" waits for room (all but 2 pages pinned by "a"); "c" fits in
    # those 2 pages and must not queue behind "b" until its deadline
    s, _ = store(pages=8, loader_threads=1, load_wait_timeout_s=5.0)
    with s:
        a = ready(s.acquire(ref("a", 3)))
        b = s.acquire(ref("b", 3))
        time.sleep(0.05)
        assert s.stats().waiting_loads == 1
        c = s.acquire(ref("c", 1))
        assert c.wait(1.0) and c.error() is None and not b.ready()
        c.release()
        a.release()  # "a" (or "c") can be evicted now: "b" is retried and loads
        assert ready(b).error() is None
        assert torch.equal(b.flat(), expected_flat("b", 3))
        assert s.stats().waiting_loads == 0
        b.release()


def test_a_load_waiting_for_room_is_retried_when_a_prefetch_lands_unleased(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "b" parks while "a" is leased and a prefetch of "p" holds the rest of the pool mid-copy;
    "p" lands with no lease on it, so it can be evicted: "b" is retried then, not only when a
    lease drops or its room deadline (30 s) passes."""
    hold, copying, go = threading.Event(), threading.Event(), threading.Event()
    copy_in = AdapterStore._copy_in

    def held_copy(self: AdapterStore, *args: object) -> None:
        if hold.is_set():  # the copy starting while "hold" is set waits for "go"
            hold.clear()
            copying.set()
            assert go.wait(5)
        copy_in(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(AdapterStore, "_copy_in", held_copy)
    s, _ = store(pages=8, loader_threads=2, load_wait_timeout_s=30.0)
    with s:
        a = ready(s.acquire(ref("a", 2)))  # half the pool, in use
        hold.set()
        assert s.prefetch([(ref("p", 2), 5.0)]).accepted == 1
        assert copying.wait(5)  # "p" holds the other half, copying
        b = s.acquire(ref("b", 2))
        _wait_for(lambda: s.stats().waiting_loads == 1)
        go.set()
        assert ready(b, timeout=2.0).error() is None  # "p" evicted for it
        assert torch.equal(b.flat(), expected_flat("b", 2))
        assert [r.adapter_id for r in s.resident_adapters()] == ["a", "b"]
        a.release()
        b.release()


def test_room_bytes_counts_free_and_unleased_resident_pages() -> None:
    s, _ = store(pages=8, load_wait_timeout_s=5.0)
    with s:
        assert s.room_bytes() == 8 * PAGE
        a = ready(s.acquire(ref("a", 3)))  # 6 pages, leased
        assert s.room_bytes() == 2 * PAGE
        b = s.acquire(ref("b", 3))  # no room: parked, not "loading"
        time.sleep(0.05)
        assert s.stats().waiting_loads == 1 and s.loading_adapters() == []
        a.release()  # "a" evictable: "b" takes its place
        ready(b)
        assert s.room_bytes() == 2 * PAGE
        b.release()
        assert s.room_bytes() == 8 * PAGE


def test_loading_adapters_lists_loads_in_flight_until_resident() -> None:
    s, src = store(pages=16)
    src.gate = threading.Event()  # hold the source reads
    with s:
        b = s.acquire(ref("b", 2))  # demand
        assert s.prefetch([(ref("c", 1), 3.0)]).accepted == 1
        assert s.loading_adapters() == ["b", "c"]
        assert s.resident_adapters() == []
        src.gate.set()
        ready(b).release()
        deadline = time.monotonic() + 5
        while s.loading_adapters() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.loading_adapters() == []
        assert sorted(r.adapter_id for r in s.resident_adapters()) == ["b", "c"]


def test_load_fails_cleanly_when_everything_stays_in_use() -> None:
    s, _ = store(pages=8, load_wait_timeout_s=0.1)
    with s:
        a = ready(s.acquire(ref("a", 4)))
        b = ready(s.acquire(ref("b", 2)))
        assert isinstance(b.error(), PoolExhaustedError)
        assert torch.equal(a.flat(), expected_flat("a", 4))  # untouched
        a.release()
        b.release()
        assert ready(s.acquire(ref("b", 2))).error() is None  # a retry works


# ---------------------------------------------------------------------- prefetch and forecast
def test_prefetch_counts_and_use() -> None:
    s, _ = store(pages=16)
    with s:
        ready(s.acquire(ref("r", 2))).release()
        res = s.prefetch([(ref("p", 2), 3.0), (ref("r", 2), 1.0), (ref("big", 99), 9.0)])
        assert tuple(res) == (1, 1, 1)
        deadline = time.monotonic() + 5
        while "p" not in {r.adapter_id for r in s.resident_adapters()}:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        lease = s.acquire(ref("p", 2))
        assert lease.ready() and not lease.cold
        lease.release()
        st = s.stats()
        assert (st.prefetches_issued, st.prefetches_used, st.prefetches_wasted) == (1, 1, 0)


def test_prefetch_never_evicts_more_wanted_or_in_use() -> None:
    s, _ = store(pages=8)
    with s:
        s.set_forecast({"hot": 10.0})
        ready(s.acquire(ref("hot", 2))).release()  # 4 pages, expected 10
        busy = ready(s.acquire(ref("busy", 2)))  # 4 pages, in use
        assert tuple(s.prefetch([(ref("p", 2), 5.0)])) == (0, 0, 1)
        busy.release()
        s.set_forecast({"hot": 10.0, "busy": 1.0})
        assert tuple(s.prefetch([(ref("p", 2), 5.0)])) == (1, 0, 0)
        deadline = time.monotonic() + 5
        while "p" not in {r.adapter_id for r in s.resident_adapters()}:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert {r.adapter_id for r in s.resident_adapters()} == {"hot", "p"}
        assert s.stats().evictions_by_reason == {"prefetch": 1}


def test_prefetch_needs_a_real_gain_to_evict() -> None:
    """prefetch_min_gain: a prefetch evicts only when it raises the chance of use within the
    horizon by the margin (1 - e^-x under Poisson arrivals), so near-equal forecasts never
    trade places; free space is used whatever the gain."""
    s, _ = store(pages=8, prefetch_min_gain=0.2)
    with s:
        s.set_forecast({"a": 1.0, "b": 1.0})
        ready(s.acquire(ref("a", 2))).release()
        ready(s.acquire(ref("b", 2))).release()  # the pool is full
        assert tuple(s.prefetch([(ref("p", 2), 1.3)])) == (0, 0, 1)  # gain 0.09
        assert {r.adapter_id for r in s.resident_adapters()} == {"a", "b"}
        assert tuple(s.prefetch([(ref("q", 2), 4.0)])) == (1, 0, 0)  # gain 0.35
        deadline = time.monotonic() + 5
        while "q" not in {r.adapter_id for r in s.resident_adapters()}:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert s.stats().evictions_by_reason == {"prefetch": 1}
    s, _ = store(pages=8, prefetch_min_gain=0.2)
    with s:  # free space: even a long shot is loaded
        assert tuple(s.prefetch([(ref("p", 2), 0.05)])) == (1, 0, 0)


def test_demand_loads_run_before_queued_prefetches() -> None:
    s, src = store(pages=64, loader_threads=1)
    with s:
        src.gate = threading.Event()
        first = s.acquire(ref("first"))  # occupies the only loader thread
        time.sleep(0.05)
        s.prefetch([(ref(f"p{i}"), 1.0) for i in range(3)])
        demand = s.acquire(ref("need"))
        src.gate.set()
        ready(first)
        ready(demand)
        assert src.calls[:2] == ["first", "need"]


def _wait_for(cond, timeout: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_host_staging_reads_into_free_host_space_then_loads_come_from_host() -> None:
    s, src = store(pages=8, host_cache_bytes=12 * UNIT, host_staging=True)
    with s:
        # 4 + 4 + 4 units fill the 12-unit host cache; the fourth does not fit the free space
        # and is skipped (staging never evicts).
        assert s.stage([ref("a", 4), ref("b", 4), ref("c", 4), ref("d", 2)]) == 3
        _wait_for(lambda: s.stats().host_stages == 3)
        assert sorted(src.calls) == ["a", "b", "c"]
        st = s.stats()
        assert st.host_cache_used_bytes == 12 * UNIT and st.host_stages_queued == 0
        assert st.resident_adapters == 0 and st.loads_by_tier == {"source": 0, "host": 0}
        assert s.host_cached_adapters() == ["a", "b", "c"]  # what the heartbeat publishes
        lease = ready(s.acquire(ref("b", 4)))  # a cold start, served from host memory
        assert lease.cold and torch.equal(lease.flat(), expected_flat("b", 4))
        lease.release()
        assert s.stats().loads_by_tier == {"source": 0, "host": 1}
        assert s.stage([ref("a", 4), ref("b", 4)]) == 0  # cached (or resident) already
        assert sorted(src.calls) == ["a", "b", "c"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_staging_runs_at_background_priority_and_loads_do_not() -> None:
    """Staging is speculative: on a CPU host it must not take cores from decode steps, so
    its thread runs at nice BACKGROUND_NICE; the loader threads (demand loads) keep ours."""
    s, _ = store(host_staging=True)
    with s:
        threads = {t.name: t.native_id for t in threading.enumerate()}
        ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        _wait_for(lambda: _nice(threads["adapter-stager"]) == max(ours, BACKGROUND_NICE))
        assert _nice(threads["adapter-loader-0"]) == ours


def _nice(tid: int | None) -> int:
    assert tid is not None
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_host_staging_is_off_by_default_and_yields_to_demand_loads() -> None:
    off, src_off = store()
    with off:
        assert off.stage([ref("a")]) == 0
        assert src_off.calls == []
    s, src = store(pages=64, loader_threads=2, host_staging=True)
    with s:
        src.gate = threading.Event()
        first = s.acquire(ref("first"))  # takes one loader thread
        time.sleep(0.05)
        assert s.stage([ref(f"s{i}") for i in range(3)]) == 3
        time.sleep(0.05)  # the staging thread reads s0; two stay queued
        assert s.stats().host_stages_queued == 2
        demand = s.acquire(ref("need"))
        s.prefetch([(ref("pre"), 5.0)])
        src.gate.set()
        ready(first)
        ready(demand)
        _wait_for(lambda: s.stats().host_stages == 3)
        # one staging read at a time, on its own thread (both loader threads stayed free for
        # "first" and "need")
        assert src.calls[:3] == ["first", "s0", "need"]


def test_host_staging_waits_for_a_queued_demand_load_not_for_a_queued_prefetch() -> None:
    s, src = store(pages=64, loader_threads=1, host_staging=True)
    with s:
        src.gates["first"] = threading.Event()
        first = s.acquire(ref("first"))  # holds the only loader thread
        _wait_for(lambda: src.calls == ["first"])
        s.prefetch([(ref("pre"), 5.0)])  # queued behind it
        assert s.stage([ref("s0"), ref("s1")]) == 2
        _wait_for(lambda: s.stats().host_stages == 2)  # staged with the prefetch queued
        assert "pre" not in src.calls
        need = s.acquire(ref("need"))  # a demand load queued: staging pauses
        assert s.stage([ref("s2")]) == 1
        time.sleep(0.1)
        assert "s2" not in src.calls and s.stats().host_stages_queued == 1
        src.gates["first"].set()
        ready(first)
        ready(need)
        _wait_for(lambda: s.stats().host_stages == 3)
        assert src.calls.index("need") < src.calls.index("pre")  # demand before prefetch


def test_each_staging_pass_replaces_the_queue_in_its_order() -> None:
    s, src = store(host_staging=True)
    with s:
        src.gate = threading.Event()
        assert s.stage([ref("x"), ref("y"), ref("z")]) == 3
        _wait_for(lambda: src.calls == ["x"])  # x is being read; y, z queued
        assert s.stage([ref("z"), ref("x"), ref("w")]) == 2  # the forecast changed
        src.gate.set()
        _wait_for(lambda: s.stats().host_stages == 3)
        assert src.calls == ["x", "z", "w"]  # y dropped, x not read twice


def test_host_staging_of_a_bad_source_is_dropped_and_unload_cancels_it() -> None:
    s, src = store(host_staging=True)
    with s:
        src.fail["bad"] = InvalidAdapterError("no adapter_model.safetensors")
        src.gate = threading.Event()
        assert s.stage([ref("bad"), ref("gone"), ref("ok")]) == 3
        time.sleep(0.05)
        assert s.unload("gone")  # still queued: cancelled
        src.gate.set()
        _wait_for(lambda: s.stats().host_stages_queued == 0 and "ok" in src.calls)
        _wait_for(lambda: s.stats().host_stages == 1)
        assert "gone" not in src.calls and s.stats().host_cache_adapters == 1
        bad = ready(s.acquire(ref("bad")))  # the demand load reports the error
        assert isinstance(bad.error(), InvalidAdapterError)
        bad.release()


def test_a_failed_staging_read_is_not_retried_every_pass_nor_logged_each_time(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new user's 5 broken adapters were read again by every worker every 2 s and logged each
    time (636 of 696 lines of ``plora up``'s output in 25 minutes). A version whose staging read
    failed now waits SOURCE_RETRY_S before the next try, and its failure is logged once; a new
    version is tried at once."""
    monkeypatch.setattr(store_loading, "SOURCE_RETRY_S", 1.0)
    s, src = store(host_staging=True)
    events: list[StoreEvent] = []
    s._on_event = events.append
    with s, caplog.at_level(logging.DEBUG, logger="services.worker.store"):
        src.fail["bad"] = InvalidAdapterError("lora_A holds NaN or Inf values")
        s.stage([ref("bad")])
        _wait_for(lambda: src.calls == ["bad"] and s.stats().host_stages_queued == 0)
        _wait_for(lambda: s._staging_current is None)
        for _ in range(3):  # the next passes, 2 s apart in a worker
            assert s.stage([ref("bad")]) == 0
        assert s.stage([ref("bad", version=2)]) == 1  # registered again: a new version
        _wait_for(lambda: src.calls == ["bad", "bad"] and s._staging_current is None)
        assert s.stage([ref("bad", version=2)]) == 0
        time.sleep(1.0)  # SOURCE_RETRY_S later
        assert s.stage([ref("bad", version=2)]) == 1
        _wait_for(lambda: src.calls == ["bad"] * 3 and s._staging_current is None)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage().split(" failed")[0] for r in warned] == [
        "host staging of bad v1",
        "host staging of bad v2",
    ]  # the retry of v2 failed again: logged at DEBUG
    # every failed read is counted (plora_worker_host_stage_failures_total)
    failed = [(e.adapter_id, e.version) for e in events if e.kind == "host_stage_failed"]
    assert failed == [("bad", 1), ("bad", 2), ("bad", 2)]


def test_a_failed_load_stops_prefetches_of_that_version_not_demand_loads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new operator removed a registered adapter's files and sent one request: the
    predictor then prefetched it every tick and each worker logged a warning for every try
    (38 lines in 20 s), each counted as an issued prefetch. A version whose source read failed
    is now ignored by prefetch for SOURCE_RETRY_S and its failure logged once; a request still
    reads it, and gets the error."""
    s, src = store()
    events: list[StoreEvent] = []
    s._on_event = events.append
    with s, caplog.at_level(logging.DEBUG, logger="services.worker.store"):
        src.fail["gone"] = InvalidAdapterError("adapter directory '/x' does not exist")
        for _ in range(2):  # two requests: both read the source, both get the error
            lease = ready(s.acquire(ref("gone")))
            assert isinstance(lease.error(), InvalidAdapterError)
            lease.release()
        assert src.calls == ["gone", "gone"]
        for _ in range(3):  # the predictor's ticks
            assert tuple(s.prefetch([(ref("gone"), 5.0)])) == (0, 0, 1)
        assert s.prefetch([(ref("gone", version=2), 5.0)]).accepted == 1  # registered again
        _wait_for(lambda: src.calls == ["gone"] * 3)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [m.split(" failed")[0] for m in warned] == ["load of gone v1", "load of gone v2"]
    # every failed load is counted by its error (plora_worker_adapter_load_failures_total)
    failed = [(e.version, e.reason) for e in events if e.kind == "load_failed"]
    assert failed == [(1, "InvalidAdapterError")] * 2 + [(2, "InvalidAdapterError")]


def test_reconcile_drops_what_the_registry_deleted_or_replaced_while_unload_was_missed() -> None:
    """A worker frozen while adapters were deleted or registered again never got the
    gateway's unload and kept the old copies resident (listed in its status) until the pool
    needed the room. Its periodic check against the registry drops them;
    an adapter first seen after the registry was read is left alone."""
    s, _ = store(pages=32, host_staging=True)
    with s:
        for name in ("keep", "gone", "old"):
            ready(s.acquire(ref(name, 2))).release()
        leased = ready(s.acquire(ref("leased", 2)))
        as_of = time.monotonic()
        ready(s.acquire(ref("new", 2))).release()  # registered after the listing was read
        registered = {"keep": 1, "old": 2}  # "gone" and "leased" deleted, "old" replaced
        assert s.reconcile(registered, as_of) == 3
        assert {r.adapter_id for r in s.resident_adapters()} == {"keep", "new"}
        # a leased copy serves its request to the end, and is freed at its release
        assert torch.equal(leased.flat(), expected_flat("leased", 2))
        leased.release()
        stats = s.stats().evictions_by_reason
        assert stats.get("unload") == 2 and stats.get("superseded") == 1
        with pytest.raises(AdapterNotFoundError, match="superseded by version 2"):
            s.acquire(ref("old"))  # version 1 is refused from now on
        assert s.reconcile(registered, time.monotonic()) == 1  # "new" is not registered
        assert s.reconcile(registered | {"old": 2}, time.monotonic()) == 0


def test_predictive_eviction_is_lru_without_a_forecast() -> None:
    s, _ = store(pages=8, eviction="predictive")
    with s:
        ready(s.acquire(ref("a", 2))).release()
        ready(s.acquire(ref("b", 2))).release()
        ready(s.acquire(ref("c", 2))).release()  # no forecast: LRU evicts a
        assert {r.adapter_id for r in s.resident_adapters()} == {"b", "c"}


@pytest.mark.parametrize(("eviction", "b_misses"), [("lru", 12), ("predictive", 4)])
def test_predictive_eviction_learns_to_follow_a_forecast_that_is_right(
    eviction: str, b_misses: int
) -> None:
    """Room for two adapters; "b" comes back after two others each time, and the forecast
    says so. LRU evicts "b" every time; the predictive policy starts with recency, pays for
    three of its evictions of "b" (requests that miss, after the first request's cold start),
    then follows the forecast and keeps it."""
    s, _ = store(pages=8, eviction=eviction)
    with s:
        s.set_forecast({"b": 5.0})
        misses = 0
        for i in range(12):
            for other in (f"x{i}", f"y{i}"):
                ready(s.acquire(ref(other, 2))).release()
            lease = ready(s.acquire(ref("b", 2)))
            misses += lease.cold
            lease.release()
        assert misses == b_misses


# ---------------------------------------------------------------------- compaction
def test_compaction_repoints_views_and_keeps_leased_in_place() -> None:
    s, _ = store(pages=10)
    with s:
        leases = {n: ready(s.acquire(ref(n, 1))) for n in "abcde"}  # 2 pages each
        for n in "bd":
            leases.pop(n).release()
        s.unload("b")
        s.unload("d")  # holes at pages 2-3 and 6-7
        was_at = {n: leases[n].flat().data_ptr() for n in "ace"}
        for n in "ace":
            leases[n].release()
        keep = ready(s.acquire(ref("a", 1)))  # a in use: must not move
        big = ready(s.acquire(ref("f", 2)))  # 4 pages: c and e can slide down past a
        assert big.error() is None
        st = s.stats()
        assert st.compactions == 1 and st.split_allocations == 0
        assert keep.flat().data_ptr() == was_at["a"]
        for n, lease in (("a", keep), ("f", big)):
            assert torch.equal(lease.flat(), expected_flat(n, 1 if n == "a" else 2))
        moved = 0
        for r in s.resident_adapters():
            lease = ready(s.acquire(ref(r.adapter_id, r.pages // 2)))
            assert torch.equal(lease.flat(), expected_flat(r.adapter_id, r.pages // 2))
            moved += r.adapter_id in "ce" and lease.flat().data_ptr() != was_at[r.adapter_id]
            lease.release()
        assert moved  # views of a moved adapter were re-pointed to its new run
        s.pool.allocator.check_invariants()


def fragment_around_pins(s: AdapterStore) -> dict:
    """Pages 0-9 as a b c d e (2 pages each) with b and d gone and a, c, e leased: the two
    free 2-page holes are separated by adapters in use, so compaction cannot join them."""
    leases = {n: ready(s.acquire(ref(n, 1))) for n in "abcde"}
    for n in "bd":
        leases.pop(n).release()
        s.unload(n)
    return leases


@pytest.mark.parametrize("device", DEVICES)
def test_split_adapter_serves_the_same_weights_as_an_unsplit_one(device: str) -> None:
    events: list[StoreEvent] = []
    s, _ = store(pages=10, device=device)
    s._on_event = events.append
    whole, _ = store(pages=10, device=device)
    with s, whole:
        held = fragment_around_pins(s)
        split = ready(s.acquire(ref("f", 2)))  # 4 pages: only the two holes are free
        assert split.error() is None
        st = s.stats()
        demand = st.evictions_by_reason.get("demand", 0)
        assert (st.split_allocations, st.compactions, demand) == (1, 0, 0)
        (r,) = [r for r in s.resident_adapters() if r.adapter_id == "f"]
        assert [(p, u) for p, u, _ in r.extents] == [(2, 2), (6, 2)] and r.pages == 4
        assert st.mean_extents_per_adapter == pytest.approx(5 / 4)  # a c e: 1, f: 2
        assert [e.kind for e in events].count("split") == 1
        unsplit = ready(whole.acquire(ref("f", 2)))
        assert not whole.resident_adapters()[0].extents[1:]
        w_split, w_whole = split.weights(), unsplit.weights()
        base = s.pool.buffer
        lo, hi = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
        x = torch.randn(3, 16, device=device)
        for key, m in w_split.items():
            # views of pool memory, contiguous, identical to the unsplit adapter's
            for t, u in ((m.lora_a, w_whole[key].lora_a), (m.lora_b, w_whole[key].lora_b)):
                assert lo <= t.data_ptr() < hi and t.is_contiguous()
                assert torch.equal(t, u)
            assert m.scaling == w_whole[key].scaling
            assert torch.equal(
                x @ m.lora_a.T @ m.lora_b.T, x @ w_whole[key].lora_a.T @ w_whole[key].lora_b.T
            )
        want = expected_flat("f", 2).to(device)
        assert torch.equal(split.flat(), want) and torch.equal(unsplit.flat(), want)
        assert not lo <= split.flat().data_ptr() < hi  # flat() of a split adapter is a copy
        for n, lease in held.items():  # the adapters in use were not touched
            assert torch.equal(lease.flat(), expected_flat(n, 1).to(device))
        for lease in [*held.values(), split, unsplit]:
            lease.release()
        for n in "acef":
            s.unload(n)
        assert bool((s.pool.buffer == 0).all()) and s.stats().pages_used == 0


def test_split_is_not_used_when_cheap_compaction_can_join_the_space() -> None:
    s, _ = store(pages=10)
    with s:
        held = fragment_around_pins(s)
        held.pop("c").release()  # c movable: compaction can join both holes
        ready(s.acquire(ref("f", 2))).release()
        st = s.stats()
        assert (st.compactions, st.split_allocations) == (1, 0)


def test_split_comes_before_dear_compaction_and_eviction() -> None:
    """compaction_max_ratio 0: never compact while a split works; with too few free pages for
    any placement the load evicts."""
    s, _ = store(pages=10, compaction_max_ratio=0.0)
    with s:
        held = fragment_around_pins(s)
        held.pop("c").release()  # compaction would work, but it is never cheap here
        ready(s.acquire(ref("f", 2))).release()
        st = s.stats()
        demand = st.evictions_by_reason.get("demand", 0)
        assert (st.compactions, st.split_allocations, demand) == (0, 1, 0)
        # 6 pages: more than the 4 free in the pool, so something is evicted first
        big = ready(s.acquire(ref("g", 3)))
        assert big.error() is None
        assert s.stats().evictions_by_reason.get("demand", 0) >= 1


def test_compaction_waits_for_running_step() -> None:
    s, _ = store(pages=6)
    with s:
        for n in "abc":
            ready(s.acquire(ref(n, 1))).release()
        s.unload("a")
        s.unload("c")  # free: pages 0-1 and 4-5; b in the middle
        step_done = threading.Event()
        order: list[str] = []

        def step() -> None:
            with s.compute_guard():
                order.append("step start")
                time.sleep(0.2)
                order.append("step end")
            step_done.set()

        t = threading.Thread(target=step)
        t.start()
        time.sleep(0.05)
        big = ready(s.acquire(ref("d", 2)))  # 4 pages: b must move
        order.append("loaded")
        t.join()
        assert big.error() is None
        assert order == ["step start", "step end", "loaded"]
        assert s.stats().compactions == 1 and s.stats().bytes_moved == 2 * PAGE


# ---------------------------------------------------------------------- stats and events
def test_stats_and_event_hook() -> None:
    events: list[StoreEvent] = []
    src = Source()
    cfg = StoreConfig(pool_bytes=8 * PAGE, page_bytes=PAGE, host_cache_bytes=64 * PAGE)
    with AdapterStore(cfg, src, on_event=events.append) as s:
        ready(s.acquire(AdapterRef("a", 1, "rank:3", 3 * UNIT))).release()
        ready(s.acquire(ref("b", 2))).release()  # needs 4 pages, 2 free: evicts a
        st = s.stats()
        assert st.pages_total == 8 and st.pages_used == 4 and st.live_bytes == 4 * PAGE
        assert st.utilization == pytest.approx(0.5)
        assert st.pressure_samples == 1 and st.utilization_under_pressure == pytest.approx(0.5)
        assert st.internal_waste == 0.0 and st.external_fragmentation == 0.0
        kinds = [e.kind for e in events]
        assert kinds.count("load") == 2 and kinds.count("evict") == 1
        assert kinds.count("cold_start") == 2
        assert st.to_dict()["evictions_by_reason"] == {"demand": 1}


# ---------------------------------------------------------------------- concurrency
@pytest.mark.parametrize("device", DEVICES)
def test_streaming_adapter_stays_intact_while_others_load_and_evict(device: str) -> None:
    """A is leased and read every "step" while B, C, D load (forcing E out, and compactions)."""
    s, src = store(pages=32, device=device, load_wait_timeout_s=5.0)
    with s:
        a = ready(s.acquire(ref("A", 3)))
        ready(s.acquire(ref("E", 4))).release()
        want = expected_flat("A", 3).to(device)
        stop = threading.Event()
        errors: list[str] = []
        steps = 0

        def engine() -> None:
            nonlocal steps
            x = torch.ones(1, 16, device=device)
            ref_out = None
            while not stop.is_set():
                with s.compute_guard():
                    w = a.weights()
                    out = sum((x @ m.lora_a.T @ m.lora_b.T) * m.scaling for m in w.values())
                    if ref_out is None:
                        ref_out = out
                    if not torch.equal(out, ref_out) or not torch.equal(a.flat(), want):
                        errors.append(f"step {steps}: A changed")
                steps += 1

        t = threading.Thread(target=engine)
        t.start()
        others = []
        for _ in range(5):
            for n, r in (("B", 4), ("C", 3), ("D", 4)):
                lease = ready(s.acquire(ref(n, r)))
                assert lease.error() is None
                others.append(lease)
            for lease in others:
                lease.release()
            others.clear()
            ready(s.acquire(ref("E", 4))).release()
        stop.set()
        t.join()
        assert not errors, errors[:3]
        assert steps > 0
        assert s.stats().evictions_by_reason.get("demand", 0) > 0
        assert torch.equal(a.flat(), want)
        a.release()


def test_cold_starts_say_why() -> None:
    """Each cold lease carries its cause (services/worker/cold.py), counted in the stats:
    never held here, evicted for a demand load by recency, a prefetch still loading."""
    s, src = store(pages=4)  # room for two rank-2 adapters
    with s:
        a = ready(s.acquire(ref("a")))
        assert a.cold_cause == "first_use"
        a.release()
        for name in ("b", "c"):
            lease = ready(s.acquire(ref(name)))
            lease.release()
        again = ready(s.acquire(ref("a")))  # "a" was the least recently used: evicted
        assert (again.cold, again.cold_cause) == (True, "evicted_recency")
        again.release()
        src.gate = threading.Event()
        s.prefetch([(ref("d"), 5.0)])
        late = s.acquire(ref("d"))
        assert (late.cold, late.cold_cause) == (True, "prefetch_late")
        src.gate.set()
        ready(late).release()
        warm = s.acquire(ref("d"))
        assert (warm.cold, warm.cold_cause) == (False, "")
        warm.release()
        causes = s.stats().cold_starts_by_cause
    assert causes == {"first_use": 3, "evicted_recency": 1, "prefetch_late": 1}
