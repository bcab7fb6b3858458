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


def _feed(f, events: dict[int, dict[str, int]], ticks: range, train: bool = False):
    out = {}
    for t in ticks:
        f.observe_counts(events.get(t, {}), float(t))
        out[t] = f.tick(float(t))
        if train:
            f.train(0.01)
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


# ---------------------------------------------------------------- ensemble weight learning
def _hot_switching(ticks: int, period: int, ids: int = 20, seed: int = 0):
    """Poisson(3) requests/s to one hot adapter that changes every ``period`` seconds."""
    rng = np.random.default_rng(seed)
    return {t: {f"h{(t // period) % ids}": int(rng.poisson(3)) + 1} for t in range(ticks)}


def _stable_popularity(ticks: int, ids: int = 10, seed: int = 0):
    """One request/s to an adapter drawn from a fixed Zipf-like law over ``ids`` adapters."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, ids + 1)
    p /= p.sum()
    return {t: {f"s{rng.choice(ids, p=p)}": 1} for t in range(ticks)}


@pytest.mark.parametrize("pool", ["shares", "rates"])
@pytest.mark.parametrize(
    ("events", "right"),
    [(_hot_switching(400, 30), 0), (_stable_popularity(600), 1)],
    ids=["fast-member-right", "slow-member-right"],
)
def test_ensemble_weight_moves_to_the_member_that_is_right(pool, events, right):
    """Members: a 1 s EWMA (right when the hot adapter keeps changing) and a 600 s window (right
    when popularity is stable and each second holds one random draw). From equal weights the
    learned weight goes to the right member in both streams, so it is not an order bias."""
    f = EnsembleForecaster(("ewma:1", "frequency:600"), pool=pool, learning_rate=0.1)
    _feed(f, events, range(len(events)), train=True)
    assert f.updates > 100
    assert f.weights.sum() == pytest.approx(1.0)
    assert f.weights[right] > 0.7
    assert f.weights.min() >= f.share * 0.5 - 1e-12  # fixed share keeps a floor


def test_ensemble_one_exponentiated_gradient_step_by_hand():
    """Horizon 1 s, members with windows 1 s and 2 s. t=0: a; t=1: b; t=2: a.
    The t=0 forecast (both: all on a) meets b at t=1: no member scored b, no update.
    The t=1 forecast (shares: m1 b=1; m2 a=.5, b=.5) meets a at t=2: q_a = .25,
    r = (0, 2), w ~ (.5 e^{-2 eta}, .5), then fixed share."""
    eta, alpha = 0.3, 0.05
    f = EnsembleForecaster(
        ("frequency:1", "frequency:2"), horizon_s=1.0, learning_rate=eta, share=alpha
    )
    _feed(f, {0: {"a": 1}, 1: {"b": 1}}, range(2), train=True)
    assert f.updates == 0
    np.testing.assert_array_equal(f.weights, [0.5, 0.5])
    f.observe("a", 2.0)
    fc = f.tick(2.0)
    assert f.updates == 0  # tick() never learns: the t=2 forecast used the weights so far
    np.testing.assert_array_equal(f.weights, [0.5, 0.5])
    assert fc.get("a")[1] == pytest.approx(0.75)  # m1: a=1; m2: a=.5, b=.5; equal weights
    f.train(0.01)
    assert f.updates == 1
    w = np.array([math.exp(-2 * eta), 1.0])
    w = (1 - alpha) * w / w.sum() + alpha * 0.5
    np.testing.assert_allclose(f.weights, w, rtol=1e-12)


def test_ensemble_rates_pool_poisson_steps_by_hand():
    """Same stream, ``pool="rates"``: a window without a scored request still teaches (all
    predicted mass was wasted): t=1 gains -L = (-1, -.5); t=2: lambda_a = .25 w-mixed, gains
    ((0 - 1) / 1, (.5 / .25 - 1) / 1) at equal-ish weights (recomputed from the state)."""
    eta, alpha = 0.3, 0.0
    f = EnsembleForecaster(
        ("frequency:1", "frequency:2"),
        horizon_s=1.0,
        pool="rates",
        learning_rate=eta,
        share=alpha,
    )
    _feed(f, {0: {"a": 1}, 1: {"b": 1}}, range(2), train=True)
    w = np.array([0.5 * math.exp(-eta * 1.0), 0.5 * math.exp(-eta * 0.5)])
    w /= w.sum()
    np.testing.assert_allclose(f.weights, w, rtol=1e-12)
    f.observe("a", 2.0)
    fc = f.tick(2.0)  # m1 a=1; m2 a=.5, b=.5, mixed with the weights learned so far
    assert fc.get("a")[1] == pytest.approx(w[0] + 0.5 * w[1])  # raw weighted mean
    assert fc.get("b")[1] == pytest.approx(0.5 * w[1])
    f.train(0.01)
    lam = w[1] * 0.5
    gain = np.array([-1.0, 0.5 / lam - 1.0])
    w = w * np.exp(eta * (gain - gain.max()))
    w /= w.sum()
    np.testing.assert_allclose(f.weights, w, rtol=1e-12)


def test_ensemble_without_learning_is_the_weighted_mean():
    """learning_rate 0: the weights stay the prior; "rates" is the weighted mean of the
    members' forecasts, "shares" has the mixed total and the mixed shares."""
    ev = _traffic(4, 60)
    r = EnsembleForecaster(("ewma:3", "frequency:20"), (1.0, 3.0), pool="rates", learning_rate=0)
    s = EnsembleForecaster(("ewma:3", "frequency:20"), (1.0, 3.0), learning_rate=0)
    m1, m2 = EWMAForecaster(tau_s=3), FrequencyForecaster(window_s=20)
    for t in range(60):
        fcs = []
        for f in (r, s, m1, m2):
            f.observe_counts(ev[t], float(t))
            fcs.append(f.tick(float(t)))
        fr, fs, f1, f2 = fcs
        e1 = {a: e for a, (_p, e) in f1.as_dict().items()}
        e2 = {a: e for a, (_p, e) in f2.as_dict().items()}
        for a in set(e1) | set(e2):
            x1, x2 = e1.get(a, 0.0), e2.get(a, 0.0)
            assert fr.get(a)[1] == pytest.approx(0.25 * x1 + 0.75 * x2)
            total = 0.25 * sum(e1.values()) + 0.75 * sum(e2.values())
            share = 0.25 * x1 / sum(e1.values()) + 0.75 * x2 / sum(e2.values())
            assert fs.get(a)[1] == pytest.approx(total * share)
            assert fs.get(a)[0] == pytest.approx(fr.get(a)[0])
    np.testing.assert_array_equal(r.weights, [0.25, 0.75])
    np.testing.assert_array_equal(s.weights, [0.25, 0.75])


def _step(f, counts: dict[str, int], t: int, train: bool = True) -> Forecast:
    f.observe_counts(counts, float(t))
    fc = f.tick(float(t))
    if train:
        f.train(0.01)
    return fc


def test_ensemble_learning_is_deterministic_and_round_trips_mid_window():
    """Default members (LSTM included): two runs give bit-identical weights and forecasts; a
    state saved while forecasts still wait for their window resumes with the same weights and
    forecasts as the run that never stopped (ticks only after the restore, as in
    test_state_dict_round_trip_resumes_identically)."""
    ev = _traffic(5, 140)
    a, b = make_forecaster("ensemble", seed=2), make_forecaster("ensemble", seed=2)
    for t in range(90):
        fa, fb = (_step(f, ev[t], t) for f in (a, b))
        assert fa.adapter_ids == fb.adapter_ids
        np.testing.assert_array_equal(fa.expected_count, fb.expected_count)
        np.testing.assert_array_equal(a.weights, b.weights)
    assert a.updates > 50 and not np.allclose(a.weights, a.prior)
    assert len(a._due) == a.h  # forecasts still waiting for their window
    c = make_forecaster("ensemble", seed=2)
    c.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(c.weights, a.weights)
    for t in range(90, 140):
        # no training after the restore: the LSTM's replay buffer is not persisted
        fa, fc = (_step(f, ev[t], t, train=False) for f in (a, c))
        assert fa.adapter_ids == fc.adapter_ids
        np.testing.assert_allclose(fa.expected_count, fc.expected_count, rtol=1e-6)
        np.testing.assert_allclose(fa.probability, fc.probability, rtol=1e-6)
        np.testing.assert_allclose(a.weights, c.weights, rtol=1e-9)
    assert c.updates == a.updates


def test_ensemble_drops_forecasts_cut_by_a_gap():
    """A forecast whose window a gap between ticks cut short is not scored, and the buckets
    skipped are empty (not the counts left from h buckets earlier)."""
    f = EnsembleForecaster(("ewma:1", "frequency:10"), horizon_s=2.0, learning_rate=1.0)
    _feed(f, {0: {"a": 1}, 1: {"b": 1}, 2: {"a": 1}, 3: {"a": 1}}, range(4), train=True)
    done = f.updates
    assert done >= 1
    w = f.weights.copy()
    f.tick(10.0)  # the forecasts of t=2, 3 are cut: dropped
    f.train(0.01)
    assert f.updates == done
    np.testing.assert_array_equal(f.weights, w)
    for t in (11.0, 12.0):  # the t=10 forecast's window (11, 12] is complete and empty
        f.tick(t)
        f.train(0.01)
    assert f.updates == done


def test_ensemble_rejects_bad_settings():
    with pytest.raises(ValueError, match="bad pool"):
        EnsembleForecaster(pool="median")
    with pytest.raises(ValueError, match="bad pool"):
        EnsembleForecaster(learning_rate=-1.0)
    with pytest.raises(ValueError, match="non-negative weight"):
        EnsembleForecaster(weights=(1.0,))
    with pytest.raises(ValueError, match="bad ensemble members"):
        EnsembleForecaster(members=("ensemble", "ewma"))
