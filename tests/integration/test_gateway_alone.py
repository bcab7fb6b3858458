"""The gateway with real Redis but no workers, and services started without Redis."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from plora import cli
from plora.make_adapters import write_peft_adapter
from plora.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.lifecycle import EXIT_REGISTRY_UNAVAILABLE
from services.common.registry import AdapterRecord, Registry, WorkerRecord, connect
from services.common.routing import ROUTED_GRACE_S, worker_view
from services.common.types import ModelSpec
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.metrics import GatewayMetrics
from services.gateway.server import GatewayService
from tests.conftest import REPO, OwnRedis

#: A tiny served model for registrations through a gateway with no real worker.
SPEC = ModelSpec("m", 2, 8, 16, 2, 1, 4, 32, 64, 10000.0, 1e-6, True)


@pytest.fixture()
def gateway(redis_url: str):
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
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


def test_error_messages_repeat_at_most_the_start_of_a_huge_field(gateway) -> None:
    """A refusal of a huge adapter id (5,000 characters in RegisterAdapter, 10,000 in Generate)
    repeats only its first characters and its length."""
    calls = [
        lambda: gateway.RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(adapter_id="a" * 5000, source="/x"), timeout=10
        ),
        lambda: list(
            gateway.Generate(
                gateway_pb2.GenerateRequest(adapter_id="b" * 10_000, prompt="hi"), timeout=10
            )
        ),
        lambda: gateway.GetAdapter(gateway_pb2.GetAdapterRequest(adapter_id="c" * 128), timeout=10),
    ]
    for call, length in zip(calls, [5000, 10_000, 128], strict=True):
        with pytest.raises(grpc.RpcError) as err:
            call()
        details = err.value.details()
        assert f"... ({length} characters)" in details and len(details) < 300, details


@pytest.mark.parametrize(
    "source",
    ["/tmp/" + "a" * 300, "/tmp/a\0b", "/tmp/" + "abc/" * 25_000],
    ids=["300-character name", "NUL byte", "100,000-character path"],
)
def test_a_source_path_the_system_refuses_is_invalid_argument(
    gateway, source: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A path the system refuses to look up is INVALID_ARGUMENT, with no traceback in the
    gateway's log."""
    with pytest.raises(grpc.RpcError) as err:
        gateway.RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(adapter_id="a", source=source), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("source '/tmp/")
    assert "is not a usable path" in err.value.details() and "\n" not in err.value.details()
    assert "Traceback" not in caplog.text


def test_every_rpc_applies_the_adapter_id_and_tenant_id_rules(gateway) -> None:
    """Every RPC refuses a malformed adapter id (``../../x``) and tenant id with
    INVALID_ARGUMENT and the same message."""
    g = gateway_pb2
    by_adapter = {
        "Generate": lambda a, t: list(
            gateway.Generate(g.GenerateRequest(adapter_id=a, tenant_id=t, prompt="hi"), timeout=10)
        ),
        "RegisterAdapter": lambda a, t: gateway.RegisterAdapter(
            g.RegisterAdapterRequest(adapter_id=a, tenant_id=t, source="/x"), timeout=10
        ),
        "GetAdapter": lambda a, t: gateway.GetAdapter(
            g.GetAdapterRequest(adapter_id=a, tenant_id=t), timeout=10
        ),
        "DeleteAdapter": lambda a, t: gateway.DeleteAdapter(
            g.DeleteAdapterRequest(adapter_id=a, tenant_id=t), timeout=10
        ),
        "ListAdapters": lambda a, t: gateway.ListAdapters(
            g.ListAdaptersRequest(tenant_id=t), timeout=10
        ),
    }
    messages = set()
    for name, call in by_adapter.items():
        cases = [("ok", "a b", "tenant_id 'a b' is invalid")]
        if name != "ListAdapters":
            cases.append(("../../x", "", "adapter_id '../../x' is invalid"))
        for adapter_id, tenant_id, start in cases:
            with pytest.raises(grpc.RpcError) as err:
                call(adapter_id, tenant_id)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert err.value.details().startswith(start), (name, err.value.details())
            if adapter_id != "ok":
                messages.add(err.value.details())
    assert len(messages) == 1  # the same rule, in the same words, everywhere
    listed = gateway.ListAdapters(g.ListAdaptersRequest(tenant_id="acme"), timeout=10)
    assert list(listed.adapters) == []


def test_a_full_gateway_refuses_generate_before_reading_its_request(redis_url: str) -> None:
    """While every place is taken, a Generate call is refused RESOURCE_EXHAUSTED without its
    request being read (here the client never sends one), counted once; a call that
    half-closes without a request is INVALID_ARGUMENT; one request serves as a unary call does."""
    service = GatewayService(
        GatewayConfig(
            port=0, metrics_port=0, http_port=0, redis_url=redis_url, max_concurrent_requests=1
        )
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    raw = channel.stream_stream(
        "/plora.v1.Gateway/Generate",
        request_serializer=gateway_pb2.GenerateRequest.SerializeToString,
        response_deserializer=gateway_pb2.GenerateResponse.FromString,
    )
    never_sent = threading.Event()

    def no_request_yet() -> Iterator[gateway_pb2.GenerateRequest]:
        never_sent.wait(30)  # holds the request stream open, sending nothing
        yield from ()

    try:
        ticket = service.core.admission.admit("")  # the one place, taken
        with pytest.raises(grpc.RpcError) as full:
            list(raw(no_request_yet(), timeout=10))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit of 1 concurrent Generate streams" in full.value.details()
        rejected = service.metrics.registry.get_sample_value(
            "plora_gateway_requests_rejected_total", {"reason": "max_concurrent_requests"}
        )
        assert rejected == 1
        ticket.release()

        with pytest.raises(grpc.RpcError) as none:
            list(raw(iter([]), timeout=10))
        assert none.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Generate takes one GenerateRequest" in none.value.details()

        with pytest.raises(grpc.RpcError) as one:
            list(raw(iter([gateway_pb2.GenerateRequest(prompt="hi")]), timeout=10))
        assert one.value.code() == grpc.StatusCode.UNAVAILABLE  # as the unary call's, above
        assert "no healthy worker" in one.value.details()
        assert service.core.admission.in_flight == 0
    finally:
        never_sent.set()
        channel.close()
        service.stop(0)


@pytest.mark.parametrize("service", ["gateway", "predictor", "worker"])
def test_unreachable_redis_gives_a_clear_message(service: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "plora.cli",
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
    assert out.returncode == EXIT_REGISTRY_UNAVAILABLE  # 75: a temporary failure, retried
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in out.stderr
    assert "Traceback" not in out.stderr


def test_plora_up_with_unreachable_redis_fails_cleanly(tmp_path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "plora.cli",
            "up",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--state-file",
            str(tmp_path / "c.json"),
            "--gateway-port",
            "0",  # a cluster the developer runs on the default port does not fail this test
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


def test_a_redis_outage_is_unavailable_with_the_registry_named_then_served_again(
    own_redis: OwnRedis, tmp_path, caplog: pytest.LogCaptureFixture, capsys
) -> None:
    """``kill -9`` of Redis under a running gateway: every RPC that needs the registry, the
    streamed Generate included, fails UNAVAILABLE with a message naming the registry and what
    to do (no redis traceback in the log); once Redis is back on its port the same gateway
    serves again."""
    service = GatewayService(
        GatewayConfig(
            port=0, metrics_port=0, http_port=0, redis_url=own_redis.url, worker_cache_s=0.0
        )
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)
    calls = {
        "Generate(base model)": lambda: list(
            stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=2), timeout=10)
        ),
        "Generate(adapter)": lambda: list(
            stub.Generate(
                gateway_pb2.GenerateRequest(prompt="hi", adapter_id="a", max_new_tokens=2),
                timeout=10,
            )
        ),
        "RegisterAdapter": lambda: stub.RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(adapter_id="a", source=str(tmp_path)), timeout=10
        ),
        "GetAdapter": lambda: stub.GetAdapter(
            gateway_pb2.GetAdapterRequest(adapter_id="a"), timeout=10
        ),
        "ListAdapters": lambda: stub.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=10),
        "DeleteAdapter": lambda: stub.DeleteAdapter(
            gateway_pb2.DeleteAdapterRequest(adapter_id="a"), timeout=10
        ),
        "GetClusterStatus": lambda: stub.GetClusterStatus(
            gateway_pb2.GetClusterStatusRequest(), timeout=10
        ),
    }
    try:
        assert list(stub.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=10).adapters) == []
        own_redis.kill()
        caplog.set_level(logging.INFO)
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
            details = err.value.details()
            assert f"the adapter registry (Redis at {own_redis.url}) is unreachable" in details
            assert details.endswith("check that Redis is running"), name
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        # the CLI shows it as it is: the gateway runs, its registry does not
        capsys.readouterr()
        assert cli.main(["adapters", "list", "--gateway", f"127.0.0.1:{service.port}"]) == 1
        err_text = capsys.readouterr().err
        assert "UNAVAILABLE: the adapter registry" in err_text
        assert "is the cluster running" not in err_text

        own_redis.start()  # empty, on the same port
        list_adapters = lambda: stub.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=10)  # noqa: E731
        _until_served(list_adapters, "admin call after the restart")
        assert list(list_adapters().adapters) == []
        deadline = time.monotonic() + 10
        while True:  # Generate finds Redis back at the gateway's next background check
            with pytest.raises(grpc.RpcError) as err:
                calls["Generate(base model)"]()
            if "no healthy worker" in err.value.details():
                break
            assert time.monotonic() < deadline, err.value.details()
            time.sleep(0.2)
    finally:
        channel.close()
        service.stop(0)


def test_routing_joins_a_load_it_started_until_a_heartbeat_reports_it(redis_url: str) -> None:
    """A second request for an adapter resident nowhere follows the first to the worker now
    loading it (no second load elsewhere), even before that worker's next heartbeat; once a
    heartbeat taken well after the routing no longer lists it, the gateway forgets it."""
    registry = Registry(connect(redis_url))
    for wid in ("w0", "w1"):
        registry.heartbeat(WorkerRecord(wid, "127.0.0.1:1"), ttl_seconds=30)
    config = GatewayConfig(
        port=0, metrics_port=0, http_port=0, redis_url=redis_url, worker_cache_s=0.0
    )
    gw = GatewayCore(config, registry, GatewayMetrics())
    routed = gw.metrics.routed

    def count(reason: str) -> float:
        return routed.labels("rank_aware", reason)._value.get()

    try:
        adapter = AdapterRecord("a", "/src", version=1, rank=8)
        assert gw._choose(adapter, set()).worker_id == "w0"  # least loaded, ties on id
        # w1 has less pending, but w0 is loading the adapter: join that load
        assert gw._choose(adapter, set()).worker_id == "w0"
        assert count("loading") == 1
        for _ in range(2):
            gw.routing.first_token("w0")
        # a heartbeat taken well after the routing shows the load still in flight: joined
        time.sleep(ROUTED_GRACE_S + 0.1)
        registry.heartbeat(WorkerRecord("w0", "127.0.0.1:1", loading=["a"]), ttl_seconds=30)
        assert gw._choose(adapter, set()).worker_id == "w0"
        assert count("loading") == 2
        gw.routing.first_token("w0")
        # the worker has dropped it (evicted, or the load failed): the gateway's own record
        # is older than the heartbeat and is forgotten
        time.sleep(ROUTED_GRACE_S + 0.1)
        registry.heartbeat(WorkerRecord("w0", "127.0.0.1:1"), ttl_seconds=30)
        # (had it been kept, w0 would win: no pending, its 3 in flight within the slack)
        assert gw._choose(adapter, set()).worker_id == "w1"
        assert count("loading") == 2 and count("least_loaded") == 2
    finally:
        gw.close()


def test_loads_the_gateway_started_take_their_bytes_from_the_workers_room(
    redis_url: str,
) -> None:
    mb = 1 << 20
    registry = Registry(connect(redis_url))
    registry.heartbeat(
        WorkerRecord("w0", "127.0.0.1:1", resident=["r"], room_bytes=15 * mb), ttl_seconds=30
    )
    registry.heartbeat(
        WorkerRecord("w1", "127.0.0.1:1", running=3, room_bytes=100 * mb), ttl_seconds=30
    )
    config = GatewayConfig(
        port=0, metrics_port=0, http_port=0, redis_url=redis_url, worker_cache_s=0.0
    )
    gw = GatewayCore(config, registry, GatewayMetrics())
    try:
        a = AdapterRecord("a", "/src", version=1, rank=8, size_bytes=10 * mb)
        b = AdapterRecord("b", "/src", version=1, rank=8, size_bytes=10 * mb)
        r = AdapterRecord("r", "/src", version=1, rank=8, size_bytes=10 * mb)
        assert gw._choose(a, set()).worker_id == "w0"  # least loaded (w1 runs 3), has room
        gw.routing.first_token("w0")
        assert gw._choose(r, set()).worker_id == "w0"  # resident there: no load, no bytes
        gw.routing.first_token("w0")
        w0 = next(w for w in registry.list_workers() if w.worker_id == "w0")
        assert gw.routing.since_heartbeat(worker_view(w0), w0.heartbeat_unix) == ({"a"}, 5 * mb)
        # "b" would fit in w0's 15 MB as heartbeated, but not in the 5 MB left after "a":
        # the cold start goes to w1 although w0 is less loaded (2 in flight against 3)
        assert gw._choose(b, set()).worker_id == "w1"
    finally:
        gw.close()


def test_equally_loaded_workers_take_turns(redis_url: str) -> None:
    """Ties in rank-aware routing rotate over the workers: requests that each finish before
    the next arrives (every worker idle each time) are spread evenly, not all sent to the
    first worker by id."""
    registry = Registry(connect(redis_url))
    for wid in ("w0", "w1", "w2"):
        registry.heartbeat(WorkerRecord(wid, "127.0.0.1:1"), ttl_seconds=30)
    config = GatewayConfig(
        port=0, metrics_port=0, http_port=0, redis_url=redis_url, worker_cache_s=0.0
    )
    gw = GatewayCore(config, registry, GatewayMetrics())
    try:
        chosen = []
        for _ in range(6):
            w = gw._choose(None, set()).worker_id
            gw.routing.done(w, pending=True)
            chosen.append(w)
        assert chosen == ["w0", "w1", "w2"] * 2
    finally:
        gw.close()


class _TokenStreamer(worker_pb2_grpc.WorkerServicer):
    """A worker's gRPC server that streams one token every ``step_s`` seconds, for as long as
    the request asks: what is tested here is the gateway's end of a stream, which needs no
    model (the real worker's streaming is tested in tests/integration/test_cluster.py)."""

    def __init__(self, step_s: float, worker_id: str = "w0") -> None:
        self.step_s = step_s
        self.worker_id = worker_id  # named in the last message of each stream
        #: seconds a request waits before it is refused UNAVAILABLE (a failing worker); None:
        #: served
        self.fail_after_s: float | None = None
        self.time_remaining: list[float] = []  # of each Generate call, as it starts
        #: adapter id -> oldest version served; older ones are refused as a real worker
        #: refuses a superseded version (NOT_FOUND)
        self.refuse_below: dict[str, int] = {}
        self.unloads: list[worker_pb2.UnloadAdapterRequest] = []

    def UnloadAdapter(self, request, context):  # noqa: N802, ANN001, ANN201
        self.unloads.append(request)
        return worker_pb2.UnloadAdapterResponse()

    def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        self.time_remaining.append(context.time_remaining())
        if self.fail_after_s is not None:
            time.sleep(self.fail_after_s)
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker failing")
        adapter = request.adapter
        if adapter.version < self.refuse_below.get(adapter.adapter_id, 0):
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"adapter {adapter.adapter_id!r} version {adapter.version} was superseded",
            )
        n = request.request.max_new_tokens
        for i in range(n):
            if not context.is_active():
                return
            time.sleep(self.step_s)
            last = i == n - 1
            yield gateway_pb2.GenerateResponse(
                text="x",
                token_ids=[i],
                finish_reason=gateway_pb2.FINISH_REASON_LENGTH if last else 0,
                worker_id=self.worker_id,
            )


def _start_token_streamer(
    redis_url: str,
    step_s: float,
    servicer: _TokenStreamer | None = None,
    worker_id: str = "w0",
) -> tuple[grpc.Server, int]:
    """Start a :class:`_TokenStreamer` server (one token per ``step_s``; ``servicer`` when
    given) and register it in Redis as ``worker_id``, publishing the tiny :data:`SPEC` as the
    served model; returns the server and its port."""
    worker = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer or _TokenStreamer(step_s), worker)
    port = worker.add_insecure_port("127.0.0.1:0")
    worker.start()
    Registry(connect(redis_url)).heartbeat(
        WorkerRecord(worker_id, f"127.0.0.1:{port}"), ttl_seconds=60, model=(SPEC, "float32")
    )
    return worker, port


def test_stopping_gateway_ends_a_long_stream_with_unavailable_saying_why(redis_url: str) -> None:
    """A stream still running when the gateway stops (a client mid-generation when ``plora
    up`` stops) ends a second before the grace period runs out, with UNAVAILABLE naming the
    shutdown rather than gRPC's bare "Cancelling all calls"."""
    worker, _ = _start_token_streamer(redis_url, 0.05)
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)
    stopped_by_test = False
    try:
        # a short stream finishes as before
        short = list(stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=3)))
        assert short[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        call = stub.Generate(
            gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=500), timeout=60
        )
        first = next(call)
        assert first.token_ids
        stopped = threading.Thread(target=service.stop, args=(2.0,))
        started = time.monotonic()
        stopped.start()
        stopped_by_test = True
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "the gateway is shutting down and ended this stream after its 2 s grace" in (
            err.value.details()
        )
        assert 0.8 < time.monotonic() - started < 2.0
        stopped.join(10)
        assert not stopped.is_alive()
    finally:
        channel.close()
        if not stopped_by_test:
            service.stop(0)
        worker.stop(0)


@contextlib.contextmanager
def _gateway_before_a_streaming_worker(
    redis_url: str, **config: object
) -> Iterator[tuple[GatewayService, int, Callable[[str], list[gateway_pb2.GenerateResponse]]]]:
    """A gateway (registry caches off unless ``config`` says otherwise) in front of a
    :class:`_TokenStreamer` registered as worker ``w0``, with adapters ``a`` and ``b``
    registered. Yields ``(service, the worker's port, generate(adapter_id))``, which streams
    a two-token request through the gateway."""
    worker, port = _start_token_streamer(redis_url, 0.0)
    registry = Registry(connect(redis_url))
    for adapter_id in ("a", "b"):
        registry.put_adapter(AdapterRecord(adapter_id, "/src", version=1, rank=8))
    settings: dict[str, Any] = {"worker_cache_s": 0.0, "adapter_cache_s": 0.0, **config}
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url, **settings)
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def generate(adapter_id: str) -> list[gateway_pb2.GenerateResponse]:
        request = gateway_pb2.GenerateRequest(prompt="hi", adapter_id=adapter_id, max_new_tokens=2)
        return list(stub.Generate(request, timeout=30))

    try:
        yield service, port, generate
    finally:
        channel.close()
        service.stop(0)
        worker.stop(0)


def _until_served(generate: Callable[[], object], what: str) -> None:
    """Call ``generate`` until it is served (the gateway's background check finds Redis back
    within a second); fails after 15 s."""
    deadline = time.monotonic() + 15
    while True:
        try:
            generate()
            return
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            assert time.monotonic() < deadline, f"the gateway never found Redis back ({what})"
            time.sleep(0.2)


def test_generate_goes_on_through_a_redis_outage_for_records_read_before_it(
    own_redis: OwnRedis,
) -> None:
    """With Redis killed, Generate for an adapter (and the base model) the gateway read
    shortly before is still routed and streamed, from the records it cached, and counted;
    an adapter it never read, the admin calls, and anything once ``registry_stale_s`` has
    passed answer UNAVAILABLE naming the registry. Once Redis is back, it is read again."""
    stale_s = 3.0
    with _gateway_before_a_streaming_worker(own_redis.url, registry_stale_s=stale_s) as (
        service,
        port,
        generate,
    ):
        stale = service.core.metrics.stale_reads
        admin = grpc.insecure_channel(f"127.0.0.1:{service.port}")
        stub = gateway_pb2_grpc.GatewayStub(admin)
        assert len(generate("a")) == 2 and len(generate("")) == 2
        killed = time.monotonic()
        own_redis.kill()
        for _ in range(3):
            assert generate("a")[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
            assert len(generate("")) == 2
        assert stale.labels("adapter")._value.get() == 3
        assert stale.labels("workers")._value.get() == 6
        assert stale.labels("placement")._value.get() == 3
        with pytest.raises(grpc.RpcError) as err:
            generate("b")  # registered, but not read before the outage
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the adapter registry (Redis at" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.GetAdapter(gateway_pb2.GetAdapterRequest(adapter_id="a"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        admin.close()
        time.sleep(max(0.0, stale_s - (time.monotonic() - killed)) + 0.2)
        with pytest.raises(grpc.RpcError) as err:
            generate("a")  # older than registry_stale_s now
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        own_redis.start()  # empty: the worker's next heartbeat and a new record are read
        registry = Registry(connect(own_redis.url))
        registry.heartbeat(WorkerRecord("w0", f"127.0.0.1:{port}"), ttl_seconds=30)
        registry.put_adapter(AdapterRecord("b", "/src", version=1, rank=8))
        _until_served(lambda: generate("b"), "after a restart")
        with pytest.raises(grpc.RpcError) as err:
            generate("a")  # gone from the new Redis: not served from the old cache
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # and its old record is forgotten: a later outage cannot serve a deleted adapter
        assert "a" not in service.core.catalog._adapters._data


def test_a_hung_redis_costs_one_request_its_timeout_not_every_request(
    own_redis: OwnRedis,
) -> None:
    """A Redis that stops answering (SIGSTOP: no refusal, reads time out after 5 s): the first
    read to time out marks the registry unreachable, and later requests are served from the
    cache at once, or fail at once, instead of each waiting out the timeout, until a
    background check finds Redis answering again."""
    pid = own_redis.pid
    with _gateway_before_a_streaming_worker(own_redis.url) as (_, _, generate):
        try:
            assert len(generate("a")) == 2
            os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            assert len(generate("a")) == 2  # waits out one timeout, then the cached record
            assert time.monotonic() - started > 4.0
            started = time.monotonic()
            for _ in range(5):
                assert len(generate("a")) == 2
            with pytest.raises(grpc.RpcError) as err:
                generate("b")  # never read: fails at once
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 2.0
        finally:
            os.kill(pid, signal.SIGCONT)
        _until_served(lambda: generate("b"), "after SIGCONT")


def test_admin_calls_wait_out_a_hung_redis_once_then_fail_at_once(
    own_redis: OwnRedis, tmp_path
) -> None:
    """The admin calls read and write Redis directly (no cache). With a hung Redis the first
    call to time out (5 s socket timeout) marks the registry unreachable and the rest fail
    at once, naming it, until the gateway's background check finds Redis answering again."""
    pid = own_redis.pid
    with _gateway_before_a_streaming_worker(own_redis.url) as (service, _, _):
        channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
        stub = gateway_pb2_grpc.GatewayStub(channel)
        calls = {
            "RegisterAdapter": lambda: stub.RegisterAdapter(
                gateway_pb2.RegisterAdapterRequest(adapter_id="c", source=str(tmp_path)),
                timeout=10,
            ),
            "GetAdapter": lambda: stub.GetAdapter(
                gateway_pb2.GetAdapterRequest(adapter_id="a"), timeout=10
            ),
            "ListAdapters": lambda: stub.ListAdapters(
                gateway_pb2.ListAdaptersRequest(), timeout=10
            ),
            "DeleteAdapter": lambda: stub.DeleteAdapter(
                gateway_pb2.DeleteAdapterRequest(adapter_id="b"), timeout=10
            ),
            "GetClusterStatus": lambda: stub.GetClusterStatus(
                gateway_pb2.GetClusterStatusRequest(), timeout=10
            ),
        }
        try:
            assert len(calls["ListAdapters"]().adapters) == 2
            os.kill(pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    calls["GetAdapter"]()  # the first call waits out the timeout
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - started > 4.0
                for name, call in calls.items():
                    started = time.monotonic()
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
                    assert "the adapter registry (Redis at" in err.value.details(), name
                    assert time.monotonic() - started < 1.0, name
                with pytest.raises(grpc.RpcError) as err:  # input errors still come first
                    stub.GetAdapter(gateway_pb2.GetAdapterRequest(adapter_id="../x"), timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            finally:
                os.kill(pid, signal.SIGCONT)
            _until_served(calls["ListAdapters"], "after SIGCONT")
            assert {a.adapter_id for a in calls["ListAdapters"]().adapters} == {"a", "b"}
        finally:
            channel.close()


def test_a_request_refused_for_a_superseded_version_is_sent_again_with_the_new_one(
    redis_url: str,
) -> None:
    """A gateway's cached record can be older than the registry's (another gateway, or this
    one within ``adapter_cache_s``); a worker that has seen the newer version refuses the
    old one (NOT_FOUND). The gateway reads the record again and sends the request once more
    with the newer version (no NOT_FOUND right after a re-registration)."""
    streamer = _TokenStreamer(0.0)
    worker, _ = _start_token_streamer(redis_url, 0.0, streamer)
    registry = Registry(connect(redis_url))
    registry.put_adapter(AdapterRecord("a", "/src", version=1, rank=8))
    service = GatewayService(
        GatewayConfig(
            port=0, metrics_port=0, http_port=0, redis_url=redis_url, adapter_cache_s=60.0
        )
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(prompt="hi", adapter_id="a", max_new_tokens=2)
    try:
        assert len(list(stub.Generate(request, timeout=10))) == 2  # caches version 1
        registry.put_adapter(AdapterRecord("a", "/src", version=2, rank=8))  # elsewhere
        streamer.refuse_below["a"] = 2
        assert len(list(stub.Generate(request, timeout=10))) == 2
        assert service.core.metrics.retries._value.get() == 1
        # refused although the registry has nothing newer: the worker's NOT_FOUND, once
        streamer.refuse_below["a"] = 3
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "version 2 was superseded" in err.value.details()
        assert service.core.metrics.retries._value.get() == 1
    finally:
        channel.close()
        service.stop(0)
        worker.stop(0)


def test_registering_again_unloads_only_older_versions_and_a_lost_race_is_aborted(
    redis_url: str, tmp_path
) -> None:
    """Re-registration has the workers drop the versions older than the new one only (a late
    unload must not drop the new version while a request loads it). Of two registrations of
    one id racing, the one that reserved the later version stays, and the other answers
    ABORTED instead of overwriting it."""
    streamer = _TokenStreamer(0.0)
    worker, _ = _start_token_streamer(redis_url, 0.0, streamer)
    source = write_peft_adapter(tmp_path / "a", SPEC, rank=4, alpha=8.0, seed=1)
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.RegisterAdapterRequest(adapter_id="a", source=str(source))
    try:
        assert stub.RegisterAdapter(request, timeout=10).adapter.version == 1
        assert stub.RegisterAdapter(request, timeout=10).adapter.version == 2
        deadline = time.monotonic() + 10
        while len(streamer.unloads) < 2:  # version 1's before its write, version 2's after
            assert time.monotonic() < deadline, streamer.unloads
            time.sleep(0.05)
        assert [(u.adapter_id, u.below_version) for u in streamer.unloads] == [("a", 0), ("a", 2)]

        registry = service.core.registry
        put = registry.put_adapter

        def another_gateway_registers_first(record: AdapterRecord) -> bool:
            later = AdapterRecord("a", "/elsewhere", version=registry.next_adapter_version("a"))
            assert put(later)
            return put(record)

        registry.put_adapter = another_gateway_registers_first  # type: ignore[method-assign]
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterAdapter(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "with a later version than this call's 3" in err.value.details()
        got = stub.GetAdapter(gateway_pb2.GetAdapterRequest(adapter_id="a"), timeout=10).adapter
        assert (got.version, got.source) == (4, "/elsewhere")
    finally:
        channel.close()
        service.stop(0)
        worker.stop(0)


#: A :class:`_TokenStreamer` (one token per 10 ms, worker id w1) served with the services'
#: server options in a process of its own, so the test can freeze it; prints its port.
_STREAMER_PROCESS = """
from plora.v1 import worker_pb2_grpc
from services.common.grpc_util import create_server
from tests.integration.test_gateway_alone import _TokenStreamer

def register(server):
    worker_pb2_grpc.add_WorkerServicer_to_server(_TokenStreamer(0.01, "w1"), server)
    return ["plora.v1.Worker"]

server, port, _ = create_server(register)
server.start()
print(port, flush=True)
server.wait_for_termination()
"""


@pytest.mark.slow
def test_a_request_on_a_frozen_worker_is_retried_on_another_within_the_keepalive(
    redis_url: str,
) -> None:
    """A worker that stops answering (SIGSTOP; a paused VM) while it holds a request that
    has had no token yet: the gateway's channel to it misses a keepalive answer and fails
    the call UNAVAILABLE, and the request is retried on the other worker rather than hanging
    until the client's deadline."""
    frozen = subprocess.Popen(
        [sys.executable, "-c", _STREAMER_PROCESS], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    healthy, _ = _start_token_streamer(redis_url, 0.01)
    service = None
    try:
        assert frozen.stdout is not None
        frozen_port = int(frozen.stdout.readline())
        Registry(connect(redis_url)).heartbeat(
            WorkerRecord("w1", f"127.0.0.1:{frozen_port}"), ttl_seconds=120
        )
        service = GatewayService(
            GatewayConfig(
                port=0, metrics_port=0, http_port=0, redis_url=redis_url, worker_cache_s=0.0
            )
        ).start()
        channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def generate() -> str:
            request = gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=3)
            return list(stub.Generate(request, timeout=40))[-1].worker_id

        assert {generate() for _ in range(4)} == {"w0", "w1"}  # both channels connected
        os.kill(frozen.pid, signal.SIGSTOP)
        started = time.monotonic()
        with futures.ThreadPoolExecutor(2) as pool:
            served_by = list(pool.map(lambda _: generate(), range(2)))
        took = time.monotonic() - started
        assert served_by == ["w0", "w0"]
        assert took < 25.0, took  # a ping unanswered for 10 s, then w0
        assert service.core.metrics.retries._value.get() >= 1
        channel.close()
    finally:
        if service is not None:
            service.stop(0)
        healthy.stop(0)
        os.kill(frozen.pid, signal.SIGCONT)
        frozen.kill()
        frozen.wait()


def test_per_worker_gauges_follow_the_registry_while_no_request_arrives(redis_url: str) -> None:
    """The per-worker gauges follow the registry every second, requests or not (an idle
    gateway shows a frozen worker down and a drained queue empty), and the series of a worker
    gone from it are removed. A down worker's last resident list is shown as nothing resident
    (gauge and GetClusterStatus), since its pool is gone."""
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
    registry = Registry(connect(redis_url))
    metrics = service.core.metrics

    def until(what: str, check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 5
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    def series(gauge: Any) -> dict[str, float]:
        return {s.labels["worker"]: s.value for m in gauge.collect() for s in m.samples if s.labels}

    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def status_resident() -> list[str]:
        (w,) = stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=5).workers
        return list(w.resident_adapters)

    try:
        registry.heartbeat(WorkerRecord("w9", "127.0.0.1:1", queue_length=3), ttl_seconds=2)
        until("healthy", lambda: metrics.workers_healthy._value.get() == 1)
        until("queue 3", lambda: series(metrics.worker_queue) == {"w9": 3})
        record = WorkerRecord("w9", "127.0.0.1:1", queue_length=0, resident=["a", "b"])
        registry.heartbeat(record, ttl_seconds=2)
        until("queue 0", lambda: series(metrics.worker_queue) == {"w9": 0})
        assert series(metrics.resident) == {"w9": 2} and status_resident() == ["a", "b"]
        # no more heartbeats: down once its liveness key expires, its age growing meanwhile
        until("down", lambda: metrics.workers_healthy._value.get() == 0)
        assert series(metrics.heartbeat_age)["w9"] >= 1.5
        # a down worker's pool is gone: its last resident list is not shown as resident
        until("resident 0", lambda: series(metrics.resident) == {"w9": 0})
        assert status_resident() == []
        assert series(metrics.worker_down) == {"w9": 1}  # counted once, for dashboards
        registry.heartbeat(record, ttl_seconds=2)  # back
        until("healthy again", lambda: metrics.workers_healthy._value.get() == 1)
        until("down again", lambda: metrics.workers_healthy._value.get() == 0)
        assert series(metrics.worker_down) == {"w9": 2}
        registry.deregister_worker("w9")
        until("series removed", lambda: series(metrics.heartbeat_age) == {})
        assert series(metrics.worker_queue) == {} and series(metrics.resident) == {}
        assert series(metrics.worker_down) == {"w9": 2}  # a counter keeps its count
    finally:
        channel.close()
        service.stop(0)


def test_a_retried_request_gets_what_is_left_of_the_clients_deadline(redis_url: str) -> None:
    """Each worker call of a request gets what is left of the client's deadline as the call
    starts, so a retry never runs past it."""
    failing, serving = _TokenStreamer(0.0, "w0"), _TokenStreamer(0.0, "w1")
    failing.fail_after_s = 1.0
    servers = [
        _start_token_streamer(redis_url, 0.0, failing, "w0")[0],
        _start_token_streamer(redis_url, 0.0, serving, "w1")[0],
    ]
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)
    try:
        for _ in range(2):  # whichever worker is tried first
            request = gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=2)
            assert list(stub.Generate(request, timeout=5.0))[-1].worker_id == "w1"
        retried = [t for t in serving.time_remaining if t < 4.5]
        assert len(failing.time_remaining) >= 1 and len(retried) == len(failing.time_remaining)
        assert all(3.0 < t < 4.05 for t in retried), serving.time_remaining
        assert all(4.5 < t < 5.05 for t in failing.time_remaining), failing.time_remaining
    finally:
        channel.close()
        service.stop(0)
        for server in servers:
            server.stop(0)


def test_a_worker_whose_call_failed_is_left_out_until_it_heartbeats_again(
    redis_url: str,
) -> None:
    """After ``kill -9`` of a worker its liveness key outlives it by up to 5 s. A worker whose
    call failed is left out until a heartbeat newer than the one it had then speaks for it,
    so requests do not each pay a refused connection and a retry meanwhile."""
    serving, _ = _start_token_streamer(redis_url, 0.0)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there: connections are refused
    registry = Registry(connect(redis_url))
    registry.heartbeat(WorkerRecord("w1", f"127.0.0.1:{dead_port}"), ttl_seconds=60)
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url, worker_cache_s=0.0)
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)
    retries = service.core.metrics.retries._value
    request = gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=2)
    try:
        for _ in range(6):  # the first to reach w1 fails over; later ones leave it out
            assert len(list(stub.Generate(request, timeout=10))) == 2
        assert retries.get() == 1
        time.sleep(0.01)
        registry.heartbeat(WorkerRecord("w1", f"127.0.0.1:{dead_port}"), ttl_seconds=60)
        for _ in range(4):  # a new heartbeat speaks for it: tried again
            assert len(list(stub.Generate(request, timeout=10))) == 2
        assert retries.get() == 2
    finally:
        channel.close()
        service.stop(0)
        serving.stop(0)


def test_only_an_adapters_owner_replaces_or_deletes_it_and_shared_ones_are_the_operators(
    redis_url: str, tmp_path
) -> None:
    """An adapter registered without a tenant is shared: every tenant is served it, but only
    calls with the owner's exact tenant_id (none, for a shared adapter) replace or delete it,
    so no tenant can swap the weights everyone gets, take the id over or delete it; the
    owner's own calls and serving are unaffected."""
    worker, _ = _start_token_streamer(redis_url, 0.0)
    v1 = write_peft_adapter(tmp_path / "v1", SPEC, rank=4, alpha=8.0, seed=1)
    v2 = write_peft_adapter(tmp_path / "v2", SPEC, rank=4, alpha=8.0, seed=2)
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def register(adapter_id: str, source: Path, tenant_id: str = "") -> int:
        request = gateway_pb2.RegisterAdapterRequest(
            adapter_id=adapter_id, source=str(source), tenant_id=tenant_id
        )
        return stub.RegisterAdapter(request, timeout=10).adapter.version

    def delete(adapter_id: str, tenant_id: str = "") -> int:
        request = gateway_pb2.DeleteAdapterRequest(adapter_id=adapter_id, tenant_id=tenant_id)
        return stub.DeleteAdapter(request, timeout=10).version

    def refused(call: Callable[[], object], words: str) -> None:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        assert words in err.value.details(), err.value.details()

    def owner_and_source(adapter_id: str, tenant_id: str = "") -> tuple[str, str]:
        request = gateway_pb2.GetAdapterRequest(adapter_id=adapter_id, tenant_id=tenant_id)
        got = stub.GetAdapter(request, timeout=10).adapter
        return got.tenant_id, got.source

    try:
        assert register("shared", v1) == 1
        refused(lambda: register("shared", v2, "tenant-b"), "is shared (registered without")
        refused(lambda: delete("shared", "tenant-a"), "only the operator")
        # still shared, still v1, served to every tenant
        assert owner_and_source("shared", "tenant-a") == ("", str(v1))
        assert owner_and_source("shared", "tenant-b") == ("", str(v1))
        assert register("shared", v2) == 2  # the operator replaces it
        assert delete("shared") == 2

        assert register("mine", v1, "tenant-a") == 1
        refused(lambda: register("mine", v2), "is owned by another tenant")
        refused(lambda: register("mine", v2, "tenant-b"), "choose another id")
        refused(lambda: delete("mine"), "only a call with its owner's tenant_id deletes")
        assert register("mine", v2, "tenant-a") == 2
        assert owner_and_source("mine", "tenant-a") == ("tenant-a", str(v2))
        assert delete("mine", "tenant-a") == 2
    finally:
        channel.close()
        service.stop(0)
        worker.stop(0)


def test_a_failed_request_is_logged_with_the_id_the_workers_saw(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway logs every Generate that did not end OK with the id the workers see
    (``<caller's id>~<8 hex>``), the adapter and tenant, the status and its message, at INFO
    (the causes are logged once as warnings where they happen: a warning per request would
    flood the terminal during an outage). A request that ends OK adds no line."""
    caplog.set_level(logging.INFO, logger="services.gateway.core")
    streamer = _TokenStreamer(0.0)
    worker, _ = _start_token_streamer(redis_url, 0.0, streamer)
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)

    def generate(request_id: str, **fields: Any) -> grpc.StatusCode:
        request = gateway_pb2.GenerateRequest(
            request_id=request_id, prompt="hi", max_new_tokens=2, **fields
        )
        try:
            list(stub.Generate(request, timeout=10))
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def lines(request_id: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith(f"request {request_id}~")]

    try:
        assert generate("fine") == grpc.StatusCode.OK and not lines("fine")
        assert generate("unknown", adapter_id="nope", tenant_id="t1") == grpc.StatusCode.NOT_FOUND
        (record,) = lines("unknown")
        assert record.levelno == logging.INFO
        assert re.fullmatch(
            r"request unknown~[0-9a-f]{8} \(adapter nope, tenant t1\) ended NOT_FOUND after "
            r"\d+\.\d{3} s: .*nope.*",
            record.getMessage(),
        ), record.getMessage()
        streamer.fail_after_s = 0.0
        assert generate("lost") == grpc.StatusCode.UNAVAILABLE
        (record,) = lines("lost")
        assert record.levelno == logging.INFO
        assert "(adapter -, tenant -) ended UNAVAILABLE after" in record.getMessage()
    finally:
        channel.close()
        service.stop(0)
        worker.stop(0)
