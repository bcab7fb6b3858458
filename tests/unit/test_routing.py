"""The routing state the gateway and the simulated gateway share (services.common.routing)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict

import pytest

from services.common.registry import WorkerRecord
from services.common.routing import ROUTED_GRACE_S, RoutingState, WorkerView, worker_view

MB = 1 << 20


def hb(worker_id: str, **kw: object) -> WorkerView:
    return WorkerView(worker_id, pool_bytes=100 * MB, free_bytes=100 * MB, **kw)  # type: ignore[arg-type]


def test_the_queue_is_at_least_the_requests_in_flight_and_pending_is_counted() -> None:
    gauge: list[tuple[str, int]] = []
    state = RoutingState(on_pending=lambda w, n: gauge.append((w, n)))
    beats = [(hb("w0", queue_length=2), 10.0), (hb("w1"), 10.0)]
    assert state.route("", beats, {}, size_bytes=0, now=10.5) == ("w1", "least_loaded")
    assert state.route("", beats, {}, size_bytes=0, now=10.5) == ("w0", "least_loaded")
    assert state.in_flight("w1") == (1, 1)
    (v0, v1) = state.views(beats)
    assert (v0.queue_length, v0.pending) == (2, 1)  # the heartbeat's 2 covers the 1 in flight
    assert (v1.queue_length, v1.pending) == (1, 1)
    state.first_token("w1")
    state.done("w1", pending=False)
    state.done("w0", pending=True)
    assert state.in_flight("w0") == state.in_flight("w1") == (0, 0)
    assert gauge == [("w1", 1), ("w0", 1), ("w1", 0), ("w0", 0)]


def test_a_load_it_started_counts_until_a_heartbeat_taken_the_grace_later() -> None:
    state = RoutingState()
    w0 = hb("w0", room_bytes=30 * MB, resident=frozenset({"r"}))
    state.route("a", [(w0, 100.0)], {}, size_bytes=10 * MB, now=100.2)
    state.route("r", [(w0, 100.0)], {}, size_bytes=10 * MB, now=100.3)  # resident: no load
    assert state.since_heartbeat(w0, 100.0) == ({"a"}, 20 * MB)
    # a heartbeat taken within the grace may not show it yet: still counted, bytes and all
    assert state.since_heartbeat(w0, 100.2 + ROUTED_GRACE_S - 0.1) == ({"a"}, 20 * MB)
    # one that does show it loading: not counted twice
    loading = hb("w0", room_bytes=20 * MB, resident=frozenset({"r"}), loading=frozenset({"a"}))
    assert state.since_heartbeat(loading, 100.5) == ({"a"}, 20 * MB)
    # one taken later speaks for it: forgotten
    assert state.since_heartbeat(w0, 100.2 + ROUTED_GRACE_S + 0.1) == (set(), 30 * MB)


def test_room_never_goes_below_zero_and_unknown_room_stays_unknown() -> None:
    state = RoutingState()
    small = hb("w0", room_bytes=5 * MB)
    unknown = hb("w1")  # room_bytes -1
    state.record("w0", "a", 10 * MB, 1.0)
    state.record("w1", "a", 10 * MB, 1.0)
    assert state.since_heartbeat(small, 1.0) == ({"a"}, 0)
    assert state.since_heartbeat(unknown, 1.0) == ({"a"}, -1)


def test_a_load_routed_before_a_clock_skewed_heartbeat_is_not_counted() -> None:
    """A worker's heartbeat time comes from its own clock: a routing stamped more than the
    grace before it is the heartbeat's to report."""
    state = RoutingState()
    w0 = hb("w0", room_bytes=30 * MB)
    state.views([(w0, 100.0)])
    state.record("w0", "a", 10 * MB, 100.0 - ROUTED_GRACE_S - 0.5)
    assert state.since_heartbeat(w0, 100.0) == (set(), 30 * MB)
    state.record("w0", "a", 10 * MB, 100.5)  # routed again: counted from now
    assert state.since_heartbeat(w0, 100.0) == ({"a"}, 20 * MB)


def test_a_worker_whose_call_failed_is_left_out_until_it_heartbeats_again() -> None:
    state = RoutingState()
    w0 = WorkerRecord("w0", "x", heartbeat_unix=5.0)
    w1 = WorkerRecord("w1", "x", heartbeat_unix=5.0)
    state.failed("w0", 5.0)
    assert state.usable([w0, w1]) == [w1]
    state.failed("w1", 5.0)
    assert state.usable([w0, w1]) == [w0, w1]  # every one failed: all of them
    again = WorkerRecord("w0", "x", heartbeat_unix=6.0)
    assert state.usable([again, w1]) == [again]


def test_equally_loaded_workers_take_turns_and_round_robin_goes_by_id() -> None:
    state = RoutingState()
    beats = [(hb("w1"), 0.0), (hb("w0"), 0.0), (hb("w2"), 0.0)]
    chosen = []
    for _ in range(6):
        w, _reason = state.route("", beats, {}, size_bytes=0, now=0.0)
        state.done(w, pending=True)
        chosen.append(w)
    assert chosen == ["w1", "w0", "w2"] * 2  # in the order given, rotating
    rr = RoutingState("round_robin")
    views = rr.views(beats)
    assert [rr.pick("a", views, {})[0] for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    assert rr.pick("a", views, {})[1] == "round_robin"
    with pytest.raises(ValueError, match="routing must be"):
        RoutingState("random")


def test_counts_given_replace_its_own_and_refresh_rebuilds_an_unchanged_time() -> None:
    state = RoutingState()
    beat = hb("w0", queue_length=1, room_bytes=50 * MB)
    state.route("a", [(beat, 3.0)], {}, size_bytes=10 * MB, now=3.0)
    (view,) = state.views([(beat, 3.0)], counts=[(7, 4)])
    assert (view.queue_length, view.pending, view.room_bytes) == (7, 4, 40 * MB)
    changed = hb("w0", queue_length=1, room_bytes=45 * MB, loading=frozenset({"a"}))
    (view,) = state.views([(changed, 3.0)], counts=[(0, 0)])
    assert view.room_bytes == 40 * MB  # same time: taken as the same heartbeat
    (view,) = state.views([(changed, 3.0)], counts=[(0, 0)], refresh=True)
    assert (view.room_bytes, set(view.loading)) == (45 * MB, {"a"})


def _since_heartbeat_from_scratch(
    routed: dict[str, tuple[float, int]], beat: WorkerView, beat_t: float
) -> tuple[set[str], int]:
    """What a worker's loading and room are, recomputed from every load routed there (the
    rule the state keeps up to date incrementally)."""
    loading = set(beat.loading)
    room = beat.room_bytes
    for a, (t, size) in routed.items():
        if t >= beat_t - ROUTED_GRACE_S and a not in loading and a not in beat.resident:
            loading.add(a)
            if room >= 0:
                room = max(0, room - size)
    return loading, room


@pytest.mark.parametrize("seed", range(20))
def test_the_views_kept_up_to_date_equal_the_views_recomputed_from_scratch(seed: int) -> None:
    rng = random.Random(seed)
    adapters = [f"a{i}" for i in range(6)]
    sizes = {a: rng.choice([0, 3, 10, 40]) * MB for a in adapters}
    state = RoutingState()
    routed: dict[str, dict[str, tuple[float, int]]] = {"w0": {}, "w1": {}}
    now = 0.0
    beats: dict[str, tuple[WorkerView, float]] = {}

    def heartbeat(w: str) -> None:
        view = WorkerView(
            w,
            resident=frozenset(rng.sample(adapters, rng.randint(0, 2))),
            loading=frozenset(rng.sample(adapters, rng.randint(0, 2))),
            room_bytes=rng.choice([-1, 0, 20 * MB, 60 * MB]),
        )
        # each heartbeat later than the last, but skewed against this clock (ahead or behind)
        last = beats[w][1] if w in beats else -1e9
        beats[w] = (view, max(last + 0.01, now + rng.choice([-2.0, -0.3, 0.0, 1.5])))

    for w in ("w0", "w1"):
        heartbeat(w)
    for _ in range(200):
        now += rng.choice([0.0, 0.1, 0.4, 0.9])
        if rng.random() < 0.2:
            heartbeat(rng.choice(["w0", "w1"]))
        for w, (_, t) in beats.items():  # loads older than the grace are forgotten
            routed[w] = {a: v for a, v in routed[w].items() if v[0] >= t - ROUTED_GRACE_S}
        a = rng.choice(adapters)
        chosen, _ = state.route(a, list(beats.values()), {}, size_bytes=sizes[a], now=now)
        routed[chosen].setdefault(a, (now, sizes[a]))
        state.done(chosen, pending=True)
        for w, (view, t) in beats.items():
            assert state.since_heartbeat(view, t) == _since_heartbeat_from_scratch(
                routed[w], view, t
            )


def test_worker_view_reads_a_heartbeat() -> None:
    record = WorkerRecord(
        "w0",
        "x",
        queue_length=2,
        running=3,
        resident=["a"],
        loading=["b"],
        room_bytes=7,
        host_cached=["a", "c"],
        pool={"pool_bytes": 100, "live_bytes": 30},
        prefill_s=0.5,
        cold_wait_s=0.25,
        source_load_s=3.5,
    )
    view = worker_view(WorkerRecord.from_json(json.dumps(asdict(record))))  # as heartbeats store it
    assert (view.queue_length, view.free_bytes, view.room_bytes) == (5, 70, 7)
    assert (view.prefill_s, view.cold_wait_s, view.source_load_s) == (0.5, 0.25, 3.5)
    assert view.resident == {"a"} and set(view.loading) == {"b"}
    assert view.host_cached == {"a", "c"}
    # the gateway's views keep the heartbeat's host cache (step "host" of the rule)
    (kept,) = RoutingState().views([(view, 1.0)])
    assert kept.host_cached == {"a", "c"} and kept.source_load_s == 3.5
    cached = hb("w0", host_cached=frozenset({"c"}))
    routed = RoutingState().route("c", [(cached, 1.0), (hb("w1"), 1.0)], {}, size_bytes=0, now=1.5)
    assert routed == ("w0", "host")


@pytest.mark.parametrize(("turns", "spread"), [((0, 0), [4, 2, 2]), ((0, 1), [3, 3, 2])])
def test_gateways_starting_at_their_own_turns_spread_their_first_cold_adapters(
    turns: tuple[int, int], spread: list[int]
) -> None:
    """Two gateways, each counting only its own requests, route four requests each for cold
    adapters over three idle workers (the heartbeats show none of them yet). Rotating alike,
    both send their first and fourth to the same worker (4, 2, 2: the adapters' residency
    keeps that skew afterwards); starting at their own turns (their start index), they spread
    them as evenly as eight over three goes (3, 3, 2)."""
    heartbeats = [(WorkerView(f"w{i}", pool_bytes=1 << 30), 1.0) for i in range(3)]
    gateways = [RoutingState(first_turn=t) for t in turns]
    sent: dict[str, int] = {}
    for n in range(8):
        chosen, reason = gateways[n % 2].route(
            f"a{n}", heartbeats, {}, size_bytes=1 << 20, now=1.0 + n / 100
        )
        assert reason == "least_loaded"
        sent[chosen] = sent.get(chosen, 0) + 1
    assert sorted(sent.values(), reverse=True) == spread


def test_a_cold_load_another_gateway_started_is_joined() -> None:
    """``note_peer_load``: an adapter another gateway just sent cold to w1 counts as loading
    there, so this gateway's request for it joins that load instead of starting a copy on
    the idle w0."""
    state = RoutingState()
    beats = [(hb("w0"), 100.0), (hb("w1", queue_length=1), 100.0)]
    assert state.route("a", beats, {}, size_bytes=10 * MB, now=100.1) == ("w0", "least_loaded")
    other = RoutingState()
    other.note_peer_load(beats, "w1", "b", 10 * MB, now=100.2)
    assert other.route("b", beats, {}, size_bytes=10 * MB, now=100.3) == ("w1", "loading")
    other.note_peer_load(beats, "w9", "c", 10 * MB, now=100.2)  # not a worker here: ignored
    assert other.route("c", beats, {}, size_bytes=10 * MB, now=100.3)[1] == "least_loaded"
