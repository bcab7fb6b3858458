"""The predictor's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import service_registry


class PredictorMetrics:
    """Every series the predictor exports; names ``plora_predictor_*``."""

    def __init__(self) -> None:
        self.registry = service_registry()
        r = self.registry
        self.events = Counter(
            "plora_predictor_events_received", "Request events received", registry=r
        )
        self.streams = Gauge("plora_predictor_event_streams", "Open event streams", registry=r)
        self.tick = Histogram(
            "plora_predictor_tick_seconds",
            "Duration of one forecast + prefetch round",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.training_loss = Gauge(
            "plora_predictor_training_loss",
            "Latest online training loss of the forecaster",
            registry=r,
        )
        self.recall_at_3 = Gauge(
            "plora_predictor_recall_at_3_ratio",
            "Forecast recall@3 over 5 s windows, averaged over the last minute (scored online)",
            registry=r,
        )
        self.prefetches = Counter(
            "plora_predictor_prefetches_sent", "Adapters sent in PrefetchAdapters calls", registry=r
        )
        self.prefetch_errors = Counter(
            "plora_predictor_prefetch_errors", "PrefetchAdapters calls that failed", registry=r
        )
        self.adapters_tracked = Gauge(
            "plora_predictor_adapters_tracked", "Adapters with a forecast", registry=r
        )
        self.placement_moves = Counter(
            "plora_predictor_placement_moves", "Adapter-to-worker assignments changed", registry=r
        )
        self.internal_auth_refused = Counter(
            "plora_predictor_internal_auth_refused",
            "Calls refused for a missing or wrong internal token, by method",
            ["method"],
            registry=r,
        )
