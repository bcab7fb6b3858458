"""Adapter sources confined to adapter roots, through real servers: a gateway (real Redis, gRPC
on port 0) refuses every source outside its roots with one message, identical for a path that
exists and one that does not; a tenant-confined registration reads only ``ROOT/<tenant>/``;
and (slow) a cluster started by ``plora up --adapter-root`` serves from its roots, its worker
refuses a registry record edited to point outside them and counts it, and a config changed
after registration fails its load with FAILED_PRECONDITION."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from plora.make_adapters import write_peft_adapter
from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.errors import AdapterNotFoundError
from services.common.registry import Registry, WorkerRecord, connect
from services.common.sources import SOURCE_REFUSED, SourceRefusedError
from services.common.types import ModelSpec
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService
from tests.conftest import REPO

#: A tiny served model for registrations through a gateway with no real worker.
SPEC = ModelSpec("m", 2, 8, 16, 2, 1, 4, 32, 64, 10000.0, 1e-6, True)


def _publish_model(redis_url: str) -> None:
    """Publish :data:`SPEC` as the served model (a worker's heartbeat; nothing listens at its
    address, so the gateway's best-effort unloads fail at once)."""
    Registry(connect(redis_url)).heartbeat(
        WorkerRecord("w0", "127.0.0.1:1"), ttl_seconds=60, model=(SPEC, "float32")
    )


@pytest.fixture()
def tree(tmp_path: Path) -> SimpleNamespace:
    """``root/acme/good`` and ``root/bob/theirs`` under the root, ``outside/stolen`` out of
    it, and the ways out of the root a caller could try."""
    root = tmp_path / "root"
    good = write_peft_adapter(root / "acme" / "good", SPEC, rank=4, alpha=8.0, seed=1)
    theirs = write_peft_adapter(root / "bob" / "theirs", SPEC, rank=4, alpha=8.0, seed=2)
    stolen = write_peft_adapter(tmp_path / "outside" / "stolen", SPEC, rank=4, alpha=8.0, seed=3)
    (root / "acme" / "link-out").symlink_to(stolen, target_is_directory=True)
    weights_out = root / "acme" / "weights-out"
    weights_out.mkdir()
    shutil.copy(good / "adapter_config.json", weights_out)
    (weights_out / "adapter_model.safetensors").symlink_to(stolen / "adapter_model.safetensors")
    return SimpleNamespace(
        tmp=tmp_path, root=root, good=good, theirs=theirs, stolen=stolen, weights_out=weights_out
    )


@pytest.fixture()
def confined_gateway(
    redis_url: str, tree: SimpleNamespace
) -> Iterator[tuple[GatewayService, gateway_pb2_grpc.GatewayStub]]:
    _publish_model(redis_url)
    config = GatewayConfig(
        port=0, metrics_port=0, http_port=0, redis_url=redis_url, adapter_roots=(str(tree.root),)
    )
    service = GatewayService(config).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    yield service, gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    service.stop(0)


def _register(stub: gateway_pb2_grpc.GatewayStub, source: str | Path, adapter_id: str = "a"):
    request = gateway_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=str(source))
    return stub.RegisterAdapter(request, timeout=30)


def test_a_gateway_refuses_every_source_outside_its_roots_alike(
    confined_gateway, tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/etc``, ``~``, ``../..``, a directory symlinked out of the root, a root directory
    holding a weights file symlinked out of it, an adapter outside, a missing path: each
    INVALID_ARGUMENT with the same message, naming no path; a directory under the root
    registers as its real path."""
    _, stub = confined_gateway
    monkeypatch.chdir(tree.good)  # the gateway runs in this process: ../.. is the root itself
    refusals = {}
    for source in (
        "/etc",
        "~",
        "../..",
        "../../..",
        tree.root / "acme" / "link-out",
        tree.weights_out,
        tree.stolen,
        tree.root / "acme" / "missing",
        tree.tmp / "outside" / "missing",
        "/etc/no-such-directory",
    ):
        with pytest.raises(grpc.RpcError) as err:
            _register(stub, source)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, source
        refusals[str(source)] = err.value.details()
    assert set(refusals.values()) == {SOURCE_REFUSED}, refusals
    info = _register(stub, tree.good, "acme-good").adapter
    assert info.source == os.path.realpath(tree.good) and info.version == 1
    listed = stub.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=10)
    assert [a.adapter_id for a in listed.adapters] == ["acme-good"]  # nothing else got in


def test_a_tenant_confined_registration_reads_only_its_own_directory(
    confined_gateway, tree
) -> None:
    """``register_adapter(..., confine_to_tenant=True)`` (what a tenant's key gets): the
    source must lie under ``ROOT/<tenant>/``; another tenant's adapter and a missing path
    there are refused with the same message."""
    service, _ = confined_gateway
    core = service.core
    record = core.register_adapter("acme/a", str(tree.good), "acme", confine_to_tenant=True)
    assert record.tenant_id == "acme" and record.source == os.path.realpath(tree.good)
    messages = set()
    for source in (tree.theirs, tree.root / "bob" / "missing", tree.root / "acme" / "link-out"):
        with pytest.raises(SourceRefusedError) as err:
            core.register_adapter("acme/b", str(source), "acme", confine_to_tenant=True)
        messages.add(str(err.value))
    assert messages == {SOURCE_REFUSED}
    # the same source, registered by the operator (not tenant-confined), is under a root
    assert core.register_adapter("bob/t", str(tree.theirs), "bob").version == 1
    with pytest.raises(AdapterNotFoundError):
        core.registry.get_adapter("acme/b")


def test_without_roots_sources_are_read_as_given_but_no_tenant_has_a_directory(
    redis_url: str, tree
) -> None:
    """No roots: a source anywhere registers as today; a tenant-confined registration is
    refused, since no directory is the tenant's."""
    _publish_model(redis_url)
    service = GatewayService(
        GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    ).start()
    try:
        assert service.core.register_adapter("a", str(tree.stolen), "").version == 1
        with pytest.raises(SourceRefusedError):
            service.core.register_adapter("b", str(tree.good), "acme", confine_to_tenant=True)
    finally:
        service.stop(0)


# -- a whole cluster: plora up --adapter-root ----------------------------------------------


@pytest.fixture(scope="module")
def confined_cluster(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[SimpleNamespace]:
    """``plora up --adapter-root ROOT`` with one worker, no predictor and no host staging
    (a source is read when a request first needs it): the roots reach the gateway and the
    worker, and the demo adapters' directory is a root too."""
    tmp = tmp_path_factory.mktemp("confined")
    root = tmp / "roots"
    root.mkdir()
    state_file = tmp / "cluster.json"
    log = open(tmp / "up.log", "wb")  # noqa: SIM115
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PLORA_REDIS_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "plora.cli", "up",
            "--state-file", str(state_file),
            "--gateway-port", "0",
            "--workers", "1",
            "--policy", "baseline",
            "--demo-adapters", "1",
            "--adapters-dir", str(tmp / "demo"),
            "--adapter-root", str(root),
            "--model", str(model_dir),
            "--pool-bytes", "128MiB",
        ],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            pytest.fail(f"plora up did not come up:\n{(tmp / 'up.log').read_text()[-4000:]}")
        time.sleep(0.2)
    from plora.launcher import read_credentials  # noqa: PLC0415

    state = json.loads(state_file.read_text())
    state["redis_url"] = read_credentials(state_file)["redis_url"]  # with the password
    channel = grpc.insecure_channel(state["gateway"])
    try:
        yield SimpleNamespace(
            tmp=tmp, root=root, state=state, stub=gateway_pb2_grpc.GatewayStub(channel)
        )
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            log.close()


def _generate(stub: gateway_pb2_grpc.GatewayStub, adapter_id: str) -> str:
    request = gateway_pb2.GenerateRequest(adapter_id=adapter_id, prompt="Hi", max_new_tokens=2)
    return "".join(chunk.text for chunk in stub.Generate(request, timeout=120))


def _refused_total(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("plora_worker_adapter_source_refused_total "):
            return float(line.split()[1])
    raise AssertionError("plora_worker_adapter_source_refused_total is not exported")


@pytest.mark.slow
def test_plora_up_confines_its_gateway_and_worker_to_the_roots(
    confined_cluster, model_dir: Path
) -> None:
    """The demo adapter (its directory a root) serves; a source outside the roots is refused
    at registration; a registry record edited to point outside the roots (at an adapter
    with the same sha256, so only the roots can refuse it) is refused by the real worker,
    counted, and answered FAILED_PRECONDITION naming the adapter and no path; a config
    changed after registration fails its load with FAILED_PRECONDITION naming the adapter."""
    from services.worker.model_loader import spec_from_dir  # noqa: PLC0415

    c = confined_cluster
    stub = c.stub
    spec = spec_from_dir(model_dir)
    [demo] = c.state["adapters"]
    assert _generate(stub, demo)  # registered from --adapters-dir and read by the worker

    outside = write_peft_adapter(c.tmp / "outside" / "x", spec, rank=4, alpha=8.0, seed=5)
    with pytest.raises(grpc.RpcError) as err:
        _register(stub, outside, "outside")
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        SOURCE_REFUSED,
    )

    # a record pointing outside the roots: registered from under the root, then edited
    inside = c.root / "acme" / "moved"
    shutil.copytree(outside, inside)
    assert _register(stub, inside, "acme/moved").adapter.version == 1
    registry = Registry(connect(c.state["redis_url"]))
    record = registry.get_adapter("acme/moved")
    for edited_source in (str(outside), "/etc"):
        assert registry.put_adapter(dataclasses.replace(record, source=edited_source))
        before = _refused_total(c.state["metrics"]["worker-0"])
        with pytest.raises(grpc.RpcError) as err:
            _generate(stub, "acme/moved")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "'acme/moved' (v1) can no longer be loaded" in err.value.details()
        assert str(c.tmp) not in err.value.details() and "/etc" not in err.value.details()
        assert _refused_total(c.state["metrics"]["worker-0"]) > before

    # a config changed after registration
    changed = write_peft_adapter(c.root / "acme" / "cfg", spec, rank=4, alpha=8.0, seed=6)
    assert _register(stub, changed, "acme/cfg").adapter.version == 1
    config = changed / "adapter_config.json"
    raw = json.loads(config.read_text())
    raw["lora_alpha"] = 2 * raw["lora_alpha"]
    config.write_text(json.dumps(raw))
    with pytest.raises(grpc.RpcError) as err:
        _generate(stub, "acme/cfg")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    details = err.value.details()
    assert "'acme/cfg' (v1)" in details and "changed since registration" in details
    assert str(c.root) not in details
