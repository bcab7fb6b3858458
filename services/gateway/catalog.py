"""What the gateway reads from the registry: adapter records, the worker list, the placement.

Reads go through short-lived caches (:class:`TTLCache`), and go on being served from them while
Redis is unreachable (stale-if-error, up to ``registry_stale_s``); once a read has found Redis
unreachable, no request waits on it again until a background check finds it back. Reading the
worker list also keeps the per-worker gauges current.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from services.common.errors import AdapterNotFoundError
from services.common.registry import (
    AdapterRecord,
    Registry,
    RegistryUnavailableError,
    WorkerRecord,
)
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: While the registry is unreachable, seconds between the background checks that notice it
#: is back (requests meanwhile never wait on it: see :meth:`Catalog.cached`).
REGISTRY_PROBE_S = 1.0

#: Seconds between the background reads of the worker list behind the per-worker gauges.
WORKER_GAUGES_S = 1.0


class TTLCache:
    """Values read from the registry, thread-safe: fresh for ``ttl`` seconds after they were
    read; and, while the registry is unreachable, still served for up to ``stale_s`` seconds
    after they were read (stale-if-error, as RFC 5861 has it for HTTP caches)."""

    def __init__(self, ttl: float, stale_s: float = 0.0) -> None:
        self.ttl = ttl
        self.stale_s = stale_s
        # key -> (monotonic time read, value, still fresh unless expired)
        self._data: dict[str, tuple[float, object, bool]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> object | None:
        """The value if it is fresh, else None."""
        with self._lock:
            hit = self._data.get(key)
            if hit is None or not hit[2] or time.monotonic() - hit[0] > self.ttl:
                return None
            return hit[1]

    def get_stale(self, key: str) -> object | None:
        """The value, fresh or not, if it was read at most ``stale_s`` seconds ago, else None."""
        with self._lock:
            hit = self._data.get(key)
            if hit is None or time.monotonic() - hit[0] > self.stale_s:
                return None
            return hit[1]

    def put(self, key: str, value: object) -> None:
        with self._lock:
            self._data[key] = (time.monotonic(), value, True)

    def expire(self, key: str) -> None:
        """Make the next :meth:`get` read the registry again (the value stays for
        :meth:`get_stale`)."""
        with self._lock:
            hit = self._data.get(key)
            if hit is not None:
                self._data[key] = (hit[0], hit[1], False)

    def drop(self, key: str) -> None:
        """Forget the value (it is wrong now: the adapter was deleted or replaced)."""
        with self._lock:
            self._data.pop(key, None)


class Catalog:
    """The registry as the gateway reads it.

    Args:
        config: Cache lifetimes (``adapter_cache_s``, ``worker_cache_s``, ``registry_stale_s``).
        registry: The Redis registry.
        metrics: Stale reads and the per-worker gauges.
    """

    def __init__(self, config: GatewayConfig, registry: Registry, metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.metrics = metrics
        stale = config.registry_stale_s
        self._adapters = TTLCache(config.adapter_cache_s, stale)
        self._workers = TTLCache(config.worker_cache_s, stale)
        self._placement = TTLCache(config.worker_cache_s, stale)
        # the error of the read that found the registry unreachable, until a background
        # check finds it back (None: reachable as far as is known)
        self._registry_down: RegistryUnavailableError | None = None
        self._registry_down_lock = threading.Lock()
        self._closed = threading.Event()
        self._gauges_lock = threading.Lock()
        self._gauged: set[str] = set()  # workers with per-worker gauge series
        self._healthy_ids: set[str] = set()  # healthy at the last worker-list read

    def close(self) -> None:
        """Stop the background checks."""
        self._closed.set()

    # -- cached reads (the request path) ---------------------------------------------------

    def workers(self) -> list[WorkerRecord]:
        """Every known worker (healthy or not)."""
        return self.cached(self._workers, "workers", "workers", self._read_workers)

    def expire_workers(self) -> None:
        """Read the worker list again at the next :meth:`workers` (a worker failed)."""
        self._workers.expire("workers")

    def adapter(self, adapter_id: str) -> AdapterRecord:
        """An adapter's record.

        Raises:
            AdapterNotFoundError: not registered.
            RegistryUnavailableError: Redis is unreachable and no record is recent enough.
        """
        return self.cached(
            self._adapters, adapter_id, "adapter", lambda: self.registry.get_adapter(adapter_id)
        )

    def placement(self) -> dict[str, list[str]]:
        """The predictor's last placement (``adapter_id -> [worker_id, ...]``)."""
        return self.cached(self._placement, "placement", "placement", self.registry.get_placement)

    def reread_adapter(self, adapter_id: str) -> AdapterRecord | None:
        """The adapter's record read from Redis now (and cached), or None when that fails
        (deleted: dropped from the cache; Redis unreachable)."""
        try:
            with self.direct():
                record = self.registry.get_adapter(adapter_id)
        except AdapterNotFoundError:
            self._adapters.drop(adapter_id)
            return None
        except RegistryUnavailableError:
            return None
        self._adapters.put(adapter_id, record)
        return record

    def forget_adapter(self, adapter_id: str) -> None:
        """Drop an adapter's cached record (deleted or registered again)."""
        self._adapters.drop(adapter_id)

    def cached(self, cache: TTLCache, key: str, record: str, read: Callable[[], T]) -> T:
        """``read()`` through ``cache``. While Redis is unreachable the last value read within
        ``registry_stale_s`` is served instead (counted by ``record``), so requests for
        adapters and workers seen before the outage go on being routed. Once a read has found
        Redis unreachable, no request waits on it again (a hung Redis costs a 5 s socket
        timeout per try): reads answer from the cache, or fail at once, until a background
        check (every ``REGISTRY_PROBE_S``) finds it back.

        Raises:
            RegistryUnavailableError: Redis is unreachable and no value is recent enough.
        """
        hit = cache.get(key)
        if hit is not None:
            return hit  # type: ignore[return-value]
        stale = cache.get_stale(key)
        down = self._registry_down
        if down is None:
            try:
                value = read()
            except RegistryUnavailableError as exc:
                self._registry_unreachable(exc)
                down = exc
            except AdapterNotFoundError:
                cache.drop(key)  # deleted (by another gateway): never served from the cache
                raise
            else:
                cache.put(key, value)
                return value
        if stale is None:
            raise RegistryUnavailableError(str(down))  # a new one: requests raise concurrently
        self.metrics.stale_reads.labels(record).inc()
        return stale  # type: ignore[return-value]

    # -- direct reads and writes (the admin calls) -----------------------------------------

    @contextlib.contextmanager
    def direct(self) -> Iterator[None]:
        """Around the admin calls, which read and write Redis directly (no cache): while a
        read has found Redis unreachable and the background check has not found it back,
        fail at once rather than wait out the socket timeout again (a hung Redis: 5 s per
        call); a call that finds it unreachable starts that check.

        Raises:
            RegistryUnavailableError: Redis was or is unreachable.
        """
        down = self._registry_down
        if down is not None:
            raise RegistryUnavailableError(str(down))
        try:
            yield
        except RegistryUnavailableError as exc:
            self._registry_unreachable(exc)
            raise

    def _registry_unreachable(self, exc: RegistryUnavailableError) -> None:
        """Note that a read found Redis unreachable and start the check that notices it is
        back (one at a time)."""
        with self._registry_down_lock:
            if self._registry_down is not None:
                return
            self._registry_down = exc

        def probe() -> None:
            while not self._closed.wait(REGISTRY_PROBE_S):
                try:
                    self.registry.ping()
                except RegistryUnavailableError as err:
                    self._registry_down = err
                    continue
                with self._registry_down_lock:
                    self._registry_down = None
                return

        threading.Thread(target=probe, name="registry-probe", daemon=True).start()

    # -- the worker list and its gauges ----------------------------------------------------

    def _read_workers(self) -> list[WorkerRecord]:
        """The worker list from Redis; sets the per-worker gauges from it (and removes the
        series of workers gone from it)."""
        workers = self.registry.list_workers()
        self.metrics.workers_healthy.set(sum(w.healthy for w in workers))
        ids = {w.worker_id for w in workers}
        healthy = {w.worker_id for w in workers if w.healthy}
        with self._gauges_lock:
            known = self._gauged
            gone, self._gauged = self._gauged - ids, ids
            went_down = (self._healthy_ids & ids) - healthy
            came_back = (healthy & known) - self._healthy_ids
            self._healthy_ids = healthy
        for worker_id in sorted(went_down):
            self.metrics.worker_down.labels(worker_id).inc()
            logger.warning("worker %s is down (no heartbeat within its liveness TTL)", worker_id)
        for worker_id in sorted(came_back):
            logger.info("worker %s is healthy again", worker_id)
        for worker_id in gone:
            for gauge in (
                self.metrics.heartbeat_age,
                self.metrics.worker_queue,
                self.metrics.resident,
            ):
                gauge.remove(worker_id)
        for w in workers:
            self.metrics.heartbeat_age.labels(w.worker_id).set(w.heartbeat_age_seconds)
            self.metrics.worker_queue.labels(w.worker_id).set(w.queue_length)
            self.metrics.resident.labels(w.worker_id).set(len(w.resident))
        return workers

    def start_gauges(self) -> None:
        """Read the worker list every :data:`WORKER_GAUGES_S` in the background (until
        :meth:`close`), so the per-worker gauges stay current while no request arrives.
        Skipped while Redis is known unreachable; the requests' cache is left alone."""

        def run() -> None:
            while not self._closed.wait(WORKER_GAUGES_S):
                if self._registry_down is not None:
                    continue
                try:
                    self._read_workers()
                except RegistryUnavailableError as exc:
                    self._registry_unreachable(exc)

        threading.Thread(target=run, name="worker-gauges", daemon=True).start()
