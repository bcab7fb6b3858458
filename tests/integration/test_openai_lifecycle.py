"""The gateway's HTTP door starting and stopping, with real Redis: a taken port fails at once
with a message naming it, and a stop during an SSE stream ends the stream with an ``error``
event within the grace period (the whole cluster's SIGTERM case is in
tests/integration/test_openai_flood.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx2
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.openai_http import HttpServer
from services.gateway.server import GatewayService
from tests.conftest import REPO
from tests.integration.test_gateway_alone import SPEC, _start_token_streamer


async def _no_app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("never called: the server is not started")


def test_a_second_http_server_on_a_taken_port_fails_naming_it(redis_url: str) -> None:
    """The port is held from construction: a second server fails to bind while the first is
    not started yet (with SO_REUSEADDR Linux lets two sockets bind one port until one of them
    listens), and a second gateway on a serving one's port fails naming it and the flag; the
    first goes on serving."""
    first = HttpServer(_no_app, "127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=f"could not bind HTTP port 127.0.0.1:{first.port}: "):
            HttpServer(_no_app, "127.0.0.1", first.port)
    finally:
        first.stop(0)

    config = GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    serving = GatewayService(config).start()
    try:
        taken = GatewayConfig(
            port=0, metrics_port=0, http_port=serving.http_port, redis_url=redis_url
        )
        with pytest.raises(OSError) as err:
            GatewayService(taken)
        message = str(err.value)
        assert f"could not bind HTTP port 127.0.0.1:{serving.http_port}" in message
        assert "--http-port / PLORA_GATEWAY_HTTP_PORT" in message
        answer = httpx2.get(f"http://127.0.0.1:{serving.http_port}/health", timeout=10)
        assert answer.status_code == 503  # the first gateway's answer: no worker yet
        assert answer.json() == {"status": "unavailable"}
    finally:
        serving.stop(0)


def test_plora_serve_gateway_on_a_taken_http_port_exits_2_with_one_line(redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "plora.cli", "serve", "gateway", "--redis-url", redis_url]
            + ["--port", "0", "--metrics-port", "0", "--http-port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"could not bind HTTP port 127.0.0.1:{port}: Address already in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_stopping_the_gateway_ends_an_sse_stream_with_an_error_event(redis_url: str) -> None:
    """A stream still running when the gateway stops gets, a second before the grace period
    ends, an ``error`` event naming the shutdown (type ``service_unavailable``, as the 503 a
    refused request gets) and then ``data: [DONE]``; the stop returns soon after, with the
    stream's place given back."""
    worker, _ = _start_token_streamer(redis_url, 0.05)
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
    stopper: threading.Thread | None = None
    try:
        body = {"model": SPEC.name, "prompt": "hi", "max_tokens": 400, "stream": True}
        url = f"http://127.0.0.1:{service.http_port}/v1/completions"
        with httpx2.stream("POST", url, json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "x"
            assert service.core.admission.in_flight == 1
            stopper = threading.Thread(target=service.stop, args=(2.0,))
            began = time.monotonic()
            stopper.start()
            rest = [line for line in lines if line]
            ended = time.monotonic() - began
        assert rest[-1] == "data: [DONE]", rest[-3:]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable"
        assert error["message"].startswith(
            "the gateway is shutting down and ended this stream after its 2 s grace period"
        )
        assert all('"text":"x"' in line for line in rest[:-2])
        assert 0.8 < ended < 2.0, ended
        stopper.join(5.0)
        assert not stopper.is_alive(), "stop did not return"
        assert service.core.admission.in_flight == 0
    finally:
        if stopper is None:
            service.stop(0)
        worker.stop(0)
