"""The online-trained LSTM forecaster (:class:`LSTMForecaster`).

A single-layer LSTM with one set of weights shared by all adapters (hidden 20, 10 input
features, 2 output heads: 2,622 parameters = 10.5 KB in float32). It is run as a *streaming*
model: every tick, each tracked adapter advances its own ``(h, c)`` state by one step on that
second's features, in one batched numpy step, so a tick costs one LSTM step over the active
adapters. Its outputs are a multiplicative correction of a simple count-based rate (``log lambda
= log base + head(h, x)``, head initialized to zero), so an untrained model forecasts like the
count baseline and learning only has to add what counts miss (recency, periodicity, burst
decay). Training is truncated back-propagation through time on windows of ``window`` steps
sampled from the live history, started from the recorded state at the window start, with a
Poisson loss on the count and a cross-entropy loss on ">= 1 request", on a sliding replay buffer
of recent windows (Adam; ``train_steps`` steps per tick).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np

from services.predictor.forecast.base import Forecast, Forecaster


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
