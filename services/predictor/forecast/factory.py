"""Forecasters by name (:func:`make_forecaster`), as the predictor's configuration names them."""

from __future__ import annotations

from services.predictor.forecast.base import Forecaster
from services.predictor.forecast.ensemble import EnsembleForecaster
from services.predictor.forecast.ewma import EWMAForecaster
from services.predictor.forecast.frequency import FrequencyForecaster
from services.predictor.forecast.lstm import LSTMForecaster

#: Forecasters :func:`make_forecaster` builds.
FORECASTER_NAMES: tuple[str, ...] = ("frequency", "ewma", "lstm", "ensemble")
#: The forecaster the predictor service uses unless told otherwise (see the eval report).
DEFAULT_FORECASTER = "ensemble"


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
