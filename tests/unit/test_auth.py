"""API keys: the keys file's format, key lookup, the tenant a call acts as, and the rule that
keeps a gateway reachable from other hosts from serving without keys."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from services.common.errors import ConfigError, TenantMismatchError, UnauthenticatedError
from services.gateway.auth import (
    UNAUTHENTICATED_MESSAGE,
    KeyRing,
    Principal,
    bearer_key,
    effective_tenant,
    sees_everything,
)
from services.gateway.config import GatewayConfig, is_loopback
from tests.helpers import config_from_flags


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


KEYS = {
    "keys": [
        {"sha256": sha("acme-key"), "tenant": "acme"},
        {"sha256": sha("beta-key").upper(), "tenant": "beta", "name": "beta's CI"},
        {"sha256": sha("root-key"), "operator": True},
    ]
}


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_a_keys_file_in_json_or_yaml_maps_each_key_to_its_principal(
    tmp_path: Path, suffix: str
) -> None:
    import yaml

    path = tmp_path / f"keys{suffix}"
    path.write_text(json.dumps(KEYS) if suffix == ".json" else yaml.safe_dump(KEYS))
    ring = KeyRing.from_file(path)
    assert len(ring) == 3
    assert ring.principal_for("acme-key") == Principal(tenant="acme")
    assert ring.principal_for("beta-key") == Principal(tenant="beta")  # upper-case hex too
    assert ring.principal_for("root-key") == Principal(operator=True)
    assert ring.principal_for("unknown") is None
    assert ring.principal_for(sha("acme-key")) is None  # the hash is not a key


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], 'expected {"keys"'),
        ({"key": []}, 'expected {"keys"'),
        ({"keys": [], "extra": 1}, "unknown top-level field"),
        ({"keys": []}, "no keys listed"),
        ({"keys": ["abc"]}, r"keys\[0\]: expected a mapping"),
        ({"keys": [{"sha256": "acme-key", "tenant": "acme"}]}, "never the key itself"),
        ({"keys": [{"sha256": "z" * 64, "tenant": "acme"}]}, "64 hex digits"),
        ({"keys": [{"tenant": "acme"}]}, "64 hex digits"),
        ({"keys": [{"sha256": sha("k")}]}, "exactly one of tenant"),
        ({"keys": [{"sha256": sha("k"), "tenant": "a", "operator": True}]}, "exactly one of"),
        ({"keys": [{"sha256": sha("k"), "operator": "yes"}]}, "operator must be true or false"),
        ({"keys": [{"sha256": sha("k"), "tenant": 7}]}, "tenant must be a string"),
        ({"keys": [{"sha256": sha("k"), "tenant": "a b"}]}, "tenant_id 'a b' is invalid"),
        ({"keys": [{"sha256": sha("k"), "tennant": "a"}]}, r"unknown field\(s\) \['tennant'\]"),
        (
            {"keys": [{"sha256": sha("k"), "tenant": "a"}, {"sha256": sha("k"), "operator": True}]},
            r"keys\[1\] repeats the sha256",
        ),
    ],
)
def test_a_malformed_keys_file_is_refused_naming_the_entry(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        KeyRing.parse(data, "keys.json")
    assert str(err.value).startswith("keys.json")
    assert "acme-key" not in str(err.value)  # a key pasted by mistake is not echoed


def test_an_unreadable_or_unparsable_keys_file_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--api-keys-file / PLORA_API_KEYS_FILE .*cannot read"):
        KeyRing.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "keys.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KeyRing.from_file(bad)
    bad = tmp_path / "keys.yaml"
    bad.write_text("keys: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        KeyRing.from_file(bad)


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ([("authorization", "Bearer acme-key")], "acme-key"),
        ([("authorization", "bearer acme-key")], "acme-key"),
        ([("x-other", "1"), ("authorization", b"Bearer acme-key")], "acme-key"),
        ([("authorization", "Basic YWNtZQ==")], ""),
        ([("authorization", "Bearer ")], ""),
        ([("authorization", "acme-key")], ""),
        ([], ""),
        (None, ""),
    ],
)
def test_the_key_is_taken_from_a_bearer_authorization_entry_only(
    metadata: list | None, key: str
) -> None:
    assert bearer_key(metadata) == key


def test_a_call_without_a_known_key_is_refused_with_one_message() -> None:
    ring = KeyRing.parse(KEYS)
    assert ring.authenticate([("authorization", "Bearer root-key")]).operator
    refusals = []
    for metadata in ([], [("authorization", "Bearer nope")], [("authorization", "Basic x")]):
        with pytest.raises(UnauthenticatedError) as err:
            ring.authenticate(metadata)
        refusals.append(str(err.value))
    assert refusals == [UNAUTHENTICATED_MESSAGE] * 3


def test_a_tenant_key_acts_as_its_tenant_and_names_no_other() -> None:
    acme = Principal(tenant="acme")
    assert effective_tenant(acme, "") == "acme"
    assert effective_tenant(acme, "acme") == "acme"
    with pytest.raises(TenantMismatchError, match="tenant_id 'beta' is not the tenant of this"):
        effective_tenant(acme, "beta")
    operator = Principal(operator=True)
    assert effective_tenant(operator, "") == "" and effective_tenant(operator, "beta") == "beta"
    assert effective_tenant(None, "beta") == "beta"  # no keys: as before
    assert sees_everything(None) and sees_everything(operator) and not sees_everything(acme)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("gateway.example", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_gateway_reachable_from_other_hosts_needs_keys_or_the_explicit_opt_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("PLORA_API_KEYS_FILE", "PLORA_INSECURE_NO_AUTH", "PLORA_GATEWAY_HOST"):
        monkeypatch.delenv(name, raising=False)
    config_from_flags(GatewayConfig).check_security()  # loopback: as before
    exposed = config_from_flags(GatewayConfig, "--host", "0.0.0.0")
    with pytest.raises(ConfigError) as err:
        exposed.check_security()
    assert "--api-keys-file" in str(err.value) and "--insecure-no-auth" in str(err.value)
    config_from_flags(GatewayConfig, "--host", "0.0.0.0", "--insecure-no-auth").check_security()
    config_from_flags(GatewayConfig, "--host", "0.0.0.0", "--api-keys-file", "k").check_security()
    monkeypatch.setenv("PLORA_INSECURE_NO_AUTH", "1")
    config_from_flags(GatewayConfig, "--host", "0.0.0.0").check_security()
    monkeypatch.setenv("PLORA_INSECURE_NO_AUTH", "maybe")
    with pytest.raises(ConfigError, match="PLORA_INSECURE_NO_AUTH='maybe' is not a yes/no"):
        config_from_flags(GatewayConfig)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert", "c.pem"], "--tls-cert / PLORA_TLS_CERT and --tls-key"),
        (["--tls-key", "k.pem"], "--tls-cert / PLORA_TLS_CERT and --tls-key"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca / PLORA_TLS_CLIENT_CA .* needs TLS"),
    ],
)
def test_incomplete_tls_settings_are_refused_naming_the_flags(
    flags: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_flags(GatewayConfig, *flags).check_security()
