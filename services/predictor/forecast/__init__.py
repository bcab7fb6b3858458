"""Per-adapter demand forecasters: frequency, EWMA, an online-trained LSTM, and an ensemble.

The predictor (Predictive-LoRA, arXiv 2512.20210, section 2) forecasts which adapters will be
requested in the next few seconds so the workers can prefetch them. One module per forecaster,
all with the interface of :class:`~services.predictor.forecast.base.Forecaster`:

* :mod:`~services.predictor.forecast.base`: :class:`Forecast` (one tick's per-adapter
  probability and expected count) and :class:`Forecaster` (id -> row map, bucketing, ticking,
  persistence);
* :mod:`~services.predictor.forecast.frequency`: counts over a sliding window;
* :mod:`~services.predictor.forecast.ewma`: an exponentially weighted moving-average rate;
* :mod:`~services.predictor.forecast.lstm`: an online-trained LSTM shared by all adapters;
* :mod:`~services.predictor.forecast.ensemble`: a mixture of the above with weights learned
  online;
* :mod:`~services.predictor.forecast.factory`: :func:`make_forecaster` (forecasters by name).
"""

from services.predictor.forecast.base import Forecast, Forecaster
from services.predictor.forecast.ensemble import DEFAULT_MEMBERS, EnsembleForecaster
from services.predictor.forecast.ewma import EWMAForecaster
from services.predictor.forecast.factory import (
    DEFAULT_FORECASTER,
    FORECASTER_NAMES,
    make_forecaster,
)
from services.predictor.forecast.frequency import FrequencyForecaster
from services.predictor.forecast.lstm import LSTMConfig, LSTMForecaster

__all__ = [
    "DEFAULT_FORECASTER",
    "DEFAULT_MEMBERS",
    "FORECASTER_NAMES",
    "EWMAForecaster",
    "EnsembleForecaster",
    "Forecast",
    "Forecaster",
    "FrequencyForecaster",
    "LSTMConfig",
    "LSTMForecaster",
    "make_forecaster",
]
