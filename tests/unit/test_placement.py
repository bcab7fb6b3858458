"""Table-driven tests of placement, routing and prefetch choice."""

from __future__ import annotations

import pytest

from services.common.routing import RoundRobinRouter, WorkerView, route_rank_aware
from services.predictor.placement import (
    AdapterDemand,
    PrefetchSelector,
    plan_placement,
    rank_cost,
)

MB = 1 << 20


def views(n: int, pool: int = 1000 * MB, **kw: object) -> list[WorkerView]:
    return [WorkerView(f"w{i}", pool_bytes=pool, free_bytes=pool, **kw) for i in range(n)]


@pytest.mark.parametrize(("rank", "cost"), [(0, 1.0), (64, 1.5), (128, 2.0), (8, 1.0625)])
def test_rank_cost_is_linear_in_rank(rank: int, cost: float) -> None:
    assert rank_cost(rank) == pytest.approx(cost)


def test_hot_high_rank_adapters_do_not_pile_onto_one_worker() -> None:
    demand = {f"r128-{i}": AdapterDemand(128, 10 * MB, 10.0) for i in range(4)}
    placement, _ = plan_placement(demand, views(2))
    per_worker = {"w0": 0, "w1": 0}
    for ws in placement.values():
        assert len(ws) == 1
        per_worker[ws[0]] += 1
    assert per_worker == {"w0": 2, "w1": 2}


def test_rank_weighted_balance() -> None:
    # One rank-128 adapter (cost 2) against four rank-8 adapters of the same demand.
    demand = {"big": AdapterDemand(128, 10 * MB, 4.0)}
    demand |= {f"small-{i}": AdapterDemand(8, MB, 2.0) for i in range(4)}
    placement, _ = plan_placement(demand, views(2))
    big_worker = placement["big"][0]
    smalls_with_big = sum(1 for i in range(4) if placement[f"small-{i}"] == [big_worker])
    assert smalls_with_big <= 1


def test_an_adapter_hotter_than_one_worker_is_replicated() -> None:
    demand = {"hot": AdapterDemand(16, MB, 100.0), "cold": AdapterDemand(16, MB, 1.0)}
    placement, _ = plan_placement(demand, views(3))
    assert len(placement["hot"]) >= 2
    assert len(placement["cold"]) == 1


def test_pool_capacity_is_respected() -> None:
    demand = {f"a{i}": AdapterDemand(64, 60 * MB, 5.0 - i) for i in range(4)}
    placement, _ = plan_placement(demand, views(2, pool=100 * MB))
    used = {"w0": 0, "w1": 0}
    for a, ws in placement.items():
        for w in ws:
            used[w] += demand[a].size_bytes
    assert all(u <= 100 * MB for u in used.values())
    assert len(placement) == 2


def test_stable_demand_keeps_the_placement() -> None:
    demand = {f"a{i}": AdapterDemand(8 * (i + 1), MB, 3.0) for i in range(6)}
    first, _ = plan_placement(demand, views(2))
    nudged = {a: AdapterDemand(d.rank, d.size_bytes, d.expected * 1.05) for a, d in demand.items()}
    second, moves = plan_placement(nudged, views(2), first)
    assert second == first and moves == 0


def test_zero_demand_is_not_placed_and_no_workers_gives_nothing() -> None:
    assert plan_placement({"a": AdapterDemand(8, MB, 0.0)}, views(2)) == ({}, 0)
    assert plan_placement({"a": AdapterDemand(8, MB, 1.0)}, []) == ({}, 0)


@pytest.mark.parametrize(
    ("adapter", "workers", "placement", "expected"),
    [
        # resident beats placed and least loaded
        (
            "a",
            [
                WorkerView("w0", queue_length=2, resident=frozenset({"a"})),
                WorkerView("w1", queue_length=0),
            ],
            {"a": ["w1"]},
            ("w0", "resident"),
        ),
        # resident with the shortest queue among residents
        (
            "a",
            [
                WorkerView("w0", queue_length=3, resident=frozenset({"a"})),
                WorkerView("w1", queue_length=1, resident=frozenset({"a"})),
            ],
            {},
            ("w1", "resident"),
        ),
        # resident but overloaded beyond the slack -> placed / least loaded
        (
            "a",
            [
                WorkerView("w0", queue_length=20, resident=frozenset({"a"})),
                WorkerView("w1", queue_length=0),
            ],
            {},
            ("w1", "least_loaded"),
        ),
        # not resident anywhere -> placed worker, when no more loaded than the least loaded
        (
            "a",
            [WorkerView("w0", queue_length=0), WorkerView("w1", queue_length=0)],
            {"a": ["w1"]},
            ("w1", "placed"),
        ),
        (
            "a",
            [WorkerView("w0", queue_length=0), WorkerView("w1", queue_length=1)],
            {"a": ["w1"]},
            ("w0", "least_loaded"),
        ),
        # unknown adapter -> least loaded, ties to the first given (the gateway rotates them)
        (
            "a",
            [WorkerView("w1", queue_length=0), WorkerView("w0", queue_length=0)],
            {},
            ("w1", "least_loaded"),
        ),
        # sequences decoding on the resident worker do not move a request off it within the
        # queue slack, even where a decode row costs about a load (a CPU: prefill 50 ms, loads
        # 50 ms)
        (
            "a",
            [
                WorkerView("w0", queue_length=3, resident=frozenset({"a"}), prefill_s=0.05),
                WorkerView("w1", queue_length=0, cold_wait_s=0.05, prefill_s=0.05),
            ],
            {},
            ("w0", "resident"),
        ),
        # fewest pending prefills first, however many sequences decode: among resident workers
        (
            "a",
            [
                WorkerView("w0", queue_length=1, pending=1, resident=frozenset({"a"})),
                WorkerView("w1", queue_length=4, resident=frozenset({"a"})),
            ],
            {},
            ("w1", "resident"),
        ),
        # ... and for the least-loaded worker
        (
            "",
            [WorkerView("w0", queue_length=1, pending=1), WorkerView("w1", queue_length=4)],
            {},
            ("w1", "least_loaded"),
        ),
        # base model -> least loaded
        (
            "",
            [WorkerView("w0", queue_length=5), WorkerView("w1", queue_length=1)],
            {},
            ("w1", "least_loaded"),
        ),
        # the resident worker is still prefilling another request (0.3 s) while w1 is idle and
        # loads there take 0.05 s: a cold start on w1 is sooner -> least loaded
        (
            "a",
            [
                WorkerView(
                    "w0", queue_length=1, pending=1, prefill_s=0.3, resident=frozenset({"a"})
                ),
                WorkerView("w1", queue_length=0, cold_wait_s=0.05),
            ],
            {"a": ["w0"]},
            ("w1", "least_loaded"),
        ),
        # the same with slow loads (2 s from remote storage): waiting is sooner -> resident
        (
            "a",
            [
                WorkerView(
                    "w0", queue_length=1, pending=1, prefill_s=0.3, resident=frozenset({"a"})
                ),
                WorkerView("w1", queue_length=0, cold_wait_s=2.0),
            ],
            {},
            ("w0", "resident"),
        ),
        # three pending prefills of 0.5 s outweigh a 1 s load
        (
            "a",
            [
                WorkerView(
                    "w0", queue_length=3, pending=3, prefill_s=0.5, resident=frozenset({"a"})
                ),
                WorkerView("w1", queue_length=0, cold_wait_s=1.0),
            ],
            {},
            ("w1", "least_loaded"),
        ),
        # pending prefills weigh before decoding sequences: w1 decodes 3 but has no prefill
        # queued, w0 one request awaiting its first token
        (
            "",
            [WorkerView("w0", queue_length=1, pending=1), WorkerView("w1", queue_length=3)],
            {},
            ("w1", "least_loaded"),
        ),
        # equal pending: the resident worker even with more sequences decoding (within slack)
        (
            "a",
            [
                WorkerView("w0", queue_length=3, pending=1, resident=frozenset({"a"})),
                WorkerView("w1", queue_length=1, pending=1),
            ],
            {},
            ("w0", "resident"),
        ),
        # not resident anywhere: cold on either worker, and the placement only breaks ties, so
        # not the placed worker with a prefill pending ...
        (
            "a",
            [WorkerView("w0", queue_length=0), WorkerView("w1", queue_length=1, pending=1)],
            {"a": ["w1"]},
            ("w0", "least_loaded"),
        ),
        # ... but the placed one among equally loaded workers (one copy where the placement
        # and the prefetcher expect it)
        (
            "a",
            [WorkerView("w0", queue_length=1), WorkerView("w1", queue_length=1)],
            {"a": ["w1"]},
            ("w1", "placed"),
        ),
        # not resident anywhere but loading on w0 (a request just sent there): join that load
        # rather than start a second one on the idle w1
        (
            "a",
            [
                WorkerView("w0", queue_length=1, pending=1, loading={"a"}),
                WorkerView("w1", queue_length=0),
            ],
            {},
            ("w0", "loading"),
        ),
        # ... unless its pending prefills outweigh a cold start on w1
        (
            "a",
            [
                WorkerView("w0", queue_length=3, pending=3, prefill_s=0.5, loading={"a"}),
                WorkerView("w1", queue_length=0, cold_wait_s=1.0),
            ],
            {},
            ("w1", "least_loaded"),
        ),
        # resident on w1 beats loading on w0
        (
            "a",
            [
                WorkerView("w0", queue_length=0, loading={"a"}),
                WorkerView("w1", queue_length=0, resident=frozenset({"a"})),
            ],
            {},
            ("w1", "resident"),
        ),
        # loading where the placement keeps it: joined even with the other worker idle
        (
            "a",
            [
                WorkerView("w0", queue_length=1, pending=1, loading=frozenset({"a"})),
                WorkerView("w1", queue_length=0),
            ],
            {"a": ["w0"]},
            ("w0", "loading"),
        ),
        # loading on a worker the placement moved it from: the request joins the load in
        # flight rather than start a second copy where the placement wants it
        (
            "a",
            [
                WorkerView("w0", queue_length=0, loading=frozenset({"a"})),
                WorkerView("w1", queue_length=0),
            ],
            {"a": ["w1"]},
            ("w0", "loading"),
        ),
        # not resident or loading anywhere, in one worker's host cache: that worker (its load
        # reads host memory), before the placement and with more queued than the least loaded
        (
            "a",
            [
                WorkerView("w0", queue_length=0),
                WorkerView("w1", queue_length=2, host_cached=frozenset({"a"})),
            ],
            {"a": ["w0"]},
            ("w1", "host"),
        ),
        # ... but not when its pending prefills outweigh a cold start on the least loaded
        (
            "a",
            [
                WorkerView("w0", queue_length=0, cold_wait_s=1.0),
                WorkerView(
                    "w1", queue_length=3, pending=3, prefill_s=0.5, host_cached=frozenset({"a"})
                ),
            ],
            {},
            ("w0", "least_loaded"),
        ),
        # in every worker's host cache: no worker saves a source read, the placement breaks
        # the tie as before
        (
            "a",
            [
                WorkerView("w0", queue_length=0, host_cached=frozenset({"a"})),
                WorkerView("w1", queue_length=0, host_cached=frozenset({"a"})),
            ],
            {"a": ["w1"]},
            ("w1", "placed"),
        ),
        # a load in flight is joined before a host copy is read elsewhere
        (
            "a",
            [
                WorkerView("w0", queue_length=0, loading=frozenset({"a"})),
                WorkerView("w1", queue_length=0, host_cached=frozenset({"a"})),
            ],
            {},
            ("w0", "loading"),
        ),
        # the host-caching worker has no room for the adapter while another has: the cold
        # start goes where the load can start now
        (
            "a",
            [
                WorkerView("w0", queue_length=0, room_bytes=50 * MB),
                WorkerView("w1", queue_length=0, room_bytes=0, host_cached=frozenset({"a"})),
            ],
            {},
            ("w0", "least_loaded"),
        ),
    ],
)
def test_rank_aware_routing(adapter, workers, placement, expected) -> None:
    assert route_rank_aware(adapter, workers, placement, size_bytes=10 * MB) == expected


def test_pending_slack_applies_until_the_workers_have_figures() -> None:
    ws = [
        WorkerView("w0", queue_length=2, pending=2, resident=frozenset({"a"})),
        WorkerView("w1", queue_length=0),
    ]
    assert route_rank_aware("a", ws, {}) == ("w1", "least_loaded")  # default slack 1
    assert route_rank_aware("a", ws, {}, pending_slack=0) == ("w1", "least_loaded")
    assert route_rank_aware("a", ws, {}, pending_slack=2) == ("w0", "resident")
    one = [WorkerView("w0", queue_length=1, pending=1, resident=frozenset({"a"})), ws[1]]
    assert route_rank_aware("a", one, {}) == ("w0", "resident")
    assert route_rank_aware("a", one, {}, pending_slack=0) == ("w1", "least_loaded")


def test_leaving_for_a_read_from_the_source_is_weighed_against_that_read() -> None:
    """A request leaves the worker holding its adapter for one that would read it from the
    source only when the prefills it would wait behind take longer than that read
    (``source_load_s``), however long the holder's queue (requests waiting for the same load
    are queued there too); a copy from the other worker's host cache is weighed as before."""
    held = frozenset({"a"})

    def holder(queue: int, pending: int, **kw) -> WorkerView:
        return WorkerView("w0", queue_length=queue, pending=pending, prefill_s=0.1, **kw)

    slow_source = WorkerView("w1", cold_wait_s=0.02, source_load_s=4.0)
    # 10 more queued (past the queue slack of 4) and 10 pending prefills: 1 s < a 4 s read
    for where in ({"resident": held}, {"loading": held}):
        ws = [holder(10, 10, **where), slow_source]
        assert route_rank_aware("a", ws, {})[0] == "w0"
    # 50 pending prefills: 5 s > 4 s -> leave
    assert route_rank_aware("a", [holder(50, 50, resident=held), slow_source], {}) == (
        "w1",
        "least_loaded",
    )
    # the same queue where w1 holds the adapter in host memory: the queue slack decides
    cached = WorkerView("w1", cold_wait_s=0.02, source_load_s=4.0, host_cached=held)
    assert route_rank_aware("a", [holder(10, 10, resident=held), cached], {})[0] == "w1"
    # no source read measured yet on w1 (0): the queue slack decides
    unknown = WorkerView("w1", cold_wait_s=0.02)
    assert route_rank_aware("a", [holder(10, 10, resident=held), unknown], {})[0] == "w1"
    # loads from a fast source (a local disk, 0.05 s) are left for as readily as host copies
    fast = WorkerView("w1", cold_wait_s=0.02, source_load_s=0.05)
    assert route_rank_aware("a", [holder(1, 1, resident=held), fast], {})[0] == "w1"


def test_turn_rotates_the_order_ties_are_broken_in() -> None:
    idle = [WorkerView(f"w{i}") for i in range(3)]
    chosen = [route_rank_aware("", idle, {}, turn=t)[0] for t in range(7)]
    assert chosen == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]
    # a turn rotates ties only: the least loaded still wins
    busy = [WorkerView("w0"), WorkerView("w1", pending=1), WorkerView("w2")]
    assert [route_rank_aware("", busy, {}, turn=t)[0] for t in range(3)] == ["w0", "w2", "w2"]


def test_round_robin_ignores_residency_and_cycles() -> None:
    router = RoundRobinRouter()
    ws = [WorkerView("w1", resident=frozenset({"a"})), WorkerView("w0")]
    assert [router.route(ws) for _ in range(4)] == ["w0", "w1", "w0", "w1"]
    with pytest.raises(ValueError):
        router.route([])


def test_prefetch_selector_hysteresis_and_residency() -> None:
    sel = PrefetchSelector(high=1.0, low=0.5)
    ws = [
        WorkerView("w0", pool_bytes=100 * MB, resident=frozenset({"r"})),
        WorkerView("w1", 100 * MB),
    ]
    placement = {"a": ["w1"], "b": ["w0"], "r": ["w0"]}
    demand = {
        "a": AdapterDemand(8, MB, 2.0),
        "b": AdapterDemand(8, MB, 0.7),
        "r": AdapterDemand(8, MB, 5.0),
    }
    plan = sel.select(demand, placement, ws)
    assert plan == {"w0": [], "w1": [("a", 2.0)]}  # b below high; r already resident
    demand["a"] = AdapterDemand(8, MB, 0.6)  # drops below high but stays above low: still hot
    demand["b"] = AdapterDemand(8, MB, 1.2)
    plan = sel.select(demand, placement, ws)
    assert plan == {"w0": [("b", 1.2)], "w1": [("a", 0.6)]}
    demand["a"] = AdapterDemand(8, MB, 0.4)
    assert sel.select(demand, placement, ws)["w1"] == []


def test_prefetch_of_an_adapter_in_a_host_cache_goes_only_to_a_worker_holding_it() -> None:
    # "h" is in w1's and w2's host caches: a cold start of it is a host copy there, so it is
    # not read from the source onto w0 ahead of demand. Placed on w0 alone, it is copied in
    # on a holder (w1 and w2 tie; w1 by id); placed on w0 and w2, on w2. "s" is in no host
    # cache: prefetched where it is placed. "r", held by w1 and resident on w2, is placed on
    # w0: a second copy is not made.
    ws = [
        WorkerView("w0", pool_bytes=100 * MB),
        WorkerView("w1", pool_bytes=100 * MB, host_cached=frozenset({"h", "r"})),
        WorkerView(
            "w2", pool_bytes=100 * MB, host_cached=frozenset({"h"}), resident=frozenset({"r"})
        ),
    ]
    demand = {
        "h": AdapterDemand(8, MB, 3.0),
        "s": AdapterDemand(8, MB, 2.0),
        "r": AdapterDemand(8, MB, 1.0),
    }
    sel = PrefetchSelector(high=0.5, low=0.25)
    assert sel.select(demand, {"h": ["w0"], "s": ["w0"], "r": ["w0"]}, ws) == {
        "w0": [("s", 2.0)],
        "w1": [("h", 3.0)],
        "w2": [],
    }
    assert sel.select(demand, {"h": ["w0", "w2"], "s": ["w1"], "r": ["w0"]}, ws) == {
        "w0": [],
        "w1": [("s", 2.0)],
        "w2": [("h", 3.0)],
    }


def test_prefetch_respects_count_and_pool_budget() -> None:
    sel = PrefetchSelector(high=0.1, low=0.1)
    ws = [WorkerView("w0", pool_bytes=10 * MB)]
    demand = {f"a{i}": AdapterDemand(8, 4 * MB, 10.0 - i) for i in range(5)}
    placement = {a: ["w0"] for a in demand}
    assert [a for a, _ in sel.select(demand, placement, ws)["w0"]] == ["a0", "a1"]
    assert (
        len(
            sel.select(
                demand, placement, [WorkerView("w0", pool_bytes=100 * MB)], max_per_worker=3
            )["w0"]
        )
        == 3
    )


def test_placement_prefers_where_the_adapter_is_already_resident() -> None:
    demand = {"a": AdapterDemand(16, MB, 2.0), "b": AdapterDemand(16, MB, 2.0)}
    ws = [
        WorkerView("w0", 100 * MB, 100 * MB),
        WorkerView("w1", 100 * MB, 100 * MB, resident=frozenset({"a"})),
    ]
    placement, _ = plan_placement(demand, ws)
    assert placement == {"a": ["w1"], "b": ["w0"]}
    # ... and the prefetch plan then has nothing to load for "a".
    plan = PrefetchSelector(high=0.1, low=0.05).select(demand, placement, ws)
    assert plan == {"w0": [("b", 2.0)], "w1": []}


def test_placement_keeps_an_adapter_where_it_is_loading() -> None:
    # "a" is on its way into w1's pool (a request was just routed there): the placement keeps
    # it there rather than on the emptier w0, so routing and the load agree
    demand = {"a": AdapterDemand(16, MB, 1.0), "b": AdapterDemand(16, MB, 1.0)}
    ws = [
        WorkerView("w0", 100 * MB, 100 * MB),
        WorkerView("w1", 100 * MB, 100 * MB, queue_length=1, loading=frozenset({"a"})),
    ]
    placement, _ = plan_placement(demand, ws)
    assert placement == {"a": ["w1"], "b": ["w0"]}
    # a resident copy elsewhere comes before the load
    ws[0] = WorkerView("w0", 100 * MB, 100 * MB, resident=frozenset({"a"}))
    placement, _ = plan_placement(demand, ws)
    assert placement["a"] == ["w0"]


def test_cold_starts_go_where_the_pool_has_room_now() -> None:
    size = 10 * MB
    full = {"room_bytes": 2 * MB}  # every adapter it could evict is leased
    # placed on w0, whose pool is pinned full: the load goes to w1, which has room
    ws = [WorkerView("w0", **full), WorkerView("w1", queue_length=2, room_bytes=50 * MB)]
    assert route_rank_aware("a", ws, {"a": ["w0"]}, size_bytes=size) == ("w1", "least_loaded")
    # without the size (unknown) the placement decides, as before
    assert route_rank_aware("a", ws, {"a": ["w0"]}) == ("w0", "placed")
    # nobody has room: the load waits wherever the placement puts it
    ws = [WorkerView("w0", **full), WorkerView("w1", queue_length=2, **full)]
    assert route_rank_aware("a", ws, {"a": ["w0"]}, size_bytes=size) == ("w0", "placed")
    # room unknown (-1) counts as room; a resident copy is still preferred
    ws = [
        WorkerView("w0", resident=frozenset({"a"}), **full),
        WorkerView("w1", room_bytes=-1),
    ]
    assert route_rank_aware("a", ws, {}, size_bytes=size) == ("w0", "resident")
    # the resident worker is weighed against a cold start where there is room (w2), not
    # against the idle w1 whose load would wait
    ws = [
        WorkerView("w0", pending=2, prefill_s=0.5, resident=frozenset({"a"}), room_bytes=0),
        WorkerView("w1", cold_wait_s=0.1, **full),
        WorkerView("w2", pending=1, cold_wait_s=1.0, room_bytes=50 * MB),
    ]
    assert route_rank_aware("a", ws, {}, size_bytes=size) == ("w0", "resident")
    assert route_rank_aware("a", ws, {}) == ("w1", "least_loaded")


def test_a_resident_copy_is_kept_when_no_worker_has_room_for_a_load() -> None:
    """A cold start where every evictable adapter is leased waits for a running request to
    end, so pending prefills on the resident worker do not send the request there (35r2's
    9.6 s adapter wait); its queue still can."""
    size = 10 * MB
    full = {"room_bytes": 2 * MB}
    resident = {"resident": frozenset({"a"}), "room_bytes": 0}
    ws = [
        WorkerView("w0", queue_length=3, pending=3, prefill_s=0.5, **resident),
        WorkerView("w1", cold_wait_s=0.02, **full),
    ]
    assert route_rank_aware("a", ws, {}, size_bytes=size) == ("w0", "resident")
    # with room on w1 the same pending prefills outweigh its 0.02 s cold start
    roomy = [ws[0], WorkerView("w1", cold_wait_s=0.02, room_bytes=50 * MB)]
    assert route_rank_aware("a", roomy, {}, size_bytes=size) == ("w1", "least_loaded")
    # a copy on its way in is joined the same way
    loading = [
        WorkerView("w0", queue_length=3, pending=3, prefill_s=0.5, loading={"a"}, room_bytes=0),
        ws[1],
    ]
    assert route_rank_aware("a", loading, {}, size_bytes=size) == ("w0", "loading")
    # a queue longer by more than queue_slack still moves it
    long = [WorkerView("w0", queue_length=9, pending=3, prefill_s=0.5, **resident), ws[1]]
    assert route_rank_aware("a", long, {}, size_bytes=size) == ("w1", "least_loaded")
