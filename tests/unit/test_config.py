"""Config parsing: byte sizes, env fallbacks and cross-field checks."""

from __future__ import annotations

import itertools
import re

import pytest

from services.common.config import parse_bytes
from services.common.errors import ConfigError
from services.gateway.config import GatewayConfig
from services.predictor.config import PredictorConfig
from services.worker.config import WorkerConfig
from tests.conftest import REPO
from tests.helpers import config_from_flags


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1048576", 1 << 20),
        ("4MiB", 4 << 20),
        ("4M", 4 << 20),
        ("1.5GiB", 3 << 29),
        ("512KiB", 512 << 10),
        ("2MB", 2_000_000),
        (7, 7),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "4XB", "MiB"])
def test_parse_bytes_rejects_garbage(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_worker_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLORA_POOL_BYTES", "64MiB")
    monkeypatch.setenv("PLORA_ALLOCATOR", "contiguous")
    cfg = config_from_flags(WorkerConfig, "--allocator", "paged")
    assert cfg.pool_bytes == 64 << 20 and cfg.allocator == "paged"


def test_worker_host_cache_must_cover_pool() -> None:
    with pytest.raises(ConfigError, match="host_cache_bytes"):
        WorkerConfig(pool_bytes=1 << 30, host_cache_bytes=1 << 20)


def test_worker_host_staging_is_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_flags(WorkerConfig).host_staging == "on"
    monkeypatch.setenv("PLORA_HOST_STAGING", "off")
    assert config_from_flags(WorkerConfig).host_staging == "off"
    assert config_from_flags(WorkerConfig, "--host-staging", "on").host_staging == "on"
    with pytest.raises(ConfigError, match="host_staging"):
        WorkerConfig(host_staging="yes")


def test_gateway_rejects_unknown_routing() -> None:
    with pytest.raises(ConfigError, match="routing"):
        GatewayConfig(routing="random")


def test_gateway_default_max_new_tokens_follows_a_lower_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A limit below the default of 64 lowers the default with it (it used to stop the
    gateway from starting); an explicit default above the limit is refused by name."""
    assert config_from_flags(GatewayConfig).default_max_new_tokens == 64
    monkeypatch.setenv("PLORA_MAX_NEW_TOKENS_LIMIT", "16")
    cfg = config_from_flags(GatewayConfig)
    assert (cfg.max_new_tokens_limit, cfg.default_max_new_tokens) == (16, 16)
    monkeypatch.setenv("PLORA_DEFAULT_MAX_NEW_TOKENS", "8")
    assert config_from_flags(GatewayConfig).default_max_new_tokens == 8
    assert (
        config_from_flags(GatewayConfig, "--default-max-new-tokens", "12").default_max_new_tokens
        == 12
    )
    with pytest.raises(ConfigError, match="PLORA_DEFAULT_MAX_NEW_TOKENS must be in 1..16"):
        config_from_flags(GatewayConfig, "--default-max-new-tokens", "32")
    with pytest.raises(ConfigError, match="PLORA_MAX_NEW_TOKENS_LIMIT must be >= 1"):
        GatewayConfig(max_new_tokens_limit=-3)


def test_predictor_prefetch_is_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_flags(PredictorConfig).prefetch == "on"
    monkeypatch.setenv("PLORA_PREDICTOR_PREFETCH", "off")
    assert config_from_flags(PredictorConfig).prefetch == "off"
    assert config_from_flags(PredictorConfig, "--prefetch", "on").prefetch == "on"
    with pytest.raises(ConfigError, match="prefetch"):
        PredictorConfig(prefetch="maybe")


def _readme_variables() -> set[str]:
    """``PLORA_*`` names in the README, with ``PLORA_{A,B}_{X,Y}`` expanded."""
    names: set[str] = set()
    for m in re.finditer(r"PLORA_[A-Z0-9_{},]+", (REPO / "README.md").read_text()):
        parts = re.split(r"(\{[^}]*\})", m.group(0).rstrip("_,"))
        options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
        names.update("".join(c) for c in itertools.product(*options))
    return names


def test_every_variable_the_services_read_is_documented() -> None:
    """The README's Configuration table names every ``PLORA_*`` variable the services and the
    CLI read (a new user found six that it did not)."""
    read = {
        m.group(1)
        for path in (REPO / "services").rglob("*.py")
        if path.name != "bench_engine.py"  # PLORA_LOG_LEVEL: the engine benchmark's own
        for m in re.finditer(r'"(PLORA_[A-Z0-9_]+)"', path.read_text())
    }
    assert len(read) > 30
    missing = read - _readme_variables()
    assert not missing, f"not in README.md: {sorted(missing)}"
