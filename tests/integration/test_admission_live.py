"""Admission control through a real gateway and a real worker (the real model, Redis of its
own): the gateway's bounds in all and per tenant, places given back however a stream ends,
the per-tenant adapter quota, and the worker's queue bound relayed as RESOURCE_EXHAUSTED."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from plora.make_adapters import write_peft_adapter
from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.registry import Registry, connect
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService
from services.worker.config import WorkerConfig
from services.worker.server import WorkerService
from tests.conftest import OwnRedis

pytestmark = pytest.mark.slow

#: The worker's batch and queue: at most 4 streams in its engine at once.
BATCH, QUEUE = 2, 2


#: A prompt the base model answers greedily with hundreds of tokens (no early end of
#: sequence), so a stream holding a place runs until it is cancelled or its deadline passes.
LONG_PROMPT = "List the numbers from 1 to 1000, one per line:"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A Redis of this module's own (the worker's records live across its tests)."""
    server = OwnRedis()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def worker(redis_url: str, model_dir: Path) -> Iterator[WorkerService]:
    """One worker: the real model, batch 2, queue 2, one thread."""
    config = WorkerConfig(
        port=0,
        metrics_port=0,
        redis_url=redis_url,
        model=str(model_dir),
        pool_bytes=64 << 20,
        threads=1,
        host_staging="off",
        max_batch_size=BATCH,
        max_queue=QUEUE,
    )
    service = WorkerService(config).start()
    yield service
    service.stop()


class Gateway:
    """A started gateway with the given settings, and a stub to it."""

    def __init__(self, redis_url: str, **settings: int) -> None:
        config = GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url, **settings)  # type: ignore[arg-type]
        self.service = GatewayService(config).start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.service.port}")
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        _eventually(
            lambda: (
                len(self.stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest()).workers) == 1
            ),
            "the worker in the gateway's view",
        )

    @property
    def in_flight(self) -> int:
        return self.service.core.admission.in_flight

    def rejected(self, reason: str) -> float:
        value = self.service.metrics.registry.get_sample_value(
            "plora_gateway_requests_rejected_total", {"reason": reason}
        )
        assert value is not None
        return value

    def hold(self, tenant_id: str = "") -> grpc.Future:
        """A long stream, running (its first token read); cancel it to end it."""
        call = self.stub.Generate(
            gateway_pb2.GenerateRequest(
                prompt=LONG_PROMPT, max_new_tokens=400, tenant_id=tenant_id
            ),
            timeout=120,
        )
        next(call)
        return call

    def refusal(self, tenant_id: str = "") -> grpc.RpcError:
        """The status of a Generate call that must be refused."""
        request = gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=2, tenant_id=tenant_id)
        with pytest.raises(grpc.RpcError) as err:
            list(self.stub.Generate(request, timeout=30))
        return err.value

    def close(self) -> None:
        self.channel.close()
        self.service.stop(0)


@pytest.fixture()
def gateway(redis_url: str, worker: WorkerService) -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def start(**settings: int) -> Gateway:
        started.append(Gateway(redis_url, **settings))
        return started[-1]

    yield start
    for g in started:
        g.close()


def _eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_gateway_bound_refuses_at_once_and_every_ending_gives_the_place_back(gateway) -> None:
    """Limit 2: a third stream is refused at once naming the flag; a place comes back after a
    client cancel, a deadline, a completion and a refused request alike."""
    g = gateway(max_concurrent_requests=2)
    a, b = g.hold(), g.hold()
    assert g.in_flight == 2
    started = time.monotonic()
    err = g.refusal()
    assert time.monotonic() - started < 1.0
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 2 concurrent" in err.details()
    assert "--max-concurrent-requests" in err.details()
    assert g.rejected("max_concurrent_requests") == 1
    # client cancel
    a.cancel()
    _eventually(lambda: g.in_flight == 1, "the cancelled stream's place")
    b.cancel()
    _eventually(lambda: g.in_flight == 0, "the cancelled stream's place")
    # the client's deadline
    request = gateway_pb2.GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=400)
    with pytest.raises(grpc.RpcError) as deadline:
        list(g.stub.Generate(request, timeout=1.0))
    assert deadline.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _eventually(lambda: g.in_flight == 0, "the expired stream's place")
    # completion
    chunks = list(g.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=3)))
    assert chunks[-1].finish_reason
    assert g.in_flight == 0
    # failures: an unknown adapter, an invalid request
    for bad, code in [
        (gateway_pb2.GenerateRequest(prompt="hi", adapter_id="nope"), "NOT_FOUND"),
        (gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=100_000), "INVALID_ARGUMENT"),
    ]:
        with pytest.raises(grpc.RpcError) as failed:
            list(g.stub.Generate(bad, timeout=30))
        assert failed.value.code().name == code
        assert g.in_flight == 0
    # both places are free again
    held = [g.hold(), g.hold()]
    assert g.in_flight == 2
    for call in held:
        call.cancel()
    _eventually(lambda: g.in_flight == 0, "the places")
    assert g.rejected("max_concurrent_requests") == 1


def test_the_per_tenant_bound_refuses_that_tenant_only(gateway) -> None:
    g = gateway(max_concurrent_per_tenant=1)
    acme = g.hold("acme")
    err = g.refusal("acme")
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-concurrent-per-tenant" in err.details() and "limit of 1" in err.details()
    assert "acme" not in err.details()
    other = g.hold("globex")  # another tenant goes on
    acme.cancel()
    _eventually(lambda: g.service.core.admission.tenant_in_flight("acme") == 0, "acme's place")
    blank = g.hold("")  # requests without a tenant id are one tenant
    assert g.refusal("").code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert g.rejected("max_concurrent_per_tenant") == 2
    for call in (other, blank):
        call.cancel()
    _eventually(lambda: g.in_flight == 0, "the places")


def test_a_tenant_registers_at_most_its_quota_of_new_adapter_ids(
    gateway, redis_url: str, tmp_path: Path
) -> None:
    g = gateway(max_adapters_per_tenant=2)
    published = Registry(connect(redis_url)).get_model_spec()
    assert published is not None
    sources = {
        name: str(write_peft_adapter(tmp_path / name, published[0], rank=2, alpha=4, seed=i))
        for i, name in enumerate(["q1", "q2", "q3", "q4"])
    }

    def register(adapter_id: str, tenant_id: str) -> gateway_pb2.RegisterAdapterResponse:
        return g.stub.RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(
                adapter_id=adapter_id, source=sources[adapter_id], tenant_id=tenant_id
            ),
            timeout=60,
        )

    register("q1", "acme")
    register("q2", "acme")
    with pytest.raises(grpc.RpcError) as err:
        register("q3", "acme")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 2 adapters" in err.value.details()
    assert "--max-adapters-per-tenant" in err.value.details()
    assert g.rejected("max_adapters_per_tenant") == 1
    assert register("q1", "acme").adapter.version == 2  # a new version takes no new place
    register("q3", "globex")  # another tenant has its own quota
    g.stub.DeleteAdapter(gateway_pb2.DeleteAdapterRequest(adapter_id="q1", tenant_id="acme"))
    register("q4", "acme")  # the deleted id's place is free
    listed = g.stub.ListAdapters(gateway_pb2.ListAdaptersRequest(tenant_id="acme")).adapters
    assert sorted(a.adapter_id for a in listed if a.tenant_id == "acme") == ["q2", "q4"]
    for adapter_id, tenant_id in [("q2", "acme"), ("q4", "acme"), ("q3", "globex")]:
        g.stub.DeleteAdapter(
            gateway_pb2.DeleteAdapterRequest(adapter_id=adapter_id, tenant_id=tenant_id)
        )


def test_the_workers_queue_bound_reaches_the_client_as_resource_exhausted(gateway) -> None:
    """12 streams at once through a gateway that admits them all, to a worker that runs 2 and
    queues 2: the others are refused by the worker's queue (not held in a gRPC queue), the
    gateway relays RESOURCE_EXHAUSTED without retrying, and the admitted ones complete."""
    g = gateway()
    n = 12
    results: list[tuple[str, str, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(n)

    def run() -> None:
        request = gateway_pb2.GenerateRequest(prompt=LONG_PROMPT, max_new_tokens=48)
        start.wait()
        began = time.monotonic()
        try:
            chunks = list(g.stub.Generate(request, timeout=120))
            outcome = ("OK", chunks[-1].finish_reason and "finished" or "unfinished")
        except grpc.RpcError as exc:
            outcome = (exc.code().name, exc.details())
        with lock:
            results.append((*outcome, time.monotonic() - began))

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r[0] == "OK"]
    refused = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(refused) == n, results
    assert len(refused) >= n - BATCH - QUEUE, results
    assert all(r[1] == "finished" for r in ok)
    assert all("worker queue is full" in r[1] and "--max-queue" in r[1] for r in refused)
    assert max(r[2] for r in refused) < min(r[2] for r in ok), results  # refused at once
    retries = g.service.metrics.registry.get_sample_value("plora_gateway_retries_total")
    assert retries == 0
    assert g.in_flight == 0
