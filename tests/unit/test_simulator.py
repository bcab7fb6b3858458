"""The trace-driven cluster simulator: exact event timing, determinism, conservation, reports."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plora.policies import POLICIES, get_policy
from plora.replay.report import completed_by_both_block
from plora.simulator.calibrate import fit_replay, solo_mask
from plora.simulator.engine import (
    AdapterSet,
    ClusterSimulation,
    SimConfig,
    SimResult,
    build_adapter_set,
    make_feed,
    simulate,
)
from plora.simulator.presets import (
    CPU_PRESET,
    H100_8B_PRESET,
    StepTimeModel,
    alibaba_load_latencies,
    get_preset,
    source_latencies,
)
from plora.simulator.report import (
    compare_to_replay,
    completed_by_both,
    paper_comparison,
    search_min_workers,
    slo_attainment,
    slo_vs_load,
    summarize,
)
from plora.simulator.run import (
    add_arguments,
    replay_host_cache_bytes,
    replay_matched_inputs,
    run,
)
from plora.traces import Trace
from services.common.errors import ConfigError
from services.worker.store_types import staging_key

MB = 1 << 20
DATA = Path("../shared/data/traces")
ALIBABA = DATA / "alibaba_genai2026_lora_requests_nov.csv"

# A preset with round numbers: 10 ms steps whatever the batch, loads of exactly 1 s.
SIMPLE = CPU_PRESET.with_overrides(
    step=StepTimeModel(0.01, 0.0, 0.0, 0.0, 0.0, rank_mode="sum"),
    source="fixed",
    source_fixed_s=1.0,
    source_bytes_per_s=1e30,
    h2d_bytes_per_s=1e30,
    network_s=0.0,
    shared_compute=0.0,
)
# The cpu preset's sizes with a step model fast enough for the synthetic loads below.
FAST = CPU_PRESET.with_overrides(
    step=StepTimeModel(0.01, 0.001, 0.0002, 0.001, 1e-6, rank_mode="sum"), shared_compute=0.0
)


def _trace(times, keys, out=3, prompt=10) -> Trace:
    return Trace.from_arrays(times, keys, prompt, out)


def _sim(trace: Trace, preset=SIMPLE, policy="baseline", workers=1, k=4, **cfg):
    adapters = build_adapter_set(trace, preset, k, seed=0)
    return ClusterSimulation(
        trace, adapters, get_policy(policy), SimConfig(preset=preset, workers=workers, **cfg)
    )


def _run(trace: Trace, preset=SIMPLE, policy="baseline", workers=1, k=4, **cfg):
    sim = _sim(trace, preset, policy, workers, k, **cfg)
    return sim, sim.run()


# ------------------------------------------------------------------------------ timing
def test_event_timing_matches_hand_computation() -> None:
    # r0 at 0 (cold: 1 s load), r1 at 0.5 (same adapter: waits for the same load), r2 at 1.015
    # (warm, joins the batch at the next step boundary 1.02).
    tr = _trace([0.0, 0.5, 1.015], ["a", "a", "a"])
    _, res = _run(tr)
    np.testing.assert_allclose(res.first_token_s, [1.01, 1.01, 1.03], atol=1e-9)
    np.testing.assert_allclose(res.done_s, [1.03, 1.03, 1.05], atol=1e-9)
    np.testing.assert_allclose(res.ttft_s, [1.01, 0.51, 0.015], atol=1e-9)
    assert res.cold.tolist() == [True, True, False]
    np.testing.assert_allclose(res.cold_wait_s, [1.0, 0.5, 0.0], atol=1e-9)
    assert res.counters["loads_source"] == 1
    assert res.counters["steps"] == 5


@pytest.mark.parametrize(
    ("max_batch", "first", "done"),
    [
        (1, [1.01, 1.04], [1.03, 1.06]),  # r1 waits for r0 to leave the batch
        (2, [1.01, 1.01], [1.03, 1.03]),  # both admitted in one prefill step
    ],
)
def test_batch_limit(max_batch, first, done) -> None:
    preset = SIMPLE.with_overrides(max_batch_size=max_batch, max_num_batched_tokens=512)
    _, res = _run(_trace([0.0, 0.0], ["a", "a"]), preset)
    np.testing.assert_allclose(res.first_token_s, first, atol=1e-9)
    np.testing.assert_allclose(res.done_s, done, atol=1e-9)


def test_prefill_budget_splits_admission() -> None:
    # two 300-token prompts do not fit one 512-token step: the second is admitted a step later
    preset = SIMPLE.with_overrides(max_num_batched_tokens=512)
    _, res = _run(_trace([0.0, 0.0], ["a", "a"], prompt=300), preset)
    np.testing.assert_allclose(res.first_token_s, [1.01, 1.02], atol=1e-9)


def test_step_time_model_terms() -> None:
    m = StepTimeModel(1.0, 0.1, 0.01, 0.5, 0.001, rank_mode="max")
    # 2 rows, 10 prefill tokens, 3 segments, max rank 8
    assert m.step_s(2, 10, 3, 0.0, 8) == pytest.approx(1 + 0.2 + 0.1 + 0.5 * 3 * 8 + 0.001 * 12 * 8)
    s = StepTimeModel(1.0, 0.1, 0.01, 0.5, 0.001, rank_mode="sum")
    assert s.step_s(2, 10, 3, 400.0, 8) == pytest.approx(1 + 0.2 + 0.1 + 1.5 + 0.4)
    with pytest.raises(ValueError, match="rank_mode must be 'max' or 'sum', got 'avg'"):
        StepTimeModel(1.0, 0.1, 0.01, 0.5, 0.001, rank_mode="avg")


def test_shared_compute_slows_steps_of_concurrent_workers() -> None:
    # two requests on two workers at once: with a shared processor each step takes twice as long
    tr = _trace([0.0, 0.0], ["a", "b"])
    _, own = _run(tr, SIMPLE, "baseline", workers=2)
    _, shared = _run(tr, SIMPLE.with_overrides(shared_compute=1.0), "baseline", workers=2)
    np.testing.assert_allclose(own.done_s, [1.03, 1.03], atol=1e-9)
    np.testing.assert_allclose(shared.first_token_s, [1.01, 1.02], atol=1e-9)
    assert shared.done_s.max() > own.done_s.max()


def test_mixed_ranks_cost_more_under_padding() -> None:
    # padded kernels: the same rows cost more when one row has a larger rank
    m = H100_8B_PRESET.step
    assert m.step_s(32, 0, 2, 0, 64) > m.step_s(32, 0, 2, 0, 8)


def test_idle_workers_take_turns_as_the_gateway_routes() -> None:
    """Requests for new adapters arriving at an idle cluster: every worker ties, and the
    simulated gateway rotates the order ties are broken in per request (the gateway's own
    :class:`services.common.routing.RoutingState`), so they alternate instead of all going to
    worker-0."""
    tr = _trace([0.0, 10.0, 20.0, 30.0], ["a", "b", "c", "d"])
    _, res = _run(tr, SIMPLE, "plora-no-predictor", workers=2)
    assert res.worker.tolist() == [0, 1, 0, 1]


def test_adapter_sizes_follow_the_model() -> None:
    # SmolLM2: 30 layers x (q 1152 + k 768 + v 768 + o 1152 + 3 x 2112) x 4 bytes per rank
    assert CPU_PRESET.adapter_bytes(8) == 8 * 30 * 10176 * 4
    # Llama-3-8B: 32 x 81,920 x 2 bytes per rank = 5.24 MB
    assert H100_8B_PRESET.adapter_bytes(1) == 32 * 81920 * 2
    with pytest.raises(ValueError):
        get_preset("tpu")


# ------------------------------------------------------------------------------ invariants
def _zipf_trace(n=600, keys=40, rate=40.0, seed=1) -> Trace:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    w = (np.arange(keys) + 1.0) ** -1.1
    k = rng.choice(keys, size=n, p=w / w.sum())
    out = rng.integers(1, 40, n)
    prompt = rng.integers(5, 200, n)
    return Trace.from_arrays(t, [f"f{i}" for i in k], prompt, out)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_conservation_and_pool_invariants(policy: str) -> None:
    tr = _zipf_trace()
    # a pool of ~4 adapters forces evictions (and compaction or fragmentation)
    preset = FAST.with_overrides(pool_bytes=160 << 20, host_cache_bytes=320 << 20)
    sim, res = _run(tr, preset, policy, workers=3, k=24, forecaster="ewma")
    n = len(tr)
    ok = ~res.failed
    assert ok.sum() + res.failed.sum() == n
    assert ok.sum() > 0.9 * n
    assert np.all(np.isfinite(res.first_token_s[ok])) and np.all(np.isfinite(res.done_s[ok]))
    assert np.all(np.isnan(res.first_token_s[res.failed]))
    assert np.all(res.first_token_s[ok] >= res.arrival_s[ok])
    assert np.all(res.done_s[ok] >= res.first_token_s[ok])
    assert np.all(res.cold_wait_s >= 0)
    assert not np.any(res.cold_wait_s[~res.cold] > 0)
    assert res.counters["evictions"] > 0
    for w in sim.workers:
        w.allocator.check_invariants()
        assert sum(w.refcount) == 0  # every lease released
        assert w.n_run == 0 and w.n_waiting == 0 and not w.jobs
        live = sum(int(sim.adapters.nbytes[a]) for a in w.resident)
        assert w.allocator.live_bytes == live
    if POLICIES[policy].predictor:
        assert res.counters["predictor_ticks"] > 0


def test_determinism_from_seed() -> None:
    lat = alibaba_load_latencies()
    tr = _zipf_trace(n=400)
    preset = H100_8B_PRESET.with_overrides(pool_bytes=2 << 30, host_cache_bytes=4 << 30)

    def go(seed: int):
        return _run(
            tr, preset, "plora", 2, 24, seed=seed, source_latencies_s=lat, forecaster="lstm"
        )[1]

    a, b, c = go(3), go(3), go(4)
    for field in ("first_token_s", "done_s", "cold_wait_s", "worker"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert _timeless(a.counters) == _timeless(b.counters)
    assert not np.array_equal(a.cold_wait_s, c.cold_wait_s)  # other load-latency draws


def _timeless(counters: dict) -> dict:
    """Counters without the wall-clock ones."""
    return {k: v for k, v in counters.items() if k not in ("predictor_wall_s", "forecast_wait_s")}


def _same_outcome(a, b) -> None:
    for f in ("first_token_s", "done_s", "cold_wait_s", "worker", "cold", "failed"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert _timeless(a.counters) == _timeless(b.counters)


@pytest.mark.slow
def test_forecast_feed_shared_and_in_a_child_process_changes_nothing() -> None:
    """One feed shared by several policies, or computed in a child process ahead of the
    simulation, gives the same outcomes bit for bit as a feed made per simulation in-process."""
    tr = _zipf_trace(n=600)
    preset = FAST.with_overrides(pool_bytes=64 << 20, host_cache_bytes=1 << 30)
    adapters = build_adapter_set(tr, preset, 24, seed=0)
    cfg = SimConfig(preset=preset, workers=2, forecaster="ensemble")
    fresh = {p: simulate(tr, adapters, p, cfg) for p in ("plora", "plora-lru")}
    shared = make_feed(tr, adapters, cfg)
    child = make_feed(tr, adapters, cfg, process=True)
    assert child.child_process and len(child) == len(shared) > 10
    for p in ("plora", "plora-lru"):
        _same_outcome(simulate(tr, adapters, p, cfg, shared), fresh[p])
        _same_outcome(simulate(tr, adapters, p, cfg, child), fresh[p])
    assert child.done and shared.done and child.compute_s > 0
    for k in (0, len(child) // 2, len(child) - 1):
        for x, y in zip(child.get(k), shared.get(k), strict=True):
            np.testing.assert_array_equal(x, y)


def test_feed_must_match_the_trace_and_settings() -> None:
    tr = _zipf_trace(n=200)
    adapters = build_adapter_set(tr, FAST, 8, seed=0)
    cfg = SimConfig(preset=FAST, workers=1, forecaster="ewma")
    feed = make_feed(tr, adapters, cfg)
    assert feed.ticks[0] == cfg.tick_s and feed.ticks[-1] > tr.times[-1] >= feed.ticks[-2]
    with pytest.raises(ValueError, match="feed"):
        simulate(tr, adapters, "plora", SimConfig(preset=FAST, workers=1, forecaster="lstm"), feed)
    other = tr.sliced(0.0, float(tr.times[len(tr) // 2]))
    with pytest.raises(ValueError, match="feed"):
        simulate(other, build_adapter_set(other, FAST, 8, seed=0), "plora", cfg, feed)
    with pytest.raises(IndexError):
        feed.get(len(feed))


def test_predictor_prefetches_and_prefetched_adapters_serve() -> None:
    # a sliding periodic workload: every 3 s one key leaves the active window and one enters
    times, keys = [], []
    for s in range(120):
        for j in range(6):
            times.append(s * 1.0 + j * 0.01)
            keys.append(f"p{(s // 3 + j) % 10}")
    tr = Trace.from_arrays(times, keys, 20, 4)
    preset = FAST.with_overrides(pool_bytes=200 << 20, host_cache_bytes=2 << 30)
    _, plora = _run(tr, preset, "plora", 1, 10, forecaster="ewma")
    _, nopred = _run(tr, preset, "plora-no-predictor", 1, 10)
    c = plora.counters
    assert c["predictor_ticks"] >= 119
    assert c["prefetch_issued"] > 0 and c["prefetch_used"] > 0
    assert c["prefetch_used"] + c["prefetch_wasted"] <= c["prefetch_issued"]
    assert nopred.counters["prefetch_issued"] == 0 and nopred.counters["predictor_ticks"] == 0
    assert not plora.failed.any() and not nopred.failed.any()


def test_host_staging_takes_source_reads_off_cold_starts() -> None:
    # 4 adapters, 1 s source reads, instant host -> device copies. With host staging the
    # workers read the registered adapters one at a time from t = 0 (a loader thread stays
    # free: the demand at 0.5 s still waits exactly its own 1 s read); at 5 and 6 s the
    # adapters are in host memory: cold starts that wait nothing. The baseline reads on demand.
    tr = _trace([0.5, 5.0, 6.0], ["a", "b", "c"])
    _, staged = _run(tr, policy="plora-no-predictor", k=4)
    _, baseline = _run(tr, policy="baseline", k=4)
    assert staged.cold.tolist() == [True, True, True] == baseline.cold.tolist()
    np.testing.assert_allclose(staged.cold_wait_s, [1.0, 0.0, 0.0], atol=1e-9)
    np.testing.assert_allclose(baseline.cold_wait_s, [1.0, 1.0, 1.0], atol=1e-9)
    c = staged.counters
    assert (c["host_stages"], c["loads_source"], c["loads_host"]) == (3, 1, 2)
    assert baseline.counters["host_stages"] == 0
    assert get_policy("plora").host_staging and not get_policy("plora-no-staging").host_staging


def test_host_staging_reads_in_each_workers_own_order_whatever_the_forecast() -> None:
    # AdapterStore.stage gets the registered adapters by staging_key (rendezvous order with the
    # worker id), as the live worker passes them, and the simulated worker reads them in that
    # order, the predictor's forecast of the hot adapters notwithstanding
    sim = _sim(_trace([100.0], ["a"]), policy="plora")
    w = sim.workers[0]
    names = sim.adapters.names
    sim.run()
    staged = sorted(names, key=lambda a: staging_key(a, "worker-0"))
    used = names[int(sim.req_adapter[0])]  # the request at 100 s moved it to the LRU end
    staged.remove(used)
    assert list(w.host._items) == [*staged, used]  # noqa: SLF001 - the cache's order
    # another worker's order differs (16 adapters: two orders agree with odds 1 in 16!)
    many = [f"adapter-{i:03d}" for i in range(16)]
    orders = [sorted(many, key=lambda a, w=w: staging_key(a, w)) for w in ("worker-0", "worker-1")]
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == many


@pytest.mark.parametrize(("queued", "staging"), [("prefetch", True), ("demand", False)])
def test_host_staging_waits_for_a_queued_demand_load_not_for_a_queued_prefetch(
    queued: str, staging: bool
) -> None:
    # AdapterStore._stager's rule: with the only loader thread busy, a queued prefetch does
    # not hold a staging read back; a queued demand load does.
    sim = _sim(
        _trace([0.0, 0.0], ["a", "b"]), SIMPLE.with_overrides(loader_threads=1), policy="plora"
    )
    w = sim.workers[0]
    a, b = sim.req_adapter
    c = next(i for i in range(4) if i not in (a, b))
    w.staging.clear()
    assert w.accept(0, a, 0.0) and w.active == 1  # the demand load takes the loader thread
    if queued == "prefetch":
        w.prefetch([(b, 5.0)], 0.0)
    else:
        assert w.accept(1, b, 0.0)
    assert len(w.job_heap) == 1 and not w.staging_active
    w.staging.append(c)
    w.start_jobs(0.0)
    assert w.staging_active is staging


def test_cold_starts_go_to_a_worker_holding_the_adapter_in_host_memory() -> None:
    # 16 adapters of 9-74 MB (552 MB), host caches of 280 MB: each worker stages what fits, in
    # its own order, so the two hold different sets. After staging (16 reads of 1 s at most,
    # done long before 100 s), one request per adapter, 1 s apart, those some host cache holds
    # first: each of those goes to a worker holding it (reason "host" where only one does) and
    # waits for nothing (instant host-to-device copies); only the adapters no host cache holds
    # are read from the source (1 s). (The 140 MB pools compact now and then: copies of a
    # few ms at the cpu preset's device bandwidth.)
    preset = SIMPLE.with_overrides(pool_bytes=140 * MB, host_cache_bytes=280 * MB)
    probe = _trace([0.0], ["k"])
    adapters = build_adapter_set(probe, preset, 16, seed=0)
    staged = {}
    for w in ("worker-0", "worker-1"):
        free, held = preset.host_cache_bytes, set()
        for i in sorted(range(16), key=lambda i, w=w: staging_key(adapters.names[i], w)):
            if int(adapters.nbytes[i]) <= free:
                free -= int(adapters.nbytes[i])
                held.add(i)
        staged[w] = held
    one, both = staged["worker-0"] ^ staged["worker-1"], staged["worker-0"] & staged["worker-1"]
    neither = set(range(16)) - one - both
    assert one and neither  # each worker holds adapters the other does not
    order = [*sorted(one), *sorted(both), *sorted(neither)]
    tr = _trace([100.0 + j for j in range(16)], [f"k{j}" for j in range(16)])
    sim = ClusterSimulation(
        tr,
        AdapterSet(adapters.names, adapters.ranks, adapters.nbytes, np.array(order)),
        get_policy("plora-no-predictor"),
        SimConfig(preset=preset, workers=2),
    )
    res = sim.run()
    held_by = [{w for w, h in staged.items() if i in h} for i in order]
    assert [sim.workers[int(w)].name in h for w, h in zip(res.worker, held_by, strict=True)] == [
        bool(h) for h in held_by
    ]
    expected_wait = [0.0 if h else 1.0 for h in held_by]  # + compaction copies, < 20 ms
    np.testing.assert_allclose(res.cold_wait_s, expected_wait, atol=0.02)
    assert res.counters["loads_source"] == len(neither)
    assert res.counters["routed_by_reason"]["host"] == len(one)


def test_the_ablation_over_requests_both_policies_completed() -> None:
    # three requests; the no-predictor run fails the slow one (a wait for room that timed out)
    # that the plora run served after 35 s: its mean and p99 over completed requests look
    # better, over the two requests both completed the runs are level
    def result(ttft: list[float], failed: list[bool]) -> SimResult:
        n = len(ttft)
        t = np.array(ttft)
        f = np.array(failed)
        return SimResult(
            "p", 1, np.zeros(n), np.where(f, np.nan, t), np.where(f, np.nan, t + 1.0),
            np.ones(n, np.int64), np.zeros(n, bool), np.zeros(n), f, np.zeros(n, np.int64),
            {}, 0.0, n,
        )  # fmt: skip

    plora = result([1.0, 2.0, 35.0], [False, False, False])
    nopred = result([1.0, 2.0, 0.0], [False, False, True])
    paired = completed_by_both(plora, nopred)
    assert paired["requests"] == 2
    assert paired["ttft_mean_s"] == [1.5, 1.5]
    assert paired["ttft_p99_s"][0] == paired["ttft_p99_s"][1] == pytest.approx(1.99)
    block = completed_by_both_block([paired, completed_by_both(nopred, nopred)])
    assert block["requests"] == 2.0 and block["ttft_reduction"] == 0.0
    assert block["seed_runs"]["ttft_reduction"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="different traces"):
        completed_by_both(plora, result([1.0], [False]))


def test_overload_rejects_and_fails_cleanly() -> None:
    preset = SIMPLE.with_overrides(max_queue=2)
    tr = _trace([0.0] * 6, ["a"] * 6)
    _, res = _run(tr, preset, "baseline", workers=1)
    assert res.failed.sum() == 4  # all six wait for the load: 2 queued, 4 rejected
    assert res.counters["failed_by_reason"] == {"OverloadedError": 4}
    assert res.counters["rejected"] == 4
    np.testing.assert_array_equal(res.failed_s[res.failed], 0.0)  # rejected on arrival
    assert np.all(np.isnan(res.failed_s[~res.failed]))
    assert summarize(res, 1.0)["peak_concurrency"] == 2  # the rejected ones leave at once


def test_a_request_waiting_past_the_load_wait_bound_fails_as_the_engine_fails_it() -> None:
    # One adapter fits the pool. r0 ("a", 0 s) runs 500 steps (5 s) holding its adapter; r1
    # ("b", 0.1 s) reads for 1 s, then waits for room. The worker's engine fails a request
    # still waiting for its adapter load_wait_timeout_s after it arrived: r1 fails at 2.1 s
    # (not when its load's own wait for room ends at 3.1 s), and its load, which nobody
    # waits for any more, is cancelled. r2 ("b", 7 s) finds the pool free and is served.
    tr = Trace.from_arrays([0.0, 0.1, 7.0], ["a", "b", "b"], 10, np.array([500, 3, 3]))
    sizes = build_adapter_set(tr, SIMPLE, 2, seed=0).nbytes
    preset = SIMPLE.with_overrides(
        pool_bytes=int(max(sizes) + min(sizes) // 2),  # either adapter fits, not both
        host_cache_bytes=int(4 * sum(sizes)),
        load_wait_timeout_s=2.0,
    )
    _, res = _run(tr, preset, "baseline", workers=1, k=2)
    assert res.failed.tolist() == [False, True, False]
    assert res.counters["failed_by_reason"] == {"DeadlineExceededError": 1}
    np.testing.assert_allclose(res.failed_s[1], 2.1, atol=1e-9)
    assert res.counters["failed_loads"] == 1  # cancelled: nobody waits for it
    assert res.cold.tolist() == [True, True, True]
    assert res.first_token_s[2] > 7.0


# ------------------------------------------------------------------------------ reports
def test_summary_slo_and_load_curve() -> None:
    _, res = _run(_trace([0.0, 0.5, 1.015], ["a", "a", "a"]))
    s = summarize(res, slo_ttft_s=0.6)
    assert s["requests"] == 3 and s["completed"] == 3 and s["failed"] == 0
    assert s["slo_attainment"] == pytest.approx(2 / 3)
    assert s["cold_starts"] == 2 and s["cold_start_rate"] == pytest.approx(2 / 3)
    assert s["cold_start_wait_mean_s"] == pytest.approx(0.5)
    assert s["ttft_mean_s"] == pytest.approx((1.01 + 0.51 + 0.015) / 3)
    assert s["throughput_req_s"] == pytest.approx(3 / 1.05)
    assert slo_attainment(res, 2.0) == 1.0
    assert s["peak_concurrency"] == 3  # r2 arrives (1.015) before r0 and r1 finish (1.03)
    curve = slo_vs_load(res, 0.6, window_s=1.0)
    assert curve["requests"] == [1.0, 2.0]  # window [1,2) has 1 request, [0,1) has 2
    assert curve["slo_attainment"] == [1.0, 0.5]


@pytest.mark.parametrize(
    ("table", "expect"),
    [
        ({1: 0.5, 2: 0.9, 4: 0.995, 8: 1.0, 3: 0.991}, 3),
        ({1: 0.999}, 1),
        ({1: 0.1, 2: 0.2, 4: 0.3}, None),
    ],
)
def test_search_min_workers(table, expect) -> None:
    best, tried = search_min_workers(lambda n: table.get(n, 0.0), 0.99, max_workers=4)
    assert best == expect
    assert set(tried) <= {1, 2, 3, 4}


def test_compare_to_replay_side_by_side() -> None:
    sim = {
        "policies": ["plora", "baseline"],
        "plora": {"ttft_mean_s": 1.1, "cold_start_rate": 0.2},
        "baseline": {"ttft_mean_s": 2.0, "cold_start_rate": 0.0},
    }
    rep = {
        "policies": ["plora", "baseline"],
        "plora": {"ttft_mean_s": 1.0, "cold_start_rate": 0.3},
        "baseline": {"ttft_mean_s": 2.4, "cold_start_rate": 0.0},
        "settings": {"x": 1},
    }
    out = compare_to_replay(sim, rep, tolerance=0.25)
    p = out["policies"]["plora"]
    assert p["ttft_mean_s"]["rel_error"] == pytest.approx(0.1) and p["ttft_mean_s"]["within"]
    assert p["cold_start_rate"]["rel_error"] == pytest.approx(1 / 3)
    assert p["cold_start_rate"]["within"] is False
    assert out["policies"]["baseline"]["cold_start_rate"]["within"] is True
    assert out["all_within"] is False


def test_paper_comparison_blocks() -> None:
    p = {
        "throughput_req_s": 3.0,
        "ttft_mean_s": 1.0,
        "ttft_p99_s": 2.0,
        "cold_start_wait_mean_s": 0.5,
        "external_fragmentation": 0.01,
        "pool_utilization_under_pressure": 0.9,
        "min_workers_for_slo": 2,
    }
    b = {
        "throughput_req_s": 2.0,
        "ttft_mean_s": 2.0,
        "ttft_p99_s": 4.0,
        "cold_start_wait_mean_s": 1.0,
        "external_fragmentation": 0.2,
        "min_workers_for_slo": 4,
    }
    out = paper_comparison({"plora": p, "baseline": b, "plora-round-robin": b})
    a = out["predictive_lora_vs_slora"]
    assert a["throughput_ratio"]["sim"] == pytest.approx(1.5)
    assert a["ttft_mean_reduction"]["sim"] == pytest.approx(0.5)
    assert a["ttft_mean_reduction"]["paper"] == 0.35
    c = out["loraserve_vs_rank_oblivious"]
    assert c["ttft_p99_ratio"]["sim"] == pytest.approx(2.0)
    assert c["workers_needed_reduction"]["sim"] == pytest.approx(0.5)
    assert paper_comparison({"plora": p})["predictive_lora_vs_slora"] is None


# ------------------------------------------------------------------------------ end to end
def test_simulate_without_a_trace_or_a_replay_report_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--trace and --format are required unless --replay-report stands alone (it simulates the
    replay's own slice: see tests/integration/test_sim_validation.py)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv in ([], ["--trace", str(ALIBABA)], ["--format", "alibaba", "--replay-report", "r"]):
        assert run(parser.parse_args([*argv, "--out", str(tmp_path / "o")])) == 2
        assert "give --trace and --format (or --replay-report alone" in capsys.readouterr().err


def test_a_replay_report_that_cannot_serve_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--replay-report`` names a file that is missing, not JSON, not a replay report, lacks
    the settings the match reads, replayed a trace that is not here, or gave its workers a flag
    the worker refuses or a host cache that is not a byte size: exit 2 with one line that says
    which, nothing written."""
    trace = tmp_path / "azure2021.csv"
    trace.write_text("app,func,end_timestamp,duration\napp0,func0,1.5,0.5\n")
    settings = {
        "trace": str(trace), "format": "azure2021", "time_scale": 1.0, "seed": 0,
        "adapters": 1, "pool_bytes": 1 << 20, "workers": 1, "max_new_tokens": 8,
        "prompt_token_cap": 64,
    }  # fmt: skip

    def report(name: str, body: object) -> str:
        path = tmp_path / name
        path.write_text(body if isinstance(body, str) else json.dumps(body))
        return str(path)

    cases = {
        str(tmp_path / "missing.json"): "no such file",
        str(tmp_path): "cannot be read (Is a directory)",
        report("log.txt", "not json"): "not JSON (Expecting value at line 1)",
        report("other.json", {"settings": settings}): "no 'policies' list: not a plora bench",
        report("bare.json", {"policies": []}): "'settings' are missing",
        report("nokeys.json", {"policies": [], "settings": {"trace": str(trace)}}):
            "its settings lack format, time_scale",
        report("gone.json", {"policies": [], "settings": {**settings, "trace": "/no/such.csv"}}):
            "the trace it replayed, /no/such.csv, is not a file here",
        report("host.json", {"policies": [], "settings": {
            **settings, "worker_args": ["--host-cache-bytes=lots"]}}):
            "its worker argument --host-cache-bytes: 'lots' is not a byte size",
        report("flag.json", {"policies": [], "settings": {
            **settings, "worker_args": ["--eviction=bogus"]}}):
            "its worker argument --eviction: invalid choice: 'bogus'",
    }  # fmt: skip
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for path, words in cases.items():
        for extra in (
            [],
            ["--policies", "plora-no-predictor"],
            ["--trace", str(trace), "--format", "azure2021"],
        ):
            out = tmp_path / "out"
            argv = ["--replay-report", path, *extra, "--out", str(out)]
            assert run(parser.parse_args(argv)) == 2, (path, extra)
            err = capsys.readouterr().err
            assert err.startswith(f"plora simulate: --replay-report {path}: ") and words in err
            assert err.count("\n") == 1 and not out.exists()


def _simulate_cli(
    tmp_path: Path, functions: int, calls: int, gap_s: float
) -> tuple[argparse.ArgumentParser, list[str]]:
    """``plora simulate``'s parser and its flags for an Azure 2021 trace written here:
    ``calls`` calls ``gap_s`` apart, over ``functions`` functions in turn (h100-8b, no
    worker-count search)."""
    rows = ["app,func,end_timestamp,duration"]
    rows += [f"app0,func{i % functions},{gap_s * i + 0.5:.3f},0.5" for i in range(calls)]
    trace = tmp_path / "azure2021.csv"
    trace.write_text("\n".join(rows) + "\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--trace", str(trace), "--format", "azure2021", "--preset", "h100-8b",
             "--search-max-workers", "0"]  # fmt: skip
    return parser, flags


def test_the_prefetch_gate_is_a_flag_of_the_simulator_as_of_the_predictor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--prefetch-min-probability`` sets the simulated predictor's calibrated-probability
    gate (default the predictor's own), is recorded in the report's settings, and a value that
    is not a probability is a usage error (exit 2 naming the flag)."""
    parser, base = _simulate_cli(tmp_path, functions=3, calls=30, gap_s=2.0)
    base += ["--workers", "2", "--adapters", "3", "--policies", "plora", "--forecaster", "ewma"]
    assert parser.parse_args([*base, "--out", "o"]).prefetch_min_probability == 0.75
    assert run(parser.parse_args([*base, "--prefetch-min-probability", "0", "--out",
                                  str(tmp_path / "gate0")])) == 0  # fmt: skip
    report = json.loads((tmp_path / "gate0" / "report.json").read_text())
    assert report["settings"]["prefetch_min_probability"] == 0.0
    assert report["plora"]["completed"] == 30
    # plora's figures hang on the forecaster's floating point: the report says where it ran
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    report_md = (tmp_path / "gate0" / "report.md").read_text()
    assert f"same torch {torch.__version__} and CPU kernels" in report_md
    for bad, words in (("1.5", "1.5 is not a probability in [0, 1]"), ("x", "'x' is not a number")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*base, "--prefetch-min-probability", bad, "--out", "o"])
        assert exit_.value.code == 2
        assert f"--prefetch-min-probability: {words}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prefetch_min_probability must be in"):
        SimConfig(preset=H100_8B_PRESET, prefetch_min_probability=-0.1)


def test_rank_mode_flag_sets_the_step_cost_of_mixed_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rank-mode sum`` simulates per-segment kernels on a preset whose own is padded: the
    report's settings say which, and the same trace of mixed ranks runs faster (no row is
    padded to another adapter's rank); an unknown mode is a usage error."""
    parser, base = _simulate_cli(tmp_path, functions=8, calls=200, gap_s=0.05)
    base += ["--workers", "1", "--adapters", "8", "--policies", "plora-no-predictor"]
    ttft = {}
    for mode in (None, "max", "sum"):
        out = tmp_path / f"mode-{mode}"
        flags = [] if mode is None else ["--rank-mode", mode]
        assert run(parser.parse_args([*base, *flags, "--out", str(out)])) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["settings"]["rank_mode"] == (mode or H100_8B_PRESET.step.rank_mode)
        ttft[mode] = report["plora-no-predictor"]["ttft_mean_s"]
    assert ttft[None] == ttft["max"]
    assert ttft["sum"] < ttft["max"]
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*base, "--rank-mode", "avg", "--out", "o"])
    assert exit_.value.code == 2
    assert "--rank-mode: invalid choice: 'avg'" in capsys.readouterr().err


def test_simulate_over_several_seeds_reports_the_means_and_every_run(tmp_path: Path) -> None:
    """``--seed 1 --seeds 2`` runs the simulation's draws of seeds 1 and 2 on the trace slice
    and adapter mapping of seed 1: the first run is the run ``--seed 1`` alone gives, and the
    report's figures are the runs' means."""
    rng = np.random.default_rng(0)
    rows = ["app,func,end_timestamp,duration"]
    for f in range(12):
        for start in np.sort(rng.uniform(0.0, 120.0, 20)).tolist():
            rows.append(f"app{f % 3},func{f},{start + 0.5:.3f},0.5")
    trace = tmp_path / "azure2021.csv"
    trace.write_text("\n".join(rows) + "\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def report(out: str, *flags: str) -> dict:
        argv = [
            "--trace", str(trace), "--format", "azure2021", "--preset", "h100-8b",
            "--workers", "2", "--adapters", "12", "--policies", "plora,plora-no-predictor",
            "--forecaster", "ewma", "--search-max-workers", "0", "--out", str(tmp_path / out),
            *flags,
        ]  # fmt: skip
        assert run(parser.parse_args(argv)) == 0
        return json.loads((tmp_path / out / "report.json").read_text())

    both = report("both", "--seed", "1", "--seeds", "2")
    alone = report("seed1", "--seed", "1")
    assert both["settings"]["seeds"] == [1, 2]
    for name in ("plora", "plora-no-predictor"):
        runs = both[name]["seed_runs"]
        assert runs["seeds"] == [1, 2]
        assert runs["ttft_mean_s"][0] == alone[name]["ttft_mean_s"]
        assert runs["ttft_p99_s"][0] == alone[name]["ttft_p99_s"]
        assert both[name]["ttft_mean_s"] == pytest.approx(np.mean(runs["ttft_mean_s"]))
        assert both[name]["ttft_p99_s"] == pytest.approx(np.mean(runs["ttft_p99_s"]))
        assert runs["ttft_mean_s"][0] != runs["ttft_mean_s"][1]  # the draws differ
    per_seed = both["comparison"]["predictor_seed_runs"]["ttft_reduction"]
    assert per_seed[0] == alone["comparison"]["predictor_ttft_reduction"]
    # nothing failed: over the requests both completed, the same reductions
    paired = both["comparison"]["predictor_completed_by_both"]
    assert paired["requests"] == both["plora"]["completed"] == both["plora"]["requests"]
    assert paired["seed_runs"]["ttft_reduction"] == pytest.approx(per_seed)
    assert paired["ttft_reduction"] == pytest.approx(both["comparison"]["predictor_ttft_reduction"])
    report_md = (tmp_path / "both" / "report.md").read_text()
    assert "means over seeds 1..2" in report_md
    se = both["comparison"]["predictor_ttft_reduction_se"]
    assert se == pytest.approx(np.std(per_seed, ddof=1) / np.sqrt(2))
    assert "over 2 seeds: `predictor_ttft_reduction` " in report_md
    assert f"(standard error {100 * se:.1f} %)" in report_md
    assert run(parser.parse_args(["--trace", str(trace), "--format", "azure2021", "--seeds", "0",
                                  "--out", str(tmp_path / "none")])) == 2  # fmt: skip


def test_replay_matching_keeps_the_host_cache_the_replay_ran_with(tmp_path: Path) -> None:
    """A replay run with ``--host-cache-fraction`` (its workers got ``--host-cache-bytes``) is
    simulated with that host cache, not the worker's default: with a quarter of the adapters'
    bytes the cold loads read the source, which the default (much larger) cache would hide.
    ``--replay-report`` with ``--policies`` simulates those policies on that slice."""
    assert replay_host_cache_bytes([]) is None
    assert replay_host_cache_bytes(["--eviction=lru"]) is None
    assert replay_host_cache_bytes(["--host-cache-bytes=300MiB"]) == 300 << 20
    assert replay_host_cache_bytes(["--host-cache-bytes", "1048576", "--x"]) == 1 << 20
    assert replay_host_cache_bytes(["--host-cache-bytes=1", "--host-cache-bytes=2"]) == 2
    with pytest.raises(ConfigError):
        replay_host_cache_bytes(["--host-cache-bytes=lots"])

    rows = ["app,func,end_timestamp,duration"]
    rows += [f"app0,func{i % 4},{i + 0.5:.3f},0.5" for i in range(20)]
    trace = tmp_path / "azure2021.csv"
    trace.write_text("\n".join(rows) + "\n")
    pool = 64 << 20
    settings = {
        "trace": str(trace), "format": "azure2021", "start": 0.0, "duration": None,
        "time_scale": 1.0, "drop_top": 0, "adapters": 4, "ranks": [8], "adapter_ranks": [8] * 4,
        "pool_bytes": pool, "workers": 2, "max_new_tokens": 8, "prompt_token_cap": 64,
        "seed": 0, "worker_args": [],
    }  # fmt: skip
    default = replay_matched_inputs({"settings": settings})[2].preset
    assert default.host_cache_bytes == get_preset("cpu").host_cache_bytes > 2 * pool
    settings["worker_args"] = [f"--host-cache-bytes={2 * pool}"]
    assert replay_matched_inputs({"settings": settings})[2].preset.host_cache_bytes == 2 * pool
    settings["worker_args"] = [f"--host-cache-bytes={pool // 2}"]  # never below the pool
    assert replay_matched_inputs({"settings": settings})[2].preset.host_cache_bytes == pool

    # `plora simulate --replay-report R --policies ...`: those policies on the replay's slice
    settings["worker_args"] = [f"--host-cache-bytes={pool}"]
    report = tmp_path / "replay" / "report.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"settings": settings, "policies": []}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--replay-report", str(report), "--policies", "plora-no-predictor,oracle",
            "--search-max-workers", "0", "--out", str(tmp_path / "sim")]  # fmt: skip
    assert run(parser.parse_args(argv)) == 0
    sim = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert sim["policies"] == ["plora-no-predictor", "oracle"]
    assert sim["trace"]["requests"] == 20 and sim["settings"]["workers"] == 2
    assert sim["settings"]["adapters"] == 4 and sim["trace"]["format"] == "azure2021"
    figures = sim["settings"]["preset_figures"]
    assert figures["pool_bytes"] == figures["host_cache_bytes"] == pool
    assert all(sim[p]["completed"] == 20 for p in sim["policies"])


def test_simulate_cli_end_to_end(tmp_path: Path) -> None:
    if not ALIBABA.exists():
        pytest.skip(f"{ALIBABA} is absent (shared data not checked out)")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "sim"
    args = parser.parse_args([
        "--trace", str(ALIBABA), "--format", "alibaba", "--time-scale", "60",
        "--duration", "600", "--preset", "cpu", "--workers", "2", "--adapters", "24",
        "--policies", "plora,baseline,plora-round-robin", "--forecaster", "ewma",
        "--search-max-workers", "4", "--slo-ttft", "0.5", "--out", str(out),
    ])  # fmt: skip
    assert run(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["policies"] == ["plora", "baseline", "plora-round-robin"]
    for name in report["policies"]:
        block = report[name]
        for key in (
            "requests",
            "completed",
            "failed",
            "ttft_mean_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "throughput_req_s",
            "throughput_tok_s",
            "cold_starts",
            "cold_start_rate",
            "cold_start_wait_mean_s",
            "pool_utilization_under_pressure",
            "external_fragmentation",
            "slo_attainment",
            "min_workers_for_slo",
        ):
            assert key in block, (name, key)
        assert block["completed"] + block["failed"] == block["requests"] > 0
    assert report["comparison"]["throughput_ratio"] is not None
    assert report["papers"]["predictive_lora_vs_slora"]["ttft_mean_reduction"]["paper"] == 0.35
    assert report["papers"]["loraserve_vs_rank_oblivious"] is not None
    for f in report["plots"].values():
        assert (out / f).stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "| P-LoRA vs S-LoRA: throughput ratio | 1.52x |" in md
    assert "| LoRAServe vs rank-oblivious: p99 TTFT ratio | 9.0x |" in md


# ------------------------------------------------------------------------------ calibration
def _rec(worker, sent, ttft, end, prompt=50, tokens=2, cold=False, wait=0.0, aid="a8"):
    return {
        "worker_id": worker, "sent_s": sent, "first_token_s": sent + ttft + 0.01,
        "worker_ttft_s": ttft, "end_s": end, "status": "OK", "prompt_tokens": prompt,
        "completion_tokens": tokens, "adapter_cold": cold, "adapter_wait_s": wait,
        "adapter_id": aid,
    }  # fmt: skip


def test_solo_requests_are_alone_on_their_worker() -> None:
    recs = [
        _rec("w0", 0.0, 0.1, 1.0),  # overlaps the next one on w0
        _rec("w0", 0.5, 0.1, 2.0),
        _rec("w0", 3.0, 0.1, 4.0),  # alone
        _rec("w1", 0.2, 0.1, 5.0),  # alone on w1 (w0's requests do not count)
    ]
    assert solo_mask(recs).tolist() == [False, False, True, True]


def test_fit_replay_reads_the_machine_from_solo_requests() -> None:
    """Solo requests made from a known step model give that model back (the live-replay
    validation itself is tests/integration/test_sim_validation.py)."""
    st = CPU_PRESET.step
    share = st.per_row_s / (st.base_s + st.per_row_s)
    base, row = 0.2 * (1 - share), 0.2 * share  # decode step at batch 1: 0.2 s
    pre = 0.004
    ltr, seg = st.lora_token_rank_s, st.lora_segment_s
    recs, t = [], 0.0
    for i in range(12):
        p = 20 + 5 * i
        ttft = base + seg + (pre + ltr * 8) * p
        step = base + row + seg + ltr * 8
        recs.append(_rec("w0", t, ttft, t + ttft + 0.01 + 2 * step, prompt=p, tokens=3))
        t += 5.0
        size = (i + 1) * 10_000_000
        wait = 0.05 + size / 2e8
        first = wait + ttft + 0.01
        recs.append(_rec("w0", t, wait + ttft, t + first + 2 * step, prompt=p, tokens=3,
                         cold=True, wait=wait, aid=f"c{i}"))  # fmt: skip
        t += 5.0
    sizes = {f"c{i}": (i + 1) * 10_000_000 for i in range(12)} | {"a8": 1}
    ranks = {k: 8 for k in sizes}
    preset, fig = fit_replay(recs, sizes, ranks)
    assert fig["solo"] == 24 and fig["decode"]["samples"] == 24
    assert preset.step.base_s + preset.step.per_row_s == pytest.approx(0.2)
    assert preset.step.per_row_s == pytest.approx(row)
    assert preset.step.per_prefill_token_s == pytest.approx(pre)
    assert preset.source_fixed_s == pytest.approx(0.05)
    assert preset.source_bytes_per_s == pytest.approx(2e8)
    assert preset.network_s == pytest.approx(0.01)
    assert preset.page_bytes == CPU_PRESET.page_bytes


def test_several_gateways_spread_a_uniform_load_as_evenly_as_one() -> None:
    """Poisson arrivals (200/s) over 8 equally popular adapters on 8 workers, split over 1, 2
    or 4 simulated gateways, each routing on its own in-flight counts and the shared (1 s
    old) heartbeats: every worker's request count stays within 20 % of every other's and the
    mean TTFT within 1.5x of one gateway's (no herding onto the workers each gateway alone
    sees idle)."""
    rng = np.random.default_rng(3)
    n = rng.poisson(200 * 60)
    times = np.sort(rng.uniform(0, 60, n))
    tr = Trace.from_arrays(times, [f"k{i}" for i in rng.integers(0, 8, n)], 256, 64)
    preset = H100_8B_PRESET
    adapters = build_adapter_set(tr, preset, 8)
    latencies = source_latencies(preset, None)
    ttft: dict[int, float] = {}
    for gateways in (1, 2, 4):
        config = SimConfig(preset, workers=8, gateways=gateways, source_latencies_s=latencies)
        sim = ClusterSimulation(
            tr, adapters, get_policy("plora-no-predictor", simulated=True), config
        )
        res = sim.run()
        assert len(sim.gateways) == gateways and not res.failed.any()
        s = summarize(res, 1.0)
        assert sum(s["requests_per_worker"]) == n
        assert s["worker_requests_max_over_min"] < 1.2, (gateways, s["requests_per_worker"])
        ttft[gateways] = s["ttft_mean_s"]
    # gateways blind to each other's requests would queue them behind one another: several
    # times the TTFT (the heartbeats alone, without each gateway's own counts: 7x)
    assert max(ttft[2], ttft[4]) < 1.5 * ttft[1], ttft
    with pytest.raises(ValueError, match="gateways must be >= 1"):
        SimConfig(preset, gateways=0)


def test_oracle_prefetches_repeat_requests_only_unless_clairvoyant() -> None:
    """The ``oracle`` bound forecasts only adapters already requested (a first request has
    nothing before it to announce it); ``oracle-clairvoyant`` sees first requests too."""
    from plora.simulator.oracle import FutureArrivals

    future = FutureArrivals(np.array([1.0, 2.0, 3.0, 4.0]), np.array([0, 1, 0, 1]), 3)
    ads, counts = future.counts(1.5, 10.0, seen_only=True)
    assert ads.tolist() == [0] and counts.tolist() == [1.0]  # adapter 1 first arrives at 2.0
    ads, counts = future.counts(1.5, 10.0)
    assert ads.tolist() == [0, 1] and counts.tolist() == [1.0, 2.0]
    ads, _ = future.counts(2.5, 10.0, seen_only=True)
    assert ads.tolist() == [0, 1]
