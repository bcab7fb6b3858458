"""ForecastCalibrator (services/predictor/calibration.py), the calibrated prefetch gate, the
simulator's oracle bound and the predictor's ablation figures of report.json."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plora.simulator.oracle import BeladyPolicy, FutureArrivals
from plora.simulator.report import ablation_text, comparison_block, gap_closed, mean_over_seeds
from services.predictor.calibration import ForecastCalibrator
from services.predictor.placement import AdapterDemand, PrefetchSelector
from services.worker.eviction import Candidate


def test_unseen_buckets_read_the_score_as_poisson() -> None:
    cal = ForecastCalibrator(5.0)
    assert cal.probability(0.01) == 0.0  # below min_expected: never prefetched
    for x in (0.1, 1.0, 3.0):
        assert cal.probability(x) == pytest.approx(1 - math.exp(-x))


def test_hit_rates_are_learnt_per_bucket_from_what_arrived() -> None:
    """'a' is forecast high and requested every second; 'b' forecast as high in another
    bucket and never requested: their calibrated probabilities part."""
    cal = ForecastCalibrator(5.0)
    for t in range(200):
        cal.observe(float(t), {"a": 3.0, "b": 0.4}, ["a"])
    assert cal.probability(3.0) > 0.97
    assert cal.probability(0.4) < 0.05
    rows = cal.table()
    assert sum(r["predictions"] for r in rows) == 2 * (200 - 5)  # the last horizon is pending


def test_a_prediction_is_a_hit_only_inside_its_horizon() -> None:
    cal = ForecastCalibrator(5.0, prior_weight=0.0)
    cal.observe(0.0, {"a": 1.0}, [])
    cal.observe(7.0, {}, ["a"])  # after (0, 5]: a miss
    cal.observe(8.0, {"a": 1.0}, [])
    cal.observe(12.0, {}, ["a"])  # inside (8, 13]
    cal.observe(20.0, {}, [])
    assert (cal.hits[cal.bucket(1.0)], cal.count[cal.bucket(1.0)]) == (1, 2)


def test_prefetch_selector_gates_on_calibrated_probability() -> None:
    cal = ForecastCalibrator(5.0)
    for t in range(100):
        cal.observe(float(t), {"a": 3.0, "b": 0.4}, ["a"])
    sel = PrefetchSelector(0.1, 0.05, calibrator=cal, min_probability=0.75)
    demand = {"a": AdapterDemand(8, 100, 3.0), "b": AdapterDemand(8, 100, 0.4)}
    assert sel.update(demand) == {"a"}
    assert PrefetchSelector(0.1, 0.05).update(demand) == {"a", "b"}  # uncalibrated


def test_belady_evicts_the_adapter_needed_last() -> None:
    times = np.array([1.0, 2.0, 3.0, 9.0])
    adapters = np.array([0, 1, 0, 2])
    future = FutureArrivals(times, adapters, 4)
    assert future.next_use(0, 1.0) == 3.0 and future.next_use(3, 0.0) == math.inf
    ads, counts = future.counts(0.0, 3.0)
    assert ads.tolist() == [0, 1] and counts.tolist() == [2.0, 1.0]
    now = 1.5
    pol = BeladyPolicy(future, {"a0": 0, "a1": 1, "a2": 2, "a3": 3}, lambda: now)
    cands = [Candidate(f"a{i}", 10, last_used=float(i)) for i in range(4)]
    assert [c.adapter_id for c in pol.order(cands)] == ["a3", "a2", "a0", "a1"]


@pytest.mark.parametrize(
    ("plora", "no_pred", "oracle", "expected"),
    [
        (2.0, 3.0, 1.0, 0.5),
        (3.0, 3.0, 1.0, 0.0),
        (3.5, 3.0, 1.0, -0.25),
        (1.0, 3.0, 1.0, 1.0),
        (2.0, 3.0, 3.0, None),  # the oracle leaves no gap
        (2.0, None, 1.0, None),
    ],
)
def test_gap_closed(plora, no_pred, oracle, expected) -> None:  # noqa: ANN001
    assert gap_closed(plora, no_pred, oracle) == (
        pytest.approx(expected) if expected is not None else None
    )


def test_comparison_block_has_the_predictor_ablation() -> None:
    def s(ttft: float) -> dict[str, float]:
        return {"ttft_mean_s": ttft, "ttft_p99_s": 10 * ttft, "cold_start_wait_mean_s": ttft}

    block = comparison_block(
        {"plora": s(2.0), "plora-no-predictor": s(4.0), "oracle": s(1.0), "baseline": s(8.0)}
    )
    assert block is not None
    assert block["ttft_mean_reduction"] == pytest.approx(0.75)  # vs the baseline
    assert block["predictor_ttft_reduction"] == pytest.approx(0.5)
    assert block["predictor_gap_closed"] == pytest.approx(2 / 3)
    assert comparison_block({"baseline": s(1.0)}) is None


def test_figures_over_seeds_are_means_with_every_run_kept() -> None:
    runs = [
        {"ttft_mean_s": 1.0, "ttft_p99_s": 4.0, "failed": 0, "cold_causes": {"first_use": 3},
         "requests_per_worker": [2, 4], "min_workers_for_slo": 3, "name": "a", "ok": True},
        {"ttft_mean_s": 3.0, "ttft_p99_s": 8.0, "failed": 2, "cold_causes": {"first_use": 5},
         "requests_per_worker": [4, 2], "min_workers_for_slo": None, "name": "b", "ok": False},
    ]  # fmt: skip
    mean = mean_over_seeds(runs, [7, 8])
    assert mean["ttft_mean_s"] == pytest.approx(2.0)
    assert mean["ttft_p99_s"] == pytest.approx(6.0)
    assert mean["failed"] == pytest.approx(1.0)
    assert mean["cold_causes"] == {"first_use": pytest.approx(4.0)}
    assert mean["requests_per_worker"] == [pytest.approx(3.0), pytest.approx(3.0)]
    # the search ran for the first seed only; words and flags are the first run's
    assert (mean["min_workers_for_slo"], mean["name"], mean["ok"]) == (3, "a", True)
    assert mean["seed_runs"]["seeds"] == [7, 8]
    assert mean["seed_runs"]["ttft_p99_s"] == [4.0, 8.0]
    with pytest.raises(ValueError, match="one seed per run"):
        mean_over_seeds(runs, [7])


def test_comparison_over_seeds_compares_the_means_and_lists_each_seed() -> None:
    def s(means: list[float]) -> dict:
        runs = [
            {"ttft_mean_s": m, "ttft_p99_s": 10 * m, "cold_start_wait_mean_s": m} for m in means
        ]
        return mean_over_seeds(runs, [0, 1])

    block = comparison_block({"plora": s([2.0, 4.0]), "plora-no-predictor": s([4.0, 4.0])})
    assert block is not None
    assert block["predictor_ttft_reduction"] == pytest.approx(0.25)  # 3 against 4
    assert block["predictor_seed_runs"]["ttft_reduction"] == [
        pytest.approx(0.5),
        pytest.approx(0.0),
    ]


def test_the_oracles_room_comes_with_its_standard_error_and_noise_is_called_noise() -> None:
    """Over seeds, the comparison gives each seed's oracle room and the standard errors of the
    per-seed reductions; the report's ablation paragraph says when the oracle's room is within
    two standard errors of 0, where ``predictor_gap_closed`` divides by noise."""

    def s(means: list[float]) -> dict:
        runs = [{"ttft_mean_s": m, "ttft_p99_s": 10 * m} for m in means]
        return mean_over_seeds(runs, list(range(len(means))))

    def block(oracle: list[float]) -> dict:
        out = comparison_block(
            {"plora": s([3.0, 3.0, 4.5]), "plora-no-predictor": s([4.0, 4.0, 4.0]),
             "oracle": s(oracle)}
        )  # fmt: skip
        assert out is not None
        return out

    level = block([3.6, 4.0, 4.4])
    assert level["predictor_seed_runs"]["oracle_ttft_reduction"] == pytest.approx([0.1, 0.0, -0.1])
    assert level["oracle_ttft_reduction"] == pytest.approx(0.0)
    assert level["oracle_ttft_reduction_se"] == pytest.approx(0.1 / 3**0.5)
    assert level["predictor_ttft_reduction_se"] == pytest.approx(
        np.std([0.25, 0.25, -0.125], ddof=1) / 3**0.5
    )
    assert level["predictor_gap_closed"] is None  # the oracle is level: no gap at all
    text = ablation_text(level)
    assert text is not None and "`predictor_ttft_reduction` +12.5 % (standard error" in text
    assert "there is no gap to close" in text

    wide = block([3.9, 3.7, 3.95])  # a gap of 3.75 % with a standard error of 1.9 %
    assert wide["predictor_gap_closed"] is not None
    assert "within two standard errors of 0" in (ablation_text(wide) or "")
    clear = block([3.0, 3.1, 2.9])
    assert "within two standard errors" not in (ablation_text(clear) or "x")
    assert "no gap to close" not in (ablation_text(clear) or "x")
    one_seed = comparison_block(
        {"plora": s([3.0]), "plora-no-predictor": s([4.0]), "oracle": s([2.9])}
    )
    assert "`--seeds N` gives standard errors" in (ablation_text(one_seed) or "")
    assert ablation_text({"throughput_ratio": 1.0}) is None  # no ablation ran
