"""Overload: 500 Generate streams at once against a gateway limited to 64, each service a
process of its own (Redis, one worker with the real model, the gateway)."""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plora.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import REPO, OwnRedis

pytestmark = pytest.mark.slow

LIMIT = 64
FLOOD = 500
#: Tokens per stream: the admitted streams last seconds (two rounds of the worker's batch of
#: 32 on one CPU thread), far longer than a refusal may take.
MAX_NEW_TOKENS = 8

#: p99 of the refusals' latency, seconds, from each call's start in the client to its status.
#: A refusal is a few Python calls before the request is even read, but one client starting
#: 500 calls at once and one gateway answering them share the core the worker's first step
#: leaves them on a 2-core machine: 72-119 ms (p99, median 99 ms) there over 8 runs
#: (docs/security.md, "Measured"). The bound is 1 s, well under the admitted streams' length
#: (what a refusal that waited for a place would take; asserted separately below).
REFUSAL_P99_S = 1.0


def _serve(service: str, flags: list[str], root: Path) -> tuple[subprocess.Popen, dict]:
    """``plora serve <service>`` on free ports; returns the process and its ready file."""
    ready = root / f"{service}.ready.json"
    log = open(root / f"{service}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "plora.cli", "serve", service, "--port", "0", "--metrics-port"]
        + ["0", "--ready-file", str(ready), *flags],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 180
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(
                f"{service} did not start:\n{(root / f'{service}.log').read_text()[-3000:]}"
            )
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())


@pytest.fixture()
def small_cluster(tmp_path: Path, model_dir: Path) -> Iterator[dict]:
    """Redis, one worker (one thread, batch 32) and a gateway with
    ``--max-concurrent-requests 64``, as separate processes."""
    redis = OwnRedis()
    procs: list[subprocess.Popen] = []
    try:
        common = ["--redis-url", redis.url]
        worker, worker_ports = _serve(
            "worker",
            [*common, "--model", str(model_dir), "--threads", "1", "--host-staging", "off"]
            + ["--pool-bytes", "64MiB", "--worker-id", "flood-worker"],
            tmp_path,
        )
        procs.append(worker)
        gateway, gateway_ports = _serve(
            "gateway",
            [*common, "--http-port", "0", "--max-concurrent-requests", str(LIMIT)],
            tmp_path,
        )
        procs.append(gateway)
        yield {
            "gateway_log": tmp_path / "gateway.log",
            "gateway": f"127.0.0.1:{gateway_ports['grpc_port']}",
            "gateway_metrics": f"127.0.0.1:{gateway_ports['metrics_port']}",
            "gateway_pid": gateway.pid,
            "worker": f"127.0.0.1:{worker_ports['grpc_port']}",
        }
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.stop()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _metric(address: str, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{labels} not exported")


def _flood(address: str, n: int, max_new_tokens: int) -> list[tuple[str, float, int]]:
    """``n`` Generate calls started back to back on one channel; each call's (status, seconds
    from its start to its end, tokens). Calls are started without a thread each and timed by
    their done callbacks, so the client's own work adds little to what is measured."""
    request = gateway_pb2.GenerateRequest(prompt="Say hello.", max_new_tokens=max_new_tokens)
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        began = [0.0] * n
        ended = [0.0] * n
        done = threading.Semaphore(0)
        calls = []
        for i in range(n):

            def finished(_: object, i: int = i) -> None:
                ended[i] = time.perf_counter()
                done.release()

            began[i] = time.perf_counter()
            call = stub.Generate(request, timeout=120)
            call.add_done_callback(finished)
            calls.append(call)
        outcomes: list[tuple[str, int]] = [("", 0)] * n

        def read(indices: range) -> None:
            for i in indices:
                tokens, last = 0, None
                try:
                    for chunk in calls[i]:
                        tokens += len(chunk.token_ids)
                        last = chunk
                    code = "OK" if last is not None and last.finish_reason else "UNFINISHED"
                except grpc.RpcError as exc:
                    code = exc.code().name
                outcomes[i] = (code, tokens)

        readers = [threading.Thread(target=read, args=(range(k, n, 8),)) for k in range(8)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        for _ in range(n):
            assert done.acquire(timeout=60)
        return [(code, ended[i] - began[i], tokens) for i, (code, tokens) in enumerate(outcomes)]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The test process's garbage collector off while it measures, as ``timeit`` does: a
    full collection of this process's heap (the whole test session's modules) stopped every
    client thread for 134 ms in one measured flood, and would be timed as the refusals in
    flight."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class Poller(threading.Thread):
    """Health Check and GetClusterStatus, one after the other, until stopped; the slowest
    answer of each and any failure."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.stop = threading.Event()
        self.slowest = {"health": 0.0, "status": 0.0}
        self.calls = 0
        self.failures: list[str] = []

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            gateway = gateway_pb2_grpc.GatewayStub(channel)
            calls = {
                "health": lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5),
                "status": lambda: gateway.GetClusterStatus(
                    gateway_pb2.GetClusterStatusRequest(), timeout=5
                ),
            }
            while not self.stop.is_set():
                for name, call in calls.items():
                    began = time.perf_counter()
                    try:
                        call()
                    except grpc.RpcError as exc:
                        self.failures.append(f"{name}: {exc.code().name} {exc.details()}")
                    self.slowest[name] = max(self.slowest[name], time.perf_counter() - began)
                self.calls += 1
                self.stop.wait(0.05)


def test_500_streams_against_a_limit_of_64(small_cluster: dict) -> None:
    """The excess is refused with RESOURCE_EXHAUSTED at once (p99 under
    :data:`REFUSAL_P99_S`, and every refusal before the first admitted stream ends), every admitted
    stream completes, health and GetClusterStatus answer within 1 s throughout, no sequence
    is left on the worker, and the gateway's memory returns to within 10 % of before."""
    gateway = small_cluster["gateway"]
    # its start-up heap is out of the collector's full scans, which would otherwise stop the
    # gateway ~85 ms at a time (services.common.lifecycle.freeze_startup_heap)
    assert (
        "start-up objects out of the garbage collector" in small_cluster["gateway_log"].read_text()
    )
    # one stream first: the model's first step and the gateway's lazy imports are not the flood's
    warm = _flood(gateway, 1, MAX_NEW_TOKENS)
    assert warm[0][0] == "OK", warm
    rss_before = _rss_kib(small_cluster["gateway_pid"])

    poller = Poller(gateway)
    poller.start()
    try:
        with _collector_paused():
            results = _flood(gateway, FLOOD, MAX_NEW_TOKENS)
    finally:
        poller.stop.set()
        poller.join(timeout=30)

    by_code: dict[str, list[tuple[str, float, int]]] = {}
    for r in results:
        by_code.setdefault(r[0], []).append(r)
    summary = {code: len(rs) for code, rs in by_code.items()}
    assert set(by_code) == {"OK", "RESOURCE_EXHAUSTED"}, summary
    admitted, refused = by_code["OK"], by_code["RESOURCE_EXHAUSTED"]
    assert len(admitted) >= LIMIT, summary  # every place was used, and freed ones reused
    assert all(tokens > 0 for _, _, tokens in admitted)
    latencies = sorted(seconds for _, seconds, _ in refused)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    shortest_admitted = min(seconds for _, seconds, _ in admitted)
    timing = (
        f"refusals p50 {latencies[len(latencies) // 2] * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
        f"max {latencies[-1] * 1000:.0f} ms; shortest admitted stream "
        f"{shortest_admitted * 1000:.0f} ms; {summary}"
    )
    print(timing)
    assert p99 < REFUSAL_P99_S, timing
    assert latencies[-1] < shortest_admitted, timing  # none waited for a place

    assert poller.calls >= 3 and not poller.failures, poller.failures[:5]
    print(
        f"slowest health check {poller.slowest['health'] * 1000:.0f} ms, GetClusterStatus "
        f"{poller.slowest['status'] * 1000:.0f} ms over {poller.calls} rounds"
    )
    assert max(poller.slowest.values()) < 1.0, poller.slowest

    rejected = _metric(
        small_cluster["gateway_metrics"],
        "plora_gateway_requests_rejected_total",
        '{reason="max_concurrent_requests"}',
    )
    assert rejected == len(refused)
    assert _metric(small_cluster["gateway_metrics"], "plora_gateway_requests_in_flight") == 0

    with grpc.insecure_channel(small_cluster["worker"]) as channel:
        status = worker_pb2_grpc.WorkerStub(channel).GetWorkerStatus(
            worker_pb2.GetWorkerStatusRequest(), timeout=5
        )
    assert (status.running, status.queue_length) == (0, 0)

    deadline = time.monotonic() + 30
    while (rss := _rss_kib(small_cluster["gateway_pid"])) > rss_before * 1.1:
        assert time.monotonic() < deadline, f"gateway RSS {rss} KiB, {rss_before} KiB before"
        time.sleep(0.5)
    print(f"gateway RSS {rss_before} KiB before, {rss} KiB after")
