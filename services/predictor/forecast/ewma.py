"""The exponentially weighted moving-average rate baseline (:class:`EWMAForecaster`)."""

from __future__ import annotations

import math

import numpy as np

from services.predictor.forecast.base import Forecast, Forecaster


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
