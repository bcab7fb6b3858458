"""The predictor's tick against real Redis and a real gRPC endpoint: prefetch on and off."""

from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc
import pytest

from plora.v1 import worker_pb2, worker_pb2_grpc
from services.common.registry import AdapterRecord, Registry, WorkerRecord, connect
from services.predictor.config import PredictorConfig
from services.predictor.metrics import PredictorMetrics
from services.predictor.server import PredictorCore


class _PrefetchRecorder(worker_pb2_grpc.WorkerServicer):
    """The worker's gRPC surface, recording the prefetch requests it receives."""

    def __init__(self) -> None:
        self.requests: list[worker_pb2.PrefetchAdaptersRequest] = []

    def PrefetchAdapters(self, request, context):  # noqa: N802 - gRPC method name
        self.requests.append(request)
        return worker_pb2.PrefetchAdaptersResponse()


@pytest.fixture()
def endpoint():
    recorder = _PrefetchRecorder()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    worker_pb2_grpc.add_WorkerServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield recorder, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("prefetch", ["on", "off"])
def test_prefetch_off_places_and_publishes_but_sends_nothing(redis_url, endpoint, prefetch):
    recorder, address = endpoint
    registry = Registry(connect(redis_url))
    registry.put_adapter(AdapterRecord("hot", "/nowhere", rank=8, size_bytes=1 << 20, version=1))
    registry.heartbeat(WorkerRecord("worker-0", address, heartbeat_unix=time.time()), 30)
    core = PredictorCore(
        PredictorConfig(forecaster="frequency", prefetch=prefetch), registry, PredictorMetrics()
    )
    now = time.time()
    for i in range(20):
        core.observe("hot", now - 2 + i * 0.1)
    core.tick(now)
    # Forecast and placement are published whatever the switch says ...
    assert registry.get_forecast() is not None and "hot" in registry.get_forecast()["expected"]
    assert registry.get_placement().get("hot") == ["worker-0"]
    # ... the prefetch RPC goes out only when it is on.
    sent = [item.adapter.adapter_id for r in recorder.requests for item in r.items]
    assert sent == (["hot"] if prefetch == "on" else [])


def test_every_event_is_counted_base_model_ones_forecast_nothing(redis_url):
    """``events_received`` counts what the gateway's ``events_sent`` counts, base-model
    requests included; only adapter requests reach the forecaster."""
    metrics = PredictorMetrics()
    core = PredictorCore(
        PredictorConfig(forecaster="frequency"), Registry(connect(redis_url)), metrics
    )
    now = time.time()
    for i in range(3):
        core.observe("", now - 1 + i * 0.1)
    core.observe("hot", now)
    assert metrics.registry.get_sample_value("plora_predictor_events_received_total") == 4
    core.tick(now)
    assert set(core.latest.expected_by_id()) == {"hot"}


def test_ticks_go_on_through_a_redis_outage_and_publish_again_after_it(own_redis, caplog):
    """A tick due to persist while Redis is down used to raise redis' ConnectionError and end
    the tick thread; now it keeps forecasting, and publishes once Redis is back."""
    registry = Registry(connect(own_redis.url))
    core = PredictorCore(
        PredictorConfig(forecaster="frequency", persist_every_s=0.0), registry, PredictorMetrics()
    )
    now = time.time()
    core.observe("hot", now)
    own_redis.kill()
    caplog.set_level(logging.WARNING)
    for i in range(3):
        core.tick(now + i)  # publish, place and persist all fail: no exception
    assert "hot" in core.latest.expected_by_id()
    assert len(caplog.records) == 1 and "unreachable" in caplog.records[0].getMessage()
    own_redis.start()
    core.tick(now + 3)
    assert "hot" in registry.get_forecast()["expected"]
    assert registry.load_predictor_state()
