"""Adapters from object storage through real servers: a real S3 server (``rclone serve s3``),
a gateway that registers ``s3://`` sources only under its ``--adapter-source-allow``
prefixes (every refusal one message), and (slow) a whole cluster started by ``plora up`` whose
workers may read no adapter directory but their own roots: an adapter registered by ``s3://``
is downloaded into each worker's node-local cache and generates exactly what the same adapter
registered from a local directory generates, and an object changed after registration fails
its load with FAILED_PRECONDITION and is never cached."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from plora.make_adapters import write_peft_adapter
from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.adapters import inspect_adapter
from services.common.registry import Registry, WorkerRecord, connect
from services.common.remote_sources import (
    REMOTE_SOURCE_REFUSED,
    RemoteSourceRefusedError,
    parse_remote,
)
from services.common.types import ModelSpec
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService
from tests.conftest import run_plora_up
from tests.s3_server import BUCKET

#: A tiny served model for registrations through a gateway with no real worker.
SPEC = ModelSpec("m", 2, 8, 16, 2, 1, 4, 32, 64, 10000.0, 1e-6, True)
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture()
def s3_gateway(
    redis_url: str, s3_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SimpleNamespace]:
    """A gateway (``stub``, ``core``) allowed to read ``s3://plora-adapters/allowed/`` only
    (and a local root)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    Registry(connect(redis_url)).heartbeat(
        WorkerRecord("w0", "127.0.0.1:1"), ttl_seconds=60, model=(SPEC, "float32")
    )
    (tmp_path / "root").mkdir()
    config = GatewayConfig(
        port=0,
        metrics_port=0,
        http_port=0,
        redis_url=redis_url,
        adapter_roots=(str(tmp_path / "root"),),
        adapter_source_allow=(f"s3://{BUCKET}/allowed/",),
    )
    service = GatewayService(config).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    yield SimpleNamespace(stub=gateway_pb2_grpc.GatewayStub(channel), core=service.core)
    channel.close()
    service.stop(0)


def _register(stub, source: str, adapter_id: str = "a", tenant: str = ""):
    request = gateway_pb2.RegisterAdapterRequest(
        adapter_id=adapter_id, source=source, tenant_id=tenant
    )
    return stub.RegisterAdapter(request, timeout=30)


def test_a_gateway_registers_only_allowed_s3_sources_and_refuses_the_rest_alike(
    s3_gateway, s3_server, tmp_path
) -> None:
    """An allowed source registers with the local directory's sha256 and its canonical URL;
    an existing adapter outside the allowed prefix, a missing prefix, a missing bucket, a
    malformed URL and a path that climbs out all get INVALID_ARGUMENT with one message."""
    local = write_peft_adapter(tmp_path / "a", SPEC, rank=4, alpha=8.0, seed=1)
    source = s3_server.put_adapter(local, "allowed/team/a")
    outside = s3_server.put_adapter(local, "private/a")
    stub = s3_gateway.stub
    info = _register(stub, source.rstrip("/")).adapter
    assert info.source == source and info.version == 1
    assert info.sha256 == inspect_adapter(local, SPEC).sha256
    refusals = {}
    for refused in (
        outside,
        f"s3://{BUCKET}/allowed/missing/",
        "s3://no-such-bucket/allowed/a/",
        f"s3://{BUCKET}/allowed/../private/a/",
        "s3://",
        "hf://org/repo",
    ):
        with pytest.raises(grpc.RpcError) as err:
            _register(stub, refused, "b")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
        refusals[refused] = err.value.details()
    assert set(refusals.values()) == {REMOTE_SOURCE_REFUSED}, refusals
    listed = stub.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=10)
    assert [a.adapter_id for a in listed.adapters] == ["a"]


def test_a_tenant_registers_only_under_its_own_prefix(s3_gateway, s3_server, tmp_path) -> None:
    """Tenant-confined (what a tenant's key gets): the source must lie under
    ``PREFIX<tenant>/`` of an allowed prefix; another tenant's is refused like a missing one."""
    local = write_peft_adapter(tmp_path / "a", SPEC, rank=4, alpha=8.0, seed=2)
    own = s3_server.put_adapter(local, "allowed/acme/a")
    theirs = s3_server.put_adapter(local, "allowed/bob/a")
    core = s3_gateway.core
    assert core.register_adapter("acme/a", own, "acme", confine_to_tenant=True).source == own
    for source in (theirs, f"s3://{BUCKET}/allowed/acme/missing/"):
        with pytest.raises(RemoteSourceRefusedError, match="may read"):
            core.register_adapter("acme/b", source, "acme", confine_to_tenant=True)
    assert core.register_adapter("bob/a", theirs, "bob").version == 1  # the operator may


# -- a whole cluster: workers that read the adapters from S3 only ----------------------------


@pytest.fixture(scope="module")
def s3_cluster(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, s3_server
) -> Iterator[SimpleNamespace]:
    """``plora up`` with two workers and no host staging, every service confined to a local
    root that does not hold the S3 server's directory, the S3 bucket allowed, and each
    worker's adapter cache under this test's directory."""
    tmp = tmp_path_factory.mktemp("s3cluster")
    root = tmp / "roots"
    root.mkdir()
    assert not str(s3_server.root).startswith(str(root))
    env = {
        **s3_server.env(),
        "PLORA_ADAPTER_SOURCE_ALLOW": f"s3://{BUCKET}/",
        "PLORA_CACHE_DIR": str(tmp / "cache"),  # the workers' adapter caches go below it
    }
    flags = [
        "--workers", "2",
        "--policy", "baseline",
        "--demo-adapters", "0",
        "--adapter-root", str(root),
        "--pool-bytes", "128MiB",
    ]  # fmt: skip
    up = run_plora_up(tmp, model_dir, flags, env)
    state = next(up)
    channel = grpc.insecure_channel(state["gateway"])
    try:
        yield SimpleNamespace(
            tmp=tmp, root=root, state=state, stub=gateway_pb2_grpc.GatewayStub(channel)
        )
    finally:
        channel.close()
        up.close()


def _generate(stub, adapter_id: str, prompt: str) -> str:
    request = gateway_pb2.GenerateRequest(
        adapter_id=adapter_id, prompt=prompt, max_new_tokens=8, temperature=0.0
    )
    return "".join(chunk.text for chunk in stub.Generate(request, timeout=120))


def _metric(state: dict, name: str, **labels: str) -> float:
    """The sum over the workers of one sample of their metrics."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    total = 0.0
    for worker, url in state["metrics"].items():
        if not worker.startswith("worker"):
            continue
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line.startswith(want + " "):
                total += float(line.split()[1])
    return total


def _cache_entries(tmp: Path) -> list[str]:
    caches = tmp / "cache" / "adapter-cache"
    if not caches.is_dir():
        return []
    return sorted(
        entry.name
        for worker in caches.iterdir()
        for entry in worker.iterdir()
        if not entry.name.startswith(".")
    )


@pytest.mark.slow
def test_an_s3_adapter_serves_exactly_as_the_same_adapter_from_a_local_directory(
    s3_cluster, s3_server, model_dir: Path
) -> None:
    """Registered by ``s3://`` (the objects exist nowhere the workers may read), the adapter
    generates (greedy) what the same bytes registered from a local directory generate, on
    every request, through both workers; each worker downloads it once into its cache."""
    from services.worker.model_loader import spec_from_dir  # noqa: PLC0415

    c = s3_cluster
    spec = spec_from_dir(model_dir)
    local = write_peft_adapter(
        c.root / "local", spec, rank=8, alpha=16.0, seed=7, relative_delta=1.0
    )
    source = s3_server.put_adapter(local, "cluster/exact")
    remote = _register(c.stub, source, "remote").adapter
    assert remote.source == source
    assert remote.sha256 == _register(c.stub, str(local), "local").adapter.sha256
    base = _generate(c.stub, "", "The capital of France is")
    for prompt in ("The capital of France is", "Once upon a time", "def add(a, b):"):
        for _ in range(2):  # routed to either worker
            got = _generate(c.stub, "remote", prompt)
            assert got == _generate(c.stub, "local", prompt), prompt
    assert _generate(c.stub, "remote", "The capital of France is") != base  # the LoRA acts
    assert _cache_entries(c.tmp) and set(_cache_entries(c.tmp)) == {remote.sha256}
    downloads = _metric(c.state, "plora_worker_adapter_download_seconds_count")
    assert 1 <= downloads <= 2  # once per worker that served it
    assert _metric(c.state, "plora_worker_adapter_download_bytes_total") >= (
        (local / WEIGHTS).stat().st_size
    )


@pytest.mark.slow
def test_an_object_changed_after_registration_fails_with_failed_precondition_uncached(
    s3_cluster, s3_server, model_dir: Path
) -> None:
    from services.worker.model_loader import spec_from_dir  # noqa: PLC0415

    c = s3_cluster
    spec = spec_from_dir(model_dir)
    local = write_peft_adapter(c.tmp / "tampered", spec, rank=4, alpha=8.0, seed=8)
    source = s3_server.put_adapter(local, "cluster/tampered")
    info = _register(c.stub, source, "tampered").adapter
    weights = bytearray((local / WEIGHTS).read_bytes())
    weights[-2:] = bytes([weights[-2] ^ 1, weights[-1]])  # one bit of one value
    s3_server.put_object(parse_remote(source).key(WEIGHTS), bytes(weights))
    before = _metric(c.state, "plora_worker_adapter_download_failures_total", reason="checksum")
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as err:
            _generate(c.stub, "tampered", "Hello")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        details = err.value.details()
        assert "'tampered' (v1) can no longer be loaded" in details
        assert "changed since registration" in details and str(c.tmp) not in details
    assert info.sha256 not in _cache_entries(c.tmp)
    after = _metric(c.state, "plora_worker_adapter_download_failures_total", reason="checksum")
    assert after >= before + 1
    for worker in (c.tmp / "cache" / "adapter-cache").iterdir():
        assert not [p for p in worker.iterdir() if p.name.startswith(".tmp-")]
    assert os.path.isdir(c.root)
