"""Worker identity with real worker processes and a real Redis: one live process per id."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.registry import Registry, connect
from tests.conftest import REPO, OwnRedis

pytestmark = pytest.mark.slow


class Worker:
    """``plora serve worker`` as a process of its own: the real model, a 64 MiB pool, one
    thread, no host staging, free ports, JSON log lines in ``<name>.log``."""

    def __init__(self, root: Path, name: str, redis_url: str, model_dir: Path, *flags: str):
        self.log = root / f"{name}.log"
        self.ready = root / f"{name}.ready.json"
        self.started = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "plora.cli", "serve", "worker", "--port", "0"]
                + ["--metrics-port", "0", "--ready-file", str(self.ready), "--log-json"]
                + ["--redis-url", redis_url, "--model", str(model_dir), "--threads", "1"]
                + ["--pool-bytes", "64MiB", "--host-staging", "off", *flags],
                cwd=REPO,
                env=dict(os.environ, PYTHONPATH=str(REPO)),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 180) -> dict:
        """The ready file's ports once it serves; fails with the log if it exits first."""
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"the worker did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        return json.loads(self.ready.read_text())

    def lines(self) -> list[dict]:
        """Its JSON log lines."""
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def seconds_between(self, first: str, then: str) -> float:
        """Seconds from its log line starting ``first`` to the one containing ``then``."""
        lines = self.lines()
        start = next(x["ts"] for x in lines if x["message"].startswith(first))
        end = next(x["ts"] for x in lines if then in x["message"])
        return float(end - start)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture()
def redis_server_own() -> OwnRedis:
    server = OwnRedis()
    yield server  # type: ignore[misc]
    server.stop()


def test_a_live_workers_id_is_refused_then_taken_back_after_a_kill_and_freed_by_a_clean_stop(
    redis_server_own: OwnRedis, model_dir: Path, tmp_path: Path
) -> None:
    """A second process claiming a live worker's id exits non-zero within 5 s of its claim
    (before loading the model or serving), its log naming the holder's pid, host and
    address. The holder killed with SIGKILL, a new process with the id takes it back at once
    (same host, the old pid gone: no wait for the lease's 5 s). A clean stop frees the id
    at once."""
    url = redis_server_own.url
    registry = Registry(connect(url))
    workers: list[Worker] = []
    try:
        holder = Worker(tmp_path, "holder", url, model_dir, "--worker-id", "w-1")
        workers.append(holder)
        port = holder.wait_ready()["grpc_port"]

        second = Worker(tmp_path, "second", url, model_dir, "--worker-id", "w-1")
        workers.append(second)
        assert second.proc.wait(timeout=60) == 2
        wall = time.monotonic() - second.started
        refusal = second.seconds_between("claiming worker id w-1", "is in use by a live worker")
        assert refusal < 5.0, f"refused {refusal:.2f} s after its claim began"
        log = second.log.read_text()
        assert f"worker id 'w-1' is in use by a live worker: pid {holder.pid} on host" in log
        assert f"serving at 127.0.0.1:{port}" in log
        assert not second.ready.exists() and "resolving base model" not in log
        (record,) = registry.list_workers()
        assert (record.worker_id, record.address, record.healthy) == (
            "w-1",
            f"127.0.0.1:{port}",
            True,
        )
        print(f"refused {refusal:.2f} s after its claim began, {wall:.2f} s after its start")

        holder.proc.send_signal(signal.SIGKILL)
        holder.proc.wait()
        again = Worker(tmp_path, "again", url, model_dir, "--worker-id", "w-1")
        workers.append(again)
        port = again.wait_ready()["grpc_port"]
        took = again.seconds_between("claiming worker id w-1", "took it over from pid")
        assert took < 1.0, f"took its id back {took:.2f} s after its claim began"
        assert f"took it over from pid {holder.pid} on this host" in again.log.read_text()
        lease = registry.get_worker_lease("w-1")
        assert lease is not None and lease.holder.pid == again.pid
        assert lease.address == f"127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while not any(w.address.endswith(f":{port}") for w in registry.list_workers()):
            assert time.monotonic() < deadline, "the restarted worker never heartbeated"
            time.sleep(0.1)
        print(f"took its id back {took:.2f} s after its claim began")

        again.proc.terminate()
        assert again.proc.wait(timeout=30) == 0
        assert registry.get_worker_lease("w-1") is None
        assert registry.list_workers() == []
    finally:
        for w in workers:
            w.stop()


def test_workers_started_without_an_id_get_distinct_ones(
    redis_server_own: OwnRedis, model_dir: Path, tmp_path: Path
) -> None:
    """Three workers on one host, none given an id: three ids, ``<host>-<6 hex>``, each
    holding its own lease."""
    url = redis_server_own.url
    registry = Registry(connect(url))
    env_id = os.environ.pop("PLORA_WORKER_ID", None)
    workers = [Worker(tmp_path, f"w{i}", url, model_dir) for i in range(3)]
    try:
        ports = {w.wait_ready()["grpc_port"] for w in workers}
        deadline = time.monotonic() + 15
        while len([w for w in registry.list_workers() if w.healthy]) < 3:
            assert time.monotonic() < deadline, "not every worker heartbeated"
            time.sleep(0.1)
        records = registry.list_workers()
        ids = {r.worker_id for r in records}
        assert len(ids) == 3 and {int(r.address.rsplit(":", 1)[1]) for r in records} == ports
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+-[0-9a-f]{6}", i) for i in ids), ids
        holders = {registry.get_worker_lease(i).holder.pid for i in ids}  # type: ignore[union-attr]
        assert holders == {w.pid for w in workers}
    finally:
        for w in workers:
            w.stop()
        if env_id is not None:
            os.environ["PLORA_WORKER_ID"] = env_id


def test_a_frozen_worker_loses_its_id_to_a_newcomer_and_exits_when_it_wakes(
    redis_server_own: OwnRedis, model_dir: Path, tmp_path: Path
) -> None:
    """SIGSTOP past the lease's TTL (5 s): a newcomer claims the id once the lease expires;
    the old worker, continued, finds its lease taken and exits with status 69 without
    removing the newcomer's registry record."""
    url = redis_server_own.url
    registry = Registry(connect(url))
    old = Worker(tmp_path, "old", url, model_dir, "--worker-id", "w-2")
    workers = [old]
    try:
        old.wait_ready()
        old.proc.send_signal(signal.SIGSTOP)
        new = Worker(tmp_path, "new", url, model_dir, "--worker-id", "w-2")
        workers.append(new)
        port = new.wait_ready()["grpc_port"]
        waited = new.seconds_between("claiming worker id w-2", "resolving base model")
        assert waited < 6.0, f"claimed {waited:.2f} s after its claim began"  # TTL 5 s
        old.proc.send_signal(signal.SIGCONT)
        assert old.proc.wait(timeout=30) == 69
        assert "was taken over by pid" in old.log.read_text()
        time.sleep(1.5)  # the newcomer's next heartbeat
        (record,) = registry.list_workers()
        assert (record.address, record.healthy) == (f"127.0.0.1:{port}", True)
        assert registry.get_worker_lease("w-2").holder.pid == new.pid  # type: ignore[union-attr]
        print(f"the newcomer claimed the frozen worker's id {waited:.2f} s after its claim began")
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
            w.stop()
