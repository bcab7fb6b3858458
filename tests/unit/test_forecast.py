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


def test_forecast_get_and_expected_by_id_agree_with_the_arrays():
    """``get`` (id -> row via the forecaster's index) and ``expected_by_id`` report the same
    numbers as the arrays, for scored, unscored and unknown ids, with and without the index."""
    f = make_forecaster("ensemble")
    for t, counts in _traffic(2, 40, ids=50).items():
        f.observe_counts(counts, float(t))
        fc = f.tick(float(t))
    f.observe("late", 40.5)  # known id, not yet in any forecast
    assert fc.index is not None and len(fc) > 5
    scan = Forecast(fc.now, fc.horizon_s, fc.rows, fc.probability, fc.expected_count, fc.ids)
    table = fc.as_dict()
    for a in [*f.ids, "never-seen"]:
        want = table.get(a, (0.0, 0.0))
        assert fc.get(a) == want == scan.get(a)
    assert fc.expected_by_id() == {a: e for a, (_p, e) in table.items() if e > 0}


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


@pytest.mark.parametrize("all_tracked", [True, False])
def test_lstm_tick_step_equals_torch_lstm_and_heads(all_tracked):
    """The tick's hand-written step (feature-major, sigmoid-only gates, reused buffers) gives
    the state and forecast of ``torch.nn.LSTM`` and the linear heads on the same inputs, both
    when every row is tracked (in-place path) and when some are not (gather/scatter path)."""
    f = LSTMForecaster(LSTMConfig(track_s=5.0), seed=1)
    with torch.no_grad():  # non-zero heads, so the head path is checked too
        f.head.weight.copy_(
            torch.randn(f.head.weight.shape, generator=torch.Generator().manual_seed(0))
        )
        f.head.bias.fill_(0.3)
    f._publish()
    ev = _traffic(3, 30, ids=40)
    for t in range(30):
        f.observe_counts(ev[t], float(t))
        f.tick(float(t))
    if all_tracked:
        f.observe_counts({a: 1 for a in f.ids}, 30.0)
    else:
        f.observe_counts({f.ids[0]: 2}, 30.0)
    fc = f.tick(30.0)
    n, H, b = len(f.ids), f.config.hidden, f._b
    rows = np.flatnonzero(f._tracked[:n])
    assert (len(rows) == n) == all_tracked and len(rows) > 0
    x = torch.from_numpy(f._xring[b % f._R][:, rows].T.copy())  # [T, d]
    hc0 = torch.from_numpy(f._sring[b % f._R][:, rows].T.copy())  # [T, 2H]
    with torch.no_grad():
        out, (h1, c1) = f.model(x[:, None, :], (hc0[None, :, :H], hc0[None, :, H:].contiguous()))
        o = f.head(torch.cat([out[:, 0], x], dim=1)).double()
    np.testing.assert_allclose(f._hc[:H, rows].T, h1[0].numpy(), atol=2e-6)
    np.testing.assert_allclose(f._hc[H:, rows].T, c1[0].numpy(), atol=2e-6)
    # the inputs are the documented features (class doc of LSTMForecaster)
    bucket = f._cring[rows, b % 64].astype(np.float64)
    age = np.maximum(30.0 - f._last_seen[rows], 0.0)
    want_x = np.stack(
        [
            np.log1p(bucket),
            np.log1p(f._c5[rows]),
            np.log1p(f._c60[rows]),
            np.log1p(60.0 * f._r300[rows]),
            np.log1p(3600.0 * f._r3600[rows]) / 2.0,
            np.log1p(age) / 4.0,
            np.full(len(rows), math.sin(2 * math.pi * 30.0 / 60.0)),
            np.full(len(rows), math.cos(2 * math.pi * 30.0 / 60.0)),
            np.log1p(10.0 * f._r10[rows]),
            np.log1p(f._total[rows]) / 4.0,
        ],
        axis=1,
    )
    np.testing.assert_allclose(x.numpy(), want_x, rtol=1e-5, atol=1e-6)
    r = f._r10, f._c5, f._c60, f._r300, f._r3600
    rate = 0.4 * r[0] + 0.2 * r[1] / 5 + 0.2 * r[2] / 60 + 0.1 * r[3] + 0.1 * r[4]
    want_lb = np.log(5.0 * rate[rows] + 1e-4)
    np.testing.assert_allclose(f._bring[b % f._R, rows], want_lb, rtol=1e-5, atol=1e-5)
    base = torch.from_numpy(f._bring[b % f._R, rows]).double().exp()
    want_e = base * o[:, 0].clamp(-8, 8).exp()
    want_p = torch.sigmoid(torch.log(torch.expm1(base)) + o[:, 1])
    assert list(fc.rows) == list(rows)
    np.testing.assert_allclose(fc.expected_count, want_e.numpy(), rtol=2e-5)
    np.testing.assert_allclose(fc.probability, want_p.numpy(), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("all_tracked", [True, False])
def test_lstm_prepared_step_changes_no_forecast(all_tracked):
    """The recurrent term train() prepares after a forecast is used by the next tick only when
    still valid (same rows, state and weights), and the forecasts equal those of a twin that
    never prepares; a new id or a tracking change makes the tick compute it itself."""
    a, b = LSTMForecaster(LSTMConfig(track_s=8.0)), LSTMForecaster(LSTMConfig(track_s=8.0))
    ev = _traffic(4, 60, ids=12)
    if all_tracked:  # the same few ids every second: every row stays tracked
        ev = {t: {f"ad{k}": 1 + (t + k) % 3 for k in range(6)} for t in range(60)}
    for t in range(60):
        for f in (a, b):
            f.observe_counts(ev[t], float(t))
        fa, fb = a.tick(float(t)), b.tick(float(t))
        assert fa.adapter_ids == fb.adapter_ids
        np.testing.assert_allclose(fa.expected_count, fb.expected_count, rtol=1e-5)
        np.testing.assert_allclose(fa.probability, fb.probability, rtol=1e-5, atol=1e-7)
        a._prepare_next_step()  # what train() does after the forecast (weights unchanged)
    assert b.prepared_steps == 0
    if all_tracked:
        assert a.prepared_steps == 59
    else:  # ids start and stop being tracked: some ticks could use it, some could not
        assert 0 < a.prepared_steps < 59
    used = a.prepared_steps
    a.observe("brand-new", 60.0)  # a new row: the prepared term no longer fits
    a.tick(60.0)
    assert a.prepared_steps == used


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


@pytest.mark.parametrize("name", ["lstm", "ensemble"])
def test_ticks_and_training_before_any_request(name):
    f = make_forecaster(name)
    for t in range(3):
        assert len(f.tick(float(t))) == 0
        assert f.train(0.01) is None
    f.observe("a", 3.0)
    assert f.tick(3.0).adapter_ids == ["a"]
