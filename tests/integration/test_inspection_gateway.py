"""RegisterAdapter's inspection bounds through a real gateway on real Redis, a worker record
published there as a worker's heartbeat publishes it (no model needed: every adapter here is
refused before any worker is called)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from plora.make_adapters import write_peft_adapter
from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.registry import Registry, WorkerRecord, connect
from services.common.types import ModelSpec
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService
from tests.adapter_builders import WEIGHTS, pad_config

#: A tiny served model.
SPEC = ModelSpec("m", 2, 8, 16, 2, 1, 4, 32, 64, 10000.0, 1e-6, True)


def _gateway(
    redis_url: str, pool_bytes: int, **settings: int
) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    Registry(connect(redis_url)).heartbeat(
        WorkerRecord("w0", "127.0.0.1:1", pool={"pool_bytes": pool_bytes}),
        ttl_seconds=60,
        model=(SPEC, "float32"),
    )
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url, **settings)
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield gateway_pb2_grpc.GatewayStub(channel)
    finally:
        channel.close()
        service.stop(0)


@pytest.fixture()
def small_limits(redis_url: str) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    """A gateway with a rank cap of 16 and a 1000-byte config bound, and a 64 MiB pool."""
    yield from _gateway(redis_url, 64 << 20, max_lora_rank=16, max_adapter_config_bytes=1000)


@pytest.fixture()
def tiny_pool(redis_url: str) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    """A gateway whose only worker has a 1 KiB pool."""
    yield from _gateway(redis_url, 1024)


def _register(stub: gateway_pb2_grpc.GatewayStub, source: Path) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(adapter_id="t/a", source=str(source)), timeout=10
        )
    return err.value


def test_the_gateways_rank_cap_and_config_bound_are_its_settings(small_limits, tmp_path) -> None:
    high = write_peft_adapter(tmp_path / "r32", SPEC, rank=32, alpha=8.0, seed=1)
    err = _register(small_limits, high)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "r is 32, above this server's largest LoRA rank 16" in err.details()

    big = pad_config(write_peft_adapter(tmp_path / "cfg", SPEC, rank=4, alpha=8.0, seed=1), 1001)
    err = _register(small_limits, big)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter_config.json is 1001 bytes; at most 1000" in err.details()


def test_pool_fit_is_refused_before_the_values_are_scanned(tiny_pool, tmp_path) -> None:
    """An adapter too large for every pool and holding NaN is refused for its size
    (RESOURCE_EXHAUSTED, naming the adapter): its values were never read."""
    source = write_peft_adapter(tmp_path / "a", SPEC, rank=8, alpha=8.0, seed=1)
    tensors = load_file(str(source / WEIGHTS))
    tensors = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    save_file(tensors, str(source / WEIGHTS))
    err = _register(tiny_pool, source)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("adapter 't/a': the adapter needs ")
    assert "largest worker pool holds 1024; raise --pool-bytes" in err.details()
