"""Two live gateways in front of the same workers: a uniform load spreads evenly.

Each gateway counts only its own requests in flight on each worker (``RoutingState``) and
sees the other's through the workers' heartbeats (every second). Real processes: a Redis,
three ``plora serve worker`` and two ``plora serve gateway`` sharing it, as ``plora up``
starts them (the cluster's internal token in their environment, no API keys on loopback).
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from plora.make_adapters import make_adapter_set
from plora.v1 import gateway_pb2
from services.common.registry import Registry, connect
from services.worker.model_loader import spec_from_dir
from tests.processes import AdapterSource, AofRedis, Service, gateway, request, stub, wait_for
from tests.processes import worker as worker_service

pytestmark = pytest.mark.slow

WORKERS = 3
ADAPTERS = 36
REQUESTS = 72
CONCURRENCY = 8
#: Adapter id suffixes of the rounds a test may run, each on adapters new to the workers.
ROUNDS = ("", "-again", "-third")


@pytest.fixture(scope="module")
def adapter_source() -> AdapterSource:
    """Adapters registered by their local directory."""
    return str


@pytest.fixture(scope="module")
def two_gateways(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, adapter_source: AdapterSource
) -> Iterator[tuple[list[Service], list[Service]]]:
    """Three workers (a batch of up to 8 each), two gateways on one Redis, and 36 adapters of
    rank 8 registered through the first gateway under a fresh id prefix for every round of
    each test (``one-<i>``, ``one-again-<i>``, ``two-third-<i>``, ...); yields
    ``(gateways, workers)``."""
    tmp_path = tmp_path_factory.mktemp("two-gateways")
    redis_server = AofRedis(tmp_path / "redis").start()
    token = secrets.token_urlsafe(32)
    workers = [
        worker_service(
            tmp_path, f"w{i}", redis_server.url, model_dir, token, "--max-batch-size", "8"
        )
        for i in range(WORKERS)
    ]
    gateways = [gateway(tmp_path, f"gateway-{i}", redis_server.url, token) for i in range(2)]
    try:
        for s in workers:
            s.start()
        for s in workers:
            s.wait_ready()
        for s in gateways:
            s.start().wait_ready()
        registry = Registry(connect(redis_server.url))
        wait_for(
            "every worker healthy",
            lambda: sum(w.healthy for w in registry.list_workers()) == WORKERS,
            30,
        )
        spec = spec_from_dir(model_dir)
        paths = make_adapter_set(tmp_path / "adapters", spec, count=ADAPTERS, ranks=[8], seed=2)
        first = stub(gateways[0].address)
        for i, path in enumerate(paths):
            for prefix in (f"{name}{suffix}" for name in ("one", "two") for suffix in ROUNDS):
                first.RegisterAdapter(
                    gateway_pb2.RegisterAdapterRequest(
                        adapter_id=f"{prefix}-{i}", source=adapter_source(path)
                    ),
                    timeout=60,
                )
        yield gateways, workers
    finally:
        for s in [*gateways, *workers]:
            s.stop()
        redis_server.stop()


@pytest.mark.parametrize("used", [1, 2], ids=["one", "two"])
def test_gateways_spread_a_uniform_load_evenly(
    two_gateways: tuple[list[Service], list[Service]], used: int
) -> None:
    """72 requests over 36 adapters (2 each, new to the workers), 8 at a time, sent through
    one gateway or in turn through the two: every worker serves within 25 % of every other's
    count (max / min <= 1.25), read from the workers' own request counters, which agree with
    the workers the answers name; a round over that bound is run again on fresh adapters, up
    to three rounds (placement races can move a few requests each round: on a CI runner two
    gateways measured 1.33 and then 1.45 in two consecutive rounds, while herding fails every
    round). Measured on a 2-core machine 1.00-1.13 with one gateway and 1.00-1.18 with two
    over repeated runs. With 4 requests per adapter (18 adapters) one adapter's placement
    moves 4 requests, and the same routing gave 1.09-1.40, so the load is split finer. (Two gateways
    that broke routing ties in the same order gave 1.53 and 1.33: each one's first cold
    adapters went to the same idle worker. A coarser load, 9 adapters of 8 requests, gave
    1.00-1.09 through one gateway and 1.23-1.53 through two: each gateway sees the other's
    requests in flight only through heartbeats up to a second old.)"""
    gateways, workers = two_gateways
    prefix = ["one", "two"][used - 1]
    rounds = []
    for suffix in ROUNDS:  # fresh adapters each round: races move a few requests in one,
        ratio, served = _spread(gateways, workers, used, prefix + suffix)  # herding: in all
        rounds.append(served)
        if ratio <= 1.25:
            break
    assert ratio <= 1.25, rounds


def _spread(
    gateways: list[Service], workers: list[Service], used: int, prefix: str
) -> tuple[float, dict[str, float]]:
    """Send the load through ``used`` gateways over the adapters ``{prefix}-*``; returns the
    workers' max / min request count and the counts (and checks what every round must)."""
    stubs = [stub(g.address) for g in gateways[:used]]

    def one(i: int) -> tuple[str, str]:
        adapter_id = f"{prefix}-{i % ADAPTERS}"
        worker = ""
        req = request(f"Count to {i % 7 + 3}.", adapter_id, 8)
        for chunk in stubs[i % used].Generate(req, timeout=120):
            worker = chunk.worker_id or worker
        return worker, adapter_id

    sent = [g.metric("plora_gateway_requests_total", code="OK") for g in gateways[:used]]
    before = {w.name: w.metric("plora_worker_requests_total", code="OK") for w in workers}
    start = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(one, range(REQUESTS)))
    took = time.monotonic() - start
    served = {
        w.name: w.metric("plora_worker_requests_total", code="OK") - before[w.name] for w in workers
    }
    named = Counter(w for w, _ in answers)
    assert dict(named) == {k: int(v) for k, v in served.items() if v}, (named, served)
    assert sum(served.values()) == REQUESTS
    ratio = max(served.values()) / max(1.0, min(served.values()))
    per_gateway = [
        g.metric("plora_gateway_requests_total", code="OK") - n
        for g, n in zip(gateways, sent, strict=False)
    ]
    spread = Counter((w, a) for w, a in answers)
    print(
        f"\n{used} gateway(s), {REQUESTS} requests over {ADAPTERS} adapters, {CONCURRENCY} at a "
        f"time, {took:.1f} s: per worker {dict(sorted(served.items()))} (max/min {ratio:.2f}); "
        f"per gateway {per_gateway}; (worker, adapter) pairs {len(spread)}"
    )
    assert per_gateway == [REQUESTS / used] * used
    return ratio, served
