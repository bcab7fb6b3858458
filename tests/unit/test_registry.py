"""The Redis registry against a real Redis server."""

from __future__ import annotations

import logging
import time

import grpc
import pytest
import redis

from services.common import registry as registry_module
from services.common.errors import AdapterNotFoundError
from services.common.grpc_util import status_for
from services.common.registry import (
    AdapterRecord,
    Registry,
    RegistryUnavailableError,
    WorkerRecord,
    connect,
    redact_url,
)
from services.common.types import ModelSpec
from tests.conftest import OwnRedis

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


def test_of_two_racing_registrations_the_later_version_stays_whichever_writes_last(
    redis_url: str,
) -> None:
    """Concurrent RegisterAdapter calls of one id reserve versions 1 and 2; if version 1's
    write lands last it must not replace version 2 (a worker that served version 2 would
    refuse version 1 as superseded: NOT_FOUND until the next registration)."""
    reg = Registry(connect(redis_url))
    first, second = reg.next_adapter_version("a"), reg.next_adapter_version("a")
    assert reg.put_adapter(AdapterRecord("a", "/src/2", version=second, rank=16))
    assert not reg.put_adapter(AdapterRecord("a", "/src/1", version=first, rank=8))
    assert (reg.get_adapter("a").version, reg.get_adapter("a").source) == (second, "/src/2")
    assert reg.put_adapter(AdapterRecord("a", "/src/2b", version=second, rank=16))  # same: kept
    assert [r.adapter_id for r in reg.list_adapters()] == ["a"]
    reg.delete_adapter("a")
    assert reg.put_adapter(AdapterRecord("a", "/src/1", version=first, rank=8))  # none stored


def test_a_heartbeat_says_whether_the_registry_knew_the_worker(redis_url: str) -> None:
    """False at the first heartbeat and after Redis lost its data (how a worker learns that
    the adapters' versions restart), True otherwise."""
    reg = Registry(connect(redis_url))
    record = WorkerRecord("w0", "127.0.0.1:1")
    assert not reg.heartbeat(record, ttl_seconds=5)
    assert reg.heartbeat(record, ttl_seconds=5)
    reg.client.flushdb()
    assert not reg.heartbeat(record, ttl_seconds=5)
    assert reg.heartbeat(record, ttl_seconds=5)


def test_worker_liveness_follows_the_heartbeat_ttl(redis_url: str) -> None:
    reg = Registry(connect(redis_url))
    reg.heartbeat(WorkerRecord("w0", "127.0.0.1:1", resident=["a"]), ttl_seconds=0.3)
    (w,) = reg.list_workers()
    assert w.healthy and w.resident == ["a"] and w.heartbeat_age_seconds < 1
    time.sleep(0.5)
    (w,) = reg.list_workers()
    assert not w.healthy and w.resident == []  # a down worker's pool is not served from
    reg.deregister_worker("w0")
    assert reg.list_workers() == []


def test_model_spec_placement_forecast_roundtrip(redis_url: str) -> None:
    reg = Registry(connect(redis_url))
    assert reg.get_model_spec() is None
    reg.heartbeat(WorkerRecord("w0", "127.0.0.1:1"), ttl_seconds=5)  # no model: none published
    assert reg.get_model_spec() is None
    reg.heartbeat(WorkerRecord("w0", "127.0.0.1:1"), ttl_seconds=5, model=(SPEC, "float32"))
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


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:s3cret@10.0.0.5:6380/2", "redis://:***@10.0.0.5:6380/2"),
        ("rediss://app:s3cret@cache.example:6379/0", "rediss://app:***@cache.example:6379/0"),
        ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
    ],
)
def test_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_unreachable_redis_names_no_password() -> None:
    with pytest.raises(RegistryUnavailableError) as err:
        connect("redis://:s3cret@127.0.0.1:1/0", timeout=0.5)
    assert "s3cret" not in str(err.value) and "redis://:***@127.0.0.1:1/0" in str(err.value)


def test_an_outage_is_unavailable_logged_once_and_over_when_redis_is_back(
    own_redis: OwnRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """``kill -9`` of Redis: every call raises the UNAVAILABLE error naming the registry (no
    redis-py error escapes), the outage is one warning however many calls fail, and the same
    registry works again once Redis is back on its port."""
    reg = Registry(connect(own_redis.url))
    reg.put_adapter(AdapterRecord("a", "/src", version=1))
    own_redis.kill()
    caplog.set_level(logging.INFO, logger="services.common.registry")
    calls = [
        reg.list_adapters,
        lambda: reg.get_adapter("a"),
        lambda: reg.delete_adapter("a"),
        lambda: reg.next_adapter_version("a"),
        lambda: reg.heartbeat(WorkerRecord("w0", "127.0.0.1:1"), ttl_seconds=1),
        reg.list_workers,
        reg.get_forecast,
    ]
    for call in calls:
        with pytest.raises(RegistryUnavailableError) as err:
            call()
        message = str(err.value)
        assert message.startswith(f"the adapter registry (Redis at {own_redis.url}) is unreachable")
        assert message.endswith("check that Redis is running")
        assert status_for(err.value) is grpc.StatusCode.UNAVAILABLE
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None
    assert "unreachable" in warnings[0].getMessage()

    own_redis.start()  # empty, same port: redis-py reconnects on the next call
    assert reg.list_adapters() == []
    assert "reachable again" in caplog.records[-1].getMessage()


def test_a_long_outage_is_logged_again_at_most_every_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One warning when the outage starts, then one per interval however many calls fail."""
    reg = Registry(redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5))
    monkeypatch.setattr(registry_module, "OUTAGE_LOG_EVERY_S", 0.2)
    caplog.set_level(logging.WARNING, logger="services.common.registry")
    for _ in range(3):
        with pytest.raises(RegistryUnavailableError):
            reg.list_workers()
    time.sleep(0.25)
    with pytest.raises(RegistryUnavailableError):
        reg.list_workers()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "(still: 4 failed calls in " in lines[1]


def test_a_cold_route_is_shared_for_its_lifetime(redis_url: str) -> None:
    reg = Registry(connect(redis_url))
    assert reg.cold_route("shared-a") is None
    reg.note_cold_route("shared-a", "w1", ttl_s=0.3)
    assert reg.cold_route("shared-a") == "w1"
    time.sleep(0.5)
    assert reg.cold_route("shared-a") is None
