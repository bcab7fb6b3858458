"""The forecaster interface and the machinery every forecaster shares.

The predictor (Predictive-LoRA, arXiv 2512.20210, section 2) forecasts which adapters will be
requested in the next few seconds so the workers can prefetch them. Every forecaster has the
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
"""

from __future__ import annotations

import io
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


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
