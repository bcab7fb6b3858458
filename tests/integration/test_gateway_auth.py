"""API keys and TLS on a real gateway (real gRPC server on port 0, real Redis, a real worker
server streaming tokens): keys decide the tenant, tenants see only their own and shared
adapters, TLS and mutual TLS, and the gateway processes that refuse to start."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plora.make_adapters import write_peft_adapter
from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.grpc_util import client_channel, tls_channel_credentials
from services.common.registry import Registry, WorkerRecord, connect
from services.gateway.auth import UNAUTHENTICATED_MESSAGE
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService
from tests.conftest import REPO
from tests.helpers import write_tls_files
from tests.integration.test_gateway_alone import SPEC, _start_token_streamer

#: The keys of the tests, by whom they act as.
KEYS = {"acme": "acme-secret-1", "beta": "beta-secret-2", "operator": "operator-secret-3"}

GATEWAY = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]


def write_keys_file(path: Path) -> Path:
    """A keys file with :data:`KEYS`' hashes: acme's and beta's tenant keys, the operator's."""
    entries = [
        {"sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": who}
        if who != "operator"
        else {"sha256": hashlib.sha256(key.encode()).hexdigest(), "operator": True}
        for who, key in KEYS.items()
    ]
    path.write_text(json.dumps({"keys": entries}))
    return path


def bearer(who: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[who]}")]


def call(channel: grpc.Channel, name: str, request: Any, metadata: Any = None) -> Any:
    """Call the Gateway RPC ``name`` on ``channel`` (a stream is read to its end)."""
    method = GATEWAY.methods_by_name[name]
    response_class = getattr(gateway_pb2, method.output_type.name)
    path = f"/{GATEWAY.full_name}/{name}"
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    stub = kind(
        path,
        request_serializer=type(request).SerializeToString,
        response_deserializer=response_class.FromString,
    )
    result = stub(request, metadata=metadata, timeout=10)
    return list(result) if method.server_streaming else result


def refused(code: grpc.StatusCode, fn: Callable[[], Any]) -> str:
    """Run ``fn``, which must fail with ``code``; returns the message."""
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.code() == code, err.value.details()
    return err.value.details() or ""


@pytest.fixture()
def keyed(redis_url: str, tmp_path: Path) -> Iterator[tuple[GatewayService, grpc.Channel]]:
    """A gateway with API keys over a worker server that streams tokens; its adapter root is
    ``tmp_path / "adapters"`` (tenants register under ``adapters/<tenant>/``)."""
    worker, _port = _start_token_streamer(redis_url, 0.0)
    keys = write_keys_file(tmp_path / "keys.json")
    (tmp_path / "adapters").mkdir()
    config = GatewayConfig(
        port=0,
        metrics_port=0,
        http_port=0,
        redis_url=redis_url,
        api_keys_file=str(keys),
        adapter_roots=(str(tmp_path / "adapters"),),
    )
    service = GatewayService(config).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    yield service, channel
    channel.close()
    service.stop(0)
    worker.stop(0)


def test_every_gateway_rpc_without_a_known_key_is_unauthenticated_and_health_answers(
    keyed: tuple[GatewayService, grpc.Channel], caplog: pytest.LogCaptureFixture
) -> None:
    """Each RPC of ``plora.v1.Gateway`` (read from its descriptor, so a new RPC is covered),
    called without a key, with an unknown key and with a key in another scheme, is refused
    UNAUTHENTICATED with one message; health and reflection answer without a key; no key
    reaches the log."""
    caplog.set_level(logging.DEBUG)
    service, channel = keyed
    assert len(GATEWAY.methods) >= 6
    for method in GATEWAY.methods:
        request = getattr(gateway_pb2, method.input_type.name)()
        for metadata in (
            None,
            [("authorization", "Bearer not-a-key")],
            [("authorization", f"Basic {KEYS['operator']}")],
        ):
            message = refused(
                grpc.StatusCode.UNAUTHENTICATED,
                lambda m=method.name, r=request, md=metadata: call(channel, m, r, md),
            )
            assert message == UNAUTHENTICATED_MESSAGE, method.name
    assert service.metrics.unauthenticated._value.get() == 3 * len(GATEWAY.methods)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert GATEWAY.full_name in names
    # a known key passes
    request = gateway_pb2.GetClusterStatusRequest()
    status = call(channel, "GetClusterStatus", request, bearer("acme"))
    assert status.base_model == SPEC.name
    assert "not-a-key" not in caplog.text
    assert not any(key in caplog.text for key in KEYS.values())


def test_a_tenant_key_naming_another_tenant_is_permission_denied_on_every_rpc(
    keyed: tuple[GatewayService, grpc.Channel],
) -> None:
    _service, channel = keyed
    g = gateway_pb2
    requests = {
        "Generate": g.GenerateRequest(prompt="hi", tenant_id="beta"),
        "RegisterAdapter": g.RegisterAdapterRequest(adapter_id="x", source="/x", tenant_id="beta"),
        "GetAdapter": g.GetAdapterRequest(adapter_id="x", tenant_id="beta"),
        "ListAdapters": g.ListAdaptersRequest(tenant_id="beta"),
        "DeleteAdapter": g.DeleteAdapterRequest(adapter_id="x", tenant_id="beta"),
    }
    for name, request in requests.items():
        message = refused(
            grpc.StatusCode.PERMISSION_DENIED,
            lambda n=name, r=request: call(channel, n, r, bearer("acme")),
        )
        assert "tenant_id 'beta' is not the tenant of this API key" in message, name


def test_tenants_see_and_serve_only_their_own_and_shared_adapters(
    keyed: tuple[GatewayService, grpc.Channel], redis_url: str, tmp_path: Path
) -> None:
    """acme lists and reads only its own and the shared adapters, without source paths, and
    cannot read, serve or delete beta's; a tenant key registers under its own tenant and
    cannot delete a shared adapter; the operator sees everything, sources included;
    GetClusterStatus shows a tenant only the residency of adapters it may use and no
    worker addresses."""
    _service, channel = keyed
    root = tmp_path / "adapters"
    sources = {
        "acme/a1": write_peft_adapter(root / "acme" / "a1", SPEC, rank=4, alpha=8.0, seed=1),
        "beta/b1": write_peft_adapter(root / "beta" / "b1", SPEC, rank=4, alpha=8.0, seed=2),
        "shared": write_peft_adapter(root / "shared", SPEC, rank=4, alpha=8.0, seed=3),
    }

    def register(adapter_id: str, who: str) -> gateway_pb2.AdapterInfo:
        request = gateway_pb2.RegisterAdapterRequest(
            adapter_id=adapter_id, source=str(sources[adapter_id])
        )
        return call(channel, "RegisterAdapter", request, bearer(who)).adapter

    with pytest.raises(grpc.RpcError) as not_mine:  # beta's directory is not acme's
        call(
            channel,
            "RegisterAdapter",
            gateway_pb2.RegisterAdapterRequest(adapter_id="x", source=str(sources["beta/b1"])),
            bearer("acme"),
        )
    assert not_mine.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    mine = register("acme/a1", "acme")
    assert mine.tenant_id == "acme" and mine.source == ""  # no tenant_id given: the key's
    assert register("beta/b1", "beta").tenant_id == "beta"
    shared = register("shared", "operator")
    assert shared.tenant_id == "" and shared.source == str(sources["shared"])

    def listed(who: str) -> dict[str, gateway_pb2.AdapterInfo]:
        response = call(channel, "ListAdapters", gateway_pb2.ListAdaptersRequest(), bearer(who))
        return {a.adapter_id: a for a in response.adapters}

    acme = listed("acme")
    assert set(acme) == {"acme/a1", "shared"}
    assert all(a.source == "" for a in acme.values())
    everything = listed("operator")
    assert set(everything) == {"acme/a1", "beta/b1", "shared"}
    assert {a.source for a in everything.values()} == {str(p) for p in sources.values()}

    got = call(
        channel, "GetAdapter", gateway_pb2.GetAdapterRequest(adapter_id="shared"), bearer("acme")
    )
    assert got.adapter.adapter_id == "shared" and got.adapter.source == ""
    for name, request in {
        "GetAdapter": gateway_pb2.GetAdapterRequest(adapter_id="beta/b1"),
        "Generate": gateway_pb2.GenerateRequest(
            adapter_id="beta/b1", prompt="hi", max_new_tokens=2
        ),
        "DeleteAdapter": gateway_pb2.DeleteAdapterRequest(adapter_id="beta/b1"),
    }.items():
        message = refused(
            grpc.StatusCode.PERMISSION_DENIED,
            lambda n=name, r=request: call(channel, n, r, bearer("acme")),
        )
        assert "beta" not in message.replace("'beta/b1'", ""), message  # names no owner
    refused(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: call(
            channel,
            "DeleteAdapter",
            gateway_pb2.DeleteAdapterRequest(adapter_id="shared"),
            bearer("acme"),
        ),
    )
    chunks = call(
        channel,
        "Generate",
        gateway_pb2.GenerateRequest(adapter_id="acme/a1", prompt="hi", max_new_tokens=3),
        bearer("acme"),
    )
    assert "".join(c.text for c in chunks) == "xxx"

    # residency as the worker's heartbeat reports it
    worker = next(w for w in Registry(connect(redis_url)).list_workers() if w.worker_id == "w0")
    Registry(connect(redis_url)).heartbeat(
        WorkerRecord(
            "w0", worker.address, metrics_url="http://w0/metrics", resident=list(everything)
        ),
        ttl_seconds=60,
    )
    request = gateway_pb2.GetClusterStatusRequest()
    seen = call(channel, "GetClusterStatus", request, bearer("acme"))
    assert [sorted(w.resident_adapters) for w in seen.workers] == [["acme/a1", "shared"]]
    assert seen.adapters_registered == 2
    assert all(w.address == "" and w.metrics_url == "" for w in seen.workers)
    whole = call(channel, "GetClusterStatus", request, bearer("operator"))
    assert [sorted(w.resident_adapters) for w in whole.workers] == [sorted(everything)]
    assert whole.adapters_registered == 3 and whole.workers[0].address == worker.address

    # the operator acts as a named tenant, or as the owner of shared adapters
    as_beta = call(
        channel,
        "ListAdapters",
        gateway_pb2.ListAdaptersRequest(tenant_id="beta"),
        bearer("operator"),
    )
    assert {a.adapter_id for a in as_beta.adapters} == {"beta/b1", "shared"}
    deleted = call(
        channel,
        "DeleteAdapter",
        gateway_pb2.DeleteAdapterRequest(adapter_id="shared"),
        bearer("operator"),
    )
    assert deleted.version == 1


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made now."""
    return write_tls_files(tmp_path_factory.mktemp("tls"))


def _tls_gateway(redis_url: str, tls: dict[str, str], **extra: Any) -> GatewayService:
    config = GatewayConfig(
        port=0,
        metrics_port=0,
        http_port=0,
        redis_url=redis_url,
        tls_cert=tls["server_cert"],
        tls_key=tls["server_key"],
        **extra,
    )
    return GatewayService(config).start()


def _status(address: str, credentials: grpc.ChannelCredentials | None, key: str = "") -> Any:
    with client_channel(address, credentials, key) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=5)


def test_tls_clients_that_trust_the_ca_connect_and_others_fail(
    redis_url: str, tls: dict[str, str]
) -> None:
    service = _tls_gateway(redis_url, tls)
    address = f"127.0.0.1:{service.port}"
    try:
        _status(address, tls_channel_credentials(tls["ca"]))
        refused(grpc.StatusCode.UNAVAILABLE, lambda: _status(address, None))  # plaintext
        refused(
            grpc.StatusCode.UNAVAILABLE,
            lambda: _status(address, tls_channel_credentials(tls["other_ca"])),
        )
    finally:
        service.stop(0)


def test_mutual_tls_refuses_a_client_without_a_certificate(
    redis_url: str, tls: dict[str, str]
) -> None:
    service = _tls_gateway(redis_url, tls, tls_client_ca=tls["ca"])
    address = f"127.0.0.1:{service.port}"
    try:
        _status(address, tls_channel_credentials(tls["ca"], tls["client_cert"], tls["client_key"]))
        refused(
            grpc.StatusCode.UNAVAILABLE,
            lambda: _status(address, tls_channel_credentials(tls["ca"])),
        )
    finally:
        service.stop(0)


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PLORA_")}
    return subprocess.run(
        [sys.executable, "-m", "plora.cli", *argv],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_sends_its_key_over_tls_with_the_ca_and_fails_without(
    redis_url: str, tls: dict[str, str], tmp_path: Path
) -> None:
    """``plora status`` with ``PLORA_TLS_CA`` (or ``--tls-ca``) and ``PLORA_API_KEY`` reaches a
    gateway with TLS and keys; without the CA it cannot connect, without the key it is
    refused UNAUTHENTICATED with a hint."""
    keys = write_keys_file(tmp_path / "keys.json")
    service = _tls_gateway(redis_url, tls, api_keys_file=str(keys))
    gateway = ["--gateway", f"127.0.0.1:{service.port}"]
    key = {"PLORA_API_KEY": KEYS["operator"]}
    try:
        ok = _cli("status", *gateway, env={"PLORA_TLS_CA": tls["ca"], **key})
        assert ok.returncode == 0, ok.stderr
        assert "adapters registered: 0" in ok.stdout
        flag = _cli("status", *gateway, "--tls-ca", tls["ca"], env=key)
        assert flag.returncode == 0, flag.stderr
        plain = _cli("status", *gateway, env=key)
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr, plain.stderr
        keyless = _cli("status", *gateway, env={"PLORA_TLS_CA": tls["ca"]})
        assert keyless.returncode == 1
        assert "UNAUTHENTICATED" in keyless.stderr and "PLORA_API_KEY" in keyless.stderr
        missing = _cli("status", *gateway, env={"PLORA_TLS_CA": str(tmp_path / "none.pem")})
        assert missing.returncode == 2 and "--tls-ca / PLORA_TLS_CA" in missing.stderr
    finally:
        service.stop(0)


def _serve_gateway(redis_url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return _cli(
        "serve",
        "gateway",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--redis-url",
        redis_url,
        *flags,
        env={},
    )


def test_a_gateway_on_a_non_loopback_address_without_keys_refuses_to_start(
    redis_url: str,
) -> None:
    """The process exits 2 before it binds, naming both ways out."""
    proc = _serve_gateway(redis_url, "--host", "0.0.0.0")
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "--api-keys-file" in out and "--insecure-no-auth" in out, out


def test_a_malformed_keys_file_stops_the_gateway_at_start(redis_url: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - sha256: my-actual-key\n    tenant: acme\n")
    proc = _serve_gateway(redis_url, "--api-keys-file", str(keys))
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert f"--api-keys-file / PLORA_API_KEYS_FILE '{keys}': keys[0]: sha256 must be" in out
    assert "my-actual-key" not in out
