"""The gateway: the client-facing ``plora.v1.Gateway`` service.

It validates requests, resolves adapter metadata from Redis (cached briefly), routes each request
to a worker (``services.predictor.placement`` policies), relays the worker's token stream,
retries on another worker when one fails before the first token, and streams request events to
the predictor without ever waiting on it. The servicer is thin: validation rules live in
:mod:`services.gateway.validation`, routing in :mod:`services.predictor.placement`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from plora.v1 import gateway_pb2, gateway_pb2_grpc, predictor_pb2, worker_pb2, worker_pb2_grpc
from services.common import convert
from services.common.adapters import inspect_adapter
from services.common.config import settings_line
from services.common.errors import (
    AdapterNotFoundError,
    AdapterPermissionError,
    NoHealthyWorkerError,
    PLoRAError,
    PoolExhaustedError,
    RegistrationConflictError,
    quoted,
)
from services.common.grpc_util import (
    CHANNEL_OPTIONS,
    abort,
    already_aborted,
    create_server,
    ended_by_client,
    log_request_failure,
    map_errors,
    remaining_or,
    set_serving,
)
from services.common.lifecycle import run_service, write_ready_file
from services.common.metrics import serve_metrics
from services.common.registry import (
    AdapterRecord,
    Registry,
    RegistryUnavailableError,
    WorkerRecord,
    connect,
)
from services.common.routing import RoutingState, worker_view
from services.gateway.config import GatewayConfig
from services.gateway.events import EventStreamer
from services.gateway.metrics import GatewayMetrics
from services.gateway.validation import (
    adapter_source,
    check_adapter_id,
    check_tenant_id,
    validate_generate,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
T = TypeVar("T")

#: While the registry is unreachable, seconds between the background checks that notice it
#: is back (requests meanwhile never wait on it: see ``GatewayServicer._cached``).
REGISTRY_PROBE_S = 1.0

#: Seconds an UnloadAdapter call to one worker may take (adapter deletion and registration).
UNLOAD_TIMEOUT_S = 5.0

#: Seconds between the background reads of the worker list behind the per-worker gauges.
WORKER_GAUGES_S = 1.0


class _TTLCache:
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


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Implements ``plora.v1.Gateway`` over the registry, the workers and the predictor."""

    def __init__(self, config: GatewayConfig, registry: Registry, metrics: GatewayMetrics) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        stale = config.registry_stale_s
        self._adapters = _TTLCache(config.adapter_cache_s, stale)
        self._workers_cache = _TTLCache(config.worker_cache_s, stale)
        # the error of the read that found the registry unreachable, until a background
        # check finds it back (None: reachable as far as is known)
        self._registry_down: RegistryUnavailableError | None = None
        self._registry_down_lock = threading.Lock()
        self._closed = threading.Event()
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self._placement_cache = _TTLCache(config.worker_cache_s, stale)
        self.routing = RoutingState(
            config.routing, on_pending=lambda w, n: metrics.worker_pending.labels(w).set(n)
        )
        self._gauges_lock = threading.Lock()
        self._gauged: set[str] = set()  # workers with per-worker gauge series
        self._healthy_ids: set[str] = set()  # healthy at the last worker-list read
        # monotonic time after which streams still running are ended (the gateway stops)
        self._drain_deadline: float | None = None
        self._drain_grace_s = 0.0
        self.events = EventStreamer(
            config.predictor_address,
            config.event_queue_size,
            on_sent=lambda n: metrics.events_sent.inc(n),
            on_dropped=lambda n: metrics.events_dropped.inc(n),
            on_connected=lambda c: metrics.predictor_connected.set(1 if c else 0),
        )

    # -- helpers --------------------------------------------------------------------------

    def begin_drain(self, grace_s: float, cut_after_s: float) -> None:
        """The gateway is stopping: streams still running ``cut_after_s`` seconds from now end
        with UNAVAILABLE and a message that says so, at their next token, instead of the
        bare "Cancelling all calls" gRPC gives them when the server's ``grace_s`` runs out.

        Args:
            grace_s: The server's grace period, seconds (named in the message).
            cut_after_s: When to end the remaining streams, seconds from now (< ``grace_s``,
                so the status reaches the client before the server cancels the call).
        """
        self._drain_grace_s = grace_s
        self._drain_deadline = time.monotonic() + max(0.0, cut_after_s)

    def close(self) -> None:
        """Stop the event stream and the registry check, and close worker channels."""
        self._closed.set()
        self.events.stop()
        with self._channels_lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        with self._channels_lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                self._channels[address] = ch
        return worker_pb2_grpc.WorkerStub(ch)

    def _cached(self, cache: _TTLCache, key: str, record: str, read: Callable[[], T]) -> T:
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

    @contextlib.contextmanager
    def _direct_registry(self) -> Iterator[None]:
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

    def _workers(self) -> list[WorkerRecord]:
        return self._cached(self._workers_cache, "workers", "workers", self._read_workers)

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
        :meth:`close`), so the per-worker gauges stay current while no request arrives
        (they were set only by the reads requests made: an idle gateway showed a frozen
        worker healthy and a drained queue full). Skipped while Redis is known unreachable;
        the requests' cache is left alone."""

        def run() -> None:
            while not self._closed.wait(WORKER_GAUGES_S):
                if self._registry_down is not None:
                    continue
                try:
                    self._read_workers()
                except RegistryUnavailableError as exc:
                    self._registry_unreachable(exc)

        threading.Thread(target=run, name="worker-gauges", daemon=True).start()

    def _adapter(self, adapter_id: str) -> AdapterRecord:
        return self._cached(
            self._adapters, adapter_id, "adapter", lambda: self.registry.get_adapter(adapter_id)
        )

    def _reread_adapter(self, adapter_id: str) -> AdapterRecord | None:
        """The adapter's record read from Redis now (and cached), or None when that fails
        (deleted: dropped from the cache; Redis unreachable)."""
        try:
            with self._direct_registry():
                record = self.registry.get_adapter(adapter_id)
        except AdapterNotFoundError:
            self._adapters.drop(adapter_id)
            return None
        except RegistryUnavailableError:
            return None
        self._adapters.put(adapter_id, record)
        return record

    @staticmethod
    def _check_tenant(record: AdapterRecord, tenant_id: str) -> None:
        """Serving and reading: an adapter registered with a tenant is for that tenant only;
        one registered without one is shared by everyone.

        Raises:
            AdapterPermissionError: ``record`` belongs to another tenant.
        """
        if record.tenant_id and record.tenant_id != tenant_id:
            raise AdapterPermissionError(
                f"adapter {quoted(record.adapter_id)} belongs to another tenant; "
                "set tenant_id to the adapter's owner"
            )

    @staticmethod
    def _check_owner(record: AdapterRecord, tenant_id: str, action: str) -> None:
        """Replacing and deleting: only the owner, i.e. the same ``tenant_id`` exactly. A
        shared adapter (registered without a tenant) is the operator's: calls without a
        tenant_id replace or delete it, and no tenant can, or one tenant could swap the
        weights every tenant is served, take the id over and lock the others out of it.

        Raises:
            AdapterPermissionError: ``tenant_id`` is not the owner.
        """
        if record.tenant_id == tenant_id:
            return
        hint = "; choose another id" if action == "replaces" else ""
        if not record.tenant_id:
            raise AdapterPermissionError(
                f"adapter {quoted(record.adapter_id)} is shared (registered without a "
                f"tenant_id): only a call without tenant_id {action} it{hint}"
            )
        raise AdapterPermissionError(
            f"adapter {quoted(record.adapter_id)} is owned by another tenant: only a call with "
            f"its owner's tenant_id {action} it{hint}"
        )

    def _choose(self, adapter: AdapterRecord | None, exclude: set[str]) -> WorkerRecord:
        healthy = [w for w in self._workers() if w.healthy and w.worker_id not in exclude]
        workers = self.routing.usable(healthy)
        if not workers:
            raise NoHealthyWorkerError(
                "no healthy worker is available; check `plora status` and the workers' logs"
            )
        by_id = {w.worker_id: w for w in workers}
        placement = self._placement() if adapter and self.config.routing != "round_robin" else {}
        chosen, reason = self.routing.route(
            adapter.adapter_id if adapter else "",
            [(worker_view(w), w.heartbeat_unix) for w in workers],
            placement,
            size_bytes=adapter.size_bytes if adapter else 0,
            now=time.time(),
        )
        self.metrics.routed.labels(self.config.routing, reason).inc()
        return by_id[chosen]

    def _placement(self) -> dict[str, list[str]]:
        return self._cached(
            self._placement_cache, "placement", "placement", self.registry.get_placement
        )

    # -- Generate -------------------------------------------------------------------------

    def Generate(  # noqa: N802 - gRPC method name
        self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        received = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        # A caller's id is for tracing, not unique: the workers see it with a suffix of this
        # call's own, so one client's (or tenant's) id in flight never refuses another's.
        call_id = f"{request_id}~{uuid.uuid4().hex[:8]}" if request.request_id else request_id
        self.metrics.in_flight.inc()
        code = grpc.StatusCode.OK
        detail = ""
        try:
            yield from self._generate(request, request_id, call_id, received, context)
        except PLoRAError as exc:
            code, detail = convert_status(exc), str(exc)
            abort(context, exc, request_id)
        except Exception as exc:  # noqa: BLE001
            if already_aborted(context):
                code = context.code()  # type: ignore[attr-defined]  # not in types-grpcio
                detail = context.details() or ""  # type: ignore[attr-defined]
                raise
            code, detail = grpc.StatusCode.INTERNAL, repr(exc)
            abort(context, exc, request_id)
        finally:
            if not context.is_active() and code is grpc.StatusCode.OK:
                code = ended_by_client(context)
            self.metrics.requests.labels(code.name).inc()
            self.metrics.in_flight.dec()
            if code is not grpc.StatusCode.OK:
                log_request_failure(
                    logger,
                    call_id,
                    code,
                    detail,
                    time.monotonic() - received,
                    request.adapter_id,
                    request.tenant_id,
                )

    def _generate(
        self,
        request: gateway_pb2.GenerateRequest,
        request_id: str,
        call_id: str,
        received: float,
        context: grpc.ServicerContext,
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        validate_generate(request, self.config)
        adapter: AdapterRecord | None = None
        if request.adapter_id:
            adapter = self._adapter(request.adapter_id)
            self._check_tenant(adapter, request.tenant_id)
        self.events.offer(
            predictor_pb2.RequestEvent(
                request_id=request_id,
                adapter_id=request.adapter_id,
                tenant_id=request.tenant_id,
                arrival_unix=time.time(),
                prompt_tokens=0,
            )
        )
        forwarded = gateway_pb2.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.request_id = call_id
        if not forwarded.HasField("max_new_tokens"):
            forwarded.max_new_tokens = self.config.default_max_new_tokens
        worker_request = worker_pb2.WorkerGenerateRequest(
            request=forwarded, adapter=convert.adapter_info(adapter) if adapter else None
        )
        tried: set[str] = set()
        refreshed = False  # the adapter's record was read again after a worker refused it
        while True:
            worker = self._choose(adapter, tried)
            tried.add(worker.worker_id)
            # what is left of the client's deadline (else of request_timeout_s) as the call
            # starts: a retry does not get the whole of it again, and the worker's deadline
            # is the client's, so a stream the deadline ends is counted as such there too
            # (not CANCELLED by this gateway a moment before the worker's own clock passes it)
            budget = received + self.config.request_timeout_s - time.monotonic()
            timeout = remaining_or(context, max(0.001, budget))
            call = self._stub(worker.address).Generate(worker_request, timeout=timeout)
            cancel = lambda call=call: call.cancel()  # noqa: E731
            context.add_callback(cancel)
            ttft: float | None = None
            try:
                for response in call:
                    if ttft is None and (response.token_ids or response.finish_reason):
                        # at the first token, so a stream that ends badly later counts too
                        ttft = time.monotonic() - received
                        self.routing.first_token(worker.worker_id)
                        cold = str(response.adapter_cold).lower()
                        self.metrics.ttft.labels(cold).observe(ttft)
                    if response.token_ids:
                        self.metrics.tokens.inc(len(response.token_ids))
                    if response.finish_reason:
                        self.metrics.e2e.observe(time.monotonic() - received)
                    if self._drain_deadline is not None and not response.finish_reason:
                        if time.monotonic() >= self._drain_deadline:
                            call.cancel()
                            context.abort(
                                grpc.StatusCode.UNAVAILABLE,
                                f"the gateway is shutting down and ended this stream after "
                                f"its {self._drain_grace_s:g} s grace period; send the "
                                "request again once the cluster is back",
                            )
                    response.request_id = request_id
                    yield response
                return
            except grpc.RpcError as exc:
                before_first_token = ttft is None
                if (
                    exc.code() is grpc.StatusCode.UNAVAILABLE
                    and before_first_token
                    and (context.is_active())
                ):
                    logger.warning(
                        "worker %s failed before the first token (%s); retrying elsewhere",
                        worker.worker_id,
                        exc.details(),
                    )
                    self.routing.failed(worker.worker_id, worker.heartbeat_unix)
                    self.metrics.retries.inc()
                    self._workers_cache.expire("workers")
                    continue
                if (
                    exc.code() is grpc.StatusCode.NOT_FOUND
                    and before_first_token
                    and adapter is not None
                    and not refreshed
                    and context.is_active()
                ):
                    # The worker refused this version (superseded: a re-registration this
                    # gateway's cache had not seen, or it was dropped while loading): once,
                    # read the record again and, if it is newer, send the request with it.
                    refreshed = True
                    fresh = self._reread_adapter(adapter.adapter_id)
                    if fresh is not None and fresh.version > adapter.version:
                        self._check_tenant(fresh, request.tenant_id)
                        logger.info(
                            "worker %s refused %s v%d (%s); retrying with v%d",
                            worker.worker_id,
                            adapter.adapter_id,
                            adapter.version,
                            exc.details(),
                            fresh.version,
                        )
                        adapter = fresh
                        worker_request.adapter.CopyFrom(convert.adapter_info(fresh))
                        tried.discard(worker.worker_id)
                        self.metrics.retries.inc()
                        continue
                if not context.is_active():
                    return
                details = exc.details() or exc.code().name
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    details = (
                        f"worker {worker.worker_id} failed while streaming this request "
                        f"({details}); send it again (requests not yet started there are "
                        "retried on another worker)"
                    )
                context.abort(exc.code(), details)
            finally:
                self.routing.done(worker.worker_id, pending=ttft is None)

    # -- adapters -------------------------------------------------------------------------

    @map_errors
    def RegisterAdapter(  # noqa: N802
        self, request: gateway_pb2.RegisterAdapterRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.RegisterAdapterResponse:
        check_adapter_id(request.adapter_id)
        check_tenant_id(request.tenant_id)
        source = adapter_source(request.source)
        with self._direct_registry():
            return self._register(request, source)

    def _register(
        self, request: gateway_pb2.RegisterAdapterRequest, source: str
    ) -> gateway_pb2.RegisterAdapterResponse:
        """RegisterAdapter past its input checks (``source`` resolved)."""
        published = self.registry.get_model_spec()
        if published is None:
            raise NoHealthyWorkerError(
                "no worker has published the base model to the registry yet; wait for a "
                "worker to start (workers publish it with every heartbeat: a second after "
                "Redis restarted empty)"
            )
        spec, dtype_name = published
        import torch  # noqa: PLC0415 - only needed to size adapters in the serving dtype

        manifest = inspect_adapter(source, spec, dtype=getattr(torch, dtype_name))
        pools = [int(w.pool.get("pool_bytes", 0)) for w in self._workers() if w.healthy]
        largest = max(pools, default=0)
        if largest and manifest.size_bytes > largest:
            raise PoolExhaustedError(
                f"adapter {quoted(request.adapter_id)} needs {manifest.size_bytes} bytes but the "
                f"largest worker pool holds {largest}; raise --pool-bytes or use a smaller rank"
            )
        previous = None
        try:
            previous = self.registry.get_adapter(request.adapter_id)
        except AdapterNotFoundError:
            previous = None
        if previous is not None:
            self._check_owner(previous, request.tenant_id, "replaces")
        record = AdapterRecord(
            adapter_id=request.adapter_id,
            source=source,
            tenant_id=request.tenant_id,
            rank=manifest.rank,
            alpha=float(manifest.alpha),
            target_modules=list(manifest.target_modules),
            size_bytes=manifest.size_bytes,
            sha256=manifest.sha256,
            version=self.registry.next_adapter_version(request.adapter_id),
            use_rslora=manifest.use_rslora,
            created_unix_ms=int(time.time() * 1000),
            num_modules=manifest.num_modules,
        )
        if record.version == 1:
            # The first version since this Redis started counting: a worker may still hold a
            # copy from before the registry was emptied (an external Redis restarted without
            # persistence), with a higher version it would take this one to be superseded
            # by. Workers forget it before the record exists, so no request can race it.
            self._broadcast_unload(record.adapter_id, wait=True)
        if not self.registry.put_adapter(record):
            raise RegistrationConflictError(
                f"adapter {quoted(request.adapter_id)} was registered again meanwhile, with a "
                f"later version than this call's {record.version}, which stays registered; "
                "GetAdapter shows it, register again to replace it"
            )
        self._adapters.drop(record.adapter_id)
        if previous is not None:
            # only the older versions: a late unload must spare this one if a request has
            # already started loading it
            self._broadcast_unload(record.adapter_id, below_version=record.version)
        logger.info(
            "registered adapter %s v%d (rank %d, %d bytes, tenant %s) from %s",
            record.adapter_id,
            record.version,
            record.rank,
            record.size_bytes,
            record.tenant_id or "-",
            source,
        )
        return gateway_pb2.RegisterAdapterResponse(adapter=convert.adapter_info(record))

    @map_errors
    def GetAdapter(  # noqa: N802
        self, request: gateway_pb2.GetAdapterRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.GetAdapterResponse:
        check_adapter_id(request.adapter_id)
        check_tenant_id(request.tenant_id)
        with self._direct_registry():
            record = self.registry.get_adapter(request.adapter_id)
            self._check_tenant(record, request.tenant_id)
            resident = [w.worker_id for w in self._workers() if record.adapter_id in w.resident]
            placed = self.registry.get_placement().get(record.adapter_id, [])
            return gateway_pb2.GetAdapterResponse(
                adapter=convert.adapter_info(record),
                resident_on_workers=resident,
                placed_on_workers=placed,
            )

    @map_errors
    def ListAdapters(  # noqa: N802
        self, request: gateway_pb2.ListAdaptersRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.ListAdaptersResponse:
        check_tenant_id(request.tenant_id)
        with self._direct_registry():
            records = self.registry.list_adapters()
            if request.tenant_id:
                records = [r for r in records if r.tenant_id in ("", request.tenant_id)]
            return gateway_pb2.ListAdaptersResponse(
                adapters=[convert.adapter_info(r) for r in records]
            )

    @map_errors
    def DeleteAdapter(  # noqa: N802
        self, request: gateway_pb2.DeleteAdapterRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.DeleteAdapterResponse:
        check_adapter_id(request.adapter_id)
        check_tenant_id(request.tenant_id)
        with self._direct_registry():
            record = self.registry.get_adapter(request.adapter_id)
            self._check_owner(record, request.tenant_id, "deletes")
            self.registry.delete_adapter(request.adapter_id)
            self._adapters.drop(request.adapter_id)
            self._broadcast_unload(request.adapter_id)
            logger.info(
                "deleted adapter %s v%d (tenant %s)",
                record.adapter_id,
                record.version,
                record.tenant_id or "-",
            )
            return gateway_pb2.DeleteAdapterResponse(version=record.version)

    def _broadcast_unload(
        self, adapter_id: str, wait: bool = False, below_version: int = 0
    ) -> None:
        """Drop every copy of an adapter (or, with ``below_version``, its versions older
        than that one) from the healthy workers, best effort (a worker that is down holds
        nothing when it comes back): in the background, or with ``wait`` before returning
        (the calls run in parallel, each for at most ``UNLOAD_TIMEOUT_S``)."""

        def run() -> None:
            try:
                workers = [w for w in self._workers() if w.healthy]
            except RegistryUnavailableError:
                return  # logged by the registry; best effort, as for a worker that is down
            request = worker_pb2.UnloadAdapterRequest(
                adapter_id=adapter_id, below_version=below_version
            )
            calls = [
                (w, self._stub(w.address).UnloadAdapter.future(request, timeout=UNLOAD_TIMEOUT_S))
                for w in workers
            ]
            for w, call in calls:
                try:
                    call.result()
                except grpc.RpcError as exc:
                    logger.warning(
                        "unload of %s on %s failed: %s", adapter_id, w.worker_id, exc.code().name
                    )

        if wait:
            run()
        else:
            threading.Thread(target=run, name="unload-broadcast", daemon=True).start()

    @map_errors
    def GetClusterStatus(  # noqa: N802
        self, request: gateway_pb2.GetClusterStatusRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.GetClusterStatusResponse:
        with self._direct_registry():
            self._workers_cache.expire("workers")
            workers = self._workers()
            published = self.registry.get_model_spec()
            return gateway_pb2.GetClusterStatusResponse(
                workers=[convert.worker_status(w) for w in workers],
                adapters_registered=len(self.registry.list_adapters()),
                base_model=published[0].name if published else "",
                predictor_connected=self.events.connected,
            )


def convert_status(exc: PLoRAError) -> grpc.StatusCode:
    """Status code of a domain error (for the request counter)."""
    return getattr(grpc.StatusCode, exc.status_code_name)


class GatewayService:
    """A running gateway: gRPC server, metrics endpoint and event stream.

    Args:
        config: The gateway's settings.

    Raises:
        RegistryUnavailableError: Redis cannot be reached.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.registry = Registry(connect(config.redis_url))
        self.servicer = GatewayServicer(config, self.registry, self.metrics)

        def register(server: grpc.Server) -> list[str]:
            gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, server)
            return [SERVICE_NAME]

        self.server, self.port, self.health = create_server(
            register, host=config.host, port=config.port, max_workers=64
        )
        self.metrics_server, self.metrics_port = serve_metrics(
            self.metrics.registry, config.host, config.metrics_port
        )

    def start(self) -> GatewayService:
        """Start serving and mark the service SERVING."""
        self.server.start()
        self.servicer.events.start()
        self.servicer.start_gauges()
        set_serving(self.health, [SERVICE_NAME], True)
        if self.config.ready_file:
            write_ready_file(self.config.ready_file, self.port, self.metrics_port)
        logger.info("gateway serving on %s:%d", self.config.host, self.port)
        logger.info("settings: %s", settings_line(self.config))
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting requests, let in-flight ones finish within ``grace`` seconds; those
        still streaming a second before it ends are ended with UNAVAILABLE saying why
        (:meth:`GatewayServicer.begin_drain`)."""
        set_serving(self.health, [SERVICE_NAME], False)
        self.servicer.begin_drain(grace, max(0.0, grace - 1.0))
        self.server.stop(grace).wait()
        self.servicer.close()
        self.metrics_server.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``plora serve gateway``."""
    return run_service("gateway", GatewayConfig, GatewayService, argv)
