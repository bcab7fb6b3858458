"""The gateway with real Redis but no workers, and services started without Redis."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService
from tests.conftest import REPO


@pytest.fixture()
def gateway(redis_url: str):
    service = GatewayService(GatewayConfig(port=0, metrics_port=0, redis_url=redis_url)).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    yield gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    service.stop(0)


def test_no_healthy_worker_is_unavailable(gateway) -> None:
    req = gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as err:
        list(gateway.Generate(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy worker" in err.value.details()


def test_register_before_any_worker_is_unavailable(gateway, tmp_path) -> None:
    with pytest.raises(grpc.RpcError) as err:
        gateway.RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(adapter_id="a", source=str(tmp_path)), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cluster_status_with_no_workers(gateway) -> None:
    status = gateway.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=10)
    assert list(status.workers) == [] and status.adapters_registered == 0


@pytest.mark.parametrize("service", ["gateway", "predictor", "worker"])
def test_unreachable_redis_gives_a_clear_message(service: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            service,
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in out.stderr
    assert "Traceback" not in out.stderr


def test_plora_up_with_unreachable_redis_fails_cleanly(tmp_path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--state-file",
            str(tmp_path / "c.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "cannot reach Redis" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "c.json").exists()
