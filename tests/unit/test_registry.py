"""The Redis registry against a real Redis server."""

from __future__ import annotations

import time

import pytest

from services.common.errors import AdapterNotFoundError
from services.common.registry import (
    AdapterRecord,
    Registry,
    RegistryUnavailableError,
    WorkerRecord,
    connect,
)
from services.common.types import ModelSpec

SPEC = ModelSpec("m", 2, 8, 16, 2, 1, 4, 32, 64, 10000.0, 1e-6, True)


def test_adapter_versions_are_monotonic_even_after_delete(redis_url: str) -> None:
    reg = Registry(connect(redis_url))
    v1 = reg.next_adapter_version("a")
    reg.put_adapter(AdapterRecord("a", "/src", version=v1, rank=8))
    assert reg.get_adapter("a").rank == 8
    reg.delete_adapter("a")
    with pytest.raises(AdapterNotFoundError, match="not registered"):
        reg.get_adapter("a")
    assert reg.next_adapter_version("a") > v1
    assert reg.list_adapters() == []


def test_worker_liveness_follows_the_heartbeat_ttl(redis_url: str) -> None:
    reg = Registry(connect(redis_url))
    reg.heartbeat(WorkerRecord("w0", "127.0.0.1:1", resident=["a"]), ttl_seconds=0.3)
    (w,) = reg.list_workers()
    assert w.healthy and w.resident == ["a"] and w.heartbeat_age_seconds < 1
    time.sleep(0.5)
    (w,) = reg.list_workers()
    assert not w.healthy
    reg.deregister_worker("w0")
    assert reg.list_workers() == []


def test_model_spec_placement_forecast_roundtrip(redis_url: str) -> None:
    reg = Registry(connect(redis_url))
    assert reg.get_model_spec() is None
    reg.set_model_spec(SPEC, "float32")
    assert reg.get_model_spec() == (SPEC, "float32")
    reg.set_placement({"a": ["w0", "w1"]})
    assert reg.get_placement() == {"a": ["w0", "w1"]}
    reg.set_forecast({"a": 2.5}, 5.0, "ewma")
    assert reg.get_forecast()["expected"] == {"a": 2.5}
    reg.save_predictor_state(b"\x00\x01")
    assert reg.load_predictor_state() == b"\x00\x01"


def test_unreachable_redis_is_a_clear_error() -> None:
    with pytest.raises(RegistryUnavailableError, match="PLORA_REDIS_URL"):
        connect("redis://127.0.0.1:1/0", timeout=0.5)
