"""Table-driven tests of the replay statistics (plora.replay.report) and the pure helpers of
the replay client and CLI (prompt synthesis, request building, pool sizing, trace floor)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from plora.replay.bench import _compare_pair, auto_pool_bytes, trace_info
from plora.replay.client import PROMPT_WORDS, build_requests, synth_prompt
from plora.replay.report import (
    CLIENT_DROPPED,
    COMPARISON_KEYS,
    OK,
    POLICY_KEYS,
    RequestRecord,
    StatusSample,
    WorkerSample,
    build_report,
    compare,
    comparison_spread,
    compulsory_cold_rate,
    mean,
    mean_of_rounds,
    percentile,
    pool_stats,
    ratio,
    records_over_both,
    reduction,
    render_markdown,
    request_stats,
    series_cold_starts,
    series_pool_utilization,
    summarize_policy,
    ttft_cdf,
    write_plots,
)
from plora.traces import Trace
from tests.helpers import replay_args


def rec(
    i: int,
    sent: float | None,
    first: float | None,
    end: float | None,
    status: str = OK,
    *,
    cold: bool = False,
    wait: float = 0.0,
    tokens: int = 8,
    worker: str = "w0",
    adapter: str = "a",
) -> RequestRecord:
    return RequestRecord(
        i,
        adapter,
        f"k{adapter}",
        float(i),
        sent,
        first,
        end,
        status,
        prompt_tokens=10,
        completion_tokens=tokens if status == OK else 0,
        adapter_cold=cold,
        adapter_wait_s=wait,
        worker_id=worker,
    )


def ws(
    wid: str,
    util: float,
    evictions: int,
    *,
    upp: float = 0.0,
    frag: float = 0.0,
    cold: int = 0,
    loads: int = 0,
    pages_used: int = 1,
) -> WorkerSample:
    return WorkerSample(
        wid,
        util,
        upp,
        frag,
        loads,
        evictions,
        cold,
        pages_used=pages_used,
        pages_total=10,
        pool_bytes=10 << 20,
    )


# ------------------------------------------------------------------------------ basics
@pytest.mark.parametrize(
    ("values", "q", "want"),
    [
        ([], 50, None),
        ([3.0], 99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        (list(range(101)), 99, 99.0),
    ],
)
def test_percentile(values: list[float], q: float, want: float | None) -> None:
    got = percentile(values, q)
    assert got == pytest.approx(want) if want is not None else got is None


@pytest.mark.parametrize(("values", "want"), [([], None), ([2.0], 2.0), ([1.0, 2.0, 6.0], 3.0)])
def test_mean(values: list[float], want: float | None) -> None:
    assert mean(values) == (pytest.approx(want) if want is not None else None)


@pytest.mark.parametrize(
    ("p", "b", "red", "rat"),
    [
        (1.0, 4.0, 0.75, 0.25),
        (4.0, 4.0, 0.0, 1.0),
        (6.0, 4.0, -0.5, 1.5),
        (0.0, 4.0, 1.0, 0.0),
        (1.0, 0.0, None, None),
        (None, 4.0, None, None),
        (1.0, None, None, None),
    ],
)
def test_reduction_and_ratio(
    p: float | None, b: float | None, red: float | None, rat: float | None
) -> None:
    assert reduction(p, b) == (pytest.approx(red) if red is not None else None)
    assert ratio(p, b) == (pytest.approx(rat) if rat is not None else None)


@pytest.mark.parametrize(
    ("keys", "want"),
    [
        ([], None),
        (["a"], 1.0),
        (["a", "a", "a", "a"], 0.25),
        (["a", "b", "a", "b"], 0.5),
        (["a", "b", "c", "a", "b"], 0.6),
    ],
)
def test_compulsory_cold_rate(keys: list[str], want: float | None) -> None:
    assert compulsory_cold_rate(keys) == (pytest.approx(want) if want is not None else None)


# ------------------------------------------------------------------------------ per request
RECORDS = [
    # sent, first token, end: TTFTs 0.5, 1.0, 1.5 and 3.0; last completion at 12.0
    rec(0, 0.0, 0.5, 1.0, cold=True, wait=0.4, worker="w0", adapter="a"),
    rec(1, 2.0, 3.0, 4.0, worker="w1", adapter="a"),
    rec(2, 4.0, 5.5, 6.0, cold=True, wait=0.2, worker="w0", adapter="b", tokens=4),
    rec(3, 9.0, 12.0, 12.0, worker="w1", adapter="c"),
    rec(4, 5.0, None, 7.0, "UNAVAILABLE"),
    rec(5, None, None, None, CLIENT_DROPPED),
]


@pytest.mark.parametrize(
    ("key", "want"),
    [
        ("requests", 6),
        ("completed", 4),
        ("failed", 2),
        ("dropped", 1),
        ("failed_by_status", {CLIENT_DROPPED: 1, "UNAVAILABLE": 1}),
        ("ttft_mean_s", (0.5 + 1.0 + 1.5 + 3.0) / 4),
        ("ttft_p50_s", 1.25),
        ("ttft_p99_s", 1.5 + 0.97 * 1.5),  # numpy linear: rank 0.99 * 3 = 2.97
        ("latency_mean_s", (1.0 + 2.0 + 2.0 + 3.0) / 4),
        ("makespan_s", 12.0),
        ("throughput_req_s", 4 / 12.0),
        ("throughput_tok_s", (8 + 8 + 4 + 8) / 12.0),
        ("cold_starts", 2),
        ("cold_start_rate", 0.5),
        ("cold_start_wait_mean_s", (0.4 + 0.2) / 4),  # warm requests count as 0 s
        ("cold_start_wait_mean_cold_s", 0.3),
        ("requests_by_worker", {"w0": 2, "w1": 2}),
    ],
)
def test_request_stats(key: str, want: object) -> None:
    got = request_stats(RECORDS)[key]
    assert got == (pytest.approx(want) if isinstance(want, float) else want)


def test_request_stats_with_nothing_completed() -> None:
    s = request_stats(
        [rec(0, 0.0, None, 1.0, "DEADLINE_EXCEEDED"), rec(1, None, None, None, CLIENT_DROPPED)]
    )
    assert (s["completed"], s["failed"], s["dropped"]) == (0, 2, 1)
    assert s["ttft_mean_s"] is None and s["cold_start_rate"] is None
    assert s["throughput_req_s"] == 0.0 and s["makespan_s"] == 0.0


def test_record_properties_and_round_trip() -> None:
    r = RECORDS[2]
    assert r.ok and r.ttft_s == pytest.approx(1.5) and r.latency_s == pytest.approx(2.0)
    assert RECORDS[5].ttft_s is None and RECORDS[5].latency_s is None and not RECORDS[5].ok
    assert RequestRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r


# ------------------------------------------------------------------------------ pool samples
SAMPLES = [
    StatusSample(0.0, (ws("w0", 0.2, 0), ws("w1", 0.1, 0))),
    # w0 evicts: under pressure (util 0.9, frag 0.1); w1 does not
    StatusSample(1.0, (ws("w0", 0.9, 2, frag=0.1, cold=3, loads=4), ws("w1", 0.5, 0, frag=0.4))),
    # w0 steady (no pressure); w1 evicts (util 0.8, frag 0.3)
    StatusSample(
        2.0,
        (ws("w0", 0.7, 2, frag=0.0, cold=3, loads=4), ws("w1", 0.8, 1, frag=0.3, cold=2, loads=3)),
    ),
    # both evict; workers report their own under-pressure means
    StatusSample(
        3.0,
        (
            ws("w0", 1.0, 5, upp=0.92, frag=0.2, cold=5, loads=7),
            ws("w1", 0.6, 3, upp=0.84, frag=0.0, cold=4, loads=5),
        ),
    ),
]


@pytest.mark.parametrize(
    ("key", "want"),
    [
        ("pressure_samples", 4),
        ("pool_utilization_under_pressure", (0.92 + 0.84) / 2),
        ("pool_utilization_under_pressure_sampled", (0.9 + 0.8 + 1.0 + 0.6) / 4),
        ("external_fragmentation", (0.1 + 0.3 + 0.2 + 0.0) / 4),
        ("external_fragmentation_max", 0.3),
        ("pool_loads", 7 + 5),
        ("pool_evictions", 5 + 3),
        ("pool_cold_starts", 5 + 4),
        ("status_samples", 4),
        ("pool_bytes_per_worker", 10 << 20),
    ],
)
def test_pool_stats(key: str, want: object) -> None:
    got = pool_stats(SAMPLES)[key]
    assert got == (pytest.approx(want) if isinstance(want, float) else want)


def test_pool_stats_without_pressure_falls_back_to_samples_in_use() -> None:
    samples = [
        StatusSample(0.0, (ws("w0", 0.3, 0, frag=0.5), ws("w1", 0.0, 0, frag=0.9, pages_used=0))),
        StatusSample(1.0, (ws("w0", 0.3, 0, frag=0.1), ws("w1", 0.0, 0, pages_used=0))),
    ]
    s = pool_stats(samples)
    assert s["pressure_samples"] == 0
    assert s["pool_utilization_under_pressure"] is None
    assert s["pool_utilization_under_pressure_sampled"] is None
    assert s["external_fragmentation"] == pytest.approx(0.3)  # w0 only: pages in use
    assert pool_stats([])["external_fragmentation"] is None


def test_series_and_cdf() -> None:
    t, c = series_cold_starts(SAMPLES)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and c.tolist() == [0, 3, 5, 9]
    _, u = series_pool_utilization(SAMPLES)
    assert u.tolist() == pytest.approx([0.15, 0.7, 0.75, 0.8])
    x, y = ttft_cdf(RECORDS)
    assert x.tolist() == pytest.approx([0.5, 1.0, 1.5, 3.0]) and y.tolist() == [0.25, 0.5, 0.75, 1]
    assert StatusSample.from_dict(json.loads(json.dumps(SAMPLES[3].to_dict()))) == SAMPLES[3]


# ------------------------------------------------------------------------------ comparison
@pytest.mark.parametrize(
    ("key", "want"),
    [
        ("ttft_mean_reduction", 1 - 0.65 / 1.0),
        ("ttft_p99_reduction", 1 - 2.0 / 4.0),
        ("cold_start_wait_reduction", 1 - 0.032 / 0.1),
        ("cold_start_count_reduction", 1 - 10 / 40),
        ("cold_start_rate_reduction", 1 - 0.05 / 0.2),
        ("throughput_ratio", 3.0 / 2.0),
        ("throughput_tok_ratio", 24.0 / 16.0),
        ("baseline_cold_wait_share_of_ttft", 0.1 / 1.0),
        # floor = mean(0.5, 0.3) = 0.4 s: at most 1 - 0.4 / 1.0 of the TTFT can go
        ("ttft_mean_reduction_ceiling", 0.6),
        ("ttft_gap_closed", (1 - 0.65) / 0.6),
    ],
)
def test_compare(key: str, want: float) -> None:
    plora = {
        "ttft_uncontended_s": 0.5,
        "ttft_mean_s": 0.65,
        "ttft_p99_s": 2.0,
        "cold_start_wait_mean_s": 0.032,
        "cold_starts": 10,
        "cold_start_rate": 0.05,
        "throughput_req_s": 3.0,
        "throughput_tok_s": 24.0,
    }
    baseline = {
        "ttft_uncontended_s": 0.3,
        "ttft_mean_s": 1.0,
        "ttft_p99_s": 4.0,
        "cold_start_wait_mean_s": 0.1,
        "cold_starts": 40,
        "cold_start_rate": 0.2,
        "throughput_req_s": 2.0,
        "throughput_tok_s": 16.0,
    }
    assert compare(plora, baseline)[key] == pytest.approx(want)


def test_compare_without_probes_has_no_ttft_ceiling() -> None:
    got = compare({"ttft_mean_s": 0.5}, {"ttft_mean_s": 1.0, "ttft_uncontended_s": None})
    assert got["ttft_mean_reduction"] == pytest.approx(0.5)
    assert got["ttft_mean_reduction_ceiling"] is None and got["ttft_gap_closed"] is None


def test_build_report_has_every_contract_key_and_is_strict_json(tmp_path: Path) -> None:
    plora = summarize_policy(RECORDS, SAMPLES, [0.2, 0.4])
    baseline = summarize_policy(RECORDS[:4], SAMPLES[:2], [0.3])
    assert plora["ttft_uncontended_s"] == pytest.approx(0.3)
    assert plora["ttft_uncontended_probes"] == 2
    settings = {
        "trace": "t.csv",
        "format": "azure2021",
        "start": 0.0,
        "duration": 30.0,
        "time_scale": 10.0,
        "adapters": 4,
        "ranks": [8, 16],
        "pool_bytes": 1 << 20,
        "pool_fraction": 0.25,
        "adapter_bytes_total": 4 << 20,
        "workers": 2,
        "max_new_tokens": 8,
        "prompt_token_cap": 64,
        "concurrency": 8,
        "seed": 0,
        "wall_time_s": 12.5,
    }
    info = {"requests": 6, "keys": 3, "adapters_used": 3, "compulsory_cold_rate": 0.5}
    report = build_report(settings, info, {"plora": plora, "baseline": baseline})
    for name in ("plora", "baseline"):
        missing = [k for k in POLICY_KEYS if k not in report[name]]
        assert not missing, f"{name} lacks {missing}"
    assert set(COMPARISON_KEYS) <= set(report["comparison"])
    assert report["compulsory_cold_rate"] == 0.5 and report["policies"] == ["plora", "baseline"]
    assert report["comparison"]["cold_start_count_reduction"] == pytest.approx(1 - 2 / 2)
    json.dumps(report, allow_nan=False)  # no NaN/inf anywhere
    md = render_markdown(report)
    assert "| ttft_mean_s |" in md and "compulsory_cold_rate = 0.500" in md
    assert "| throughput_ratio |" in md
    ceiling = report["comparison"]["ttft_mean_reduction_ceiling"]
    assert ceiling == pytest.approx(1 - 0.3 / baseline["ttft_mean_s"])
    assert f"bounds ttft_mean_reduction at {ceiling:.3f}" in md
    failed = build_report(settings, info, {"plora": plora, "baseline": {"error": "boom"}})
    assert failed["comparison"] is None and failed["baseline"] == {"error": "boom"}
    # the predictor's ablation alone, without the baseline
    ablation = build_report(settings, info, {"plora": plora, "plora-no-predictor": baseline})
    assert ablation["comparison"]["predictor_ttft_reduction"] == pytest.approx(
        1 - plora["ttft_mean_s"] / baseline["ttft_mean_s"]
    )
    assert "predictor_ttft_p99_reduction" in ablation["comparison"]
    assert _compare_pair(["plora", "plora-no-predictor"]) == ("plora", "plora-no-predictor")
    assert _compare_pair(["plora-no-predictor", "plora", "baseline"]) == ("plora", "baseline")
    pair = _compare_pair(["plora", "plora-no-predictor"])
    both = build_report(
        settings, info, {"plora": plora, "plora-no-predictor": baseline}, compare_pair=pair
    )
    assert both["comparison"]["ttft_mean_reduction"] == pytest.approx(
        both["comparison"]["predictor_ttft_reduction"]
    )
    assert "comparison (plora vs plora-no-predictor)" in render_markdown(both)
    paths = write_plots(tmp_path, {"plora": RECORDS}, {"plora": SAMPLES})
    assert [p.name for p in paths] == [
        "ttft_cdf.png",
        "cold_starts_over_time.png",
        "pool_utilization_over_time.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_ablation_over_the_requests_both_replays_completed() -> None:
    """Request 4 failed under plora-no-predictor and plora served it after 9 s: over completed
    requests plora looks slower, over the three both completed the replays are level."""
    plora = [*RECORDS[:3], rec(3, 9.0, 18.0, 18.0, worker="w1", adapter="c")]
    nopred = [*RECORDS[:3], rec(3, 9.0, None, 39.0, "DEADLINE_EXCEEDED")]
    paired = records_over_both(plora, nopred)
    assert paired["requests"] == 3
    assert paired["ttft_mean_s"] == pytest.approx([1.0, 1.0])
    assert paired["ttft_p99_s"][0] == paired["ttft_p99_s"][1]
    with pytest.raises(ValueError, match="different requests"):
        records_over_both(plora, nopred[:2])
    report = build_report(
        {},
        {"requests": 4},
        {
            "plora": summarize_policy(plora, SAMPLES, []),
            "plora-no-predictor": summarize_policy(nopred, SAMPLES, []),
        },
        compare_pair=("plora", "plora-no-predictor"),
        completed_by_both=[paired, records_over_both(nopred, nopred)],
    )
    block = report["comparison"]["predictor_completed_by_both"]
    assert report["comparison"]["predictor_ttft_reduction"] < -1.0  # 3.0 s against 1.0 s
    assert block["requests"] == 3.0 and block["ttft_reduction"] == pytest.approx(0.0)
    assert block["round_runs"]["ttft_reduction"] == pytest.approx([0.0, 0.0])
    json.dumps(report, allow_nan=False)
    md = render_markdown(report)
    assert "Over the 3.0 requests both plora and plora-no-predictor completed" in md
    assert "| predictor_completed_by_both |" not in md
    # the rounds' spread leaves the block out (it is not one figure)
    spread = comparison_spread([report["comparison"], report["comparison"]])
    assert "predictor_completed_by_both" not in spread and "predictor_ttft_reduction" in spread


def test_mean_of_rounds_averages_figures_and_nested_counts() -> None:
    r1 = {
        "requests": 6,
        "ttft_mean_s": 0.4,
        "cold_start_rate": None,
        "failed_by_status": {"UNAVAILABLE": 2},
        "requests_by_worker": {"worker-0": 4, "worker-1": 2},
        "service_usage": {"worker-0": {"cpu_s": 10.0, "rss_bytes": 100}},
        "note": "first",
    }
    r2 = {
        "requests": 6,
        "ttft_mean_s": 0.6,
        "cold_start_rate": 0.5,
        "failed_by_status": {},
        "requests_by_worker": {"worker-0": 6},
        "service_usage": {"worker-0": {"cpu_s": 20.0, "rss_bytes": 300}},
        "note": "second",
    }
    m = mean_of_rounds([r1, r2])
    assert m["rounds"] == 2 and m["requests"] == 6 and isinstance(m["requests"], int)
    assert m["ttft_mean_s"] == pytest.approx(0.5)
    assert m["cold_start_rate"] == 0.5  # a round without the figure is left out of its mean
    assert m["failed_by_status"] == {"UNAVAILABLE": 1.0}  # a count a round lacks is 0 there
    assert m["requests_by_worker"] == {"worker-0": 5.0, "worker-1": 1.0}
    assert m["service_usage"] == {"worker-0": {"cpu_s": 15.0, "rss_bytes": 200.0}}
    assert m["note"] == "first"
    assert mean_of_rounds([r1])["ttft_mean_s"] == 0.4
    with pytest.raises(ValueError, match="no rounds"):
        mean_of_rounds([])


def test_comparison_spread_and_the_repeats_report(tmp_path: Path) -> None:
    rounds = [
        {"ttft_mean_reduction": 0.2, "throughput_ratio": 1.0},
        {"ttft_mean_reduction": 0.4, "throughput_ratio": None},
        {"ttft_mean_reduction": 0.3, "throughput_ratio": 0.98},
    ]
    sp = comparison_spread(rounds)
    assert sp["ttft_mean_reduction"]["mean"] == pytest.approx(0.3)
    assert (sp["ttft_mean_reduction"]["min"], sp["ttft_mean_reduction"]["max"]) == (0.2, 0.4)
    assert sp["ttft_mean_reduction"]["stdev"] == pytest.approx(0.1)  # sample stdev
    assert sp["throughput_ratio"]["mean"] == pytest.approx(0.99)  # the None round left out
    assert comparison_spread(rounds[:1])["ttft_mean_reduction"]["stdev"] is None
    assert comparison_spread([{"x": None}])["x"] == {
        "mean": None,
        "min": None,
        "max": None,
        "stdev": None,
    }

    plora = mean_of_rounds([summarize_policy(RECORDS, SAMPLES)] * 2)
    baseline = mean_of_rounds([summarize_policy(RECORDS[:4], SAMPLES[:2])] * 2)
    per_round = [compare(plora, baseline)] * 2
    repeats = {
        "rounds": 2,
        "order": [["plora", "baseline"], ["baseline", "plora"]],
        "comparison_per_round": per_round,
        "spread": comparison_spread(per_round),
    }
    info = {"requests": 6, "keys": 3, "adapters_used": 3, "compulsory_cold_rate": 0.5}
    report = build_report(
        {"repeats": 2}, info, {"plora": plora, "baseline": baseline}, repeats=repeats
    )
    assert report["repeats"]["rounds"] == 2
    assert set(COMPARISON_KEYS) <= set(report["comparison"])
    json.dumps(report, allow_nan=False)
    md = render_markdown(report)
    assert "Over 2 rounds" in md and "plora then baseline; baseline then plora" in md
    assert "| of the means | round mean | min | max | stdev | per round |" in md


def test_service_usage_from_each_service_process_metrics() -> None:
    """The bench reads CPU seconds and resident bytes from the services' real registries (the
    standard ``process_*`` series) and reports the replay's share of the CPU."""
    from prometheus_client import generate_latest

    from plora.replay.bench import _process_figures, _service_usage
    from services.gateway.metrics import GatewayMetrics
    from services.predictor.metrics import PredictorMetrics
    from services.worker.metrics import WorkerMetrics

    def texts() -> dict[str, str]:
        return {
            name: generate_latest(m.registry).decode()
            for name, m in (
                ("gateway", GatewayMetrics()),
                ("predictor", PredictorMetrics()),
                ("worker-0", WorkerMetrics()),
            )
        }

    before = _process_figures(texts())
    assert set(before) == {"gateway", "predictor", "worker-0"}
    assert all(f["process_resident_memory_bytes"] > 1 << 20 for f in before.values())
    sum(i * i for i in range(2_000_000))  # some CPU between the two scrapes
    usage = _service_usage(before, _process_figures(texts()))
    assert usage["worker-0"]["cpu_s"] > 0 and usage["worker-0"]["rss_bytes"] > 1 << 20
    assert _service_usage({}, _process_figures(texts()))["gateway"].keys() == {"rss_bytes"}
    report = {
        "settings": {},
        "trace": {},
        "policies": ["plora"],
        "plora": {"service_usage": {"worker-0": {"cpu_s": 12.25, "rss_bytes": 3 << 20}}},
    }
    assert "| worker-0 | 12.2 (3) |" in render_markdown(report)


# ------------------------------------------------------------------------------ client / CLI
@pytest.mark.parametrize(("n", "words"), [(0, 1), (1, 1), (7, 7), (64, 64)])
def test_synth_prompt_length_and_determinism(n: int, words: int) -> None:
    text = synth_prompt(n, seed=3, index=5)
    assert len(text.split(" ")) == words
    assert text == synth_prompt(n, seed=3, index=5)
    assert all(w.lower() in PROMPT_WORDS for w in text.split(" "))
    if n >= 7:
        assert text != synth_prompt(n, seed=3, index=6) and text != synth_prompt(n, 4, 5)


def test_build_requests_caps_prompts_and_keeps_order() -> None:
    reqs = build_requests(
        [0.0, 0.5, 2.0],
        ["a", "b", "a"],
        ["k1", "k2", "k1"],
        [3, 500, 64],
        max_new_tokens=8,
        prompt_token_cap=64,
        seed=0,
    )
    assert [r.index for r in reqs] == [0, 1, 2] and [r.t for r in reqs] == [0.0, 0.5, 2.0]
    assert [len(r.prompt.split()) for r in reqs] == [3, 64, 64]
    assert [r.adapter_id for r in reqs] == ["a", "b", "a"] and reqs[1].trace_key == "k2"
    assert all(r.max_new_tokens == 8 for r in reqs)
    with pytest.raises(ValueError):
        build_requests([0.0], ["a"], ["k"], [3], max_new_tokens=0, prompt_token_cap=64, seed=0)


MIB = 1 << 20


@pytest.mark.parametrize(
    ("sizes", "fraction", "want"),
    [
        ([4 * MIB] * 4, 0.25, 4 * MIB),  # a quarter of 16 MiB
        ([MIB, MIB, MIB, 10 * MIB], 0.25, 10 * MIB),  # at least the largest adapter
        ([3 * MIB + 1, 3 * MIB], 0.5, 4 * MIB),  # rounded up to whole MiB
        ([8 * MIB] * 10, 1.0, 80 * MIB),
    ],
)
def test_auto_pool_bytes(sizes: list[int], fraction: float, want: int) -> None:
    assert auto_pool_bytes(sizes, fraction) == want


def test_trace_info_floor_uses_adapters_and_keys() -> None:
    trace = Trace.from_arrays(
        [0.0, 0.2, 1.1, 1.5, 3.0], ["x", "y", "x", "z", "y"], prompt_tokens=[10, 20, 30, 40, 50]
    )
    info = trace_info(trace, {"x": "A", "y": "B", "z": "A"})  # z shares x's adapter
    assert info["requests"] == 5 and info["keys"] == 3 and info["adapters_used"] == 2
    assert info["compulsory_cold_rate"] == pytest.approx(2 / 5)
    assert info["compulsory_cold_rate_keys"] == pytest.approx(3 / 5)
    assert info["peak_req_per_s"] == 2 and info["prompt_tokens_median"] == 30
    assert math.isclose(info["mean_rate_req_s"], 5 / 3.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--ttft-probes", "-1"], "--ttft-probes must be >= 0, got -1"),
        (["--settle-timeout", "-1"], "--settle-timeout must be >= 0 seconds, got -1.0"),
        (["--settle-timeout", "nan"], "--settle-timeout must be >= 0 seconds, got nan"),
        (["--policies", "plora,fastest"], "unknown policies ['fastest']"),
    ],
)
def test_bad_replay_flags_exit_2_before_any_cluster_starts(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plora.replay import bench  # noqa: PLC0415

    out = tmp_path / "out"
    trace = ["--trace", str(tmp_path / "none.csv"), "--format", "alibaba"]
    args = replay_args([*trace, "--out", str(out), *flags])
    assert bench.run(args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing written, no trace read


def test_wait_settled_waits_for_every_worker_host_staging() -> None:
    """The bench starts probes and replay only once no worker has host staging queued or
    finishing (scraped from real worker metrics servers), and gives up after its timeout."""
    import threading
    import time

    from plora.replay.bench import wait_settled
    from services.common.metrics import serve_metrics
    from services.worker.metrics import WorkerMetrics

    workers = [WorkerMetrics() for _ in range(2)]
    servers = [serve_metrics(m.registry, "127.0.0.1", 0) for m in workers]
    state = {"metrics": {f"worker-{i}": f"http://127.0.0.1:{port}/metrics"
                         for i, (_, port) in enumerate(servers)}}  # fmt: skip
    try:
        workers[1].host_stages_queued.set(3)
        t0 = time.monotonic()
        assert not wait_settled(state, timeout_s=0.6, quiet_s=0.2, poll_s=0.05)
        assert time.monotonic() - t0 >= 0.6

        def stage() -> None:  # worker-1 reads its three adapters, 0.3 s apart
            for left in (2, 1, 0):
                time.sleep(0.3)
                workers[1].host_stages.inc()
                workers[1].host_stages_queued.set(left)

        threading.Thread(target=stage, daemon=True).start()
        t0 = time.monotonic()
        assert wait_settled(state, timeout_s=10, quiet_s=0.5, poll_s=0.05)
        waited = time.monotonic() - t0
        assert 0.9 + 0.5 <= waited < 5, waited  # the last read, then the quiet window
        assert wait_settled(state, timeout_s=0)  # 0 = do not wait
    finally:
        for server, _ in servers:
            server.shutdown()
