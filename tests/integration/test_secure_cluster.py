"""The real cluster from ``plora up`` with API keys and mutual TLS on the gateway: a
representative part of the cluster tests (generate, the CLI, an adapter's lifecycle) passes
through it with the operator's key, and the keys decide what each tenant may do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.grpc_util import client_channel, tls_channel_credentials
from tests.conftest import REPO, SECURE_KEYS

# the cluster tests run here too, against the fixtures below
from tests.integration.test_cluster import (  # noqa: F401
    test_adapter_lifecycle_register_get_list_delete,
    test_bad_generate_requests_are_invalid_argument,
    test_base_model_answers_paris_streamed,
    test_cli_generate_streams_paris,
    test_empty_prompt_is_named_in_the_refusal,
    test_seeded_sampling_is_reproducible,
    test_stop_string_ends_generation,
    test_unknown_adapter_is_not_found,
)

pytestmark = pytest.mark.slow

GATEWAY = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]


@pytest.fixture(scope="module", autouse=True)
def client_env(secure_cluster: dict) -> Iterator[dict[str, str]]:
    """The operator's key and the TLS files in this process's environment, for the CLI runs."""
    with pytest.MonkeyPatch.context() as m:
        for name, value in secure_cluster["client_env"].items():
            m.setenv(name, value)
        m.setenv("PLORA_STATE_FILE", str(Path(secure_cluster["root"]) / "cluster.json"))
        yield secure_cluster["client_env"]


@pytest.fixture(scope="module")
def cluster(secure_cluster: dict) -> dict:
    """The cluster of the cluster tests imported above: the secure one."""
    return secure_cluster


def _credentials(cluster: dict) -> grpc.ChannelCredentials:
    tls = cluster["tls"]
    return tls_channel_credentials(tls["ca"], tls["client_cert"], tls["client_key"])


def _stub(cluster: dict, who: str = "operator", key: str | None = None):
    channel = client_channel(
        cluster["gateway"], _credentials(cluster), SECURE_KEYS[who] if key is None else key
    )
    return channel, gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture(scope="module")
def stub(secure_cluster: dict) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    """The operator's stub over mutual TLS."""
    channel, gateway = _stub(secure_cluster)
    yield gateway
    channel.close()


def _chat(**kw: object) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(max_new_tokens=4, **kw)
    request.messages.add(role="user", content="What is the capital of France?")
    return request


def _code(fn) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def test_every_rpc_without_a_known_key_is_unauthenticated_and_health_answers(
    secure_cluster: dict,
) -> None:
    g = gateway_pb2
    calls = {
        "Generate": lambda s: list(s.Generate(_chat(), timeout=30)),
        "RegisterAdapter": lambda s: s.RegisterAdapter(
            g.RegisterAdapterRequest(adapter_id="x", source="/x"), timeout=30
        ),
        "GetAdapter": lambda s: s.GetAdapter(g.GetAdapterRequest(adapter_id="x"), timeout=30),
        "ListAdapters": lambda s: s.ListAdapters(g.ListAdaptersRequest(), timeout=30),
        "DeleteAdapter": lambda s: s.DeleteAdapter(
            g.DeleteAdapterRequest(adapter_id="x"), timeout=30
        ),
        "GetClusterStatus": lambda s: s.GetClusterStatus(g.GetClusterStatusRequest(), timeout=30),
    }
    assert set(calls) == set(GATEWAY.methods_by_name)
    for key in ("", "not-a-key"):
        channel, gateway = _stub(secure_cluster, key=key)
        with channel:
            for name, fn in calls.items():
                code = _code(lambda fn=fn, gateway=gateway: fn(gateway))
                assert code == grpc.StatusCode.UNAUTHENTICATED, (name, key)
            # refused before the request is parsed: bytes that are no request, alike
            raw = channel.unary_unary("/plora.v1.Gateway/RegisterAdapter")
            garbage = _code(lambda raw=raw: raw(b"\xff\xff\xff not a protobuf", timeout=30))
            assert garbage == grpc.StatusCode.UNAUTHENTICATED, key
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    # plaintext, or TLS without the client certificate, does not reach the gateway at all
    with grpc.insecure_channel(secure_cluster["gateway"]) as plain:
        health = health_pb2_grpc.HealthStub(plain)
        code = _code(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
    no_cert = tls_channel_credentials(secure_cluster["tls"]["ca"])
    with client_channel(secure_cluster["gateway"], no_cert, SECURE_KEYS["operator"]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        code = _code(lambda: stub.ListAdapters(g.ListAdaptersRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE


def test_tenant_keys_decide_what_each_tenant_lists_serves_and_sees(
    secure_cluster: dict, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    """acme registers a copy of a demo adapter under its own directory, beta another; acme
    lists only its own and the shared demo adapters without sources, cannot name beta or
    generate with beta's adapter, and sees only their residency; the operator sees all."""
    root = Path(secure_cluster["root"]) / "adapters"
    demo = secure_cluster["adapters"]
    ids = {}
    for tenant, index in (("acme", 0), ("beta", 1)):
        source = root / tenant / f"{tenant}-copy"
        shutil.copytree(root / demo[index], source, dirs_exist_ok=True)
        channel, gateway = _stub(secure_cluster, tenant)
        with channel:
            info = gateway.RegisterAdapter(
                gateway_pb2.RegisterAdapterRequest(adapter_id=f"{tenant}-copy", source=str(source)),
                timeout=60,
            ).adapter
        assert info.tenant_id == tenant and info.source == ""
        ids[tenant] = info.adapter_id
    channel, acme = _stub(secure_cluster, "acme")
    with channel:
        listed = acme.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=30).adapters
        assert {a.adapter_id for a in listed} == {ids["acme"], *demo}
        assert all(a.source == "" for a in listed)
        code = _code(
            lambda: acme.ListAdapters(gateway_pb2.ListAdaptersRequest(tenant_id="beta"), timeout=30)
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        code = _code(lambda: list(acme.Generate(_chat(adapter_id=ids["beta"]), timeout=60)))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        chunks = list(acme.Generate(_chat(adapter_id=ids["acme"]), timeout=120))
        assert chunks[-1].usage.completion_tokens > 0
        list(stub.Generate(_chat(adapter_id=ids["beta"], tenant_id="beta"), timeout=120))
        deadline = time.monotonic() + 10
        while not {ids["acme"], ids["beta"]} <= _resident(stub):  # as of the next heartbeat
            assert time.monotonic() < deadline, _resident(stub)
            time.sleep(0.2)
        assert ids["acme"] in _resident(acme) and ids["beta"] not in _resident(acme)
        status = acme.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=30)
        assert status.adapters_registered == len(demo) + 1
        assert all(w.address == "" for w in status.workers)
    everything = stub.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=30).adapters
    assert {ids["acme"], ids["beta"], *demo} <= {a.adapter_id for a in everything}
    assert all(a.source for a in everything)
    for tenant in ("acme", "beta"):
        stub.DeleteAdapter(
            gateway_pb2.DeleteAdapterRequest(adapter_id=ids[tenant], tenant_id=tenant), timeout=30
        )


def _resident(gateway: gateway_pb2_grpc.GatewayStub) -> set[str]:
    status = gateway.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=30)
    return {a for w in status.workers for a in w.resident_adapters}


def test_cli_status_and_adapters_list_over_mutual_tls_with_the_key(secure_cluster: dict) -> None:
    for argv, needle in (
        (["status"], "worker-0"),
        (["adapters", "list"], secure_cluster["adapters"][0]),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "plora.cli", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert needle in proc.stdout


def test_no_key_reaches_the_state_file_a_log_or_a_services_command_line_or_environment(
    secure_cluster: dict,
) -> None:
    state = (Path(secure_cluster["root"]) / "cluster.json").read_text()
    secrets = [*SECURE_KEYS.values()]
    assert not any(secret in state for secret in secrets)
    logs = [Path(secure_cluster["log"]), *(Path(secure_cluster["root"]) / "logs").glob("*.log")]
    assert len(logs) > 2
    for log in logs:
        assert not any(secret in log.read_text() for secret in secrets), log
    for name, pid in secure_cluster["pids"].items():
        proc = Path(f"/proc/{pid}")
        seen = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        assert not any(secret.encode() in seen for secret in secrets), name
        assert b"PLORA_API_KEY" not in (proc / "environ").read_bytes(), name
    assert os.environ["PLORA_API_KEY"] == SECURE_KEYS["operator"]  # the test's own client
