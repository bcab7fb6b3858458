"""The room decision (services/worker/room.py): its rule as a table, and the same decisions
from the live AdapterStore and the simulated worker for one sequence of requests, prefetches
and releases, step by step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from plora.policies import PolicySpec
from plora.simulator.engine import (
    _EV_LOADED,
    _EV_READ,
    AdapterSet,
    ClusterSimulation,
    SimConfig,
    SimWorker,
)
from plora.simulator.presets import CPU_PRESET, StepTimeModel
from plora.traces import Trace
from services.common.types import PROJECTION_MODULES, LoRAModuleWeights, LoRAWeights, ModelSpec
from services.worker.adapter_api import AdapterRef
from services.worker.allocators import make_allocator
from services.worker.room import PressureSampler, RoomAction, RoomDecision, RoomSearch
from services.worker.store import AdapterStore, StoreConfig, pack_weights, slot_pieces

PAGE = 1024


# ------------------------------------------------------------------------- the rule, as a table
def _fill(al, sizes):  # noqa: ANN001, ANN202
    return [al.alloc_pieces([n]) for n in sizes]


def _next(search: RoomSearch, al, victim=None, **kw) -> RoomDecision:  # noqa: ANN001
    return search.next(
        al,
        alloc=lambda p, split: al.alloc_pieces(p, split=split),
        pinned=lambda: kw.pop("pinned", set()),
        victim=lambda: victim,
        compaction_max_ratio=kw.pop("ratio", 4.0),
        **kw,
    )


@pytest.mark.parametrize(
    ("case", "demanded", "victim", "kw", "expected"),
    [
        ("fits", True, None, {}, RoomAction.PLACE),
        ("too_large", True, None, {}, RoomAction.FAIL),
        ("full", True, "x", {}, RoomAction.EVICT),
        ("full", False, None, {}, RoomAction.DROP),
        ("full", True, None, {"has_waiters": False}, RoomAction.CANCEL),
        ("full", True, None, {}, RoomAction.WAIT),
        ("full", True, None, {"wait_expired": True}, RoomAction.FAIL),
        ("holes", True, None, {}, RoomAction.COMPACT),
        ("holes", True, "x", {"ratio": 0.0}, RoomAction.EVICT),  # one tensor: no split
        ("holes_split", True, "x", {"ratio": 0.0}, RoomAction.PLACE),  # split over the holes
    ],
)
def test_room_rule_table(case, demanded, victim, kw, expected) -> None:  # noqa: ANN001
    al = make_allocator("paged", 8 * PAGE, PAGE)
    pieces = [PAGE, PAGE]
    if case == "too_large":
        pieces = [9 * PAGE]
    elif case == "full":
        _fill(al, [PAGE] * 8)
    elif case.startswith("holes"):  # 4 pages free, no two of them together
        allocs = _fill(al, [PAGE] * 8)
        for a in allocs[::2]:
            al.free(a.handle)
        pieces = [PAGE, PAGE] if case == "holes_split" else [2 * PAGE]
    d = _next(RoomSearch(pieces, demanded=demanded), al, victim, **kw)
    assert d.action is expected
    if expected is RoomAction.PLACE:
        assert d.allocation is not None
        assert d.allocation.units == sum(pieces) // PAGE
        assert d.allocation.is_split == (case == "holes_split")
    if expected is RoomAction.FAIL:
        assert d.reason == ("too_large" if case == "too_large" else "timeout")
        assert d.sample_pressure == (case != "too_large")


def test_compaction_that_did_not_help_is_not_repeated_until_an_eviction() -> None:
    al = make_allocator("paged", 8 * PAGE, PAGE)
    allocs = _fill(al, [PAGE] * 8)
    for a in allocs[::2]:
        al.free(a.handle)
    search = RoomSearch([2 * PAGE], demanded=True)
    assert _next(search, al, "x").action is RoomAction.COMPACT
    # the driver did not compact (say every run was pinned): evict rather than compact again
    d = _next(search, al, "x")
    assert (d.action, d.victim, search.pressure) == (RoomAction.EVICT, "x", True)
    assert _next(search, al, "x").action is RoomAction.COMPACT  # the pool changed


def test_pressure_sampler_means() -> None:
    al = make_allocator("paged", 8 * PAGE, PAGE)
    _fill(al, [PAGE // 2] * 4)
    p = PressureSampler()
    p.note_layout([PAGE])
    p.sample(al, set())
    m = p.means()
    assert p.samples == 1
    assert m.utilization == pytest.approx(2 / 8)
    assert m.internal_waste == pytest.approx(0.5)
    assert m.free_run_fragmentation == 0.0 and m.mean_extents == 1.0


# ------------------------------------------------------------------ live store vs simulated worker
#: A tiny model: adapters on all seven projections of 2 layers, a few KiB each.
TINY = ModelSpec(
    name="tiny",
    num_layers=2,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    vocab_size=32,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
RANKS = (1, 2, 4, 8, 2, 1, 4, 8, 1, 2)


def _weights(ref: AdapterRef) -> LoRAWeights:
    rank = RANKS[int(ref.adapter_id.split("-")[1])]
    g = torch.Generator().manual_seed(hash(ref.adapter_id) % (2**31))
    mods = {}
    for layer in range(TINY.num_layers):
        for m in PROJECTION_MODULES:
            fan_in, fan_out = TINY.module_shape(m)
            a = torch.randn(rank, fan_in, generator=g)
            b = torch.randn(fan_out, rank, generator=g)
            mods[(layer, m)] = LoRAModuleWeights(a, b, 2.0 / rank)
    return LoRAWeights(ref.adapter_id, ref.version, mods, alpha=2.0)


@dataclass(frozen=True)
class Op:
    kind: str  # "acquire", "release", "prefetch"
    adapter: int
    expected: float = 0.0


def _script(seed: int, n: int = 160) -> list[Op]:
    """Requests, prefetches and releases over 10 adapters whose pool holds about four."""
    rng = random.Random(seed)
    held: list[int] = []
    ops: list[Op] = []
    for _ in range(n):
        roll = rng.random()
        if held and (roll < 0.35 or len(held) >= 4):
            ops.append(Op("release", held.pop(rng.randrange(len(held)))))
        elif roll < 0.55:
            ops.append(Op("prefetch", rng.randrange(len(RANKS)), round(rng.uniform(0.5, 5), 2)))
        else:
            a = rng.randrange(len(RANKS))
            held.append(a)
            ops.append(Op("acquire", a))
    ops += [Op("release", a) for a in held]
    return ops


def _names() -> tuple[str, ...]:
    return tuple(f"adapter-{i}" for i in range(len(RANKS)))


def _preset(allocator_pool_pages: int):  # noqa: ANN202
    return CPU_PRESET.with_overrides(
        name="tiny",
        model=TINY,
        dtype_bytes=4,
        ranks=RANKS,
        step=StepTimeModel(1e-3, 0.0, 0.0, 0.0, 0.0, "sum"),
        max_queue=10_000,
        pool_bytes=allocator_pool_pages * PAGE,
        page_bytes=PAGE,
        alignment_bytes=256,
        host_cache_bytes=1 << 24,
        source="fixed",
        source_fixed_s=0.01,
        loader_threads=1,
        load_wait_timeout_s=1e9,
        shared_compute=0.0,
    )


Decision = tuple[str, str, str | None, int, tuple[tuple[int, int], ...]]


def _record(out: list[Decision]):  # noqa: ANN202
    def on_decision(adapter_id: str, d: RoomDecision) -> None:
        extents = tuple((e.start, e.length) for e in d.allocation.extents) if d.allocation else ()
        out.append((adapter_id, d.action.value, d.victim, d.compact_units, extents))

    return on_decision


def _run_live(
    policy: PolicySpec, pages: int, ops: list[Op]
) -> tuple[list[list[Decision]], set[int]]:
    """The script through a live store; also the releases it skipped: a request ends only
    once its adapter is resident (the simulator models no cancellation of a waiting one)."""
    steps: list[list[Decision]] = []
    skipped: set[int] = set()
    log: list[Decision] = []
    cfg = StoreConfig(
        allocator=policy.allocator,
        eviction=policy.eviction,
        pool_bytes=pages * PAGE,
        page_bytes=PAGE,
        alignment_bytes=256,
        host_cache_bytes=1 << 24,
        loader_threads=1,
        load_wait_timeout_s=1e9,
    )
    names = _names()
    refs = [AdapterRef(n, 1, "mem", _bytes(i)) for i, n in enumerate(names)]
    leases: dict[int, list] = {}
    with AdapterStore(cfg, _weights, on_decision=_record(log)) as store:
        for i, op in enumerate(ops):
            if op.kind == "acquire":
                leases.setdefault(op.adapter, []).append(store.acquire(refs[op.adapter]))
            elif op.kind == "release":
                if leases[op.adapter][0].ready():
                    leases[op.adapter].pop(0).release()
                else:
                    skipped.add(i)
            else:
                store.prefetch([(refs[op.adapter], op.expected)])
            assert store.wait_idle(10)
            steps.append(list(log))
            log.clear()
    return steps, skipped


def _bytes(i: int) -> int:
    w = _weights(AdapterRef(f"adapter-{i}", 1, "mem"))
    return pack_weights(w, torch.float32).nbytes


def _run_sim(
    policy: PolicySpec, pages: int, ops: list[Op], skipped: set[int]
) -> list[list[Decision]]:
    names = _names()
    k = len(names)
    n = sum(op.kind == "acquire" for op in ops)
    trace = Trace(
        times=np.zeros(n),
        key_index=np.arange(n, dtype=np.int32) % k,
        keys=names,
        prompt_tokens=np.ones(n, dtype=np.int32),
        output_tokens=np.ones(n, dtype=np.int32),
    )
    adapters = AdapterSet(
        names,
        np.asarray(RANKS, dtype=np.int64),
        np.asarray([_bytes(i) for i in range(k)], dtype=np.int64),
        np.arange(k, dtype=np.int64),
    )
    sim = ClusterSimulation(trace, adapters, policy, SimConfig(_preset(pages), workers=1))
    w: SimWorker = sim.workers[0]
    log: list[Decision] = []
    w.on_decision = _record(log)
    steps: list[list[Decision]] = []
    t = 0.0
    r = 0
    for i, op in enumerate(ops):
        t += 1.0
        if op.kind == "acquire":
            assert w.accept(r, op.adapter, t)
            r += 1
        elif op.kind == "release":
            if i not in skipped:
                w.release(op.adapter, t)
        else:
            w.prefetch([(op.adapter, op.expected)], t)
        # run the loads to the end (the engine's step boundaries are not part of this)
        while any(e[2] in (_EV_READ, _EV_LOADED) for e in sim._heap):
            ev = min(e for e in sim._heap if e[2] in (_EV_READ, _EV_LOADED))
            sim._heap.remove(ev)
            t = max(t, ev[0])
            if ev[2] == _EV_READ:
                w.read_done(ev[4], t)
            else:
                w.loaded(ev[4], t)
        steps.append(list(log))
        log.clear()
    return steps


POLICIES = [
    PolicySpec("paged-lru", "paged", "lru", "rank_aware", False, False),
    PolicySpec("paged-predictive", "paged", "predictive", "rank_aware", False, False),
    PolicySpec("contiguous-lru", "contiguous", "lru", "round_robin", False, False),
]


def test_tiny_adapters_pack_as_the_preset_says() -> None:
    preset = _preset(16)
    for i, rank in enumerate(RANKS):
        packed = pack_weights(_weights(AdapterRef(f"adapter-{i}", 1, "mem")), torch.float32)
        assert slot_pieces(packed.slots, 4) == preset.adapter_pieces(rank)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_live_store_and_simulated_worker_decide_alike(policy: PolicySpec, seed: int) -> None:
    """Every room decision (place where, compact how much, evict whom, drop, wait), step by
    step, for one script of requests, prefetches and releases."""
    pages = 24  # about four adapters of the mixed ranks
    ops = _script(seed)
    live, skipped = _run_live(policy, pages, ops)
    sim = _run_sim(policy, pages, ops, skipped)
    for i, (op, a, b) in enumerate(zip(ops, live, sim, strict=True)):
        assert a == b, f"step {i} ({op}): live {a} vs simulated {b}"
    actions = {d[1] for step in live for d in step}
    # the script reaches the decisions that matter
    assert {"place", "evict"} <= actions, actions
    if policy.allocator == "paged":
        assert "wait" in actions or "compact" in actions or "drop" in actions, actions
