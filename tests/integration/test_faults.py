"""Faults across the cluster, with real processes: a worker killed mid-stream, workers frozen,
Redis restarted under the running services.

One cluster for the module, started by hand as a supervisor (Kubernetes, ``plora up``) would:
a Redis with its append-only file, three ``plora serve worker`` processes (one request at a
time each, so a queued request has no first token and every stream's tokens are its request's
alone) and a ``plora serve gateway``. The adapters live only in an object store: a real S3
server (``rclone serve s3``, the ``s3_server`` fixture) to which the ``adapter_source`` fixture
uploads each adapter's directory, registering it by its ``s3://`` URL. The gateway and the
workers reach the store through the standard AWS variables, are allowed its bucket
(``--adapter-source-allow``), and are confined to adapter roots (``--adapter-root``) that do
not hold the adapters' local directories, so no service could read those even if it tried;
each worker downloads what it serves into its node-local adapter cache (``--adapter-cache-dir``).

The bounds, from the code:

* a worker's liveness key lives ``heartbeat_ttl_s`` (5 s) past its last heartbeat
  (``WorkerConfig``), and the gateway re-reads the worker list every ``worker_cache_s`` (0.25 s);
* the gateway's channels ping every ``KEEPALIVE_TIME_MS`` (10 s) and close a connection whose
  ping is unanswered for ``KEEPALIVE_TIMEOUT_MS`` (10 s) (``services.common.grpc_util``): a
  peer that stopped answering fails its calls UNAVAILABLE within 20 s;
* a killed process's sockets are closed by the kernel at once, so its streams end at once.
"""

from __future__ import annotations

import dataclasses
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from plora.make_adapters import make_adapter_set
from plora.v1 import gateway_pb2
from services.common.grpc_util import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from services.common.registry import Registry, connect
from services.gateway.catalog import REGISTRY_PROBE_S
from services.worker.model_loader import spec_from_dir
from tests.processes import (
    AdapterSource,
    AofRedis,
    Service,
    gateway,
    request,
    stub,
    wait_for,
    worker,
)
from tests.s3_server import BUCKET

pytestmark = pytest.mark.slow

#: Seconds within which a peer that stopped answering fails its calls (keepalive).
KEEPALIVE_BOUND_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
#: The workers' liveness TTL (``WorkerConfig.heartbeat_ttl_s``'s default).
HEARTBEAT_TTL_S = 5.0
WEIGHTS = "adapter_model.safetensors"

TOPICS = ["a lighthouse", "a dragon", "the sea", "a robot", "a forest", "a city", "the moon"]
TOPICS += ["a river", "a clock", "a ship", "a garden", "a storm"]


@pytest.fixture(scope="module")
def adapter_source(s3_server) -> AdapterSource:
    """Adapters registered by ``s3://``: each local directory uploaded to the S3 server once
    (under a prefix of its own), its URL returned."""
    uploaded: dict[Path, str] = {}

    def source(path: Path) -> str:
        if path not in uploaded:
            uploaded[path] = s3_server.put_adapter(path, f"faults/{path.name}")
        return uploaded[path]

    return source


@pytest.fixture(scope="module")
def service_env(s3_server) -> dict[str, str]:
    """What the gateway and the workers get in their environment: the S3 server's endpoint
    and credentials (boto3's standard chain) and its bucket allowed."""
    return {**s3_server.env(), "PLORA_ADAPTER_SOURCE_ALLOW": f"s3://{BUCKET}/"}


@dataclasses.dataclass
class FaultCluster:
    """The module's cluster: its processes, registry, the adapters' directories."""

    root: Path
    redis: AofRedis
    token: str
    model_dir: Path
    workers: dict[str, Service]
    gateway: Service
    adapters: list[Path]
    source: AdapterSource
    env: dict[str, str]
    registered: list[str] = dataclasses.field(default_factory=list)

    def worker(self, name: str, worker_id: str = "") -> Service:
        """A worker ``name`` (not started) confined to the workers' adapter root, its adapter
        cache in ``<root>/node-cache/<name>``, the object store in its environment."""
        flags = ["--adapter-root", str(self.root / "worker-root")]
        flags += ["--adapter-cache-dir", str(self.cache_dir(name))]
        return worker(
            self.root,
            name,
            self.redis.url,
            self.model_dir,
            self.token,
            *flags,
            worker_id=worker_id,
            env=self.env,
        )

    def cache_dir(self, name: str) -> Path:
        """The node-local adapter cache of the worker ``name``."""
        return self.root / "node-cache" / name

    def cached(self, name: str) -> set[str]:
        """The sha256s of the adapters in the worker ``name``'s cache."""
        cache = self.cache_dir(name)
        return {p.name for p in cache.iterdir() if not p.name.startswith(".")}

    def sha256(self, adapter_id: str) -> str:
        """The registered sha256 of ``adapter_id``."""
        return next(a.sha256 for a in self.registry.list_adapters() if a.adapter_id == adapter_id)

    @property
    def registry(self) -> Registry:
        """A client of the cluster's registry."""
        return Registry(connect(self.redis.url))

    def healthy(self) -> set[str]:
        """The ids of the workers with a live heartbeat."""
        return {w.worker_id for w in self.registry.list_workers() if w.healthy}

    def register(self, adapter_id: str, path: Path) -> None:
        """Register the adapter at ``path`` through the gateway."""
        stub(self.gateway.address).RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=self.source(path)),
            timeout=60,
        )
        self.registered.append(adapter_id)


@pytest.fixture(scope="module")
def faults(
    tmp_path_factory: pytest.TempPathFactory,
    model_dir: Path,
    adapter_source: AdapterSource,
    service_env: dict[str, str],
) -> Iterator[FaultCluster]:
    """Redis (append-only file on), three workers ``w0``..``w2``, a gateway; 25 adapters of
    rank 8 made for the base model in ``<root>/adapters`` (none registered yet), which no
    service's adapter root holds."""
    root = tmp_path_factory.mktemp("faults")
    for name in ("worker-root", "gateway-root"):
        (root / name).mkdir()
    redis_server = AofRedis(root / "redis").start()
    token = secrets.token_urlsafe(32)
    spec = spec_from_dir(model_dir)
    adapters = make_adapter_set(root / "adapters", spec, count=25, ranks=[8], seed=1)
    gateway_flags = ("--adapter-root", str(root / "gateway-root"))
    cluster = FaultCluster(
        root,
        redis_server,
        token,
        model_dir,
        {},
        gateway(root, "gateway", redis_server.url, token, *gateway_flags, env=service_env),
        adapters,
        adapter_source,
        service_env,
    )
    cluster.workers = {f"w{i}": cluster.worker(f"w{i}") for i in range(3)}
    try:
        for w in cluster.workers.values():
            w.start()
        for w in cluster.workers.values():
            w.wait_ready()
        cluster.gateway.start().wait_ready()
        wait_for("three healthy workers", lambda: len(cluster.healthy()) == 3, 30)
        # the adapters' local directories are out of every service's reach
        with pytest.raises(grpc.RpcError) as refused:
            stub(cluster.gateway.address).RegisterAdapter(
                gateway_pb2.RegisterAdapterRequest(adapter_id="local", source=str(adapters[0])),
                timeout=30,
            )
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        yield cluster
    finally:
        for s in [cluster.gateway, *cluster.workers.values()]:
            s.stop()
        redis_server.stop()


@dataclasses.dataclass
class Stream:
    """One Generate call run on a thread: its tokens as they come, where and how it ended."""

    index: int
    adapter_id: str
    prompt: str
    max_new_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    worker: str = ""
    code: grpc.StatusCode | None = None
    details: str = ""
    ended: float = 0.0
    started: float = 0.0
    thread: threading.Thread | None = None

    def run(self, address: str) -> Stream:
        """Start it on a thread."""
        self.thread = threading.Thread(target=self._call, args=(address,), daemon=True)
        self.started = time.monotonic()
        self.thread.start()
        return self

    def _call(self, address: str) -> None:
        req = request(self.prompt, self.adapter_id, self.max_new_tokens)
        try:
            for chunk in stub(address).Generate(req, timeout=180):
                self.tokens.extend(chunk.token_ids)
                self.worker = chunk.worker_id or self.worker
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        self.ended = time.monotonic()

    def join(self, timeout: float) -> Stream:
        """Wait for it to end."""
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"stream {self.index} did not end in {timeout} s"
        return self


def generate(address: str, adapter_id: str, prompt: str, max_new_tokens: int) -> Stream:
    """One request, to its end."""
    return Stream(0, adapter_id, prompt, max_new_tokens).run(address).join(180)


def story(i: int) -> str:
    return f"Tell me a long story about {TOPICS[i % len(TOPICS)]}."


def test_a_worker_killed_mid_stream(faults: FaultCluster) -> None:
    """Nine long requests (a new adapter each) spread three to a worker: one streaming, two
    queued without a first token. The worker of the first stream is killed with SIGKILL: that
    stream ends UNAVAILABLE at once (well within 20 s), its tokens so far a prefix of the
    request's undisturbed answer; its queued requests are retried on the other workers; every
    other stream completes with the tokens of an undisturbed run. Restarted with its id on its
    port (a container restarted in its pod), the worker takes its id back, heartbeats, is
    routed to, and loads an adapter it had held cold (from its node-local adapter cache, which
    outlived the process: no download), then serves it warm; a new adapter it
    downloads from the object store into that cache."""
    c = faults
    for i in range(9):
        c.register(f"k{i}", c.adapters[i])
    address = c.gateway.address
    retries_before = c.gateway.metric("plora_gateway_retries_total")
    streams = [Stream(i, f"k{i}", story(i), 48).run(address) for i in range(9)]
    # one streaming on each worker (a worker runs one request at a time)
    wait_for("three streams", lambda: sum(len(s.tokens) >= 4 for s in streams) == 3, 120)
    assert not any(s.code for s in streams)
    victim = c.workers["w0"]
    port = victim.ports["grpc_port"]
    killed = time.monotonic()
    victim.kill()
    for s in streams:
        s.join(180)

    failed = [s for s in streams if s.code is not grpc.StatusCode.OK]
    assert len(failed) == 1, [(s.index, s.code, s.details) for s in failed]
    (first,) = failed
    assert first.code is grpc.StatusCode.UNAVAILABLE and len(first.tokens) >= 4
    assert f"worker {victim.name} failed while streaming this request" in first.details
    to_unavailable = first.ended - killed
    assert to_unavailable < 20.0
    retried = c.gateway.log.read_text().count(f"worker {victim.name} failed before the first token")
    retries = c.gateway.metric("plora_gateway_retries_total") - retries_before
    assert retried >= 1 and retries == retried, (retried, retries)
    assert all(s.worker != victim.name for s in streams if s is not first)

    # what it had downloaded (the adapter it streamed, at least) stays on its node's disk
    cached_before = c.cached(victim.name)
    first_sha = c.sha256(first.adapter_id)
    assert first_sha in cached_before

    # the restarted worker, as a supervisor restarts it: same id, same port
    restarted = time.monotonic()
    victim.start(port).wait_ready()
    ready_s = time.monotonic() - restarted
    lease = c.registry.get_worker_lease(victim.name)
    assert lease is not None and lease.holder.pid == victim.pid
    healthy_s = wait_for("the restarted worker's heartbeat", lambda: victim.name in c.healthy(), 10)
    healthy_s += ready_s
    # the adapter it streamed when killed, resident nowhere now, placed on it
    assert not any(first.adapter_id in w.resident for w in c.registry.list_workers())
    c.registry.set_placement({first.adapter_id: [victim.name]})
    time.sleep(0.5)  # the gateway re-reads the placement every 0.25 s (worker_cache_s)
    cold = generate(address, first.adapter_id, "Hi", 4)
    rejoin_s = time.monotonic() - restarted
    warm = generate(address, first.adapter_id, "Hi", 4)
    assert (cold.code, cold.worker) == (grpc.StatusCode.OK, victim.name), cold
    assert (warm.code, warm.worker) == (grpc.StatusCode.OK, victim.name), warm
    assert victim.metric("plora_worker_cold_starts_total") == 1
    assert victim.metric("plora_worker_requests_total", code="OK") == 2
    # its node-local cache outlived the process: the cold load read the adapter from there
    assert first_sha in c.cached(victim.name)
    assert victim.metric("plora_worker_adapter_cache_hits_total") == 1
    assert victim.metric("plora_worker_adapter_download_seconds_count") == 0
    # an adapter no worker has held comes from the object store into its cache
    c.register("k-new", c.adapters[24])
    assert c.sha256("k-new") not in cached_before
    c.registry.set_placement({"k-new": [victim.name]})
    time.sleep(0.5)
    fetched = generate(address, "k-new", "Hi", 4)
    assert (fetched.code, fetched.worker) == (grpc.StatusCode.OK, victim.name), fetched
    assert victim.metric("plora_worker_adapter_download_seconds_count") == 1
    downloaded = victim.metric("plora_worker_adapter_download_bytes_total")
    assert downloaded >= (c.adapters[24] / WEIGHTS).stat().st_size
    assert c.sha256("k-new") in c.cached(victim.name)
    assert victim.metric("plora_worker_cold_starts_total") == 2
    c.registry.set_placement({})

    # the undisturbed run, one request at a time, now the cluster is whole again
    for s in streams:
        alone = generate(address, s.adapter_id, s.prompt, s.max_new_tokens)
        assert alone.code is grpc.StatusCode.OK
        if s is first:
            assert alone.tokens[: len(s.tokens)] == s.tokens and len(s.tokens) < len(alone.tokens)
        else:
            assert s.tokens == alone.tokens, s.index
    print(
        f"\nSIGKILL mid-stream: UNAVAILABLE after {to_unavailable:.3f} s; {retried} queued "
        f"requests retried elsewhere; restarted worker ready after {ready_s:.1f} s, healthy "
        f"in the registry after {healthy_s:.1f} s, served a request routed to it after "
        f"{rejoin_s:.1f} s (cold from its disk cache {cold.ended - cold.started:.2f} s, warm "
        f"{warm.ended - warm.started:.2f} s, cold with a download of {downloaded / 1e6:.2f} MB "
        f"from S3 {fetched.ended - fetched.started:.2f} s)"
    )


def test_frozen_workers_are_routed_around_and_come_back_as_their_ids_allow(
    faults: FaultCluster,
) -> None:
    """w1 (streaming a long request) and w2 (idle) frozen with SIGSTOP at once. New requests
    all succeed on w0: a call sent to a
    frozen worker fails UNAVAILABLE before its first token within the keepalive bound (20 s)
    and is retried there. The stream on w1 ends UNAVAILABLE within that bound; both leave the
    registry's healthy workers within the heartbeat TTL (5 s), after which requests go to w0
    without waiting. A replacement claims w1's expired id; continued, the old w1 finds its id
    taken and exits 69, while w2, whose id nobody took, claims it again, heartbeats and is
    routed to, as is the replacement."""
    c = faults
    wait_for("three healthy workers", lambda: len(c.healthy()) == 3, 15)
    for i in range(9, 20):
        c.register(f"f{i}", c.adapters[i])
    retried_before = c.gateway.log.read_text().count("failed before the first token")
    address = c.gateway.address
    frozen, idle = c.workers["w1"], c.workers["w2"]
    c.registry.set_placement({"f9": ["w1"]})
    long = Stream(0, "f9", story(0), 64).run(address)
    wait_for("the stream on w1", lambda: len(long.tokens) >= 3, 60)
    # the gauge is set at each heartbeat (every second)
    wait_for("w1 running it", lambda: frozen.metric("plora_worker_running_requests") == 1, 3)
    c.registry.set_placement({})
    frozen.signal(signal.SIGSTOP)
    idle.signal(signal.SIGSTOP)
    t0 = time.monotonic()

    # new adapters: the frozen workers look the least loaded to some of them
    new = [Stream(i, f"f{i}", "Hi", 8).run(address) for i in range(10, 18)]
    gone_s = wait_for(
        "the frozen workers out of the healthy ones",
        lambda: not c.healthy() & {"w1", "w2"},
        HEARTBEAT_TTL_S + 5,
    )
    time.sleep(0.5)  # the gateway's worker list is re-read every 0.25 s (worker_cache_s)
    after = generate(address, "f10", "Hello", 8)
    for s in [*new, long]:
        s.join(KEEPALIVE_BOUND_S + 60)
    assert [(s.code, s.worker) for s in new] == [(grpc.StatusCode.OK, "w0")] * len(new)
    assert (after.code, after.worker) == (grpc.StatusCode.OK, "w0")
    assert after.ended - after.started < 10, "a request waited on a frozen worker"
    slowest = max(s.ended - t0 for s in new)
    assert slowest < KEEPALIVE_BOUND_S + 10
    assert long.code is grpc.StatusCode.UNAVAILABLE, (long.code, long.details)
    stream_s = long.ended - t0
    assert stream_s < KEEPALIVE_BOUND_S + 2
    assert gone_s < HEARTBEAT_TTL_S + 1.5
    retried = c.gateway.log.read_text().count("failed before the first token") - retried_before
    assert retried >= 1

    # a replacement with w1's id (its supervisor started it elsewhere): the id is free
    replacement = c.worker("w1-replacement", worker_id="w1")
    c.workers["w1"] = replacement
    replacement.start().wait_ready()
    lease = c.registry.get_worker_lease("w1")
    assert lease is not None and lease.holder.pid == replacement.pid
    frozen.signal(signal.SIGCONT)
    idle.signal(signal.SIGCONT)
    woke = time.monotonic()
    assert frozen.proc is not None and frozen.proc.wait(timeout=30) == 69
    exit_s = time.monotonic() - woke
    assert "was taken over by pid" in frozen.log.read_text()
    wait_for("w2 healthy again", lambda: "w2" in c.healthy(), 10)
    back_s = time.monotonic() - woke
    assert "its lease was gone (expired or lost by Redis) and is claimed again" in (
        idle.log.read_text()
    )
    lease = c.registry.get_worker_lease("w2")
    assert lease is not None and lease.holder.pid == idle.pid
    # the old w1 may have heartbeated once on waking, before its lease renewal failed: the
    # replacement's next heartbeat (every second) writes its own record again
    wait_for(
        "w1's record naming the replacement",
        lambda: (
            {(w.worker_id, w.address) for w in c.registry.list_workers() if w.healthy}
            == {("w0", c.workers["w0"].address), ("w1", replacement.address), ("w2", idle.address)}
        ),
        2,
    )

    c.registry.set_placement({"f18": ["w2"], "f19": ["w1"]})
    on_w2, on_w1 = generate(address, "f18", "Hi", 4), generate(address, "f19", "Hi", 4)
    c.registry.set_placement({})
    assert (on_w2.code, on_w2.worker) == (grpc.StatusCode.OK, "w2")
    assert (on_w1.code, on_w1.worker) == (grpc.StatusCode.OK, "w1")
    print(
        f"\nSIGSTOP: out of the healthy workers after {gone_s:.1f} s (TTL {HEARTBEAT_TTL_S:g} s); "
        f"the frozen stream ended UNAVAILABLE after {stream_s:.1f} s (keepalive bound "
        f"{KEEPALIVE_BOUND_S:g} s); {len(new)} new requests all served by w0, the slowest "
        f"done {slowest:.1f} s after the freeze ({retried} calls to the frozen workers retried); "
        f"after that a request took {after.ended - after.started:.2f} s. Continued: the "
        f"taken-over worker exited 69 after {exit_s:.1f} s, the other was healthy again after "
        f"{back_s:.1f} s"
    )


def test_redis_restarted_with_its_append_only_file_keeps_every_registration(
    faults: FaultCluster,
) -> None:
    """Redis stopped (SIGTERM) for 3 s and started again on its append-only file under the
    running services: a request meanwhile is served from the gateway's records; every adapter
    is still registered with its version, the workers heartbeat to it again without a restart
    (and do not take it for a registry that lost their records), every adapter serves, and a
    registration after it gets the next version (the gateway's admin calls answer UNAVAILABLE
    until its check, every second, finds Redis back)."""
    c = faults
    wait_for("three healthy workers", lambda: len(c.healthy()) == 3, 15)
    for i in range(20, 24):
        c.register(f"r{i}", c.adapters[i])
    address = c.gateway.address
    gw = stub(address)
    before = {a.adapter_id: a.version for a in c.registry.list_adapters()}
    assert set(before) == set(c.registered)
    assert generate(address, "r20", "Hi", 4).code is grpc.StatusCode.OK

    c.redis.stop()
    down = time.monotonic()
    # meanwhile the gateway serves from the records it read before
    during = generate(address, "r20", "Hello", 4)
    time.sleep(max(0.0, 3.0 - (time.monotonic() - down)))  # a restart of some seconds
    c.redis.start()
    down_s = time.monotonic() - down
    restarted = time.time()
    assert (during.code, during.details) == (grpc.StatusCode.OK, "")
    assert {a.adapter_id: a.version for a in c.registry.list_adapters()} == before
    back_s = wait_for(
        "every worker heartbeating to the restarted Redis",
        lambda: all(w.heartbeat_unix > restarted and w.healthy for w in c.registry.list_workers()),
        10,
    )
    # the gateway's admin calls fail at once (UNAVAILABLE) until its background check, every
    # REGISTRY_PROBE_S, finds Redis back
    listed: list[set[str]] = []

    def list_adapters() -> bool:
        try:
            adapters = gw.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=10).adapters
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
            return False
        listed.append({a.adapter_id for a in adapters})
        return True

    admin_s = wait_for(
        "the gateway's admin calls back", list_adapters, REGISTRY_PROBE_S + 2, every=0.1
    )
    assert listed == [set(before)]
    served = [generate(address, adapter_id, "Hi", 4) for adapter_id in sorted(before)]
    assert all(s.code is grpc.StatusCode.OK for s in served), [
        (s.adapter_id, s.code, s.details) for s in served if s.code is not grpc.StatusCode.OK
    ]
    again = gw.RegisterAdapter(
        gateway_pb2.RegisterAdapterRequest(adapter_id="r20", source=c.source(c.adapters[20])),
        timeout=60,
    )
    assert again.adapter.version == before["r20"] + 1
    for w in c.workers.values():
        assert "lost this worker's record" not in w.log.read_text(), w.name
    print(
        f"\nRedis restart: down {down_s:.2f} s; {len(before)} adapters kept; every worker "
        f"heartbeating again {back_s:.2f} s after it was back, the gateway's admin calls a "
        f"further {admin_s:.2f} s later; {len(served)} adapters served"
    )
