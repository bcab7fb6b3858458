"""The gateway's admission counts: bounds in all and per tenant, refusals naming the flag,
places given back exactly once, and the adapter quota."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.common.errors import ConfigError
from services.common.grpc_util import status_for
from services.gateway.admission import (
    MAX_CONCURRENT_REGISTRATIONS,
    RESERVED_THREADS,
    Admission,
    AdmissionRefusedError,
    Registrations,
    check_adapter_quota,
    server_threads,
)
from services.gateway.config import GatewayConfig
from tests.helpers import config_from_flags


def test_streams_beyond_the_gateway_bound_are_refused_naming_the_flag() -> None:
    admission = Admission(2)
    first, second = admission.admit(""), admission.admit("acme")
    assert admission.in_flight == 2
    with pytest.raises(AdmissionRefusedError) as err:
        admission.admit("other")
    assert err.value.reason == "max_concurrent_requests"
    assert "limit of 2 concurrent" in str(err.value)
    assert "--max-concurrent-requests" in str(err.value)
    assert status_for(err.value) is grpc.StatusCode.RESOURCE_EXHAUSTED
    first.release()
    third = admission.admit("other")  # the place given back is taken again
    assert admission.in_flight == 2
    for ticket in (second, third):
        ticket.release()
    assert admission.in_flight == 0


def test_checking_for_room_refuses_as_admission_does_and_takes_no_place() -> None:
    admission = Admission(1, max_per_tenant=1)
    admission.check_room()  # room: nothing taken
    assert admission.in_flight == 0
    ticket = admission.admit("acme")
    with pytest.raises(AdmissionRefusedError) as peeked:
        admission.check_room()
    with pytest.raises(AdmissionRefusedError) as admitted:
        admission.admit("globex")
    assert (peeked.value.reason, str(peeked.value)) == (admitted.value.reason, str(admitted.value))
    assert admission.in_flight == 1
    ticket.release()
    admission.check_room()


def test_streams_beyond_a_tenants_bound_are_refused_and_other_tenants_go_on() -> None:
    admission = Admission(10, max_per_tenant=2)
    held = [admission.admit("acme"), admission.admit("acme")]
    with pytest.raises(AdmissionRefusedError, match=r"limit of 2 .*--max-concurrent-per-tenant"):
        admission.admit("acme")
    # requests without a tenant id count as one tenant of their own
    blank = [admission.admit(""), admission.admit("")]
    with pytest.raises(AdmissionRefusedError) as err:
        admission.admit("")
    assert err.value.reason == "max_concurrent_per_tenant"
    assert "acme" not in str(err.value)  # the message names no tenant
    other = admission.admit("globex")
    assert (admission.in_flight, admission.tenant_in_flight("acme")) == (5, 2)
    held[0].release()
    held.append(admission.admit("acme"))
    for ticket in [*held, *blank, other]:
        ticket.release()
    assert admission.in_flight == 0
    assert admission._by_tenant == {}  # noqa: SLF001 - no entry kept per tenant ever seen


def test_the_gateway_bound_is_checked_before_the_tenants() -> None:
    admission = Admission(1, max_per_tenant=1)
    ticket = admission.admit("acme")
    with pytest.raises(AdmissionRefusedError) as err:
        admission.admit("acme")
    assert err.value.reason == "max_concurrent_requests"
    ticket.release()


def test_a_ticket_released_twice_gives_its_place_back_once() -> None:
    admission = Admission(2)
    ticket = admission.admit("acme")
    other = admission.admit("acme")
    ticket.release()
    ticket.release()
    assert admission.in_flight == 1 and admission.tenant_in_flight("acme") == 1
    other.release()
    assert admission.in_flight == 0


@pytest.mark.parametrize(
    ("max_concurrent", "max_per_tenant", "reason"),
    [(8, 0, "max_concurrent_requests"), (1000, 3, "max_concurrent_per_tenant")],
)
def test_concurrent_admissions_never_pass_the_bounds(
    max_concurrent: int, max_per_tenant: int, reason: str
) -> None:
    """64 threads of 4 tenants each admit, hold the place a moment, and release, 50 times:
    the streams held at once, counted by the test itself, never pass the bound, the bound is
    met (refusals), and every place is given back."""
    admission = Admission(max_concurrent, max_per_tenant)
    held: dict[str, int] = {"all": 0}
    peak = {"all": 0, "tenant": 0}
    refused: dict[str, int] = {}
    lock = threading.Lock()
    start = threading.Barrier(64)

    def run(i: int) -> None:
        tenant = f"t{i % 4}"
        start.wait()
        for _ in range(50):
            try:
                ticket = admission.admit(tenant)
            except AdmissionRefusedError as exc:
                with lock:
                    refused[exc.reason] = refused.get(exc.reason, 0) + 1
                time.sleep(0.0002)
                continue
            with lock:
                held["all"] += 1
                held[tenant] = held.get(tenant, 0) + 1
                peak["all"] = max(peak["all"], held["all"])
                peak["tenant"] = max(peak["tenant"], held[tenant])
            time.sleep(0.001)  # other threads run while this one holds its place
            with lock:
                held["all"] -= 1
                held[tenant] -= 1
            ticket.release()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak["all"] <= max_concurrent, peak
    assert peak["tenant"] <= (max_per_tenant or max_concurrent), peak
    assert set(refused) == {reason}, refused
    assert admission.in_flight == 0


@pytest.mark.parametrize(
    ("owned", "limit", "replacing", "refused"),
    [
        (0, 0, False, False),  # no bound
        (500, 0, False, False),
        (1, 2, False, False),
        (2, 2, False, True),  # a new id at the limit
        (2, 2, True, False),  # a new version of one of its own ids
        (3, 2, False, True),  # beyond it (lowered since)
        (3, 2, True, False),
    ],
)
def test_adapter_quota(owned: int, limit: int, replacing: bool, refused: bool) -> None:
    if not refused:
        check_adapter_quota(owned, limit, replacing)
        return
    with pytest.raises(AdmissionRefusedError, match=rf"limit of {limit} adapters") as err:
        check_adapter_quota(owned, limit, replacing)
    assert "--max-adapters-per-tenant" in str(err.value)
    assert err.value.reason == "max_adapters_per_tenant"


def test_the_gateway_pool_has_a_thread_per_admitted_stream_and_a_reserve() -> None:
    assert server_threads(64) == 64 + RESERVED_THREADS
    assert RESERVED_THREADS >= 8


def test_admission_settings_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_from_flags(GatewayConfig)
    assert (
        config.max_concurrent_requests,
        config.max_concurrent_per_tenant,
        config.max_adapters_per_tenant,
    ) == (256, 0, 0)
    monkeypatch.setenv("PLORA_MAX_CONCURRENT_REQUESTS", "64")
    monkeypatch.setenv("PLORA_MAX_CONCURRENT_PER_TENANT", "4")
    monkeypatch.setenv("PLORA_MAX_ADAPTERS_PER_TENANT", "10")
    config = config_from_flags(GatewayConfig, "--max-adapters-per-tenant", "0")
    assert (
        config.max_concurrent_requests,
        config.max_concurrent_per_tenant,
        config.max_adapters_per_tenant,
    ) == (64, 4, 0)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("max_concurrent_requests", 0, "--max-concurrent-requests / PLORA_MAX_CONCURRENT_REQUESTS"),
        ("max_concurrent_per_tenant", -1, "--max-concurrent-per-tenant"),
        ("max_adapters_per_tenant", -1, "PLORA_MAX_ADAPTERS_PER_TENANT"),
    ],
)
def test_admission_settings_out_of_range_are_refused(field: str, value: int, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        GatewayConfig(**{field: value})  # type: ignore[arg-type]


def test_the_worker_pool_has_a_thread_per_running_and_waiting_stream_and_a_reserve() -> None:
    """So a flood meets the engine's queue bound (RESOURCE_EXHAUSTED), not gRPC's queue."""
    from services.worker.config import RESERVED_THREADS as WORKER_RESERVE
    from services.worker.config import WorkerConfig

    config = config_from_flags(WorkerConfig, "--max-batch-size", "4", "--max-queue", "300")
    assert (config.max_batch_size, config.max_queue) == (4, 300)
    assert config.server_threads == 4 + 300 + WORKER_RESERVE
    assert WorkerConfig().server_threads == 32 + 256 + WORKER_RESERVE
    with pytest.raises(ConfigError, match="--max-queue / PLORA_MAX_QUEUE"):
        WorkerConfig(max_queue=0)


def test_registrations_beyond_their_places_are_refused_at_once() -> None:
    """So a burst of slow registrations cannot hold every reserved thread of the gateway."""
    assert MAX_CONCURRENT_REGISTRATIONS < RESERVED_THREADS
    registrations = Registrations(limit=2)
    first, second = registrations.admit(), registrations.admit()
    with pytest.raises(AdmissionRefusedError, match="limit of 2 adapter registrations") as err:
        registrations.admit()
    assert err.value.reason == "max_concurrent_registrations"
    first.release()
    first.release()  # once only: a second release gives nothing back
    third = registrations.admit()
    with pytest.raises(AdmissionRefusedError):
        registrations.admit()
    for ticket in (second, third):
        ticket.release()
    held = [registrations.admit(), registrations.admit()]
    for ticket in held:
        ticket.release()
