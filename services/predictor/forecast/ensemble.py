"""The online-weighted mixture of forecasters (:class:`EnsembleForecaster`)."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence

import numpy as np

from services.predictor.forecast.base import Forecast, Forecaster, _npz_bytes

#: Members of the default ensemble: the LSTM, EWMAs on a log-spaced ladder of time constants
#: (3, 10, 30, 300 s) and the 60 s window (the two baselines of the evaluation are among them).
DEFAULT_MEMBERS: tuple[str, ...] = (
    "lstm", "ewma:3", "ewma:10", "ewma:30", "ewma:300", "frequency:60",
)  # fmt: skip


class EnsembleForecaster(Forecaster):
    """Mixture of member forecasters with weights learned online (exponentiated gradient).

    Default members (:data:`DEFAULT_MEMBERS`): the LSTM, EWMAs with time constants 3, 10, 30
    and 300 s and the 60 s window. Which one forecasts best depends on the traffic (bursts that
    decay in seconds on Alibaba GenAI, steady per-function rates on Azure Functions), so the
    weights are learned rather than fixed; having the evaluation's baselines (``ewma`` = 30 s,
    ``frequency`` = 60 s) among the members means the mixture's log-loss regret is bounded
    against each of them. Every observation is forwarded to every member in the same order, so
    all members share one row map.

    **Combination** (``pool="shares"``, the default). Each member ``m`` with a non-zero total
    ``L_m = sum_i e_mi`` of expected counts is read as a *distribution of the next requests over
    adapters*, ``s_mi = e_mi / L_m``; the ensemble forecasts the mixture ``q_i = sum_m v_m
    s_mi`` (``v``: the weights renormalized over the members with ``L_m > 0``) scaled to the
    mixed total: ``expected_i = (sum_m v_m L_m) q_i``, so its ranking is the ranking of ``q``.
    ``probability_i = sum_m w_m p_mi`` (a member that does not score an adapter contributes
    0). ``pool="rates"`` mixes the raw expected counts instead (``expected_i = sum_m w_m
    e_mi``, fixed weights).

    **Learning.** The metrics the predictor serves are rankings weighted by requests (hit@k,
    recall@3), so the loss is the log-loss of the mixture on the requests that arrive: once the
    horizon of the forecast made at bucket ``b`` has passed (at bucket ``b + h``), with ``y_i``
    the requests of ``(b, b + h]`` per adapter, ``loss(v) = -(1/Y) sum_i y_i log q_i`` (``Y =
    sum y_i`` over the adapters some member scored; requests to adapters no member scored
    cannot move the weights and are left out; a window without requests is skipped). This is
    the multinomial log-loss of sequential prediction with expert advice, convex in ``v``; its
    gradient is ``-r_m`` with ``r_m = (1/Y) sum_i y_i s_mi / q_i`` (``sum_m v_m r_m = 1``). The
    update is exponentiated gradient (Kivinen & Warmuth 1997; Helmbold et al. 1998 for mixture
    log-loss): ``w_m <- w_m exp(eta r_m)``, normalized, then mixed with the prior, ``w <- (1 -
    share) w + share prior`` (fixed share, Herbster & Warmuth 1998), which bounds every weight
    from below so the update can follow a change in which member is right. It learns the best
    *mixture* in hindsight, not the best single member (Hedge on the members' own losses would
    converge to one member and lose what averaging buys). With ``pool="rates"`` the loss is the
    Poisson negative log-likelihood of the mixed counts per request, gradient ``g_m = (L_m -
    sum_i y_i e_mi / lambda_i) / max(Y, 1)``, update ``w_m <- w_m exp(-eta g_m)``.

    Settings: ``share = 0.001`` per update is the fixed-share rate for about one change of the
    best mixture per 1,000 updates (about 17 min of 1 s ticks; fixed-share theory sets it to
    switches / updates). ``eta = 0.1``: ``r_m`` is O(1) per window and consecutive windows
    overlap (each request is scored ``h`` times), so a member consistently twice as likely on
    the requests gains a factor e in about 15 scored windows. Both were checked, not fitted, on
    the evaluation traces (Alibaba GenAI 2026 at 60x, Azure Functions 2019 ``--drop-top 1``):
    eta in {0.03, 0.1, 0.3, 1}, share in {0.0001, 0.001, 0.01, 0.05}; with share 0.01 the
    pull to the prior kept the LSTM's weight at 0.42 on Azure, where it is the best member.

    Cost per tick: the members' ticks and one ``[n]`` bucket folded into an ``[n, h]`` ring,
    O(n). The weight update (a search of the adapters requested in the window in each member's
    stored forecast, O(n)) runs in :meth:`train`, after the forecast is served, as the LSTM's
    training does; a forecast therefore uses the weights learned up to the previous tick.
    The members' forecasts of the last ``h`` ticks are kept until their windows close; they,
    the ring and the weights are part of :meth:`state_dict`. Forecasts whose window was cut by
    a gap of more than one bucket between ticks are dropped unscored.

    Args:
        members: Forecaster names for :func:`make_forecaster` (the first one's row map is
            shared).
        weights: Prior weight per member (normalized to sum 1; default equal): the starting
            weights and the fixed-share target.
        horizon_s: Forecast horizon, seconds (whole buckets).
        bucket_s: Bucket width, seconds.
        seed: Seed passed to the members (the LSTM's init and sampling).
        pool: ``"shares"`` or ``"rates"`` (see above).
        learning_rate: ``eta`` (>= 0; 0 keeps the prior weights).
        share: Fixed-share mixing rate in [0, 1].

    Attributes:
        weights: ``float64 [members]`` current weights (sum 1).
        updates: Weight updates done.

    Raises:
        ValueError: No member, a nested ensemble, bad weights, pool, rate or share.
    """

    name = "ensemble"
    POOLS = ("shares", "rates")

    def __init__(
        self,
        members: Sequence[str] = DEFAULT_MEMBERS,
        weights: Sequence[float] | None = None,
        horizon_s: float = 5.0,
        bucket_s: float = 1.0,
        seed: int = 0,
        pool: str = "shares",
        learning_rate: float = 0.1,
        share: float = 0.001,
    ):
        # the factory builds ensembles too, so it is imported here, not at module level
        from services.predictor.forecast.factory import make_forecaster

        super().__init__(horizon_s, bucket_s)
        if not members or any(m.partition(":")[0] == "ensemble" for m in members):
            raise ValueError(f"bad ensemble members {members}")
        w = np.asarray(weights if weights is not None else [1.0] * len(members), dtype=np.float64)
        if len(w) != len(members) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"need one non-negative weight per member, got {weights}")
        if pool not in self.POOLS or learning_rate < 0 or not 0.0 <= share <= 1.0:
            raise ValueError(f"bad pool/learning_rate/share {pool!r}, {learning_rate}, {share}")
        self.member_names = tuple(members)
        self.prior = w / w.sum()
        self.weights = self.prior.copy()
        self.pool = pool
        self.learning_rate = float(learning_rate)
        self.share = float(share)
        self.h = max(1, int(round(horizon_s / bucket_s)))
        self.members = [
            make_forecaster(m, horizon_s=horizon_s, seed=seed, bucket_s=bucket_s) for m in members
        ]
        self.ids = self.members[0].ids
        self.index = self.members[0].index
        self._counts = np.zeros((0, self.h), dtype=np.float64)  # [cap, h] bucket b in b % h
        self._window = np.zeros(0, dtype=np.float64)  # [cap] sum of the h buckets (exact ints)
        self._b = 0  # buckets closed so far
        # forecasts waiting for their window: (bucket, [(rows, expected) per member])
        self._due: list[tuple[int, list[tuple[np.ndarray, np.ndarray]]]] = []
        self.updates = 0  # weight updates done

    def _row_arrays(self) -> list[str]:
        return super()._row_arrays() + ["_counts", "_window"]

    def _fit_rows(self) -> int:
        n = len(self.ids)
        if n > self._cap:
            self._resize(max(64, 2 * self._cap, n))
        return n

    def observe(self, adapter_id: str, t: float) -> None:
        for m in self.members:
            m.observe(adapter_id, t)
        self._fit_rows()
        self._pending[self.index[adapter_id]] += 1.0

    def observe_counts(self, counts: Mapping[str, float], t: float) -> None:
        for m in self.members:
            m.observe_counts(counts, t)
        self._fit_rows()
        for a, c in counts.items():
            if c > 0:
                self._pending[self.index[a]] += c

    def tick(self, now: float) -> Forecast:
        steps = self._steps_to(now)
        n = self._fit_rows()
        h = self.h
        for b in range(max(self._b + 1, self._b + steps - h + 1), self._b + steps):
            self._drop_bucket(b % h, n)  # buckets skipped by a gap are empty
        self._b += steps
        self._drop_bucket(self._b % h, n)
        self._counts[:n, self._b % h] = self._pending[:n]
        self._window[:n] += self._pending[:n]
        self._pending[:n] = 0.0
        while self._due and self._due[0][0] + h < self._b:
            self._due.pop(0)  # its window passed without a train() to learn from it
        fcs = self._tick_members(now)
        self._due.append((self._b, [(f.rows, f.expected_count) for f in fcs]))
        self.ticks += 1
        return self._combine(now, fcs, n)

    def _drop_bucket(self, slot: int, n: int) -> None:
        """Take the bucket in ``slot`` of the ring out of the window sum and zero it."""
        col = self._counts[:n, slot]
        self._window[:n] -= col
        col[:] = 0.0

    def _tick_members(self, now: float) -> list[Forecast]:
        return [m.tick(now) for m in self.members]

    def _combine(self, now: float, fcs: Sequence[Forecast], n: int) -> Forecast:
        exp = np.zeros(n, dtype=np.float64)
        prob = np.zeros(n, dtype=np.float64)
        totals = np.array([f.expected_count.sum() for f in fcs])
        scale = self.weights.copy()
        if self.pool == "shares":
            live = totals > 0
            if live.any():
                v = np.where(live, self.weights, 0.0)
                v /= v.sum()
                scale = v * float(v @ totals) / np.where(live, totals, 1.0)
        for s, w, f in zip(scale, self.weights, fcs, strict=True):
            # rows are sorted and unique: n of them are all rows (no scatter needed)
            at = slice(0, n) if len(f.rows) == n else f.rows
            exp[at] += s * f.expected_count
            prob[at] += w * f.probability
        rows = np.flatnonzero(exp > 0)
        return self._make(now, rows, exp[rows], prob[rows])

    def _learn(self, fcs: Sequence[tuple[np.ndarray, np.ndarray]], n: int) -> None:
        """One exponentiated-gradient step on the forecasts ``fcs`` of the bucket ``h`` ago,
        scored on the requests of the ``h`` buckets since (see the class doc)."""
        if self.learning_rate == 0.0:
            return
        hit = np.flatnonzero(self._window[:n] > 0.5)  # whole request counts
        yv = self._window[hit]
        M = len(fcs)
        e = np.zeros((M, len(hit)))  # each member's expected count at the requested rows
        totals = np.zeros(M)
        for m, (rows, exp) in enumerate(fcs):
            totals[m] = exp.sum()
            if not len(rows) or not len(hit):
                continue
            if rows[-1] == len(rows) - 1 and hit[-1] < len(rows):  # rows 0..k-1: no search
                e[m] = exp[hit]
            else:
                i = np.minimum(np.searchsorted(rows, hit), len(rows) - 1)
                e[m] = np.where(rows[i] == hit, exp[i], 0.0)
        w = self.weights
        if self.pool == "shares":
            live = totals > 0
            if not live.any():
                return
            s = e / np.where(live, totals, 1.0)[:, None]  # [M, k] shares
            v = np.where(live, w, 0.0)
            q = (v / v.sum()) @ s
            ok = q > 0
            Y = float(yv[ok].sum())
            if Y == 0.0:
                return
            gain = (s[:, ok] * (yv[ok] / q[ok])).sum(axis=1) / Y  # r_m
        else:
            lam = w @ e
            ok = lam > 0
            Y = float(yv[ok].sum())
            gain = ((e[:, ok] * (yv[ok] / lam[ok])).sum(axis=1) - totals) / max(Y, 1.0)
        z = self.learning_rate * (gain - gain.max())
        w = w * np.exp(z)
        w /= w.sum()
        self.weights = (1.0 - self.share) * w + self.share * self.prior
        self.updates += 1

    def _advance(self, bucket: np.ndarray, steps: int, now: float) -> None:  # pragma: no cover
        raise NotImplementedError("EnsembleForecaster ticks its members")

    def _forecast(self, now: float) -> Forecast:  # pragma: no cover
        raise NotImplementedError("EnsembleForecaster ticks its members")

    def train(self, budget_s: float = 0.05) -> float | None:
        """Learn the weights from the forecast whose window the last tick closed, then train
        the members; returns the members' mean loss, or None.

        Like the LSTM's training, the weight update runs here, after the tick's forecast was
        served, never inside :meth:`tick`: a forecast uses the weights learned up to the
        previous tick's window. A window closed by a tick not followed by ``train()`` is not
        learned from.
        """
        n, h = len(self.ids), self.h
        while self._due and self._due[0][0] + h <= self._b:
            b0, fcs = self._due.pop(0)
            if b0 + h == self._b:
                self._learn(fcs, n)
        losses = [m.train(budget_s) for m in self.members]
        got = [x for x in losses if x is not None]
        return float(np.mean(got)) if got else None

    def _config(self) -> dict:
        return super()._config() | {
            "members": list(self.member_names),
            "weights": self.prior.tolist(),
            "pool": self.pool,
            "learning_rate": self.learning_rate,
            "share": self.share,
        }

    def _scalars(self) -> dict:
        return super()._scalars() | {
            "b": self._b,
            "updates": self.updates,
            "due": [b for b, _ in self._due],
        }

    def state_dict(self) -> bytes:
        """Members' states, learned weights, the count ring and the forecasts still waiting
        for their window (npz, no pickle)."""
        arrays = {
            f"m{i}": np.frombuffer(m.state_dict(), dtype=np.uint8)
            for i, m in enumerate(self.members)
        }
        arrays |= self._row_state()
        arrays["weights"] = self.weights
        for j, (_b, fcs) in enumerate(self._due):
            for i, (rows, exp) in enumerate(fcs):
                arrays[f"d{j}_{i}_rows"] = rows
                arrays[f"d{j}_{i}_exp"] = exp
        meta = {"name": self.name, "config": self._config(), "scalars": self._scalars()}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        return _npz_bytes(arrays)

    def load_state_dict(self, data: bytes) -> None:
        """Restore a state written by :meth:`state_dict` of the same configuration.

        Raises:
            ValueError: The bytes come from another forecaster or another configuration.
        """
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta["name"] != self.name or meta["config"] != json.loads(
                json.dumps(self._config())
            ):
                raise ValueError(f"state is for {meta['name']} {meta['config']}")
            for i, m in enumerate(self.members):
                m.load_state_dict(bytes(z[f"m{i}"]))
            self.ids = self.members[0].ids
            self.index = self.members[0].index
            self._restore_rows(z)
            self.weights = np.array(z["weights"], dtype=np.float64)
            s = meta["scalars"]
            self._due = [
                (
                    int(b),
                    [
                        (np.array(z[f"d{j}_{i}_rows"]), np.array(z[f"d{j}_{i}_exp"]))
                        for i in range(len(self.members))
                    ],
                )
                for j, b in enumerate(s["due"])
            ]
        self._b = int(s["b"])
        self.updates = int(s["updates"])
        self._last_tick = s["last_tick"]
        self.ticks = int(s["ticks"])
