"""The locked internal plane of a cluster started by ``plora up`` (the ``cluster`` fixture: real
Redis, predictor, workers and gateway as separate processes): its Redis refuses a client
without the run's password (NOAUTH), its workers and predictor refuse a direct call without the
run's internal token (UNAUTHENTICATED) and answer one with it, and neither secret is on any
process's command line, in the state file (mode 0600) or in a log."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
import redis

from plora.v1 import (
    gateway_pb2,
    gateway_pb2_grpc,
    predictor_pb2,
    predictor_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.internal_auth import REFUSAL, internal_channel
from services.common.redis_server import redis_server_binary

pytestmark = pytest.mark.slow


def _secrets(cluster: dict) -> list[str]:
    password = urlsplit(cluster["redis_url"]).password
    assert password and len(password) >= 32, "plora up's Redis has no random password"
    assert len(cluster["internal_token"]) >= 32
    return [password, cluster["internal_token"]]


def test_the_clusters_redis_answers_noauth_without_its_password(cluster: dict) -> None:
    public = urlsplit(cluster["public_redis_url"])
    assert public.password is None and public.hostname and public.port
    cli = str(Path(redis_server_binary()).with_name("redis-cli"))
    env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    refused = subprocess.run(
        [cli, "-h", public.hostname, "-p", str(public.port), "ping"],
        capture_output=True,
        text=True,
        timeout=10,
        env=env,
    )
    assert "NOAUTH" in refused.stdout + refused.stderr
    with socket.create_connection((public.hostname, public.port), timeout=5) as s:
        s.sendall(b"GET anything\r\n")
        assert s.recv(100).startswith(b"-NOAUTH")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(cluster["public_redis_url"]).ping()
    client = redis.Redis.from_url(cluster["redis_url"])
    assert client.ping()
    assert client.config_get("protected-mode") == {"protected-mode": "yes"}


def _unauthenticated(call) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED, exc.value
    assert exc.value.details() == REFUSAL


def test_direct_worker_calls_need_the_internal_token(cluster: dict) -> None:
    adapter = cluster["adapters"][0]
    for address in cluster["workers"].values():
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            _unauthenticated(
                lambda stub=stub: stub.GetWorkerStatus(
                    worker_pb2.GetWorkerStatusRequest(), timeout=10
                )
            )
            _unauthenticated(
                lambda stub=stub: list(
                    stub.Generate(
                        worker_pb2.WorkerGenerateRequest(
                            request=gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=2)
                        ),
                        timeout=10,
                    )
                )
            )
            _unauthenticated(
                lambda stub=stub: stub.UnloadAdapter(
                    worker_pb2.UnloadAdapterRequest(adapter_id=adapter), timeout=10
                )
            )
            _unauthenticated(
                lambda stub=stub: stub.PrefetchAdapters(
                    worker_pb2.PrefetchAdaptersRequest(), timeout=10
                )
            )
        with internal_channel(address, "x" * 43) as channel:  # a wrong token
            stub = worker_pb2_grpc.WorkerStub(channel)
            _unauthenticated(
                lambda stub=stub: stub.GetWorkerStatus(
                    worker_pb2.GetWorkerStatusRequest(), timeout=10
                )
            )
        with internal_channel(address, cluster["internal_token"]) as channel:
            status = worker_pb2_grpc.WorkerStub(channel).GetWorkerStatus(
                worker_pb2.GetWorkerStatusRequest(), timeout=10
            )
            assert status.worker_id in cluster["workers"]


def test_direct_predictor_calls_need_the_internal_token(cluster: dict) -> None:
    request = predictor_pb2.GetForecastRequest(limit=3)
    with grpc.insecure_channel(cluster["predictor"]) as channel:
        stub = predictor_pb2_grpc.PredictorStub(channel)
        _unauthenticated(lambda: stub.GetForecast(request, timeout=10))
        events = iter([predictor_pb2.RequestEvent(adapter_id="x", arrival_unix=1.0)])
        _unauthenticated(lambda: stub.StreamRequestEvents(events, timeout=10))
    with internal_channel(cluster["predictor"], cluster["internal_token"]) as channel:
        answer = predictor_pb2_grpc.PredictorStub(channel).GetForecast(request, timeout=10)
    assert answer.horizon_seconds > 0


def test_the_gateway_reaches_the_workers_with_the_token(cluster: dict) -> None:
    """The public path still works: the gateway sends the token to the workers (a refused
    worker call would end this request UNAUTHENTICATED or UNAVAILABLE)."""
    with grpc.insecure_channel(cluster["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        chunks = list(
            stub.Generate(
                gateway_pb2.GenerateRequest(
                    adapter_id=cluster["adapters"][0], prompt="Hi", max_new_tokens=2
                ),
                timeout=120,
            )
        )
    assert chunks and chunks[-1].finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED


def _cmdlines() -> dict[int, bytes]:
    """Every process's command line this user can read, by pid (what ``ps`` shows)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                continue
    return out


def test_no_secret_on_a_command_line_in_the_state_file_or_a_log(cluster: dict) -> None:
    secrets = [s.encode() for s in _secrets(cluster)]
    state_file = Path(cluster["root"]) / "cluster.json"
    cmdlines = _cmdlines()
    # the cluster's own processes (as now: a restarted one has a new pid) are among them ...
    for name, pid in json.loads(state_file.read_text())["pids"].items():
        assert pid in cmdlines and cmdlines[pid], name
    assert any(b"redis-server" in c for c in cmdlines.values())
    # ... and no process's command line holds a secret
    for pid, cmdline in cmdlines.items():
        for secret in secrets:
            assert secret not in cmdline, f"pid {pid}: {cmdline[:200]!r}"
    # the state file: no secret, the Redis URL without password, readable by its owner only
    text = state_file.read_bytes()
    assert not any(secret in text for secret in secrets)
    state = json.loads(text)
    assert urlsplit(state["redis_url"]).password is None
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    # the secrets are in the credentials file it names, also 0600
    credentials = Path(state["credentials_file"])
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    assert all(secret in credentials.read_bytes() for secret in secrets)
    # the launcher's output and every service's log
    logs = [Path(cluster["log"]), *sorted((Path(cluster["root"]) / "logs").glob("*.log"))]
    assert len(logs) >= 4
    for log in logs:
        data = log.read_bytes()
        for secret in secrets:
            assert secret not in data, f"{log} holds a secret"
    assert b"internal_token='***'" in (Path(cluster["root"]) / "logs" / "gateway.log").read_bytes()
