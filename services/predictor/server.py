"""The predictor: ``plora.v1.Predictor`` - forecasting, placement and prefetch (issue 5).

It consumes the gateways' request-event streams, keeps the forecaster's per-adapter counts, and
every tick (default 1 s): forecasts demand over the horizon, publishes the forecast to Redis
(workers use it for predictive eviction), plans placement of adapters across workers
(LoRAServe-style, rank-aware; :mod:`services.predictor.placement`) and sends
``PrefetchAdapters`` to each worker for the adapters it should hold. Training runs after the
forecast is served, under a time budget, so it never stalls a forecast. The model and recent
counts are persisted to Redis and restored at start, so a restarted predictor resumes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator

import grpc
import torch

from plora.v1 import predictor_pb2, predictor_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common import convert
from services.common.config import settings_line
from services.common.errors import PLoRAError
from services.common.grpc_util import CHANNEL_OPTIONS, create_server, map_errors, set_serving
from services.common.internal_auth import InternalStubs, resolve_token, server_interceptors
from services.common.lifecycle import lower_thread_priority, run_service, write_ready_file
from services.common.metrics import serve_metrics
from services.common.registry import Registry, RegistryUnavailableError, connect
from services.predictor.calibration import ForecastCalibrator
from services.predictor.config import PredictorConfig
from services.predictor.forecast import Forecast, make_forecaster
from services.predictor.metrics import PredictorMetrics
from services.predictor.placement import (
    AdapterDemand,
    PrefetchSelector,
    plan_placement,
    worker_view,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = predictor_pb2.DESCRIPTOR.services_by_name["Predictor"].full_name


class OnlineRecall:
    """Forecast recall@3 over 5 s windows, scored online as the truth arrives.

    Every tick t records the predicted top-3; once ``t + horizon`` has passed, the true top-3 of
    the requests in ``(t, t + horizon]`` is known and the tick is scored
    ``|pred ∩ true| / |true|`` (prediction recall@3; ticks whose window has no request
    are not scored). :meth:`value` averages the scores of the last ``window_s`` seconds.
    """

    def __init__(self, horizon_s: float = 5.0, window_s: float = 60.0) -> None:
        self.horizon_s = horizon_s
        self.window_s = window_s
        self._pending: collections.deque[tuple[float, list[str]]] = collections.deque()
        self._arrivals: collections.deque[tuple[float, str]] = collections.deque()
        self._scores: collections.deque[tuple[float, float]] = collections.deque()

    def arrival(self, t: float, adapter_id: str) -> None:
        """Record one request (times non-decreasing within the tolerance of a tick)."""
        self._arrivals.append((t, adapter_id))

    def predicted(self, t: float, top3: list[str]) -> None:
        """Record the top-3 forecast made at ``t``."""
        self._pending.append((t, top3))

    def score_until(self, now: float) -> None:
        """Score every prediction whose window ``(t, t + horizon]`` has closed by ``now``."""
        while self._pending and self._pending[0][0] + self.horizon_s <= now:
            t, top3 = self._pending.popleft()
            counts: collections.Counter[str] = collections.Counter(
                a for (ta, a) in self._arrivals if t < ta <= t + self.horizon_s
            )
            if counts:
                truth = [a for a, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]]
                self._scores.append((t, len(set(truth) & set(top3)) / len(truth)))
        oldest = (self._pending[0][0] if self._pending else now) - 1.0
        while self._arrivals and self._arrivals[0][0] <= oldest:
            self._arrivals.popleft()
        while self._scores and self._scores[0][0] < now - self.window_s:
            self._scores.popleft()

    def value(self) -> float | None:
        """Mean recall@3 of the scored ticks in the last ``window_s`` seconds (None if none)."""
        if not self._scores:
            return None
        return sum(s for _, s in self._scores) / len(self._scores)


class PredictorServicer(predictor_pb2_grpc.PredictorServicer):
    """Implements ``plora.v1.Predictor``: event ingest and forecast queries."""

    def __init__(self, core: PredictorCore) -> None:
        self.core = core

    def StreamRequestEvents(  # noqa: N802
        self, request_iterator: Iterator[predictor_pb2.RequestEvent], context: grpc.ServicerContext
    ) -> predictor_pb2.StreamRequestEventsResponse:
        received = 0
        self.core.metrics.streams.inc()
        try:
            for event in request_iterator:
                self.core.observe(event.adapter_id, event.arrival_unix)
                received += 1
        finally:
            self.core.metrics.streams.dec()
        return predictor_pb2.StreamRequestEventsResponse(received=received)

    @map_errors
    def GetForecast(  # noqa: N802
        self, request: predictor_pb2.GetForecastRequest, context: grpc.ServicerContext
    ) -> predictor_pb2.GetForecastResponse:
        forecast = self.core.latest
        response = predictor_pb2.GetForecastResponse(
            horizon_seconds=self.core.config.horizon_s, model=self.core.config.forecaster
        )
        if forecast is None:
            return response
        response.made_unix = forecast.now
        idx = forecast.ranking(request.limit or None)
        for i in idx.tolist():
            response.forecasts.add(
                adapter_id=forecast.ids[int(forecast.rows[i])],
                probability=float(forecast.probability[i]),
                expected_count=float(forecast.expected_count[i]),
            )
        return response


class PredictorCore:
    """Forecasting, placement and prefetch state, driven by :meth:`tick` (no gRPC server here).

    Args:
        config: Predictor settings.
        registry: The Redis registry.
        metrics: Prometheus series.
    """

    def __init__(self, config: PredictorConfig, registry: Registry, metrics: PredictorMetrics):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.forecaster = make_forecaster(config.forecaster, horizon_s=config.horizon_s)
        self._lock = threading.Lock()
        self.latest: Forecast | None = None
        self.recall = OnlineRecall(config.horizon_s)
        # the forecast's hit rates, learnt from what arrived: prefetch only where it pays
        self.calibrator = ForecastCalibrator(config.horizon_s)
        self._arrived: list[str] = []  # adapters requested since the last tick
        self.selector = PrefetchSelector(
            high=config.prefetch_min_expected,
            low=config.prefetch_min_expected / 2,
            calibrator=self.calibrator,
            min_probability=config.prefetch_min_probability,
        )
        self.placement: dict[str, list[str]] = {}
        #: Sent on every call to a worker, required of every call to this predictor.
        self.internal_token = resolve_token(config.internal_token_file, config.internal_token)
        self._workers = InternalStubs(
            worker_pb2_grpc.WorkerStub, self.internal_token, options=CHANNEL_OPTIONS
        )
        self._last_persist = time.monotonic()
        blob = registry.load_predictor_state()
        if blob:
            try:
                self.forecaster.load_state_dict(blob)
                logger.info("resumed forecaster state from Redis (%d bytes)", len(blob))
            except Exception as exc:  # noqa: BLE001 - a stale or foreign state is not fatal
                logger.warning("ignoring persisted predictor state: %s", exc)

    def observe(self, adapter_id: str, t: float) -> None:
        """Record one request event (thread-safe). Every event is counted (the gateway's
        ``events_sent`` and this ``events_received`` match); base-model requests (empty
        ``adapter_id``) feed no forecast."""
        self.metrics.events.inc()
        if not adapter_id:
            return
        with self._lock:
            self.forecaster.observe(adapter_id, t)
            self.recall.arrival(t, adapter_id)
            self._arrived.append(adapter_id)

    def tick(self, now: float | None = None) -> None:
        """One round: forecast, publish, plan placement, prefetch, then train and persist.

        An unreachable Redis skips publishing, placement and persisting for this round (the
        registry logs the outage); forecasting and training go on.
        """
        started = time.perf_counter()
        now = time.time() if now is None else now
        with self._lock:
            forecast = self.forecaster.tick(now)
            self.recall.predicted(now, forecast.top_k(3))
            self.recall.score_until(now)
        self.latest = forecast
        self.metrics.adapters_tracked.set(len(forecast))
        recall = self.recall.value()
        if recall is not None:
            self.metrics.recall_at_3.set(recall)
        expected = forecast.expected_by_id()
        with self._lock:
            arrived, self._arrived = self._arrived, []
        self.calibrator.observe(now, expected, arrived)
        try:
            self.registry.set_forecast(expected, self.config.horizon_s, self.config.forecaster)
            self._place_and_prefetch(forecast, expected)
        except RegistryUnavailableError:
            pass  # the registry logs the outage; the next tick tries again
        except PLoRAError as exc:
            logger.warning("tick could not publish: %s", exc)
        except Exception as exc:  # noqa: BLE001 - the next tick tries again
            logger.warning("tick failed: %s", exc)
        self.metrics.tick.observe(time.perf_counter() - started)
        with self._lock:
            loss = self.forecaster.train(self.config.train_budget_s)
        if loss:
            self.metrics.training_loss.set(float(loss))
        if time.monotonic() - self._last_persist > self.config.persist_every_s:
            try:
                self.persist()
            except RegistryUnavailableError:
                pass  # logged by the registry; the next tick tries again

    def persist(self) -> None:
        """Save the forecaster's state to Redis.

        Raises:
            RegistryUnavailableError: Redis cannot be reached.
        """
        with self._lock:
            blob = self.forecaster.state_dict()
        self.registry.save_predictor_state(blob)
        self._last_persist = time.monotonic()

    def _place_and_prefetch(self, forecast: Forecast, expected: dict[str, float]) -> None:
        workers = [w for w in self.registry.list_workers() if w.healthy]
        if not workers:
            return
        records = {r.adapter_id: r for r in self.registry.list_adapters()}
        demand = {
            a: AdapterDemand(rank=records[a].rank, size_bytes=records[a].size_bytes, expected=e)
            for a, e in expected.items()
            if a in records
        }
        views = [worker_view(w) for w in workers]
        placement, moves = plan_placement(demand, views, self.placement)
        if moves:
            self.metrics.placement_moves.inc(moves)
        self.placement = placement
        self.registry.set_placement(placement)
        if self.config.prefetch == "off":
            return
        plan = self.selector.select(
            demand, placement, views, max_per_worker=self.config.max_prefetch_per_worker
        )
        addresses = {w.worker_id: w.address for w in workers}
        for worker_id, items in plan.items():
            if not items:
                continue
            request = worker_pb2.PrefetchAdaptersRequest(horizon_seconds=self.config.horizon_s)
            for adapter_id, count in items:
                p, _e = forecast.get(adapter_id)
                request.items.add(
                    adapter=convert.adapter_info(records[adapter_id]),
                    probability=p,
                    expected_count=count,
                )
            try:
                self._workers.get(addresses[worker_id]).PrefetchAdapters(request, timeout=2.0)
                self.metrics.prefetches.inc(len(items))
            except grpc.RpcError as exc:
                self.metrics.prefetch_errors.inc()
                logger.warning("prefetch to %s failed: %s", worker_id, exc.code().name)

    def close(self) -> None:
        """Close worker channels."""
        self._workers.close()


class PredictorService:
    """A running predictor: gRPC server, metrics endpoint and the tick thread.

    Raises:
        RegistryUnavailableError: Redis cannot be reached.
    """

    def __init__(self, config: PredictorConfig) -> None:
        self.config = config
        # The forecaster's tensors are tiny: one thread avoids OpenMP spin-waits that made a
        # training step 40x slower on a shared 2-core host.
        torch.set_num_threads(1)
        self.metrics = PredictorMetrics()
        self.registry = Registry(connect(config.redis_url))
        self.core = PredictorCore(config, self.registry, self.metrics)
        servicer = PredictorServicer(self.core)

        def register(server: grpc.Server) -> list[str]:
            predictor_pb2_grpc.add_PredictorServicer_to_server(servicer, server)
            return [SERVICE_NAME]

        refused = self.metrics.internal_auth_refused
        self.server, self.port, self.health = create_server(
            register,
            host=config.host,
            port=config.port,
            max_workers=32,
            interceptors=server_interceptors(
                self.core.internal_token, lambda method: refused.labels(method=method).inc()
            ),
        )
        self.metrics_server, self.metrics_port = serve_metrics(
            self.metrics.registry, config.host, config.metrics_port
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="predictor-tick", daemon=True)

    def _loop(self) -> None:
        # Forecasting, training and placement are ahead-of-demand work: at background
        # priority they take idle CPU, not the cores the workers' decode steps need when the
        # predictor shares a host with them (plora up, a CPU node).
        lower_thread_priority()
        next_tick = time.monotonic()
        while True:
            next_tick += self.config.tick_s
            if self._stop.wait(max(0.0, next_tick - time.monotonic())):
                return
            try:
                self.core.tick()
            except Exception:  # noqa: BLE001 - a bug in one round must not end the ticking
                logger.exception("predictor tick failed; the next one runs as planned")

    def start(self) -> PredictorService:
        """Start serving and ticking."""
        self.server.start()
        self._thread.start()
        set_serving(self.health, [SERVICE_NAME], True)
        if self.config.ready_file:
            write_ready_file(self.config.ready_file, self.port, self.metrics_port)
        logger.info(
            "predictor serving on %s:%d (forecaster %s)",
            self.config.host,
            self.port,
            self.config.forecaster,
        )
        logger.info("settings: %s", settings_line(self.config))
        return self

    def stop(self, grace: float = 2.0) -> None:
        """Stop ticking, persist the state, stop the server."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.core.persist()
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not persist predictor state: %s", exc)
        set_serving(self.health, [SERVICE_NAME], False)
        self.server.stop(grace).wait()
        self.core.close()
        self.metrics_server.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``plora serve predictor``."""
    return run_service("predictor", PredictorConfig, PredictorService, argv)
