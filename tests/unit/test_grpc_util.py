"""Server and channel options of every service (services/common/grpc_util.py), on real
gRPC servers on loopback."""

from __future__ import annotations

import gc
import socket
import threading
import time

import grpc
import pytest

from services.common.grpc_util import (
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    channel_options,
    create_server,
    server_options,
    set_serving,
    started_thread_pool,
)


def _pool_threads() -> set[threading.Thread]:
    """The gRPC server pool threads alive now (other tests' servers' included: compare sets)."""
    return {t for t in threading.enumerate() if t.name.startswith("grpc-server")}


def test_a_server_pool_has_all_its_threads_running_before_the_first_call() -> None:
    """A burst of calls must not wait for thread start-ups in the server's polling thread:
    every thread runs before the first call, and a burst as large as the pool runs at once
    on those threads without starting more."""
    before = _pool_threads()
    pool = started_thread_pool(6)
    try:
        started = _pool_threads() - before
        assert len(started) == 6
        all_in = threading.Barrier(6, timeout=10)  # broken unless the 6 tasks run at once
        tasks = [pool.submit(all_in.wait) for _ in range(6)]
        for task in tasks:
            task.result(timeout=10)
        assert _pool_threads() - before == started
    finally:
        pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in started)


def test_a_stopped_server_leaves_no_pool_thread_behind() -> None:
    """Its threads run from start-up, so a process that starts and stops servers (a test
    session, a service restarted in place) must get them back once a server is gone."""
    before = _pool_threads()
    server, _, _ = create_server(lambda s: [], port=0, max_workers=5)
    server.start()
    started = _pool_threads() - before
    assert len(started) == 5
    server.stop(None).wait(10)
    del server
    gc.collect()
    deadline = time.monotonic() + 10
    while alive := [t.name for t in started if t.is_alive()]:
        assert time.monotonic() < deadline, alive
        time.sleep(0.05)


def test_a_second_server_on_a_taken_port_fails_to_bind() -> None:
    """gRPC's default SO_REUSEPORT let a second ``plora up`` listen on the first one's 50051
    and take half its requests; the second bind must fail instead."""
    server, port, _ = create_server(lambda s: [], port=0)
    server.start()
    try:
        with pytest.raises(OSError, match="could not bind"):
            create_server(lambda s: [], port=port)
    finally:
        server.stop(None)


def test_servers_accept_the_channels_idle_keepalive_pings() -> None:
    """The channels ping idle connections every ``keepalive_time_ms``; a server must allow
    pings without calls that often. By default it allows one every 5 minutes and answers a
    later early one with GOAWAY too_many_pings, after which the next call fails UNAVAILABLE
    "Too many pings": the gateway's idle worker channels went that way ~2 minutes after the
    last request, and the next request failed on every worker at once. (Reproduced on
    loopback with these channel options: a default server failed the call made after 150 s
    idle; one with :func:`server_options` served it. That run takes minutes, and at shorter
    intervals the client's own ping throttling hides the fault, so only the options are
    checked here.)"""
    for keepalive_ms in (KEEPALIVE_TIME_MS, 10_000):
        client = dict(channel_options(keepalive_ms))
        server = dict(server_options(keepalive_ms))
        assert client["grpc.keepalive_time_ms"] == keepalive_ms
        assert client["grpc.keepalive_permit_without_calls"] == 1
        # an unanswered ping fails the connection after 10 s, whichever ping it is (see
        # tests/integration/test_gateway_alone.py: a frozen worker)
        assert client["grpc.keepalive_timeout_ms"] == KEEPALIVE_TIMEOUT_MS
        assert client["grpc.http2.ping_timeout_ms"] == KEEPALIVE_TIMEOUT_MS
        assert client["grpc.max_reconnect_backoff_ms"] <= 2_000
        assert server["grpc.keepalive_permit_without_calls"] == 1
        assert 0 < server["grpc.http2.min_ping_interval_without_data_ms"] < keepalive_ms


@pytest.mark.slow
def test_a_channel_reconnects_within_seconds_to_a_peer_that_was_down_a_while() -> None:
    """A worker left stopped for a minute (a crash-loop pause) served again, but the gateway's
    channel to it was deep in gRPC's exponential reconnect backoff (up to 120 s) and its
    calls were refused for seconds more. With the channels' options a peer that
    comes back after 20 s down is reached within about 2 s."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there for now
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    stub = health_pb2_grpc.HealthStub(channel)

    def check() -> bool:
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            return True
        except grpc.RpcError:
            return False

    server = None
    try:
        down_until = time.monotonic() + 20
        while time.monotonic() < down_until:  # calls refused: the backoff grows
            assert not check()
            time.sleep(0.1)
        server, _, health = create_server(lambda s: [], port=port)
        server.start()
        set_serving(health, [], True)
        started = time.monotonic()
        while not check():
            assert time.monotonic() - started < 3.5, "no reconnect within 3.5 s"
            time.sleep(0.05)
    finally:
        channel.close()
        if server is not None:
            server.stop(None)
