"""Per-adapter demand forecasters: frequency, EWMA, an online-trained LSTM, and an ensemble.

The predictor (Predictive-LoRA, arXiv 2512.20210, section 2) forecasts which adapters will be
requested in the next few seconds so the workers can prefetch them. Every forecaster here has the
same interface (:class:`Forecaster`):

* ``observe(adapter_id, t)`` / ``observe_counts({adapter_id: n}, t)`` record requests as they
  arrive (time in seconds, any epoch, non-decreasing across ticks);
* ``tick(now) -> Forecast`` closes the current 1 s bucket (every request observed since the
  previous tick belongs to it; a gap of several seconds closes empty buckets too) and returns,
  per adapter, the ``probability`` of at least one request and the ``expected_count`` of
  requests in ``(now, now + horizon_s]`` (default 5 s);
* ``train(budget_s)`` (LSTM only; a no-op elsewhere) runs a bounded number of optimizer steps
  *after* the forecast was served, so training never stalls a forecast;
* ``state_dict() -> bytes`` / ``load_state_dict(bytes)`` persist everything (id map, counters,
  weights, optimizer moments) so the predictor resumes after a restart (it stores the bytes in
  Redis).

State lives in numpy arrays indexed by an ``adapter id -> row`` map that grows on demand, so
thousands of ids and ids never seen before cost nothing special. Only adapters with recent
activity are scored; any other adapter has probability 0 and expected count 0.

The LSTM (:class:`LSTMForecaster`) is a single-layer LSTM with one set of weights shared by all
adapters (hidden 20, 10 input features, 2 output heads: 2,622 parameters = 10.5 KB in float32).
It is run as a *streaming* model: every tick, each tracked adapter advances its own ``(h, c)``
state by one step on that second's features, in one batched numpy step, so a tick costs one LSTM
step over the active adapters. Its outputs are a multiplicative correction of a simple
count-based rate (``log lambda = log base + head(h, x)``, head initialized to zero), so an
untrained model forecasts like the count baseline and learning only has to add what counts miss
(recency, periodicity, burst decay). Training is truncated back-propagation through time on
windows of ``window`` steps sampled from the live history, started from the recorded state at the
window start, with a Poisson loss on the count and a cross-entropy loss on ">= 1 request", on a
sliding replay buffer of recent windows (Adam; ``train_steps`` steps per tick).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

logger = logging.getLogger(__name__)

#: Forecasters :func:`make_forecaster` builds.
FORECASTER_NAMES: tuple[str, ...] = ("frequency", "ewma", "lstm", "ensemble")
#: The forecaster the predictor service uses unless told otherwise (see the eval report).
DEFAULT_FORECASTER = "ensemble"


# ---------------------------------------------------------------------------- Forecast
@dataclass(frozen=True, eq=False)
class Forecast:
    """Per-adapter demand over ``(now, now + horizon_s]``.

    Only scored adapters are listed; every other adapter has probability 0 and expected count 0.

    Attributes:
        now: Time of the tick, seconds.
        horizon_s: Forecast horizon, seconds.
        rows: ``int64 [n]`` row of each scored adapter in ``ids`` (first-seen order).
        probability: ``float64 [n]`` P(at least one request in the horizon), in [0, 1].
        expected_count: ``float64 [n]`` expected number of requests in the horizon, >= 0.
        ids: The forecaster's append-only row -> adapter id list (shared, not copied).
        index: The forecaster's adapter id -> row map (shared; optional: :meth:`get` falls
            back to a scan without it).
    """

    now: float
    horizon_s: float
    rows: np.ndarray
    probability: np.ndarray
    expected_count: np.ndarray
    ids: Sequence[str] = field(repr=False)
    index: Mapping[str, int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def adapter_ids(self) -> list[str]:
        """Ids of the scored adapters, aligned with ``probability`` and ``expected_count``."""
        ids = self.ids
        return [ids[r] for r in self.rows.tolist()]

    def ranking(self, k: int | None = None) -> np.ndarray:
        """Indices into the arrays of the top ``k`` adapters (all when None), best first.

        Order: expected count descending, then probability descending, then first-seen order
        (deterministic).
        """
        n = len(self.rows)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        idx = np.arange(n)
        if k is not None and k < n:
            # candidates: everything scoring >= the k-th largest expected count
            kth = np.partition(self.expected_count, n - k)[n - k]
            idx = np.flatnonzero(self.expected_count >= kth)
        order = np.lexsort((self.rows[idx], -self.probability[idx], -self.expected_count[idx]))
        out = idx[order]
        return out if k is None else out[:k]

    def top_k(self, k: int) -> list[str]:
        """The ``k`` adapters with the highest expected count (see :meth:`ranking`)."""
        ids = self.ids
        return [ids[r] for r in self.rows[self.ranking(k)].tolist()]

    def get(self, adapter_id: str) -> tuple[float, float]:
        """``(probability, expected_count)`` of one adapter ((0, 0) when not scored).

        O(log n) with ``index`` (``rows`` ascending, as forecasters make them), else a scan.
        """
        if self.index is not None:
            r = self.index.get(adapter_id)
            i = int(np.searchsorted(self.rows, r)) if r is not None else len(self.rows)
            hit = [i] if i < len(self.rows) and self.rows[i] == r else []
        else:
            hit = [i for i, r in enumerate(self.rows.tolist()) if self.ids[r] == adapter_id]
        if not hit:
            return 0.0, 0.0
        return float(self.probability[hit[0]]), float(self.expected_count[hit[0]])

    def expected_by_id(self) -> dict[str, float]:
        """``{adapter_id: expected_count}`` of the adapters with an expected count > 0."""
        ids = self.ids
        return {
            ids[r]: e
            for r, e in zip(self.rows.tolist(), self.expected_count.tolist(), strict=True)
            if e > 0
        }

    def as_dict(self) -> dict[str, tuple[float, float]]:
        """``{adapter_id: (probability, expected_count)}`` of the scored adapters."""
        return {
            a: (float(p), float(e))
            for a, p, e in zip(self.adapter_ids, self.probability, self.expected_count, strict=True)
        }


# ---------------------------------------------------------------------------- base class
@contextlib.contextmanager
def _one_torch_thread(torch):
    """Run the block with one torch intra-op thread (restored after): the forecasters' tensors
    are small, and contended BLAS/OpenMP threads make them 10-40x slower on a shared host."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


def _grow(arr: np.ndarray, rows: int) -> np.ndarray:
    """Return ``arr`` with at least ``rows`` rows (zero-filled), doubling to amortize."""
    if arr.shape[0] >= rows:
        return arr
    new = np.zeros((max(rows, 2 * arr.shape[0], 64),) + arr.shape[1:], dtype=arr.dtype)
    new[: arr.shape[0]] = arr
    return new


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``arrays`` as the bytes of one npz file, each under its key (no pickle)."""
    buf = io.BytesIO()
    # mypy also matches ``**arrays`` against savez's ``allow_pickle: bool`` (no key is named so)
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


class Forecaster(ABC):
    """Common machinery: id -> row map, the pending bucket, ticking, persistence.

    Args:
        horizon_s: Forecast horizon in seconds (> 0).
        bucket_s: Bucket width in seconds (> 0); ticks are expected every ``bucket_s``.
    """

    name = "base"

    def __init__(self, horizon_s: float = 5.0, bucket_s: float = 1.0) -> None:
        if horizon_s <= 0 or bucket_s <= 0:
            raise ValueError(f"horizon_s and bucket_s must be > 0, got {horizon_s}, {bucket_s}")
        self.horizon_s = float(horizon_s)
        self.bucket_s = float(bucket_s)
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self._cap = 0
        self._pending = np.zeros(0, dtype=np.float32)  # [cap] requests since the last tick
        self._last_seen = np.zeros(0, dtype=np.float64)  # [cap] time of the last request
        self._last_tick: float | None = None
        self.ticks = 0

    # -- rows
    def _row(self, adapter_id: str) -> int:
        r = self.index.get(adapter_id)
        if r is None:
            r = len(self.ids)
            self.ids.append(adapter_id)
            self.index[adapter_id] = r
            if r >= self._cap:
                self._resize(max(64, 2 * self._cap, r + 1))
        return r

    def _resize(self, cap: int) -> None:
        """Grow every per-row array to ``cap`` rows; subclasses extend :meth:`_row_arrays`."""
        for name in self._row_arrays():
            setattr(self, name, _grow(getattr(self, name), cap))
        self._cap = cap

    def _row_arrays(self) -> list[str]:
        return ["_pending", "_last_seen"]

    # -- input
    def observe(self, adapter_id: str, t: float) -> None:
        """Record one request for ``adapter_id`` arriving at time ``t`` (seconds)."""
        r = self._row(adapter_id)
        self._pending[r] += 1.0
        if t > self._last_seen[r]:
            self._last_seen[r] = t

    def observe_counts(self, counts: Mapping[str, float], t: float) -> None:
        """Record ``counts[adapter_id]`` requests per adapter, all arriving by time ``t``."""
        for a, n in counts.items():
            if n > 0:
                r = self._row(a)
                self._pending[r] += n
                if t > self._last_seen[r]:
                    self._last_seen[r] = t

    # -- ticking
    def tick(self, now: float) -> Forecast:
        """Close the current bucket and forecast ``(now, now + horizon_s]``.

        If more than one bucket width passed since the previous tick, the buckets in between are
        closed empty first (the pending requests go to the newest bucket).
        """
        steps = self._steps_to(now)
        n = len(self.ids)
        bucket = self._pending[:n].copy()
        self._pending[:n] = 0.0
        self._advance(bucket, steps, now)
        self.ticks += 1
        return self._forecast(now)

    def _steps_to(self, now: float) -> int:
        """Buckets closed by a tick at ``now`` (1, or more after a gap); records the tick."""
        steps = 1
        if self._last_tick is not None:
            steps = max(1, int(round((now - self._last_tick) / self.bucket_s)))
        self._last_tick = now
        return steps

    @abstractmethod
    def _advance(self, bucket: np.ndarray, steps: int, now: float) -> None:
        """Fold one closed bucket ``bucket`` (``float32 [n_ids]``) in, after ``steps - 1``
        empty ones."""

    @abstractmethod
    def _forecast(self, now: float) -> Forecast:
        """Forecast from the current state."""

    def _make(self, now: float, rows: np.ndarray, expected: np.ndarray, prob: np.ndarray):
        """A :class:`Forecast`; ``rows`` must be ascending (``np.flatnonzero`` order)."""
        return Forecast(
            now,
            self.horizon_s,
            rows.astype(np.int64, copy=False),
            np.clip(prob.astype(np.float64, copy=False), 0.0, 1.0),
            np.maximum(expected.astype(np.float64, copy=False), 0.0),
            self.ids,
            self.index,
        )

    def train(self, budget_s: float = 0.05) -> float | None:
        """Run learning steps within ``budget_s`` seconds; returns the loss (None: no model)."""
        return None

    # -- persistence
    def _config(self) -> dict:
        return {"horizon_s": self.horizon_s, "bucket_s": self.bucket_s}

    def _scalars(self) -> dict:
        return {"last_tick": self._last_tick, "ticks": self.ticks}

    def _extra_arrays(self) -> dict[str, np.ndarray]:
        return {}

    def _load_extra(self, arrays: Mapping[str, np.ndarray], scalars: dict) -> None:
        return None

    def _row_state(self) -> dict[str, np.ndarray]:
        """The per-row arrays of the ``len(ids)`` rows in use, keyed as :meth:`state_dict`
        stores them."""
        n = len(self.ids)
        return {name.lstrip("_"): getattr(self, name)[:n] for name in self._row_arrays()}

    def _restore_rows(self, z: Mapping[str, np.ndarray]) -> None:
        """Re-make the per-row arrays for ``len(ids)`` rows and fill them from ``z`` (what
        :meth:`_row_state` stored)."""
        n = len(self.ids)
        self._cap = 0
        for name in self._row_arrays():
            old = getattr(self, name)
            setattr(self, name, np.zeros((0,) + old.shape[1:], dtype=old.dtype))
        self._resize(max(64, n))
        for name in self._row_arrays():
            getattr(self, name)[:n] = z[name.lstrip("_")]

    def state_dict(self) -> bytes:
        """Serialize the whole state (ids, counters, weights) to bytes (npz, no pickle)."""
        arrays = self._row_state()
        arrays.update({f"x_{k}": v for k, v in self._extra_arrays().items()})
        meta = {
            "name": self.name,
            "config": self._config(),
            "scalars": self._scalars(),
            "ids": self.ids,
        }
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        return _npz_bytes(arrays)

    def load_state_dict(self, data: bytes) -> None:
        """Restore a state written by :meth:`state_dict` of the same forecaster class.

        Raises:
            ValueError: The bytes come from another forecaster or another configuration.
        """
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta["name"] != self.name or meta["config"] != json.loads(
                json.dumps(self._config())
            ):
                raise ValueError(
                    f"state is for {meta['name']} {meta['config']}, "
                    f"not {self.name} {self._config()}"
                )
            self.ids = list(meta["ids"])
            self.index = {a: i for i, a in enumerate(self.ids)}
            self._restore_rows(z)
            s = meta["scalars"]
            self._last_tick = s["last_tick"]
            self.ticks = int(s["ticks"])
            extra = {k[2:]: z[k] for k in z.files if k.startswith("x_")}
            self._load_extra(extra, s)


# ---------------------------------------------------------------------------- baselines
class FrequencyForecaster(Forecaster):
    """Counts over the last ``window_s`` seconds, scaled to the horizon.

    ``expected_count = count(last window) * horizon_s / window_s``; ``probability = 1 -
    exp(-expected_count)`` (Poisson). Scores every adapter with a request in the window.

    Args:
        window_s: Window length in seconds (a whole number of buckets, >= 1 bucket).
    """

    name = "frequency"

    def __init__(self, window_s: float = 60.0, horizon_s: float = 5.0, bucket_s: float = 1.0):
        super().__init__(horizon_s, bucket_s)
        self.window = max(1, int(round(window_s / bucket_s)))
        self._ring = np.zeros((0, self.window), dtype=np.float32)  # [cap, window]
        self._sum = np.zeros(0, dtype=np.float64)  # [cap] sum over the ring
        self._pos = 0

    def _row_arrays(self) -> list[str]:
        return super()._row_arrays() + ["_ring", "_sum"]

    def _config(self) -> dict:
        return super()._config() | {"window": self.window}

    def _scalars(self) -> dict:
        return super()._scalars() | {"pos": self._pos}

    def _load_extra(self, arrays: Mapping[str, np.ndarray], scalars: dict) -> None:
        self._pos = int(scalars["pos"])

    def _advance(self, bucket: np.ndarray, steps: int, now: float) -> None:
        n = len(bucket)
        if steps > self.window:
            self._ring[:n] = 0.0
            self._sum[:n] = 0.0
            steps = 1
        for s in range(steps):
            self._pos = (self._pos + 1) % self.window
            self._sum[:n] -= self._ring[:n, self._pos]
            col = bucket if s == steps - 1 else 0.0
            self._ring[:n, self._pos] = col
            self._sum[:n] += self._ring[:n, self._pos]
        np.maximum(self._sum[:n], 0.0, out=self._sum[:n])  # float drift

    def _forecast(self, now: float) -> Forecast:
        n = len(self.ids)
        rows = np.flatnonzero(self._sum[:n] > 0.5)
        exp = self._sum[rows] * (self.horizon_s / (self.window * self.bucket_s))
        return self._make(now, rows, exp, -np.expm1(-exp))


class EWMAForecaster(Forecaster):
    """Exponentially weighted moving average of the request rate.

    Per bucket: ``rate <- a * count / bucket_s + (1 - a) * rate`` with ``a = 1 - exp(-bucket_s
    / tau_s)``; ``expected_count = rate * horizon_s``; ``probability = 1 - exp(-expected)``.
    Adapters whose rate fell below ``min_rate`` requests/s are not scored.

    Args:
        tau_s: Time constant in seconds.
        min_rate: Rate below which an adapter is dropped from the forecast (requests/s).
    """

    name = "ewma"

    def __init__(
        self,
        tau_s: float = 30.0,
        horizon_s: float = 5.0,
        bucket_s: float = 1.0,
        min_rate: float = 1e-4,
    ):
        super().__init__(horizon_s, bucket_s)
        self.tau_s = float(tau_s)
        self.alpha = 1.0 - math.exp(-bucket_s / tau_s)
        self.min_rate = float(min_rate)
        self._rate = np.zeros(0, dtype=np.float64)  # [cap] requests/s

    def _row_arrays(self) -> list[str]:
        return super()._row_arrays() + ["_rate"]

    def _config(self) -> dict:
        return super()._config() | {"tau_s": self.tau_s, "min_rate": self.min_rate}

    def _advance(self, bucket: np.ndarray, steps: int, now: float) -> None:
        n = len(bucket)
        keep = (1.0 - self.alpha) ** steps
        self._rate[:n] = keep * self._rate[:n] + self.alpha * (bucket / self.bucket_s)

    def _forecast(self, now: float) -> Forecast:
        n = len(self.ids)
        rows = np.flatnonzero(self._rate[:n] >= self.min_rate)
        exp = self._rate[rows] * self.horizon_s
        return self._make(now, rows, exp, -np.expm1(-exp))


# ---------------------------------------------------------------------------- LSTM
@dataclass(frozen=True)
class LSTMConfig:
    """Hyper-parameters of :class:`LSTMForecaster` (defaults: 2,622 parameters, 10.5 KB fp32).

    Attributes:
        hidden: LSTM hidden size H.
        window: Truncated-BPTT window L (steps of one bucket).
        track_s: An adapter is tracked (stepped and scored) until this many seconds after its
            last request; then its state is dropped.
        batch: Windows per optimizer step.
        lr: Adam learning rate.
        train_steps: Optimizer steps per ``train()`` call (also bounded by its time budget).
        samples_per_tick: Training windows recorded per bucket (from tracked adapters).
        positive_fraction: Up to this share of the recorded windows are drawn from adapters with
            a request in the window's targets (the rest uniformly from the others), so the
            rare positives are seen often enough.
        buffer: Replay buffer capacity in windows (a sliding window of recent history).
        max_log_correction: Clip of the learned log-rate correction (numerical safety).
    """

    hidden: int = 20
    window: int = 12
    track_s: float = 3600.0
    batch: int = 64
    lr: float = 3e-3
    train_steps: int = 1
    samples_per_tick: int = 16
    positive_fraction: float = 0.5
    buffer: int = 8192
    max_log_correction: float = 8.0

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.window < 1 or self.batch < 1 or self.buffer < self.batch:
            raise ValueError(f"bad LSTMConfig {self}")


_N_FEATURES = 10
_RING = 64  # count-ring length in buckets (>= 60 for the 60 s count, >= window + horizon)


class LSTMForecaster(Forecaster):
    """Online-trained single-layer LSTM shared by all adapters (see the module doc).

    Per bucket and tracked adapter, the input (10 features) is: ``log1p`` of the bucket count,
    of the counts over the last 5 s and 60 s, of the EWMA rates with time constants 300 s and
    3600 s (per minute; per hour, / 2), ``log1p(seconds since the last request) / 4``, the
    phase of ``now`` in the minute (sin, cos), ``log1p`` of the 10 s EWMA rate (per 10 s) and
    ``log1p(requests ever) / 4``. The base rate of the skip connection is ``base = horizon *
    (0.4 r10 + 0.2 c5/5 + 0.2 c60/60 + 0.1 r300 + 0.1 r3600) + 1e-4``; the heads give
    ``expected = base * exp(o_0)`` and ``probability = sigmoid(log(expm1(base)) + o_1)``
    with ``o = W [h; x] + b`` (zero at initialization).

    Args:
        config: Hyper-parameters.
        horizon_s: Forecast horizon (whole buckets).
        bucket_s: Bucket width in seconds.
        seed: Seed of the weight init and window sampling.
    """

    name = "lstm"

    def __init__(
        self,
        config: LSTMConfig | None = None,
        horizon_s: float = 5.0,
        bucket_s: float = 1.0,
        seed: int = 0,
    ):
        import torch

        super().__init__(horizon_s, bucket_s)
        self.config = cfg = config or LSTMConfig()
        self.seed = seed
        self.h = max(1, int(round(horizon_s / bucket_s)))
        if cfg.window + self.h + 1 > _RING:
            raise ValueError("window + horizon must fit the 64-bucket ring")
        self._R = cfg.window + self.h + 1  # feature/state ring length
        H, d = cfg.hidden, _N_FEATURES
        self._a10 = 1.0 - math.exp(-bucket_s / 10.0)
        self._a300 = 1.0 - math.exp(-bucket_s / 300.0)
        self._a3600 = 1.0 - math.exp(-bucket_s / 3600.0)
        # per-row state
        self._cring = np.zeros((0, _RING), dtype=np.float32)  # [cap, 64] bucket counts
        self._c5 = np.zeros(0, dtype=np.float64)
        self._c60 = np.zeros(0, dtype=np.float64)
        self._r10 = np.zeros(0, dtype=np.float64)  # EWMA rates, requests/s
        self._r300 = np.zeros(0, dtype=np.float64)
        self._total = np.zeros(0, dtype=np.float64)  # requests ever
        self._r3600 = np.zeros(0, dtype=np.float64)
        # LSTM state (h; c) feature-major [2H, cap]: the tick's math runs on [features, rows]
        # blocks, so every gate is one contiguous block
        self._hc = np.zeros((2 * H, 0), dtype=np.float32)
        self._tracked = np.zeros(0, dtype=bool)
        self._since = np.zeros(0, dtype=np.int64)  # bucket index tracking began
        # rings indexed [slot, ...] so one bucket's writes land in one contiguous block, stored
        # feature-major ([slot, feature, row]) like the state
        self._xring = np.zeros((self._R, d, 0), dtype=np.float32)  # inputs per bucket
        self._bring = np.zeros((self._R, 0), dtype=np.float32)  # log base per bucket
        self._sring = np.zeros((self._R, 2 * H, 0), dtype=np.float32)  # state before step
        self._out_exp = np.zeros(0, dtype=np.float64)  # last forecast per row
        self._out_prob = np.zeros(0, dtype=np.float64)
        self._b = 0  # buckets closed so far
        self._pre_key: tuple | None = None  # see _prepare_next_step (buffers: _resize)
        # model (torch for training, a numpy copy for inference)
        gen = torch.Generator().manual_seed(seed)
        self._torch = torch
        self.model = torch.nn.LSTM(d, H, batch_first=True)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(H))
        self.head = torch.nn.Linear(H + d, 2)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.opt = torch.optim.Adam(
            list(self.model.parameters()) + list(self.head.parameters()), lr=cfg.lr
        )
        self._publish()
        # horizon * base rate as a dot product with the inputs before their log (_features)
        coef = np.zeros((1, d), dtype=np.float32)
        coef[0, [8, 1, 2, 3, 4]] = [0.04, 0.04, 0.2 / 60.0, 0.1 / 60.0, 0.1 / 3600.0]
        self._rate_coef = torch.from_numpy(coef * np.float32(self.horizon_s))
        # replay buffer of windows
        L = cfg.window
        self._buf_hc = np.zeros((cfg.buffer, 2 * H), dtype=np.float32)
        self._buf_x = np.zeros((cfg.buffer, L, d), dtype=np.float32)
        self._buf_b = np.zeros((cfg.buffer, L), dtype=np.float32)
        self._buf_y = np.zeros((cfg.buffer, L), dtype=np.float32)
        self._buf_n = 0
        # Steps whose training windows are still to be recorded: done in train(), after the
        # forecast was served, so the tick itself only runs the LSTM step.
        self._pending_windows: list[int] = []
        self._buf_pos = 0
        self._rng = np.random.default_rng(seed)
        self.train_steps_done = 0
        self.prepared_steps = 0  # steps that used the term _prepare_next_step computed
        self.last_loss = float("nan")

    # -- sizes
    @property
    def num_parameters(self) -> int:
        """Trainable parameters (LSTM + heads)."""
        return sum(p.numel() for p in self.model.parameters()) + sum(
            p.numel() for p in self.head.parameters()
        )

    def _row_arrays(self) -> list[str]:
        return super()._row_arrays() + [
            "_cring", "_c5", "_c60", "_r10", "_r300", "_r3600", "_total", "_tracked",
            "_since",
            "_out_exp", "_out_prob",
        ]  # fmt: skip

    def _resize(self, cap: int) -> None:
        super()._resize(cap)
        for name, axis in (("_hc", 1), ("_xring", 2), ("_bring", 1), ("_sring", 2)):
            old = getattr(self, name)
            if old.shape[axis] < cap:
                shape = list(old.shape)
                shape[axis] = cap
                new = np.zeros(shape, dtype=old.dtype)
                new[(slice(None),) * axis + (slice(0, old.shape[axis]),)] = old
                setattr(self, name, new)
        # tick workspace, reused every tick (no per-tick allocation of [4H, rows] buffers);
        # flat, so that the [k, T] views the tick takes are contiguous (BLAS writes its
        # output in place only into a contiguous one)
        H, d = self.config.hidden, _N_FEATURES
        self._ws = self._torch.zeros((d + 1 + 4 * H + H + 2 + 3) * cap)
        self._ws_views: tuple[int, list] = (-1, [])
        self._pre = self._torch.zeros(4 * H * cap)  # see _prepare_next_step
        self._pre_key = None

    def _workspace(self, T: int) -> list:
        """Contiguous ``[k, T]`` float32 views of the workspace: inputs ``x [d, T]`` and log
        base rate ``[1, T]`` (numpy), gates ``[4H, T]``, ``tanh(c) [H, T]``, heads ``[2, T]``,
        output scratch ``[3, T]`` (torch)."""
        if self._ws_views[0] == T:
            return self._ws_views[1]
        H, d = self.config.hidden, _N_FEATURES
        views: list = []  # torch views, the first two as numpy arrays
        at = 0
        for k in (d, 1, 4 * H, H, 2, 3):
            views.append(self._ws[at : at + k * T].view(k, T))
            at += k * T
        views[0] = views[0].numpy()
        views[1] = views[1].numpy()
        self._ws_views = (T, views)
        return views

    def _config(self) -> dict:
        return super()._config() | {"lstm": self.config.__dict__, "seed": self.seed}

    # -- weights
    def _publish(self) -> None:
        """Copy the weights for inference (one atomic attribute swap, so a forecast never sees
        a half-updated model).

        Layout for the tick (feature-major: ``[out, features] @ [features, T]``): input and
        recurrent gate weights ``w_x [4H, d]``, ``w_h [4H, H]`` and bias ``[4H, 1]`` with the
        cell-candidate (g) rows doubled, so one sigmoid over all gates gives
        ``sigmoid(2 g)`` and ``tanh(g) = 2 sigmoid(2 g) - 1``; heads ``wo_h [2, H]``,
        ``wo_x [2, d]``, ``bo [2, 1]``.
        """
        m, hd, torch = self.model, self.head, self._torch
        H, d = self.config.hidden, _N_FEATURES
        with torch.no_grad():
            scale = torch.ones(4 * H)
            scale[2 * H : 3 * H] = 2.0  # torch gate order i, f, g, o
            w_x = (m.weight_ih_l0 * scale[:, None]).contiguous()  # [4H, d]
            w_h = (m.weight_hh_l0 * scale[:, None]).contiguous()  # [4H, H]
            bias = m.get_parameter("bias_ih_l0") + m.get_parameter("bias_hh_l0")
            b = (bias * scale)[:, None].contiguous()  # [4H, 1]
            wo_h = hd.weight[:, :H].contiguous()  # [2, H]
            wo_x = hd.weight[:, H:].contiguous()  # [2, d]
            bo = hd.bias[:, None].clone()  # [2, 1]
        assert w_x.shape == (4 * H, d)
        self._np = (w_x, w_h, b, wo_h, wo_x, bo)

    # -- stepping
    def _advance(self, bucket: np.ndarray, steps: int, now: float) -> None:
        n = len(bucket)
        if steps > self._R:  # a long gap: forget the short-term state
            self._cring[:n] = 0.0
            self._c5[:n] = 0.0
            self._c60[:n] = 0.0
            self._hc[:, :n] = 0.0
            self._tracked[:n] = False
            decay = steps - 1
            self._r10[:n] *= (1 - self._a10) ** decay
            self._r300[:n] *= (1 - self._a300) ** decay
            self._r3600[:n] *= (1 - self._a3600) ** decay
            self._b += decay
            steps = 1
        zero = np.zeros(n, dtype=np.float32)
        with _one_torch_thread(self._torch):
            for s in range(steps):
                last = s == steps - 1
                self._step(bucket if last else zero, now - (steps - 1 - s) * self.bucket_s)

    def _step(self, bucket: np.ndarray, now: float) -> None:
        n = len(bucket)
        cfg = self.config
        b = self._b + 1
        pos = b % _RING
        ring = self._cring
        self._c5[:n] += bucket - ring[:n, (b - 5) % _RING]
        self._c60[:n] += bucket - ring[:n, (b - 60) % _RING]
        ring[:n, pos] = bucket
        self._r10[:n] += self._a10 * (bucket / self.bucket_s - self._r10[:n])
        self._r300[:n] += self._a300 * (bucket / self.bucket_s - self._r300[:n])
        self._total[:n] += bucket
        self._r3600[:n] += self._a3600 * (bucket / self.bucket_s - self._r3600[:n])
        age = now - self._last_seen[:n]
        # tracking: start on a request, stop track_s after the last one
        new = (bucket > 0) & ~self._tracked[:n]
        changed = bool(new.any())
        if changed:
            self._tracked[:n][new] = True
            self._since[:n][new] = b
            self._hc[:, :n][:, new] = 0.0
        gone = self._tracked[:n] & (age > cfg.track_s)
        if gone.any():
            changed = True
            self._tracked[:n][gone] = False
            self._hc[:, :n][:, gone] = 0.0
            self._out_exp[:n][gone] = 0.0
            self._out_prob[:n][gone] = 0.0
        rows = np.flatnonzero(self._tracked[:n])
        self._b = b
        T = len(rows)
        # the recurrent term prepared after the previous step, if still valid: same step,
        # same rows (no id added, none started or stopped tracking), same weights
        key, self._pre_key = self._pre_key, None
        pre = None
        if key is not None and not changed and key[:3] == (b - 1, n, T) and key[3] is self._np:
            pre = self._pre[: 4 * cfg.hidden * T].view(4 * cfg.hidden, T)
            self.prepared_steps += 1
        if T == 0:
            return
        # every row tracked (the worst case): slices, i.e. views instead of gathers/scatters
        full = T == n
        sel: slice | np.ndarray = slice(0, n) if full else rows
        x, logbase = self._features(sel, T, bucket, age, now)  # [d, T] view, [T]
        rpos = b % self._R
        if full:
            self._xring[rpos, :, :n] = x
        else:
            self._xring[rpos][:, rows] = x
        self._bring[rpos, sel] = logbase
        hc = self._hc[:, sel]  # [2H, T] (a view when full)
        self._sring[rpos][:, sel] = hc
        self._lstm_step(x, hc, logbase, sel, full, pre)
        self._pending_windows.append(b)

    def _prepare_next_step(self) -> None:
        """Compute the recurrent half of the next step's gate pre-activations, ``w_h h +
        bias`` (``[4H, T]`` for the rows tracked now), off the forecast path: :meth:`train`
        runs it after the forecast was served. The next :meth:`_step` uses it only if nothing
        changed the rows, the state or the weights in between (else it computes the same sum
        itself), so forecasts do not depend on whether or how often ``train`` is called."""
        n = len(self.ids)
        rows = np.flatnonzero(self._tracked[:n])
        T = len(rows)
        if T == 0:
            return
        H = self.config.hidden
        h = self._hc[:H, :n] if T == n else self._hc[:H, rows]
        _w_x, w_h, bias, *_ = self._np
        torch = self._torch
        with _one_torch_thread(torch), torch.no_grad():
            pre = self._pre[: 4 * H * T].view(4 * H, T)
            torch.addmm(bias, w_h, torch.from_numpy(h), out=pre)
        self._pre_key = (self._b, n, T, self._np)

    def _lstm_step(
        self,
        x: np.ndarray,
        hc: np.ndarray,
        logbase: np.ndarray,
        sel: slice | np.ndarray,
        full: bool,
        pre=None,
    ) -> None:
        """One LSTM step of the tracked rows and their forecast (inference only).

        Args:
            x: ``float32 [d, T]`` inputs, feature-major (a view of the workspace).
            hc: ``float32 [2H, T]`` state (h; c) before the step (a view of ``_hc`` when
                ``full``).
            logbase: ``float32 [T]`` log base rate.
            sel: The rows (a slice when ``full``).
            full: Every row is tracked; the new state is then written into ``_hc`` in place.
            pre: ``float32 [4H, T]`` tensor ``w_h h + bias`` from :meth:`_prepare_next_step`
                (overwritten), or None to compute it here.

        The same math as ``torch.nn.LSTM`` (gates i, f, g, o) with ``tanh(z) = 2 sigmoid(2 z)
        - 1`` (one sigmoid pass over all gates; this torch build's tanh is 3x slower than its
        sigmoid), feature-major so every gate is a contiguous block, in preallocated buffers,
        single-threaded (:meth:`_advance` sets one torch thread).
        """
        cfg = self.config
        H, T = cfg.hidden, x.shape[1]
        torch = self._torch
        w_x, w_h, bias, wo_h, wo_x, bo = self._np  # published copies, swapped by train()
        with torch.no_grad():
            xt = torch.from_numpy(x)  # [d, T]
            hct = torch.from_numpy(hc if full else np.ascontiguousarray(hc))  # [2H, T]
            h, c = hct[:H], hct[H:]
            _x, _lb, g, tc, out, v = self._workspace(T)
            if pre is None:
                torch.addmm(bias, w_h, h, out=g)
            else:
                g = pre
            g.addmm_(w_x, xt)  # [4H, T] pre-activations (g doubled)
            g.sigmoid_()
            gi, gf, gg, go = g[:H], g[H : 2 * H], g[2 * H : 3 * H], g[3 * H :]
            gg.mul_(2.0).sub_(1.0)  # tanh of the cell candidate
            c.mul_(gf).addcmul_(gi, gg)  # the new state overwrites the old in place
            torch.mul(c, 2.0, out=tc)
            tc.sigmoid_().mul_(2.0).sub_(1.0)  # tanh(c)
            torch.mul(go, tc, out=h)
            torch.addmm(bo, wo_h, h, out=out)
            out.addmm_(wo_x, xt)  # [2, T]
            # expected = base * exp(clip(o0)); probability = sigmoid(log(expm1(base)) + o1)
            # with log(expm1(v)) = v + log(-expm1(-v)) (no overflow for a large base)
            lb = torch.from_numpy(logbase)
            base, e, p = v[0], v[1], v[2]
            torch.exp(lb, out=base)
            torch.clamp(out[0], -cfg.max_log_correction, cfg.max_log_correction, out=e)
            e.exp_().mul_(base)
            torch.neg(base, out=p)
            p.expm1_().neg_().log_().add_(base).add_(out[1]).sigmoid_()
            if not full:
                self._hc[:, sel] = hct.numpy()
        self._out_exp[sel] = e.numpy()
        self._out_prob[sel] = p.numpy()

    def _flush_windows(self) -> None:
        """Record the training windows of the steps since the last call (oldest first).

        A step's windows read the count ring, which holds ``_RING`` buckets: steps older than
        the ring can still serve are skipped rather than read from overwritten buckets.
        """
        oldest_valid = self._b - (_RING - self.config.window - self.h - 1)
        for b in self._pending_windows:
            if b >= oldest_valid:
                self._record_windows(b)
        self._pending_windows.clear()

    def _features(
        self,
        sel: slice | np.ndarray,
        T: int,
        bucket: np.ndarray,
        age: np.ndarray,
        now: float,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Inputs ``float32 [d, T]`` (feature-major, a workspace view) and log base rate
        ``float32 [T]`` of the rows ``sel`` (``T`` of them); see the class doc."""
        x, lb = self._workspace(T)[:2]
        same: Final = "same_kind"
        np.copyto(x[0], bucket[sel], casting=same)
        np.copyto(x[1], self._c5[sel], casting=same)
        np.copyto(x[2], self._c60[sel], casting=same)
        np.multiply(self._r300[sel], 60.0, out=x[3], casting=same)
        np.multiply(self._r3600[sel], 3600.0, out=x[4], casting=same)
        np.maximum(age[sel], 0.0, out=x[5], casting=same)
        x[6:8] = 0.0
        np.multiply(self._r10[sel], 10.0, out=x[8], casting=same)
        np.copyto(x[9], self._total[sel], casting=same)
        torch = self._torch
        xt, lbt = torch.from_numpy(x), torch.from_numpy(lb)
        # horizon * rate = coef . (rows before the log); rate = 0.4 r10 + 0.2 c5 / 5
        # + 0.2 c60 / 60 + 0.1 r300 + 0.1 r3600
        torch.mm(self._rate_coef, xt, out=lbt)
        lbt.add_(1e-4).log_()
        xt[:6].log1p_()
        xt[8:].log1p_()
        xt[4].mul_(0.5)
        xt[5].mul_(0.25)
        xt[9].mul_(0.25)
        ph = 2.0 * math.pi * (now % 60.0) / 60.0
        x[6] = math.sin(ph)
        x[7] = math.cos(ph)
        return x, lb[0]

    def _record_windows(self, b: int) -> None:
        """Add windows whose targets are now known (steps ``b-h-L+1 .. b-h``) to the buffer."""
        cfg = self.config
        L, h = cfg.window, self.h
        start = b - h - L + 1
        if start < 1:
            return
        n = len(self.ids)
        ok = np.flatnonzero(self._tracked[:n] & (self._since[:n] <= start))
        if len(ok) == 0:
            return
        steps = np.arange(start, start + L)  # [L]
        rpos = steps % self._R
        # y[s] = sum of buckets s+1 .. s+h
        cols = (steps[:, None] + np.arange(1, h + 1)[None, :]) % _RING  # [L, h]
        recent = (np.arange(start + 1, b + 1) % _RING).astype(np.int64)  # buckets of the targets
        pos = self._cring[ok[:, None], recent[None, :]].sum(axis=1) > 0
        # stratified: up to positive_fraction of the windows have a request in their targets
        m = min(cfg.samples_per_tick, len(ok))
        ip, ineg = np.flatnonzero(pos), np.flatnonzero(~pos)
        mp = min(len(ip), int(round(cfg.positive_fraction * m)))
        mn = min(len(ineg), m - mp)
        mp = min(len(ip), m - mn)
        pick = np.concatenate(
            [
                self._rng.choice(ip, size=mp, replace=False) if mp < len(ip) else ip,
                self._rng.choice(ineg, size=mn, replace=False) if mn < len(ineg) else ineg,
            ]
        ).astype(np.int64)
        rows = ok[pick]
        y = self._cring[rows][:, cols].sum(axis=2)  # [m, L]
        m = len(rows)
        k = (self._buf_pos + np.arange(m)) % cfg.buffer
        self._buf_hc[k] = self._sring[rpos[0]][:, rows].T
        self._buf_x[k] = self._xring[rpos][:, :, rows].transpose(2, 0, 1)  # [m, L, d]
        self._buf_b[k] = self._bring[rpos][:, rows].T
        self._buf_y[k] = y
        self._buf_pos = int((self._buf_pos + m) % cfg.buffer)
        self._buf_n = min(cfg.buffer, self._buf_n + m)

    def _forecast(self, now: float) -> Forecast:
        n = len(self.ids)
        rows = np.flatnonzero(self._tracked[:n])
        return self._make(now, rows, self._out_exp[rows], self._out_prob[rows])

    # -- learning
    def train(self, budget_s: float = 0.05) -> float | None:
        """Up to ``config.train_steps`` Adam steps on buffer windows, stopping at ``budget_s``.

        Loss per window step: Poisson NLL of the count (``lambda - y log lambda``) plus binary
        cross-entropy of ``y >= 1``. Returns the mean loss of the steps run (None if none:
        the buffer holds fewer than ``batch`` windows). Then, with the new weights, prepares the
        recurrent term of the next step (:meth:`_prepare_next_step`), so the next tick's
        forecast does less work.
        """
        try:
            return self._train(budget_s)
        finally:
            self._prepare_next_step()

    def _train(self, budget_s: float) -> float | None:
        cfg = self.config
        self._flush_windows()
        if self._buf_n < cfg.batch:
            return None
        t_end = time.perf_counter() + budget_s
        with _one_torch_thread(self._torch):
            done = self._train_steps(t_end)
        self.train_steps_done += done
        self._publish()
        return self.last_loss

    def _train_steps(self, t_end: float) -> int:
        cfg = self.config
        torch = self._torch
        done = 0
        H = cfg.hidden
        while done < cfg.train_steps and (done == 0 or time.perf_counter() < t_end):
            idx = self._rng.integers(0, self._buf_n, size=cfg.batch)
            hc = torch.from_numpy(self._buf_hc[idx])
            x = torch.from_numpy(self._buf_x[idx])
            logbase = torch.from_numpy(self._buf_b[idx]).double()
            y = torch.from_numpy(self._buf_y[idx]).double()
            out, _ = self.model(x, (hc[None, :, :H].contiguous(), hc[None, :, H:].contiguous()))
            o = self.head(torch.cat([out, x], dim=2)).double()  # [B, L, 2]
            corr = o[..., 0].clamp(-cfg.max_log_correction, cfg.max_log_correction)
            loglam = logbase + corr
            pois = (loglam.exp() - y * loglam).mean()
            base = logbase.exp()
            logit = torch.log(torch.expm1(base)) + o[..., 1]
            bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, (y > 0).double())
            loss = pois + bce
            self.opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(
                list(self.model.parameters()) + list(self.head.parameters()), 1.0
            )
            self.opt.step()
            done += 1
            self.last_loss = float(loss.detach())
        return done

    # -- persistence
    def _scalars(self) -> dict:
        return super()._scalars() | {"b": self._b, "train_steps_done": self.train_steps_done}

    def _extra_arrays(self) -> dict[str, np.ndarray]:
        out = {"hc": self._hc[:, : len(self.ids)].T}  # [n, 2H]
        out |= {f"p_{k}": v.detach().numpy() for k, v in self.model.state_dict().items()}
        out |= {f"h_{k}": v.detach().numpy() for k, v in self.head.state_dict().items()}
        st = self.opt.state_dict()["state"]
        for i, s in st.items():
            for k, v in s.items():
                out[f"o_{i}_{k}"] = np.asarray(v.detach().numpy() if hasattr(v, "detach") else v)
        return out

    def _load_extra(self, arrays: Mapping[str, np.ndarray], scalars: dict) -> None:
        torch = self._torch
        self._b = int(scalars["b"])
        # the per-bucket rings are not persisted: record no training window reaching back
        # before the restore
        n = len(self.ids)
        self._since[:n] = self._b
        self._hc[:] = 0.0
        if "hc" in arrays:  # (absent from states written before the feature-major layout)
            self._hc[:, :n] = arrays["hc"].T
        self.train_steps_done = int(scalars["train_steps_done"])
        self.model.load_state_dict(
            {k[2:]: torch.from_numpy(np.array(v)) for k, v in arrays.items() if k[:2] == "p_"}
        )
        self.head.load_state_dict(
            {k[2:]: torch.from_numpy(np.array(v)) for k, v in arrays.items() if k[:2] == "h_"}
        )
        opt = self.opt.state_dict()
        state: dict[int, dict] = {}
        for k, v in arrays.items():
            if k[:2] == "o_":
                i, name = k[2:].split("_", 1)
                state.setdefault(int(i), {})[name] = torch.from_numpy(np.array(v))
        opt["state"] = state
        self.opt.load_state_dict(opt)
        self._publish()


# ---------------------------------------------------------------------------- factory
def make_forecaster(name: str, *, horizon_s: float = 5.0, seed: int = 0, **kwargs) -> Forecaster:
    """Build a forecaster by name.

    Names: ``"frequency"``, ``"ewma"``, ``"lstm"``, ``"ensemble"``; ``"frequency:W"`` and
    ``"ewma:TAU"`` set the window / time constant in seconds (e.g. ``"frequency:5"``).

    Raises:
        ValueError: Unknown name.
    """
    base, _, arg = name.partition(":")
    if base == "frequency":
        if arg:
            kwargs["window_s"] = float(arg)
        return FrequencyForecaster(horizon_s=horizon_s, **kwargs)
    if base == "ewma":
        if arg:
            kwargs["tau_s"] = float(arg)
        return EWMAForecaster(horizon_s=horizon_s, **kwargs)
    if base == "lstm":
        return LSTMForecaster(horizon_s=horizon_s, seed=seed, **kwargs)
    if base == "ensemble":
        return EnsembleForecaster(horizon_s=horizon_s, seed=seed, **kwargs)
    raise ValueError(f"unknown forecaster {name!r}; expected one of {FORECASTER_NAMES}")


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
    e_mi``, the fixed-weight behaviour of earlier versions).

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
