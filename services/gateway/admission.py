"""Admission control: how many ``Generate`` streams a gateway serves at once, in all and per
tenant, and how many adapters a tenant may register.

A stream beyond a bound is refused at once with RESOURCE_EXHAUSTED (the message names the
limit and the flag that sets it) instead of waiting in a queue the client cannot see: it holds
no thread, no worker slot and no memory, and a client backs off and sends it again. The counts
live here, in front of every front door (:meth:`services.gateway.core.GatewayCore.generate`),
so each door shares the same bounds. The gRPC server's thread pool is sized from them
(:func:`server_threads`) so that refusals and the admin, status and health calls always find a
thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from services.common.errors import PLoRAError

#: Threads of the gateway's gRPC pool beyond ``--max-concurrent-requests``: they serve
#: refusals, health checks, GetClusterStatus and the adapter calls while every admitted stream
#: holds its own thread. A refusal takes well under a millisecond of one, so a burst of
#: hundreds of refused calls drains through them within a few tens of milliseconds.
RESERVED_THREADS = 32

#: ``RegisterAdapter`` calls served at once; more are refused. A registration reads and hashes
#: the adapter's files (seconds for a large one), so without a bound a burst of them could hold
#: every reserved thread and leave health and status checks waiting; with it, three quarters of
#: :data:`RESERVED_THREADS` stay for those and for refusals.
MAX_CONCURRENT_REGISTRATIONS = RESERVED_THREADS // 4

#: ``reason`` label values of ``plora_gateway_requests_rejected_total``.
REJECT_REASONS = (
    "max_concurrent_requests",
    "max_concurrent_per_tenant",
    "max_adapters_per_tenant",
    "max_concurrent_registrations",
)


class AdmissionRefusedError(PLoRAError):
    """A request or registration is beyond one of the gateway's bounds (RESOURCE_EXHAUSTED).

    Attributes:
        reason: Which bound, one of :data:`REJECT_REASONS` (the metric's label).
    """

    status_code_name = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def server_threads(max_concurrent_requests: int) -> int:
    """Threads of the gateway's gRPC pool: one per admitted ``Generate`` stream (a sync gRPC
    server holds a thread for a stream's whole life) plus :data:`RESERVED_THREADS`.

    A call that finds every thread busy is not refused by gRPC but waits in its queue; with
    this many threads, at most :data:`RESERVED_THREADS` threads are ever busy with anything
    but an admitted stream, so that queue drains at the pace of refusals and short calls.
    """
    return max_concurrent_requests + RESERVED_THREADS


class Ticket:
    """One admitted stream's place; :meth:`release` gives it back (idempotent)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Give the place back; later calls do nothing."""
        release, self._release = self._release, None
        if release is not None:
            release()


class Admission:
    """Counts of the ``Generate`` streams being served, in all and per tenant. Thread-safe.

    Args:
        max_concurrent: Streams at most in all (>= 1; ``--max-concurrent-requests``).
        max_per_tenant: Streams at most per ``tenant_id`` ("" counts as one tenant); 0 = no
            per-tenant bound (``--max-concurrent-per-tenant``).
    """

    def __init__(self, max_concurrent: int, max_per_tenant: int = 0) -> None:
        self.max_concurrent = max_concurrent
        self.max_per_tenant = max_per_tenant
        self._lock = threading.Lock()
        self._total = 0
        self._by_tenant: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        """Streams admitted and not yet released."""
        return self._total

    def tenant_in_flight(self, tenant_id: str) -> int:
        """Streams of ``tenant_id`` admitted and not yet released."""
        return self._by_tenant.get(tenant_id, 0)

    def admit(self, tenant_id: str) -> Ticket:
        """Take a place for one stream of ``tenant_id``, or refuse it at once.

        Returns:
            The stream's :class:`Ticket`; release it however the stream ends.

        Raises:
            AdmissionRefusedError: ``max_concurrent`` streams, or ``max_per_tenant`` of this
                tenant's, are being served.
        """
        with self._lock:
            if self._total >= self.max_concurrent:
                raise self._full()
            held = self._by_tenant.get(tenant_id, 0)
            if self.max_per_tenant and held >= self.max_per_tenant:
                raise AdmissionRefusedError(
                    f"this tenant has its limit of {self.max_per_tenant} concurrent Generate "
                    "streams in flight (--max-concurrent-per-tenant); retry after a backoff",
                    "max_concurrent_per_tenant",
                )
            self._total += 1
            self._by_tenant[tenant_id] = held + 1
        return Ticket(lambda: self._release(tenant_id))

    def check_room(self) -> None:
        """Refuse a stream at once if ``max_concurrent`` streams are being served, without
        taking a place: for a front door that can refuse before it reads the request (and so
        before it knows the tenant). A stream that passes is still admitted by :meth:`admit`,
        which may refuse it if the last place went meanwhile.

        Raises:
            AdmissionRefusedError: ``max_concurrent`` streams are being served (the same
                refusal :meth:`admit` gives).
        """
        if self._total >= self.max_concurrent:  # one int read: no lock needed to peek
            raise self._full()

    def _full(self) -> AdmissionRefusedError:
        return AdmissionRefusedError(
            f"the gateway is serving its limit of {self.max_concurrent} concurrent "
            "Generate streams (--max-concurrent-requests); retry after a backoff",
            "max_concurrent_requests",
        )

    def _release(self, tenant_id: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._by_tenant[tenant_id] - 1
            if left:
                self._by_tenant[tenant_id] = left
            else:
                del self._by_tenant[tenant_id]  # no entry per tenant ever seen


class Registrations:
    """Places for ``RegisterAdapter`` calls in progress. Thread-safe.

    Args:
        limit: Registrations at most at once (:data:`MAX_CONCURRENT_REGISTRATIONS`).
    """

    def __init__(self, limit: int = MAX_CONCURRENT_REGISTRATIONS) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def admit(self) -> Ticket:
        """Take a place for one registration, or refuse it at once.

        Returns:
            The registration's :class:`Ticket`; release it however the call ends.

        Raises:
            AdmissionRefusedError: ``limit`` registrations are in progress.
        """
        if not self._slots.acquire(blocking=False):
            raise AdmissionRefusedError(
                f"the gateway is inspecting its limit of {self.limit} adapter registrations "
                "at once; retry after a backoff",
                "max_concurrent_registrations",
            )
        return Ticket(self._slots.release)


def check_adapter_quota(owned: int, limit: int, replacing: bool) -> None:
    """A tenant's registration of an adapter id against ``--max-adapters-per-tenant``.

    Args:
        owned: Adapters the tenant has registered (its ``tenant_id``; "" = the shared ones).
        limit: The most it may have; 0 = no bound.
        replacing: The id is already the tenant's (a new version takes no new place).

    Raises:
        AdmissionRefusedError: A new id while the tenant holds ``limit`` adapters.
    """
    if limit and not replacing and owned >= limit:
        raise AdmissionRefusedError(
            f"this tenant has registered its limit of {limit} adapters "
            "(--max-adapters-per-tenant); delete one or replace an existing id",
            "max_adapters_per_tenant",
        )
