"""Worker id leases (one live process per worker id) against a real Redis server."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time

import pytest

from services.common.registry import (
    ProcessIdentity,
    Registry,
    WorkerIdInUseError,
    WorkerLease,
    WorkerLeaseKeeper,
    connect,
    process_start_ticks,
)


def _registry(redis_url: str) -> Registry:
    return Registry(connect(redis_url))


def _elsewhere() -> ProcessIdentity:
    """A process on another host: never provably gone from here."""
    return ProcessIdentity("node-7", 4242, "another-boot", "pid:[1]", 1234)


def test_a_free_id_is_claimed_and_a_clean_release_frees_it_at_once(redis_url: str) -> None:
    reg = _registry(redis_url)
    lease = reg.claim_worker_id("w", "10.0.0.5:50061", ttl_seconds=30, renew_every_s=1)
    stored = reg.get_worker_lease("w")
    assert stored is not None and stored.token == lease.token
    assert stored.holder == ProcessIdentity.current() and stored.address == "10.0.0.5:50061"
    assert stored.holder.start_ticks == process_start_ticks(os.getpid()) > 0
    assert reg.release_worker_lease(lease)
    assert reg.get_worker_lease("w") is None
    started = time.monotonic()
    again = reg.claim_worker_id("w", "10.0.0.6:50061", ttl_seconds=30, renew_every_s=1)
    assert time.monotonic() - started < 0.5 and again.token != lease.token
    assert not reg.release_worker_lease(lease), "a stale token released the new holder's lease"
    assert reg.get_worker_lease("w") is not None


def test_a_live_holder_keeps_its_id_and_the_refusal_names_it(redis_url: str) -> None:
    """The holder renews every 0.2 s: a claimant sees a renewal and is refused within about
    one renewal period, the message naming the holder's pid, host and address."""
    reg = _registry(redis_url)
    holder = reg.claim_worker_id(
        "w", "10.0.0.5:50061", ttl_seconds=1, renew_every_s=0.2, identity=_elsewhere()
    )
    keeper = WorkerLeaseKeeper(reg, holder, 1, 0.2, on_lost=lambda _: None).start()
    try:
        started = time.monotonic()
        with pytest.raises(WorkerIdInUseError) as err:
            reg.claim_worker_id("w", "127.0.0.1:0", ttl_seconds=1, renew_every_s=0.2)
        took = time.monotonic() - started
        assert took < 1.0, f"refused after {took:.2f} s"
        message = str(err.value)
        assert "worker id 'w' is in use by a live worker: pid 4242 on host 'node-7'" in message
        assert "serving at 10.0.0.5:50061" in message and "--worker-id" in message
        assert reg.get_worker_lease("w").token == holder.token  # type: ignore[union-attr]
    finally:
        keeper.release()
    assert reg.get_worker_lease("w") is None


def test_a_dead_holder_elsewhere_gives_its_id_up_when_its_lease_expires(redis_url: str) -> None:
    """Killed on another host (nothing renews): its id is claimed once the lease expires,
    not before (the claimant cannot tell it from a live holder until then)."""
    reg = _registry(redis_url)
    reg.claim_worker_id(
        "w", "10.0.0.5:1", ttl_seconds=1.0, renew_every_s=0.2, identity=_elsewhere()
    )
    started = time.monotonic()
    lease = reg.claim_worker_id("w", "127.0.0.1:2", ttl_seconds=1.0, renew_every_s=0.2)
    took = time.monotonic() - started
    assert 0.7 < took < 1.5, f"claimed after {took:.2f} s, the lease lived 1 s"
    assert reg.get_worker_lease("w").token == lease.token  # type: ignore[union-attr]


def test_a_holder_gone_from_this_host_is_taken_over_at_once(redis_url: str) -> None:
    """Same kernel boot and PID namespace, and its pid names no process (or a later one): the
    old holder is provably dead, so its id comes back without waiting out a 30 s lease."""
    reg = _registry(redis_url)
    me = ProcessIdentity.current()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = dataclasses.replace(me, pid=child.pid, start_ticks=me.start_ticks + 1)
    reused = dataclasses.replace(me, start_ticks=me.start_ticks + 1)  # my pid, another process
    for old in (gone, reused):
        reg.client.flushdb()
        reg.claim_worker_id("w", "127.0.0.1:1", ttl_seconds=30, renew_every_s=1, identity=old)
        started = time.monotonic()
        lease = reg.claim_worker_id("w", "127.0.0.1:2", ttl_seconds=30, renew_every_s=1)
        assert time.monotonic() - started < 0.5
        assert reg.get_worker_lease("w").token == lease.token  # type: ignore[union-attr]


def test_a_live_process_on_this_host_that_stopped_renewing_is_waited_out(redis_url: str) -> None:
    """A holder still running here (frozen, say) is not provably gone: its lease must expire."""
    reg = _registry(redis_url)
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = process_start_ticks(sibling.pid)
        assert ticks
        frozen = dataclasses.replace(ProcessIdentity.current(), pid=sibling.pid, start_ticks=ticks)
        reg.claim_worker_id("w", "127.0.0.1:1", ttl_seconds=1, renew_every_s=0.2, identity=frozen)
        started = time.monotonic()
        reg.claim_worker_id("w", "127.0.0.1:2", ttl_seconds=1, renew_every_s=0.2)
        assert time.monotonic() - started > 0.7
    finally:
        sibling.kill()
        sibling.wait()


def test_a_second_claim_in_the_same_process_is_refused(redis_url: str) -> None:
    reg = _registry(redis_url)
    lease = reg.claim_worker_id("w", "127.0.0.1:1", ttl_seconds=1, renew_every_s=0.2)
    keeper = WorkerLeaseKeeper(reg, lease, 1, 0.2, on_lost=lambda _: None).start()
    try:
        with pytest.raises(WorkerIdInUseError, match=f"pid {os.getpid()} on host"):
            reg.claim_worker_id("w", "127.0.0.1:2", ttl_seconds=1, renew_every_s=0.2)
    finally:
        keeper.release()


def test_a_holder_taken_over_learns_it_at_its_next_renewal(redis_url: str) -> None:
    """Frozen past its TTL and taken over, the old holder's renewal fails and ``on_lost`` gets
    the new holder once; a lease Redis lost is claimed again by its holder."""
    reg = _registry(redis_url)
    old = reg.claim_worker_id("w", "127.0.0.1:1", ttl_seconds=0.3, renew_every_s=0.1)
    new = reg.claim_worker_id(
        "w", "127.0.0.1:2", ttl_seconds=30, renew_every_s=1, identity=_elsewhere()
    )
    lost: list[WorkerLease | None] = []
    called = threading.Event()
    keeper = WorkerLeaseKeeper(reg, old, 0.3, 0.1, on_lost=lambda h: (lost.append(h), called.set()))
    assert not keeper.renew()
    assert keeper.lost and [h.token for h in lost if h] == [new.token]
    assert not keeper.renew() and len(lost) == 1
    keeper.release()  # not its lease: left alone
    assert reg.get_worker_lease("w").token == new.token  # type: ignore[union-attr]

    reg.client.flushdb()  # Redis restarted empty
    keeper = WorkerLeaseKeeper(reg, new, 30, 1, on_lost=lambda _: called.set())
    keeper.set_address("10.0.0.9:50061")  # stored by a renewal at once: claimed again
    stored = reg.get_worker_lease("w")
    assert stored is not None and stored.token == new.token
    assert stored.address == "10.0.0.9:50061" and stored.renewals == 1
    assert keeper.renew()
    assert reg.get_worker_lease("w").renewals == 2  # type: ignore[union-attr]
    keeper.release()
    assert reg.get_worker_lease("w") is None


def test_a_process_ended_only_when_its_pid_is_free_or_names_a_later_process() -> None:
    me = ProcessIdentity.current()
    assert not me.ended()
    assert dataclasses.replace(me, start_ticks=me.start_ticks + 1).ended()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert dataclasses.replace(me, pid=child.pid).ended()
    assert not dataclasses.replace(me, pid=0).ended()  # no pid recorded: never provably gone
    assert not ProcessIdentity("?", 0).ended()
