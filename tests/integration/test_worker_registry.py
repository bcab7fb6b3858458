"""One worker (the real model, a real store) and a Redis of its own that loses its data."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest

from plora.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc
from services.common import convert
from services.common.make_adapters import make_adapter_set
from services.common.registry import AdapterRecord, Registry, connect
from services.worker.config import WorkerConfig
from services.worker.server import WorkerService
from tests.conftest import OwnRedis

pytestmark = pytest.mark.slow


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
    """Redis restarted without its data: adapters are registered again from version 1. A
    worker that had served version 3 refused version 1 as superseded, and a registration
    made before the worker's first heartbeat to the new Redis could not tell it to drop its
    copy (the new-user trial hit this in 3 of 5 tries). The worker notices the registry lost
    its own record at that heartbeat and forgets every adapter, so version 1 is served."""
    service = WorkerService(
        WorkerConfig(
            port=0,
            metrics_port=0,
            redis_url=own_redis.url,
            model=str(model_dir),
            pool_bytes=64 << 20,
            threads=1,
            host_staging="off",
        )
    ).start()
    channel = grpc.insecure_channel(service.address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    (source,) = make_adapter_set(tmp_path, service.spec, count=1, ranks=[8], seed=0)
    record = AdapterRecord("a", str(source), version=3, rank=8)
    try:
        assert _generate(stub, record)[-1].finish_reason
        old = AdapterRecord("a", str(source), version=1, rank=8)
        with pytest.raises(grpc.RpcError) as err:
            _generate(stub, old)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "superseded by version 3" in err.value.details()

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
