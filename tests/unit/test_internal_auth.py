"""The internal plane's token (services/common/internal_auth.py) on real gRPC servers and a
real Redis: the worker's and predictor's servers refuse a call without it as UNAUTHENTICATED,
answer one with it, leave health and reflection open; the gateway's event stream and the
predictor's prefetch send it; a token comes from a file or the environment and is never
logged; the embedded Redis refuses a client without its password (NOAUTH)."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plora.v1 import predictor_pb2, predictor_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.config import settings_line
from services.common.errors import ConfigError
from services.common.grpc_util import create_server, set_serving
from services.common.internal_auth import (
    REFUSAL,
    TOKEN_METADATA_KEY,
    InternalStubs,
    InternalTokenInterceptor,
    internal_channel,
    resolve_token,
    server_interceptors,
    tokens_match,
)
from services.common.lifecycle import write_json_atomic
from services.common.redis_server import EmbeddedRedis, redis_server_binary
from services.common.registry import (
    AdapterRecord,
    Registry,
    WorkerRecord,
    connect,
    url_without_password,
)
from services.gateway.config import GatewayConfig
from services.gateway.events import EventStreamer
from services.predictor.config import PredictorConfig
from services.predictor.metrics import PredictorMetrics
from services.predictor.server import PredictorCore, PredictorService
from services.worker.config import WorkerConfig
from tests.helpers import config_from_flags

TOKEN = "internal-token-of-this-test-0123456789"


class _WorkerSurface(worker_pb2_grpc.WorkerServicer):
    """The worker's gRPC surface, recording the calls that reach it."""

    def __init__(self) -> None:
        self.prefetches: list[worker_pb2.PrefetchAdaptersRequest] = []

    def PrefetchAdapters(self, request, context):  # noqa: N802 - gRPC method name
        self.prefetches.append(request)
        return worker_pb2.PrefetchAdaptersResponse()

    def GetWorkerStatus(self, request, context):  # noqa: N802
        return worker_pb2.GetWorkerStatusResponse(worker_id="surface", running=3)

    def Generate(self, request, context):  # noqa: N802
        yield from ()


@pytest.fixture()
def guarded_worker():
    """A real gRPC server with the worker's service behind the internal token check, as the
    worker builds it (``create_server`` with :func:`server_interceptors`)."""
    surface = _WorkerSurface()
    refused: list[str] = []

    def register(server: grpc.Server) -> list[str]:
        worker_pb2_grpc.add_WorkerServicer_to_server(surface, server)
        return ["plora.v1.Worker"]

    server, port, health = create_server(
        register, port=0, max_workers=4, interceptors=server_interceptors(TOKEN, refused.append)
    )
    server.start()
    set_serving(health, ["plora.v1.Worker"], True)
    yield surface, f"127.0.0.1:{port}", refused
    server.stop(0)


def test_a_call_without_the_token_or_with_another_is_unauthenticated(guarded_worker) -> None:
    _surface, address, refused = guarded_worker
    request = worker_pb2.GetWorkerStatusRequest()
    for channel in (
        grpc.insecure_channel(address),
        internal_channel(address, "another-token-of-the-same-length-0123"),
    ):
        with channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as unary:
                stub.GetWorkerStatus(request, timeout=5)
            with pytest.raises(grpc.RpcError) as stream:
                list(stub.Generate(worker_pb2.WorkerGenerateRequest(), timeout=5))
        for exc in (unary.value, stream.value):
            assert exc.code() is grpc.StatusCode.UNAUTHENTICATED
            assert exc.details() == REFUSAL
            assert TOKEN not in exc.details()
    assert refused == ["/plora.v1.Worker/GetWorkerStatus", "/plora.v1.Worker/Generate"] * 2


def test_a_call_without_the_token_is_refused_before_its_request_is_read(guarded_worker) -> None:
    """Bytes that are no request, and a request never sent, are refused UNAUTHENTICATED
    alike: the refusal neither parses nor waits for what an unauthenticated caller sends."""
    _surface, address, refused = guarded_worker
    never_sent = threading.Event()

    def no_request_yet() -> Iterator[bytes]:
        never_sent.wait(30)
        yield from ()

    method = "/plora.v1.Worker/GetWorkerStatus"
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as garbage:
            channel.unary_unary(method)(b"\xff\xff\xff not a protobuf message", timeout=5)
        with pytest.raises(grpc.RpcError) as unsent:
            channel.stream_unary(method)(no_request_yet(), timeout=5)
        never_sent.set()
    for exc in (garbage.value, unsent.value):
        assert (exc.code(), exc.details()) == (grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
    assert refused == [method] * 2


def test_a_call_with_the_token_is_served(guarded_worker) -> None:
    surface, address, refused = guarded_worker
    with internal_channel(address, TOKEN) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        assert stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5).running == 3
        assert list(stub.Generate(worker_pb2.WorkerGenerateRequest(), timeout=5)) == []
        # the metadata a caller sets itself still travels beside the token
        stub.PrefetchAdapters(
            worker_pb2.PrefetchAdaptersRequest(), timeout=5, metadata=(("x-trace", "1"),)
        )
    assert len(surface.prefetches) == 1 and refused == []


def test_stubs_are_built_once_per_address_and_send_the_token(guarded_worker) -> None:
    """InternalStubs (the gateway's and the predictor's calls to the workers): one stub per
    address, reused; every call carries the token; after close a new channel serves."""
    _surface, address, refused = guarded_worker
    stubs = InternalStubs(worker_pb2_grpc.WorkerStub, TOKEN)
    try:
        stub = stubs.get(address)
        assert stubs.get(address) is stub
        assert stubs.get("127.0.0.1:1") is not stub  # another address, its own channel
        assert stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5).running == 3
        stubs.close()
        again = stubs.get(address)
        assert again is not stub
        assert again.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5).running == 3
    finally:
        stubs.close()
    assert refused == []
    unsigned = InternalStubs(worker_pb2_grpc.WorkerStub, "")
    try:
        with pytest.raises(grpc.RpcError) as exc:
            unsigned.get(address).GetWorkerStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5)
        assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        unsigned.close()


def test_health_and_reflection_stay_open(guarded_worker) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _surface, address, refused = guarded_worker
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert "plora.v1.Worker" in names and refused == []


def test_the_predictor_prefetches_with_the_token_and_is_refused_without(
    redis_url: str, guarded_worker
) -> None:
    """The predictor -> worker prefetch carries the token; a predictor without it gets
    nothing through (counted as a prefetch error)."""
    surface, address, _refused = guarded_worker
    registry = Registry(connect(redis_url))
    registry.put_adapter(AdapterRecord("hot", "/nowhere", rank=8, size_bytes=1 << 20, version=1))
    registry.heartbeat(WorkerRecord("worker-0", address, heartbeat_unix=time.time()), 30)
    for token, sent in (("", 0), (TOKEN, 1)):
        metrics = PredictorMetrics()
        config = PredictorConfig(
            forecaster="frequency", prefetch_min_probability=0, internal_token=token
        )
        core = PredictorCore(config, registry, metrics)
        now = time.time()
        for i in range(20):
            core.observe("hot", now - 2 + i * 0.1)
        core.tick(now)
        core.close()
        assert len(surface.prefetches) == sent
        errors = metrics.registry.get_sample_value("plora_predictor_prefetch_errors_total")
        assert errors == (1 - sent)


@pytest.fixture()
def predictor(redis_url: str):
    """A real predictor service with an internal token."""
    service = PredictorService(
        PredictorConfig(
            port=0, metrics_port=0, redis_url=redis_url, forecaster="frequency",
            internal_token=TOKEN,
        )
    ).start()  # fmt: skip
    yield service
    service.stop(0)


def _sample(service: PredictorService, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_direct_predictor_call_needs_the_token(predictor: PredictorService) -> None:
    address = f"127.0.0.1:{predictor.port}"
    request = predictor_pb2.GetForecastRequest()
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            predictor_pb2_grpc.PredictorStub(channel).GetForecast(request, timeout=5)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    refused = "plora_predictor_internal_auth_refused_total"
    method = "/plora.v1.Predictor/GetForecast"
    assert _sample(predictor, refused, method=method) == 1
    with internal_channel(address, TOKEN) as channel:
        answer = predictor_pb2_grpc.PredictorStub(channel).GetForecast(request, timeout=5)
    assert answer.model == "frequency"
    assert _sample(predictor, refused, method=method) == 1


def test_the_gateways_event_stream_reaches_the_predictor_only_with_the_token(
    predictor: PredictorService,
) -> None:
    address = f"127.0.0.1:{predictor.port}"
    received = "plora_predictor_events_received_total"
    for token, expected in (("", 0.0), (TOKEN, 3.0)):
        streamer = EventStreamer(address, 100, internal_token=token)
        streamer.start()
        try:
            deadline = time.monotonic() + 10
            while not streamer.connected and time.monotonic() < deadline:
                time.sleep(0.05)
            for i in range(3):
                streamer.offer(predictor_pb2.RequestEvent(adapter_id=f"a{i}", arrival_unix=1.0))
            deadline = time.monotonic() + 5
            while _sample(predictor, received) < expected and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # give a refused stream the time to have been counted
        finally:
            streamer.stop()
        assert _sample(predictor, received) == expected
    refused = "plora_predictor_internal_auth_refused_total"
    assert _sample(predictor, refused, method="/plora.v1.Predictor/StreamRequestEvents") >= 1


def test_the_refusal_log_names_the_method_never_the_token(caplog) -> None:
    interceptor = InternalTokenInterceptor(TOKEN)
    sent = "a-wrong-token-someone-guessed-0123456"

    class Details(grpc.HandlerCallDetails):
        method = "/plora.v1.Worker/LoadAdapter"
        invocation_metadata = ((TOKEN_METADATA_KEY, sent),)

    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    with caplog.at_level(logging.WARNING):
        refusing = interceptor.intercept_service(lambda _d: handler, Details())
    assert refusing is not handler
    assert "/plora.v1.Worker/LoadAdapter (wrong token)" in caplog.text
    assert sent not in caplog.text and TOKEN not in caplog.text
    with pytest.raises(ValueError, match="non-empty token"):
        InternalTokenInterceptor("")


def test_tokens_are_compared_whole() -> None:
    assert tokens_match(TOKEN, TOKEN) and tokens_match(TOKEN.encode(), TOKEN)
    assert not tokens_match(None, TOKEN)
    assert not tokens_match(TOKEN[:-1], TOKEN) and not tokens_match(TOKEN + "x", TOKEN)


def test_the_token_comes_from_its_file_else_the_variable_else_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PLORA_INTERNAL_TOKEN", "PLORA_INTERNAL_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    config = config_from_flags(WorkerConfig)
    assert resolve_token(config.internal_token_file, config.internal_token) == ""
    monkeypatch.setenv("PLORA_INTERNAL_TOKEN", TOKEN)
    config = config_from_flags(WorkerConfig)
    assert resolve_token(config.internal_token_file, config.internal_token) == TOKEN
    secret = tmp_path / "token"
    secret.write_text("token-from-the-mounted-secret-0123456789\n")
    for config in (
        config_from_flags(GatewayConfig, "--internal-token-file", str(secret)),
        config_from_flags(PredictorConfig, "--internal-token-file", str(secret)),
    ):
        token = resolve_token(config.internal_token_file, config.internal_token)
        assert token == "token-from-the-mounted-secret-0123456789"  # the file wins
    monkeypatch.setenv("PLORA_INTERNAL_TOKEN_FILE", str(secret))
    config = config_from_flags(WorkerConfig)
    assert resolve_token(config.internal_token_file, config.internal_token) == token


def test_a_bad_token_setting_is_refused_naming_it_never_showing_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the internal token") as missing:
        resolve_token(str(tmp_path / "absent"), "")
    assert "--internal-token-file" in str(missing.value)
    short = "short-token"
    with pytest.raises(ConfigError, match="at least 16 characters") as exc:
        resolve_token("", short)
    assert "PLORA_INTERNAL_TOKEN" in str(exc.value) and short not in str(exc.value)
    spaced = tmp_path / "spaced"
    spaced.write_text("a token with spaces in it, long enough")
    with pytest.raises(ConfigError, match="letters, digits"):
        resolve_token(str(spaced), "")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="at least 16"):
        resolve_token(str(empty), "")


@pytest.mark.parametrize("service", [WorkerConfig, GatewayConfig, PredictorConfig])
def test_settings_line_and_repr_never_show_the_token(
    service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLORA_INTERNAL_TOKEN", TOKEN)
    config = config_from_flags(service)
    assert config.internal_token == TOKEN
    line = settings_line(config)
    assert TOKEN not in line and "internal_token='***'" in line
    assert TOKEN not in repr(config)


def _raw_redis_reply(host: str, port: int, command: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(command)
        return s.recv(200)


def test_embedded_redis_with_a_password_refuses_a_client_without_it() -> None:
    password = "redis-password-of-this-test-0123"
    with EmbeddedRedis(password=password) as server:
        assert password not in server.public_url and password in server.url
        assert url_without_password(server.url) == server.public_url
        # redis-cli, the binary bundled beside redis-server, without and with the password
        cli = str(Path(redis_server_binary()).with_name("redis-cli"))
        base = [cli, "-h", server.host, "-p", str(server.port)]
        refused = subprocess.run([*base, "ping"], capture_output=True, text=True, timeout=10)
        assert "NOAUTH" in refused.stdout + refused.stderr
        allowed = subprocess.run(
            [*base, "ping"],
            capture_output=True,
            text=True,
            timeout=10,
            env={**os.environ, "REDISCLI_AUTH": password},  # not -a: ps would show it
        )
        assert allowed.stdout.strip() == "PONG"
        assert _raw_redis_reply(server.host, server.port, b"PING\r\n").startswith(b"-NOAUTH")
        client = connect(server.url)
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert server.proc is not None
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline


def test_embedded_redis_without_a_password_is_protected_but_open_on_loopback() -> None:
    with EmbeddedRedis() as server:
        assert server.url == server.public_url
        client = connect(server.url)
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert client.ping()
    with pytest.raises(ValueError, match="white space"):
        EmbeddedRedis(password="two words")


def test_json_written_with_a_mode_is_never_readable_by_others(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{}")
    path.chmod(0o644)
    write_json_atomic(path, {"a": 1}, mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"a": 1}


def test_url_without_password() -> None:
    assert url_without_password("redis://:pw@host:6379/0") == "redis://host:6379/0"
    assert url_without_password("redis://user:pw@host:6379/2") == "redis://host:6379/2"
    assert url_without_password("redis://host:6379/0") == "redis://host:6379/0"
    assert url_without_password("unix:///run/redis.sock") == "unix:///run/redis.sock"
