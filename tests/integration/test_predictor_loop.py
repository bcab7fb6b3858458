"""The predictor loop on the real cluster: events -> forecast -> prefetch -> warm requests.

Also: the predictor can die mid-run without any request failing, and a restarted predictor
resumes from the state it persisted in Redis.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from plora.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.helpers import worker_stub

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stub(cluster: dict) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(cluster["gateway"]))


def ask(stub: gateway_pb2_grpc.GatewayStub, adapter: str) -> gateway_pb2.GenerateResponse:
    req = gateway_pb2.GenerateRequest(adapter_id=adapter, max_new_tokens=1)
    req.messages.add(role="user", content="Hi")
    return list(stub.Generate(req, timeout=120))[-1]


def register_copies(stub, cluster: dict, prefix: str, count: int) -> list[str]:
    """Register demo adapter files under fresh ids, so they start cold everywhere."""
    ids = []
    for i in range(count):
        source = Path(cluster["root"]) / "adapters" / cluster["adapters"][i % 8]
        adapter_id = f"{prefix}-{i}"
        stub.RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=str(source)),
            timeout=60,
        )
        ids.append(adapter_id)
    return ids


def live_resident(workers: list[worker_pb2_grpc.WorkerStub]) -> set[str]:
    """Adapters resident on any worker now (asked of the workers, not their last heartbeat)."""
    return {
        a
        for w in workers
        for a in w.GetWorkerStatus(
            worker_pb2.GetWorkerStatusRequest(), timeout=10
        ).resident_adapters
    }


def why_not_prefetched(cluster: dict, missing: set[str]) -> str:
    """What a failure should show: the predictor's last forecast of ``missing`` (from Redis)
    and each worker's prefetch outcomes (``plora_worker_prefetch_requests_total``)."""
    forecast = json.loads(redis.Redis.from_url(cluster["redis_url"]).get("plora:forecast") or b"{}")
    expected = {a: forecast.get("expected", {}).get(a) for a in sorted(missing)}
    outcomes = {}
    for name in cluster["workers"]:
        text = urllib.request.urlopen(cluster["metrics"][name], timeout=10).read().decode()
        outcomes[name] = [
            line for line in text.splitlines() if line.startswith("plora_worker_prefetch_requests")
        ]
    return f"not prefetched: {sorted(missing)}; forecast {expected}; workers {outcomes}"


def test_burst_makes_the_predictor_prefetch_and_the_next_burst_is_warm(stub, cluster):
    workers = [worker_stub(cluster, a) for a in cluster["workers"].values()]
    # Pools emptied of what earlier tests left on this shared cluster: a worker takes a
    # prefetch only when room can be made without evicting an adapter forecast to be as
    # busy, so a pool full of other tests' adapters would refuse the largest copy here.
    for w in workers:
        for a in live_resident([w]):
            w.UnloadAdapter(worker_pb2.UnloadAdapterRequest(adapter_id=a), timeout=10)
    adapters = register_copies(stub, cluster, "loop", 3)
    # First burst: cold starts, and the predictor sees the demand.
    with ThreadPoolExecutor(6) as pool:
        first = list(pool.map(lambda a: ask(stub, a), adapters * 2))
    assert any(r.adapter_cold for r in first)
    # Take the adapters out of every worker (as eviction under pressure would) ...
    for w in workers:
        for a in adapters:
            w.UnloadAdapter(worker_pb2.UnloadAdapterRequest(adapter_id=a), timeout=10)
    assert not set(adapters) & live_resident(workers)
    # ... and the predictor, still forecasting demand for them, must bring them back.
    deadline = time.monotonic() + 20
    while True:
        resident = live_resident(workers)
        if set(adapters) <= resident:
            break
        if time.monotonic() >= deadline:
            pytest.fail(why_not_prefetched(cluster, set(adapters) - resident))
        time.sleep(0.25)
    time.sleep(1.5)  # one heartbeat, so the gateway's routing sees the new residency
    second = [ask(stub, a) for a in adapters]
    assert not any(r.adapter_cold for r in second), [(r.adapter_cold, r.worker_id) for r in second]
    metrics = urllib.request.urlopen(cluster["metrics"]["predictor"], timeout=10).read().decode()
    sent = [
        line
        for line in metrics.splitlines()
        if line.startswith("plora_predictor_prefetches_sent_total")
    ]
    assert sent and float(sent[0].split()[-1]) >= len(adapters)


def test_killing_the_predictor_fails_no_request_and_it_resumes(stub, cluster):
    adapters = register_copies(stub, cluster, "resume", 2)
    client = redis.Redis.from_url(cluster["redis_url"])
    for a in adapters:
        for _ in range(3):
            ask(stub, a)
    # Wait until the predictor has persisted state that includes these adapters.
    deadline = time.monotonic() + 30
    while client.get("plora:predictor_state") is None or not all(
        a.encode() in client.get("plora:predictor_state") for a in adapters
    ):
        assert time.monotonic() < deadline, "predictor never persisted its state"
        time.sleep(0.5)
    state_file = Path(cluster["root"]) / "cluster.json"
    old_pid = json.loads(state_file.read_text())["pids"]["predictor"]
    os.kill(old_pid, signal.SIGKILL)
    # While it is down (and while it restarts) every request is served as usual.
    outcomes = [ask(stub, adapters[i % 2]).finish_reason for i in range(6)]
    assert all(o != gateway_pb2.FINISH_REASON_UNSPECIFIED for o in outcomes)
    # The launcher restarts it on the same port; the gateway reconnects; the forecast resumes.
    deadline = time.monotonic() + 90
    while json.loads(state_file.read_text())["pids"]["predictor"] == old_pid:
        assert time.monotonic() < deadline, "predictor was not restarted"
        time.sleep(0.5)
    # the fixture's teardown checks every child ended, and later tests read the pids
    cluster["pids"]["predictor"] = json.loads(state_file.read_text())["pids"]["predictor"]
    deadline = time.monotonic() + 30
    while not stub.GetClusterStatus(
        gateway_pb2.GetClusterStatusRequest(), timeout=10
    ).predictor_connected:
        assert time.monotonic() < deadline, "gateway did not reconnect to the predictor"
        time.sleep(0.5)
    restarted_at = time.time()
    log = (Path(cluster["root"]) / "logs" / "predictor.log").read_text()
    assert "resumed forecaster state" in log
    deadline = time.monotonic() + 15
    while True:
        forecast = json.loads(client.get("plora:forecast") or b"{}")
        fresh = forecast.get("made_unix", 0) > restarted_at
        if fresh and set(adapters) <= set(forecast.get("expected", {})):
            break
        assert time.monotonic() < deadline, f"forecast lost the pre-restart demand: {forecast}"
        time.sleep(0.5)
