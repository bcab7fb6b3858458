"""The sliding-window count baseline (:class:`FrequencyForecaster`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from services.predictor.forecast.base import Forecast, Forecaster


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
