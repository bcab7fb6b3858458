"""One worker (the real model, a real store) and a Redis of its own that loses its data."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plora.make_adapters import make_adapter_set
from plora.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc
from services.common import convert
from services.common.registry import AdapterRecord, Registry, connect
from services.worker.config import WorkerConfig
from services.worker.engine import EngineRequest
from services.worker.server import (
    EXIT_ENGINE_STALLED,
    RECONCILE_INTERVAL_S,
    SERVICE_NAME,
    WorkerService,
)
from tests.conftest import OwnRedis

pytestmark = pytest.mark.slow


def _worker(redis_url: str, model_dir: Path, **kw: object) -> WorkerService:
    """A started worker on free ports: the real model, a 64 MiB pool, one thread, no staging."""
    kw.setdefault("worker_id", "worker-0")
    cfg = WorkerConfig(
        port=0,
        metrics_port=0,
        redis_url=redis_url,
        model=str(model_dir),
        pool_bytes=64 << 20,
        threads=1,
        host_staging="off",
        **kw,  # type: ignore[arg-type]
    )
    return WorkerService(cfg).start()


def _generate(stub: worker_pb2_grpc.WorkerStub, record: AdapterRecord) -> list:
    request = worker_pb2.WorkerGenerateRequest(
        request=gateway_pb2.GenerateRequest(
            prompt="Hello", adapter_id=record.adapter_id, max_new_tokens=2, request_id="t"
        ),
        adapter=convert.adapter_info(record),
    )
    return list(stub.Generate(request, timeout=60))


def test_a_worker_forgets_its_adapters_when_redis_comes_back_empty(
    own_redis: OwnRedis, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis restarted without its data: adapters are registered again from version 1, which a
    worker that had served version 3 would refuse as superseded, and a registration made
    before the worker's first heartbeat to the new Redis cannot tell it to drop its copy. The
    worker notices the registry lost its own record at that heartbeat and forgets every
    adapter, so version 1 is served.
    (Also: the worker logs its settings at start, and each request that failed with its id.)"""
    caplog.set_level(logging.INFO, logger="services.worker.server")
    caplog.set_level(logging.INFO, logger="services.worker.core")  # the failed request's line
    service = _worker(own_redis.url, model_dir)
    channel = grpc.insecure_channel(service.address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    (source,) = make_adapter_set(tmp_path, service.spec, count=1, ranks=[8], seed=0)
    record = AdapterRecord("a", str(source), version=3, rank=8)
    Registry(connect(own_redis.url)).put_adapter(record)  # else the worker's check drops it
    try:
        assert _generate(stub, record)[-1].finish_reason
        old = AdapterRecord("a", str(source), version=1, rank=8)
        with pytest.raises(grpc.RpcError) as err:
            _generate(stub, old)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "superseded by version 3" in err.value.details()
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("settings: worker_id='worker-0', ") for m in messages)
        (failed,) = [m for m in messages if m.startswith("request t ")]
        assert "(adapter a, tenant -) ended NOT_FOUND after " in failed
        assert "superseded by version 3" in failed

        # deleted while the gateway's unload could not reach this worker: its next check
        # against the registry drops it (every RECONCILE_INTERVAL_S; run here at once)
        assert [r.adapter_id for r in service.store.resident_adapters()] == ["a"]
        Registry(connect(own_redis.url)).delete_adapter("a")
        service._last_reconcile = -RECONCILE_INTERVAL_S
        service.heartbeat()
        assert service.store.resident_adapters() == []
        assert any("dropped 1 adapters deleted" in r.getMessage() for r in caplog.records)
        Registry(connect(own_redis.url)).put_adapter(record)

        caplog.set_level(logging.WARNING, logger="services.worker.server")
        own_redis.kill()
        own_redis.start()  # empty, on the same port
        registry = Registry(connect(own_redis.url))
        deadline = time.monotonic() + 15
        while not registry.list_workers():  # the worker's next heartbeat
            assert time.monotonic() < deadline, "the worker never heartbeated to the new Redis"
            time.sleep(0.1)
        time.sleep(0.2)  # the heartbeat's own handling of its reply
        assert any("lost this worker's record" in r.getMessage() for r in caplog.records)
        assert _generate(stub, old)[-1].finish_reason
    finally:
        channel.close()
        service.stop()


def test_a_stalled_engine_makes_the_worker_leave_the_registry_and_exit(
    own_redis: OwnRedis, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Past ``stall_timeout_s`` without progress while it has requests (a deadlocked engine
    would otherwise go on heartbeating healthy and draw requests), the worker logs every
    thread's stack, stops serving, leaves the registry and exits (status 70) for its
    supervisor to restart it; idle, it never does."""
    service = _worker(
        own_redis.url, model_dir, stall_timeout_s=1.0, heartbeat_interval_s=0.2, heartbeat_ttl_s=1.0
    )
    exited = threading.Event()
    codes: list[int] = []
    service._exit = lambda code: (codes.append(code), exited.set())  # type: ignore[method-assign]
    release = threading.Event()
    forward = service.engine.model.forward

    def hung(batch, kv):  # type: ignore[no-untyped-def]  # a step that never returns
        release.wait(60)
        return forward(batch, kv)

    registry = Registry(connect(own_redis.url))
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(service.address))
    try:
        assert not exited.wait(2.0)  # idle for twice the timeout: not a stall
        assert [w.worker_id for w in registry.list_workers() if w.healthy] == ["worker-0"]
        service.engine.model.forward = hung  # type: ignore[method-assign]
        service.engine.submit(EngineRequest("stuck", [1, 2, 3], max_new_tokens=2))
        assert exited.wait(10), "the watchdog did not end the stalled worker"
        assert codes == [EXIT_ENGINE_STALLED]
        assert not any(w.healthy for w in registry.list_workers())
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert "the engine made no progress for" in caplog.text
        assert "thread plora-engine:" in caplog.text and "in hung" in caplog.text
    finally:
        release.set()
        service.stop()


def test_the_worker_publishes_how_long_a_load_from_the_source_takes(
    own_redis: OwnRedis, model_dir: Path, tmp_path: Path
) -> None:
    """A load that read the adapter's files (host staging off, so no host copy) is folded into
    the heartbeat's ``source_load_s``, which routing weighs before sending a request to read
    an adapter from the source on another worker (``route_rank_aware``, rule (c))."""
    service = _worker(own_redis.url, model_dir)
    channel = grpc.insecure_channel(service.address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    (source,) = make_adapter_set(tmp_path, service.spec, count=1, ranks=[8], seed=0)
    record = AdapterRecord("a", str(source), version=1, rank=8)
    registry = Registry(connect(own_redis.url))
    registry.put_adapter(record)
    try:
        service.heartbeat()
        (before,) = registry.list_workers()
        assert before.source_load_s == 0.0  # nothing read yet
        assert _generate(stub, record)[-1].finish_reason
        service.heartbeat()
        (after,) = registry.list_workers()
        assert after.source_load_s > 0.0
        assert after.source_load_s == service.engine.estimates.source_load_s
    finally:
        channel.close()
        service.stop()
