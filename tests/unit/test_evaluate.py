"""Tests of plora.evaluate: hand-computed metrics on tiny traces, and the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from plora.evaluate import add_arguments, evaluate_trace, run, tick_benchmark
from plora.traces import Trace
from services.predictor.forecast import make_forecaster

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"


def _trace(events: list[tuple[float, str]]) -> Trace:
    return Trace.from_arrays([t for t, _ in events], [k for _, k in events])


def test_hand_computed_frequency_metrics():
    """a is requested at t = 1..20, b once at t = 10.

    Ticks t = 0..20; windows (t, t+5] have a request for t = 0..19 (20 seconds).
    frequency (5 s window) has seen nothing at t = 0 (recall 0, hit 0); for t = 5..9 the truth
    is {a, b} (a 5 requests, b 1) but b is unseen: recall 1/2, hit 5/6; otherwise 1.
    """
    tr = _trace([(float(t), "a") for t in range(1, 21)] + [(10.0, "b")])
    res = evaluate_trace(tr.times, tr.key_index, tr.keys, {"freq": make_forecaster("frequency:5")})
    f, o = res["freq"], res["oracle"]
    assert f["recall_at_3_5s"] == pytest.approx((4 + 5 * 0.5 + 10) / 20)
    assert f["hit_at_8_5s"] == pytest.approx((4 + 5 * 5 / 6 + 10) / 20)
    assert f["hit_at_32_5s"] == pytest.approx(f["hit_at_8_5s"])
    assert f["recall_bound_seen_before"] == pytest.approx((4 + 5 * 0.5 + 10) / 20)
    assert f["adapters_seen"] == 2
    assert o["recall_at_3_5s"] == 1.0 and o["hit_at_8_5s"] == 1.0
    # prefetch = top 8 with p >= 0.5: a at t = 1..20 (p = 1 - e^-5; requested after t for
    # t <= 19), b at t = 10..14 (1 request in 5 s -> p = 1 - e^-1 = 0.63; never again)
    assert f["prefetch_precision"] == pytest.approx(19 / 25)


@pytest.mark.parametrize(
    ("events", "recall"),
    [
        # truth ties (1 request each) are broken by the trace's key order: x before y
        ([(1.0, "x"), (1.0, "y"), (3.0, "x"), (3.0, "y")], None),
        ([], None),
    ],
)
def test_oracle_is_perfect_and_empty_trace(events, recall):
    tr = _trace(events)
    res = evaluate_trace(tr.times, tr.key_index, tr.keys, {"ewma": make_forecaster("ewma")})
    if events:
        assert res["oracle"]["recall_at_3_5s"] == 1.0
        assert 0.0 <= res["ewma"]["recall_at_3_5s"] <= 1.0
    else:
        assert res["ewma"]["recall_at_3_5s"] is None


def test_truth_ties_follow_key_order():
    """Four adapters with one request each in (0, 5]: the true top 3 is the first 3 keys, so a
    forecaster ranking the 4th first scores 2/3 at t = 0 at most."""
    tr = _trace([(1.0, "k1"), (2.0, "k2"), (3.0, "k3"), (4.0, "k4")])
    wk = np.unique(tr.key_index)
    assert [tr.keys[k] for k in wk[:3]] == ["k1", "k2", "k3"]
    res = evaluate_trace(tr.times, tr.key_index, tr.keys, {"f": make_forecaster("frequency:5")})
    # t=0: nothing seen -> 0; t=1: truth {k2,k3,k4}, predicted {k1} -> 0; t=2: truth {k3,k4},
    # predicted k1,k2 -> 0; t=3: truth {k4} -> 0
    assert res["f"]["recall_at_3_5s"] == pytest.approx(0.0)
    assert res["f"]["recall_bound_seen_before"] == pytest.approx(0.0)


@pytest.mark.slow
def test_cli_on_real_azure2021(tmp_path, capsys):
    trace = DATA / "azure_functions_2021_first998.csv"
    if not trace.exists():
        pytest.skip(f"real trace {trace} absent")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "eval.json"
    args = parser.parse_args(
        [
            "--trace", str(trace), "--format", "azure2021", "--max-seconds", "300",
            "--forecasters", "frequency,ewma,lstm", "--bench-ids", "50", "--bench-seconds", "30",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert run(args) == 0
    report = json.loads(out.read_text())
    assert set(report["forecasters"]) == {"frequency", "ewma", "lstm", "oracle"}
    for name, r in report["forecasters"].items():
        for key in (
            "recall_at_3_5s", "hit_at_8_5s", "hit_at_32_5s", "prefetch_precision",
            "tick_seconds_p50", "tick_seconds_p99", "adapters_seen", "recall_bound_seen_before",
        ):  # fmt: skip
            assert key in r, (name, key)
        assert 0.0 <= r["recall_at_3_5s"] <= 1.0
    assert report["forecasters"]["oracle"]["recall_at_3_5s"] == 1.0
    assert report["tick_bench"]["lstm"]["adapters"] == 50
    assert report["tick_bench"]["lstm"]["scored_last_tick"] == 50  # all 50 still tracked
    assert "recall@3" in capsys.readouterr().out


def test_tick_benchmark_scores_every_id():
    b = tick_benchmark("frequency", n_adapters=300, seconds=5)
    assert b["adapters"] == 300 and b["scored_last_tick"] == 300
    assert b["tick_seconds_p99"] >= b["tick_seconds_p50"] > 0
