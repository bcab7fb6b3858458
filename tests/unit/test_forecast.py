"""Tests of services.predictor.forecast: exact baseline arithmetic, ranking, persistence, LSTM."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.predictor.forecast import (
    DEFAULT_FORECASTER,
    FORECASTER_NAMES,
    EnsembleForecaster,
    EWMAForecaster,
    Forecast,
    FrequencyForecaster,
    LSTMConfig,
    LSTMForecaster,
    make_forecaster,
)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The LSTM trains tiny batches: one thread is faster and steadier than several."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _feed(f, events: dict[int, dict[str, int]], ticks: range):
    out = {}
    for t in ticks:
        f.observe_counts(events.get(t, {}), float(t))
        out[t] = f.tick(float(t))
    return out


# ---------------------------------------------------------------- baselines, exact values
@pytest.mark.parametrize(
    ("window", "events", "at", "expected"),
    [
        (10, {1: {"a": 4}}, 1, {"a": 2.0}),  # 4 in 10 s -> 2 per 5 s
        (10, {1: {"a": 4}, 3: {"b": 1}}, 3, {"a": 2.0, "b": 0.5}),
        (10, {1: {"a": 4}}, 10, {"a": 2.0}),  # still inside (0, 10]
        (10, {1: {"a": 4}}, 11, {}),  # bucket 1 left the window
        (5, {1: {"a": 1}, 2: {"a": 1}}, 2, {"a": 2.0}),
    ],
)
def test_frequency_counts(window, events, at, expected):
    f = FrequencyForecaster(window_s=window, horizon_s=5.0)
    fc = _feed(f, events, range(1, at + 1))[at]
    got = {a: e for a, (p, e) in fc.as_dict().items()}
    assert got == pytest.approx(expected)
    for a, e in expected.items():
        assert fc.get(a)[0] == pytest.approx(1 - math.exp(-e))


def test_frequency_gap_closes_empty_buckets():
    f = FrequencyForecaster(window_s=10)
    f.observe("a", 1.0)
    f.tick(1.0)
    f.observe("b", 5.0)
    fc = f.tick(5.0)  # 4 buckets: 2,3,4 empty, 5 holds b
    assert set(fc.adapter_ids) == {"a", "b"}
    fc = f.tick(30.0)  # gap longer than the window: everything leaves
    assert len(fc) == 0


@pytest.mark.parametrize(("tau", "n"), [(1.0, 10), (10.0, 10), (30.0, 3)])
def test_ewma_rate(tau, n):
    f = EWMAForecaster(tau_s=tau, horizon_s=5.0)
    f.observe_counts({"a": n}, 0.0)
    fc = f.tick(0.0)
    a = 1 - math.exp(-1 / tau)
    assert fc.get("a")[1] == pytest.approx(a * n * 5.0)
    fc = f.tick(1.0)
    assert fc.get("a")[1] == pytest.approx((1 - a) * a * n * 5.0)
    fc = f.tick(4.0)  # 3 buckets later
    assert fc.get("a")[1] == pytest.approx((1 - a) ** 4 * a * n * 5.0)


# ---------------------------------------------------------------- Forecast ranking
@pytest.mark.parametrize(
    ("expected", "prob", "k", "top"),
    [
        ([1.0, 3.0, 2.0], [0.5, 0.9, 0.8], 2, ["b", "c"]),
        ([1.0, 1.0, 1.0], [0.5, 0.5, 0.5], 2, ["a", "b"]),  # ties: first-seen order
        ([1.0, 1.0, 2.0], [0.1, 0.6, 0.5], 3, ["c", "b", "a"]),  # then probability
        ([1.0], [0.1], 5, ["a"]),
        ([], [], 3, []),
    ],
)
def test_forecast_top_k(expected, prob, k, top):
    ids = ["a", "b", "c"]
    n = len(expected)
    fc = Forecast(0.0, 5.0, np.arange(n), np.array(prob), np.array(expected), ids)
    assert fc.top_k(k) == top
    assert fc.top_k(k) == [ids[r] for r in fc.rows[fc.ranking()][:k]]


# ---------------------------------------------------------------- factory, persistence
def test_factory_names():
    assert set(FORECASTER_NAMES) == {"frequency", "ewma", "lstm", "ensemble"}
    assert DEFAULT_FORECASTER in FORECASTER_NAMES
    assert make_forecaster("frequency:5").window == 5
    assert make_forecaster("ewma:7").tau_s == 7.0
    assert isinstance(make_forecaster("lstm"), LSTMForecaster)
    assert isinstance(make_forecaster("ensemble"), EnsembleForecaster)
    with pytest.raises(ValueError, match="unknown forecaster"):
        make_forecaster("nope")


def _traffic(seed: int, ticks: int, ids: int = 30) -> dict[int, dict[str, int]]:
    rng = np.random.default_rng(seed)
    out = {}
    for t in range(ticks):
        ks = rng.zipf(1.5, size=rng.poisson(4)) % ids
        out[t] = {f"ad{k}": int(c) for k, c in zip(*np.unique(ks, return_counts=True), strict=True)}
    return out


@pytest.mark.parametrize("name", ["frequency", "ewma", "lstm", "ensemble"])
def test_state_dict_round_trip_resumes_identically(name):
    ev = _traffic(1, 120)
    a = make_forecaster(name, seed=3)
    for t in range(80):
        a.observe_counts(ev[t], float(t))
        a.tick(float(t))
        a.train(0.01)
    blob = a.state_dict()
    assert isinstance(blob, bytes)
    b = make_forecaster(name, seed=3)
    b.load_state_dict(blob)
    for t in range(80, 120):
        a.observe_counts(ev[t], float(t))
        b.observe_counts(ev[t], float(t))
        fa, fb = a.tick(float(t)), b.tick(float(t))
        assert fa.adapter_ids == fb.adapter_ids
        np.testing.assert_allclose(fa.expected_count, fb.expected_count, rtol=1e-6)
        np.testing.assert_allclose(fa.probability, fb.probability, rtol=1e-6)


def test_load_state_of_another_forecaster_raises():
    blob = make_forecaster("frequency").state_dict()
    with pytest.raises(ValueError, match="state is for"):
        make_forecaster("ewma").load_state_dict(blob)
    with pytest.raises(ValueError, match="state is for"):
        make_forecaster("frequency:5").load_state_dict(blob)


# ---------------------------------------------------------------- LSTM
def test_lstm_size_is_about_10_kb():
    f = LSTMForecaster()
    assert f.num_parameters == 2_622
    assert 8_000 <= 4 * f.num_parameters <= 12_000


def test_untrained_lstm_equals_its_count_baseline():
    """Head initialized to zero: expected = base rate of the skip connection."""
    f = LSTMForecaster()
    f.observe_counts({"a": 5, "b": 1}, 0.0)
    fc = f.tick(0.0)
    a10 = 1 - math.exp(-1 / 10)
    a300 = 1 - math.exp(-1 / 300)
    a3600 = 1 - math.exp(-1 / 3600)
    for key, n in (("a", 5), ("b", 1)):
        rate = 0.4 * a10 * n + 0.2 * n / 5 + 0.2 * n / 60 + 0.1 * a300 * n + 0.1 * a3600 * n
        base = 5.0 * rate + 1e-4
        p, e = fc.get(key)
        assert e == pytest.approx(base, rel=1e-5)
        assert p == pytest.approx(-math.expm1(-base), rel=1e-4)


def test_lstm_unseen_ids_and_untracking():
    f = LSTMForecaster(LSTMConfig(track_s=10.0))
    for t in range(5):
        f.observe(f"new{t}", float(t))
        fc = f.tick(float(t))
        assert f"new{t}" in fc.adapter_ids
    fc = f.tick(20.0)
    assert "new0" not in fc.adapter_ids  # not requested for > track_s


@pytest.mark.slow
def test_lstm_learns_a_period_counts_cannot_see():
    """One adapter requested exactly every 10 s: after online training the LSTM expects it
    right before the request (age 6-9 s) far more than right after it (age 0-3 s); the count
    baseline it starts from cannot tell the two apart."""
    f = LSTMForecaster(LSTMConfig(train_steps=2, samples_per_tick=8, batch=32, lr=1e-2), seed=0)
    before, after = [], []
    for t in range(900):
        if t % 10 == 0:
            f.observe("p", float(t))
        f.observe_counts({"noise": 1} if t % 3 == 0 else {}, float(t))
        fc = f.tick(float(t))
        f.train(1.0)
        if t >= 700:
            (before if t % 10 >= 6 else after if t % 10 <= 3 else []).append(fc.get("p")[0])
    assert f.train_steps_done > 500
    assert np.mean(before) > 0.8 and np.mean(after) < 0.3
