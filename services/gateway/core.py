"""The gateway's serving logic, behind whichever front door receives the requests.

:class:`GatewayCore` validates requests, resolves adapter records
(:mod:`~services.gateway.catalog`), checks tenancy (:mod:`~services.gateway.tenancy`), routes
each request to a worker (the shared :class:`~services.common.routing.RoutingState`), relays
the worker's stream (:mod:`~services.gateway.workers`), sends a request again on another
worker when one fails before the first token (:func:`~services.gateway.retry.should_retry`),
streams request events to the predictor without waiting on it, and keeps the gateway's
metrics. Its answers are domain values
(:mod:`~services.gateway.results`) and its failures domain errors
(:class:`~services.common.errors.PLoRAError`): a front door converts both, the gRPC one in
:mod:`services.gateway.server`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Protocol

import grpc

from plora.v1 import gateway_pb2, predictor_pb2, worker_pb2
from services.common import convert
from services.common.adapters import inspect_adapter
from services.common.errors import (
    AdapterNotFoundError,
    NoHealthyWorkerError,
    PLoRAError,
    PoolExhaustedError,
    RegistrationConflictError,
    quoted,
)
from services.common.grpc_util import ended_by_client, log_request_failure, remaining_or, status_for
from services.common.internal_auth import resolve_token
from services.common.registry import AdapterRecord, Registry, RegistryUnavailableError, WorkerRecord
from services.common.remote_sources import (
    RemoteSource,
    SourceAllowList,
    inspect_remote_adapter,
    is_remote,
)
from services.common.routing import (
    ROUND_ROBIN,
    ROUTED_GRACE_S,
    RoutingState,
    WorkerView,
    worker_view,
)
from services.common.sources import Confinement
from services.gateway.admission import (
    Admission,
    AdmissionRefusedError,
    Registrations,
    check_adapter_quota,
)
from services.gateway.catalog import Catalog
from services.gateway.config import GatewayConfig
from services.gateway.events import EventStreamer
from services.gateway.metrics import GatewayMetrics
from services.gateway.results import AdapterStatus, ClusterStatus, GenerateChunk
from services.gateway.retry import Retry, should_retry
from services.gateway.tenancy import check_owner, check_tenant, visible_to
from services.gateway.validation import (
    adapter_source,
    check_adapter_id,
    check_tenant_id,
    validate_generate,
)
from services.gateway.workers import WorkerCallError, WorkerClients, WorkerStream

logger = logging.getLogger(__name__)


class Client(Protocol):
    """The caller of one request, as the core needs it (a ``grpc.ServicerContext`` is one)."""

    def is_active(self) -> bool:
        """Whether the caller still waits for the answer."""
        ...

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline (None or huge: no deadline)."""
        ...

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` once the call ends, however it ends."""
        ...


class GatewayStoppingError(PLoRAError):
    """The gateway is stopping and ended a stream still running after its grace period
    (UNAVAILABLE)."""

    status_code_name = "UNAVAILABLE"


class Generation(Iterator[GenerateChunk]):
    """One Generate request in progress: iterate for its chunks; :meth:`close` ends it early
    (the client went away).

    Attributes:
        request_id: The request's id: the caller's, or one the gateway made.
    """

    def __init__(self, request_id: str, chunks: Generator[GenerateChunk, None, None]) -> None:
        self.request_id = request_id
        self._chunks = chunks

    def __next__(self) -> GenerateChunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop the request where it is (its bookkeeping and metrics are settled)."""
        self._chunks.close()


class GatewayCore:
    """The gateway's serving logic over the registry, the workers and the predictor.

    Args:
        config: The gateway's settings.
        registry: The Redis registry.
        metrics: The gateway's Prometheus series.

    Raises:
        RegistryUnavailableError: Redis cannot be reached (it numbers the gateways started).
    """

    def __init__(self, config: GatewayConfig, registry: Registry, metrics: GatewayMetrics) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.catalog = Catalog(config, registry, metrics)
        # each gateway on this registry breaks routing ties starting at its own turn
        self.routing = RoutingState(
            config.routing,
            on_pending=lambda w, n: metrics.worker_pending.labels(w).set(n),
            first_turn=registry.next_gateway_index(),
        )
        # the cluster's internal token, sent on every call to a worker and to the predictor
        internal_token = resolve_token(config.internal_token_file, config.internal_token)
        self.workers = WorkerClients(internal_token)
        self.admission = Admission(config.max_concurrent_requests, config.max_concurrent_per_tenant)
        # the in-flight gauge reads the admission count: one count of the streams served
        metrics.in_flight.set_function(lambda: self.admission.in_flight)
        self.registrations = Registrations()
        self._base_model = ("", 0.0)  # (name, monotonic time read): base_model()
        # monotonic time after which streams still running are ended (the gateway stops)
        self._drain_deadline: float | None = None
        self._drain_grace_s = 0.0
        self.events = EventStreamer(
            config.predictor_address,
            config.event_queue_size,
            on_sent=lambda n: metrics.events_sent.inc(n),
            on_dropped=lambda n: metrics.events_dropped.inc(n),
            on_connected=lambda c: metrics.predictor_connected.set(1 if c else 0),
            internal_token=internal_token,
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the event stream and the background worker-list reads."""
        self.events.start()
        self.catalog.start_gauges()

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
        """Stop the event stream and the registry checks, and close worker channels."""
        self.catalog.close()
        self.events.stop()
        self.workers.close()

    # -- Generate -------------------------------------------------------------------------

    def generate(self, request: gateway_pb2.GenerateRequest, client: Client) -> Generation:
        """Serve one generation request (``plora.v1.GenerateRequest``, the cluster's request
        schema: a front door builds one).

        The stream is admitted first (:class:`~services.gateway.admission.Admission`): beyond
        ``max_concurrent_requests`` streams in all, or ``max_concurrent_per_tenant`` of the
        request's tenant, it is refused at once, and its place is given back however it ends
        (finished, failed, cancelled by the client, past its deadline, or closed).

        Each chunk the chosen worker streams is passed on as it comes. The request is counted
        (``plora_gateway_requests_total`` by status, in flight) and, when it does not end OK,
        logged once with the id the workers see.

        Raises:
            PLoRAError: While iterating: the request was refused or failed (the worker's own
                status as :class:`~services.gateway.workers.WorkerCallError`;
                :class:`~services.gateway.admission.AdmissionRefusedError` beyond a bound).
        """
        request_id = request.request_id or uuid.uuid4().hex
        return Generation(request_id, self._counted(request, request_id, client))

    def refuse_if_full(self) -> None:
        """Refuse a ``Generate`` call before its request is read while the gateway serves
        ``max_concurrent_requests`` streams (:meth:`Admission.check_room`): a front door that
        can answer before it reads and parses the request calls this first, so that a flood
        costs the gateway as little as possible per refused call. :meth:`generate` still
        admits each stream that gets past it.

        Raises:
            AdmissionRefusedError: The gateway is full; counted as :meth:`generate` counts
                its refusals.
        """
        try:
            self.admission.check_room()
        except AdmissionRefusedError as exc:
            self._count_refusal(exc)
            raise

    def _count_refusal(self, exc: AdmissionRefusedError) -> None:
        # counted, not logged: a flood of refusals would flood the log
        self.metrics.rejected.labels(exc.reason).inc()
        self.metrics.requests.labels(exc.status_code_name).inc()

    def _counted(
        self, request: gateway_pb2.GenerateRequest, request_id: str, client: Client
    ) -> Generator[GenerateChunk, None, None]:
        received = time.monotonic()
        # A caller's id is for tracing, not unique: the workers see it with a suffix of this
        # call's own, so one client's (or tenant's) id in flight never refuses another's.
        call_id = f"{request_id}~{uuid.uuid4().hex[:8]}" if request.request_id else request_id
        try:
            ticket = self.admission.admit(request.tenant_id)
        except AdmissionRefusedError as exc:
            self._count_refusal(exc)
            raise
        code = grpc.StatusCode.OK
        detail = ""
        try:
            yield from self._generate(request, request_id, call_id, received, client)
        except Exception as exc:
            code = status_for(exc)
            detail = str(exc) if isinstance(exc, PLoRAError) else repr(exc)
            raise
        finally:
            if not client.is_active() and code is grpc.StatusCode.OK:
                code = ended_by_client(client)
            ticket.release()
            self.metrics.requests.labels(code.name).inc()
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
        client: Client,
    ) -> Iterator[GenerateChunk]:
        validate_generate(request, self.config)
        adapter: AdapterRecord | None = None
        if request.adapter_id:
            adapter = self.catalog.adapter(request.adapter_id)
            check_tenant(adapter, request.tenant_id)
        self.events.offer(
            predictor_pb2.RequestEvent(
                request_id=request_id,
                adapter_id=request.adapter_id,
                tenant_id=request.tenant_id,
                arrival_unix=time.time(),
                prompt_tokens=0,
            )
        )
        worker_request = self._worker_request(request, call_id, adapter)
        tried: set[str] = set()
        refreshed = False  # the adapter's record was read again after a worker refused it
        while True:
            worker = self._choose(adapter, tried)
            tried.add(worker.worker_id)
            first_token = False
            try:
                stream = self._call(worker, worker_request, received, client)
                for chunk in stream:
                    if not first_token and (chunk.token_ids or chunk.finish_reason):
                        # at the first token, so a stream that ends badly later counts too
                        first_token = True
                        self.routing.first_token(worker.worker_id)
                        cold = str(chunk.adapter_cold).lower()
                        self.metrics.ttft.labels(cold).observe(time.monotonic() - received)
                    self._observe(chunk, received, stream)
                    chunk.request_id = request_id
                    yield chunk
                return
            except WorkerCallError as exc:
                error = exc
            finally:
                self.routing.done(worker.worker_id, pending=not first_token)
            action = self._retry(error, first_token, client, adapter, refreshed)
            if action is Retry.ELSEWHERE:
                logger.warning(
                    "worker %s failed before the first token (%s); retrying elsewhere",
                    worker.worker_id,
                    error.details,
                )
                self.routing.failed(worker.worker_id, worker.heartbeat_unix)
                self.metrics.retries.inc()
                self.catalog.expire_workers()
                continue
            if action is Retry.REFRESH_ADAPTER:
                assert adapter is not None
                refreshed = True
                fresh = self._newer_version(adapter, request.tenant_id)
                if fresh is not None:
                    logger.info(
                        "worker %s refused %s v%d (%s); retrying with v%d",
                        worker.worker_id,
                        adapter.adapter_id,
                        adapter.version,
                        error.details,
                        fresh.version,
                    )
                    adapter = fresh
                    worker_request.adapter.CopyFrom(convert.adapter_info(fresh))
                    tried.discard(worker.worker_id)
                    self.metrics.retries.inc()
                    continue
                action = self._retry(error, first_token, client, adapter, refreshed)
            if action is Retry.CLIENT_GONE:
                return
            raise self._relayed_error(worker, error)

    def _retry(
        self,
        error: WorkerCallError,
        first_token: bool,
        client: Client,
        adapter: AdapterRecord | None,
        refreshed: bool,
    ) -> Retry:
        return should_retry(
            error.status_code_name,
            first_token_sent=first_token,
            client_active=client.is_active(),
            has_adapter=adapter is not None,
            refreshed=refreshed,
        )

    def _worker_request(
        self, request: gateway_pb2.GenerateRequest, call_id: str, adapter: AdapterRecord | None
    ) -> worker_pb2.WorkerGenerateRequest:
        """What the worker is sent: the request under the call's id, with the default
        ``max_new_tokens`` filled in and the adapter's record."""
        forwarded = gateway_pb2.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.request_id = call_id
        if not forwarded.HasField("max_new_tokens"):
            forwarded.max_new_tokens = self.config.default_max_new_tokens
        return worker_pb2.WorkerGenerateRequest(
            request=forwarded, adapter=convert.adapter_info(adapter) if adapter else None
        )

    def _call(
        self,
        worker: WorkerRecord,
        worker_request: worker_pb2.WorkerGenerateRequest,
        received: float,
        client: Client,
    ) -> WorkerStream:
        """Start the call to ``worker``, ended with the client's. It gets what is left of the
        client's deadline (else of ``request_timeout_s``) as it starts: a retry does not get
        the whole of it again, and the worker's deadline is the client's, so a stream the
        deadline ends is counted as such there too (not cancelled by this gateway a moment
        before the worker's own clock passes it)."""
        budget = received + self.config.request_timeout_s - time.monotonic()
        timeout = remaining_or(client, max(0.001, budget))
        stream = self.workers.generate(worker.address, worker_request, timeout)
        client.add_callback(stream.cancel)
        return stream

    def _observe(self, chunk: GenerateChunk, received: float, stream: WorkerStream) -> None:
        """Count a chunk's tokens (and the request's end); past the drain deadline, end the
        stream.

        Raises:
            GatewayStoppingError: The gateway is stopping and its grace period is over.
        """
        if chunk.token_ids:
            self.metrics.tokens.inc(len(chunk.token_ids))
        if chunk.finish_reason:
            self.metrics.e2e.observe(time.monotonic() - received)
        elif self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            stream.cancel()
            raise GatewayStoppingError(
                f"the gateway is shutting down and ended this stream after its "
                f"{self._drain_grace_s:g} s grace period; send the request again once the "
                "cluster is back"
            )

    def _newer_version(self, adapter: AdapterRecord, tenant_id: str) -> AdapterRecord | None:
        """The adapter's record read again, if it is a later version than ``adapter`` (and the
        tenant may use it), else None.

        Raises:
            AdapterPermissionError: The newer version belongs to another tenant.
        """
        fresh = self.catalog.reread_adapter(adapter.adapter_id)
        if fresh is None or fresh.version <= adapter.version:
            return None
        check_tenant(fresh, tenant_id)
        return fresh

    @staticmethod
    def _relayed_error(worker: WorkerRecord, error: WorkerCallError) -> WorkerCallError:
        """The worker's status as the request's, its message saying what to do."""
        details = error.details or error.status_code_name
        if error.status_code_name == "UNAVAILABLE":
            details = (
                f"worker {worker.worker_id} failed while streaming this request "
                f"({details}); send it again (requests not yet started there are "
                "retried on another worker)"
            )
        return WorkerCallError(error.status_code_name, error.details, details)

    def _choose(self, adapter: AdapterRecord | None, exclude: set[str]) -> WorkerRecord:
        """The worker for a request (``exclude``: those tried already), counted as sent there.

        Raises:
            NoHealthyWorkerError: No healthy worker is left.
        """
        healthy = [w for w in self.catalog.workers() if w.healthy and w.worker_id not in exclude]
        workers = self.routing.usable(healthy)
        if not workers:
            raise NoHealthyWorkerError(
                "no healthy worker is available; check `plora status` and the workers' logs"
            )
        by_id = {w.worker_id: w for w in workers}
        rank_aware = adapter is not None and self.config.routing != ROUND_ROBIN
        beats = [(worker_view(w), w.heartbeat_unix) for w in workers]
        now = time.time()
        if rank_aware and adapter is not None:
            self._join_peer_load(adapter, beats, now)
        chosen, reason = self.routing.route(
            adapter.adapter_id if adapter else "",
            beats,
            self.catalog.placement() if rank_aware else {},
            size_bytes=adapter.size_bytes if adapter else 0,
            now=now,
        )
        if rank_aware and adapter is not None and reason in ("least_loaded", "host", "placed"):
            self._share_cold_route(adapter.adapter_id, chosen)
        self.metrics.routed.labels(self.config.routing, reason).inc()
        return by_id[chosen]

    def _join_peer_load(
        self, adapter: AdapterRecord, beats: list[tuple[WorkerView, float]], now: float
    ) -> None:
        """Rule: an adapter no heartbeat shows resident or loading anywhere may have been sent
        cold by another gateway within the last heartbeat interval (``Registry.cold_route``);
        count it as loading there, so this request joins that load. Gateways in front of the
        same workers otherwise each start their own copy on the worker that looks idle from
        where they stand (two live gateways: one worker served 1.4-1.7x the requests of
        another under a uniform load). One Redis read, for would-be cold starts only; while
        Redis is known to be unreachable it is skipped at once (``GatewayCatalog.direct``),
        so a hung Redis costs no more requests their timeout than before."""
        aid = adapter.adapter_id
        if any(aid in v.resident or aid in v.loading for v, _ in beats):
            return
        try:
            with self.catalog.direct():  # fails at once while Redis is known to be down
                peer = self.registry.cold_route(aid)
        except RegistryUnavailableError:
            return
        if peer is not None:
            self.routing.note_peer_load(beats, peer, aid, adapter.size_bytes, now)

    def _share_cold_route(self, adapter_id: str, worker_id: str) -> None:
        """Publish a cold start this gateway began, for the other gateways
        (:meth:`_join_peer_load`), until the worker's heartbeats show the load."""
        try:
            with self.catalog.direct():
                self.registry.note_cold_route(adapter_id, worker_id, 2 * ROUTED_GRACE_S)
        except RegistryUnavailableError:
            pass

    # -- what may be asked for -------------------------------------------------------------

    def base_model(self) -> str:
        """The served base model's name as the workers published it ("" before any did);
        read at most once per ``adapter_cache_s`` (it changes only with the workers' model).

        Raises:
            RegistryUnavailableError: Redis is unreachable and no name was read before.
        """
        now = time.monotonic()
        name, read_at = self._base_model
        if name and now - read_at < self.config.adapter_cache_s:
            return name
        try:
            published = self.registry.get_model_spec()
        except RegistryUnavailableError:
            if name:
                return name
            raise
        name = published[0].name if published else ""
        self._base_model = (name, now)
        return name

    def models(self, tenant_id: str) -> tuple[str, list[AdapterRecord]]:
        """The base model's name and the adapters ``tenant_id`` may use ("" = every one).

        Raises:
            InvalidRequestError: A malformed tenant id.
            RegistryUnavailableError: Redis is unreachable.
        """
        return self.base_model(), self.list_adapters(tenant_id)

    def can_route(self) -> bool:
        """Whether a request could be routed now: some worker is healthy and not set aside
        after a failure (what an HTTP health check reports)."""
        try:
            healthy = [w for w in self.catalog.workers() if w.healthy]
        except RegistryUnavailableError:
            return False
        return bool(self.routing.usable(healthy))

    # -- adapters -------------------------------------------------------------------------

    def register_adapter(
        self, adapter_id: str, source: str, tenant_id: str, *, confine_to_tenant: bool = False
    ) -> AdapterRecord:
        """Inspect a PEFT adapter against the served base model and register it (a new
        version when the id exists; only its owner replaces it).

        With adapter roots configured (``--adapter-root``), the source directory and each
        file read in it must resolve under a root; with ``confine_to_tenant`` (a tenant's
        key), under ``ROOT/<tenant_id>/`` of some root - and with no roots configured a
        tenant-confined registration is refused, since no directory is the tenant's.

        A remote source (``s3://BUCKET/PREFIX/``, ``hf://ORG/REPO[@REV][/SUB]``) must lie
        under a prefix of ``--adapter-source-allow`` (a tenant's under ``PREFIX<tenant_id>/``)
        and is read by ranged reads, then streamed once for its sha256
        (:func:`~services.common.remote_sources.inspect_remote_adapter`); the record keeps
        its canonical URL.

        Args:
            adapter_id: Registry id.
            source: The adapter directory, or a remote source, as the client gave it.
            tenant_id: Owner ("" = shared).
            confine_to_tenant: Require the source under ``ROOT/<tenant_id>/``.

        Raises:
            InvalidRequestError: A malformed id, tenant id or source path.
            SourceRefusedError: The source is outside the roots (or the tenant's directory),
                or not an adapter directory there: one message for every cause
                (INVALID_ARGUMENT). For a remote source,
                :class:`~services.common.remote_sources.RemoteSourceRefusedError` likewise:
                not allowed, malformed, or its objects missing or forbidden.
            ObjectStoreError: The object store could not be read (UNAVAILABLE).
            NoHealthyWorkerError: No worker has published the base model yet.
            PoolExhaustedError: The adapter is larger than every worker's pool.
            AdapterPermissionError: The id belongs to another tenant.
            RegistrationConflictError: A concurrent registration of the id won.
            AdmissionRefusedError: A new id beyond ``max_adapters_per_tenant``, or
                :data:`~services.gateway.admission.MAX_CONCURRENT_REGISTRATIONS` in progress.
        """
        check_adapter_id(adapter_id)
        check_tenant_id(tenant_id)
        remote: RemoteSource | None = None
        confinement: Confinement | None = None
        if is_remote(source):
            allow = SourceAllowList(self.config.adapter_source_allow)
            remote = allow.check(source, tenant_id if confine_to_tenant else None)
            path = remote.url
        else:
            confinement = self._confinement(tenant_id if confine_to_tenant else None)
            path = adapter_source(source, confinement)
        with self.catalog.direct(), self._registration():
            self._check_adapter_quota(adapter_id, tenant_id)
            return self._register(adapter_id, path, tenant_id, confinement, remote)

    @contextlib.contextmanager
    def _registration(self) -> Iterator[None]:
        """A place among the registrations in progress for the body of the ``with``.

        Raises:
            AdmissionRefusedError: Every place is taken.
        """
        try:
            ticket = self.registrations.admit()
        except AdmissionRefusedError as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            raise
        try:
            yield
        finally:
            ticket.release()

    def _check_adapter_quota(self, adapter_id: str, tenant_id: str) -> None:
        """``max_adapters_per_tenant`` against the registry's records of ``tenant_id``, before
        the adapter's files are read. Two registrations of new ids racing may both pass it:
        the bound holds within the number of concurrent registrations.

        Raises:
            AdmissionRefusedError: ``adapter_id`` is new and the tenant holds the limit.
        """
        limit = self.config.max_adapters_per_tenant
        if not limit:
            return
        records = self.registry.list_adapters()
        owned = [r.adapter_id for r in records if r.tenant_id == tenant_id]
        try:
            check_adapter_quota(len(owned), limit, replacing=adapter_id in owned)
        except AdmissionRefusedError as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            raise

    def _confinement(self, tenant: str | None) -> Confinement | None:
        """Where a registration may read: the adapter roots (``ROOT/<tenant>/`` of each for a
        tenant); None = no roots and no tenant, read as given."""
        if not self.config.adapter_roots and tenant is None:
            return None
        return Confinement(self.config.adapter_roots, tenant)

    def _register(
        self,
        adapter_id: str,
        source: str,
        tenant_id: str,
        confinement: Confinement | None,
        remote: RemoteSource | None = None,
    ) -> AdapterRecord:
        published = self.registry.get_model_spec()
        if published is None:
            raise NoHealthyWorkerError(
                "no worker has published the base model to the registry yet; wait for a "
                "worker to start (workers publish it with every heartbeat: a second after "
                "Redis restarted empty)"
            )
        spec, dtype_name = published
        import torch  # noqa: PLC0415 - only needed to size adapters in the serving dtype

        pools = [int(w.pool.get("pool_bytes", 0)) for w in self.catalog.workers() if w.healthy]
        largest = max(pools, default=0)
        try:  # pool fit is checked from the header, before the weights are hashed or scanned
            if remote is not None:
                manifest = inspect_remote_adapter(
                    remote,
                    spec,
                    dtype=getattr(torch, dtype_name),
                    limits=self.config.inspection_limits,
                    max_bytes=largest or None,
                )
            else:
                manifest = inspect_adapter(
                    source,
                    spec,
                    dtype=getattr(torch, dtype_name),
                    limits=self.config.inspection_limits,
                    max_bytes=largest or None,
                    confinement=confinement,
                )
        except PoolExhaustedError as exc:
            raise PoolExhaustedError(f"adapter {quoted(adapter_id)}: {exc}") from None
        previous = None
        try:
            previous = self.registry.get_adapter(adapter_id)
        except AdapterNotFoundError:
            previous = None
        if previous is not None:
            check_owner(previous, tenant_id, "replaces")
        record = AdapterRecord(
            adapter_id=adapter_id,
            source=source,
            tenant_id=tenant_id,
            rank=manifest.rank,
            alpha=float(manifest.alpha),
            target_modules=list(manifest.target_modules),
            size_bytes=manifest.size_bytes,
            sha256=manifest.sha256,
            version=self.registry.next_adapter_version(adapter_id),
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
                f"adapter {quoted(adapter_id)} was registered again meanwhile, with a "
                f"later version than this call's {record.version}, which stays registered; "
                "GetAdapter shows it, register again to replace it"
            )
        self.catalog.forget_adapter(record.adapter_id)
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
        return record

    def get_adapter(self, adapter_id: str, tenant_id: str) -> AdapterStatus:
        """An adapter's record, the healthy workers holding it and those it is placed on.

        Raises:
            InvalidRequestError: A malformed id or tenant id.
            AdapterNotFoundError: Not registered.
            AdapterPermissionError: Another tenant's.
        """
        check_adapter_id(adapter_id)
        check_tenant_id(tenant_id)
        with self.catalog.direct():
            record = self.registry.get_adapter(adapter_id)
            check_tenant(record, tenant_id)
            resident = [
                w.worker_id for w in self.catalog.workers() if record.adapter_id in w.resident
            ]
            placed = self.registry.get_placement().get(record.adapter_id, [])
            return AdapterStatus(record, resident, placed)

    def list_adapters(self, tenant_id: str) -> list[AdapterRecord]:
        """The registered adapters ``tenant_id`` may use ("" = every adapter).

        Raises:
            InvalidRequestError: A malformed tenant id.
        """
        check_tenant_id(tenant_id)
        with self.catalog.direct():
            return [r for r in self.registry.list_adapters() if visible_to(r, tenant_id)]

    def delete_adapter(self, adapter_id: str, tenant_id: str) -> int:
        """Delete an adapter from the registry and every worker; returns its version.

        Raises:
            InvalidRequestError: A malformed id or tenant id.
            AdapterNotFoundError: Not registered.
            AdapterPermissionError: ``tenant_id`` is not its owner.
        """
        check_adapter_id(adapter_id)
        check_tenant_id(tenant_id)
        with self.catalog.direct():
            record = self.registry.get_adapter(adapter_id)
            check_owner(record, tenant_id, "deletes")
            self.registry.delete_adapter(adapter_id)
            self.catalog.forget_adapter(adapter_id)
            self._broadcast_unload(adapter_id)
            logger.info(
                "deleted adapter %s v%d (tenant %s)",
                record.adapter_id,
                record.version,
                record.tenant_id or "-",
            )
            return record.version

    def _broadcast_unload(
        self, adapter_id: str, wait: bool = False, below_version: int = 0
    ) -> None:
        """Drop every copy of an adapter (or, with ``below_version``, its versions older
        than that one) from the healthy workers, best effort (a worker that is down holds
        nothing when it comes back): in the background, or with ``wait`` before returning."""

        def run() -> None:
            try:
                workers = [w for w in self.catalog.workers() if w.healthy]
            except RegistryUnavailableError:
                return  # logged by the registry; best effort, as for a worker that is down
            self.workers.unload(workers, adapter_id, below_version)

        if wait:
            run()
        else:
            threading.Thread(target=run, name="unload-broadcast", daemon=True).start()

    def cluster_status(self, tenant_id: str = "") -> ClusterStatus:
        """Every worker as its last heartbeat has it, read now, and the registry's counts.

        Args:
            tenant_id: "" = the whole cluster; a tenant sees only the residency and the
                count of the adapters it may use (its own and shared ones,
                :func:`~services.gateway.tenancy.visible_to`).

        Raises:
            RegistryUnavailableError: Redis is unreachable.
        """
        with self.catalog.direct():
            self.catalog.expire_workers()
            workers = self.catalog.workers()
            published = self.registry.get_model_spec()
            adapters = [r for r in self.registry.list_adapters() if visible_to(r, tenant_id)]
            if tenant_id:
                seen = {r.adapter_id for r in adapters}
                workers = [
                    dataclasses.replace(
                        w,
                        resident=[a for a in w.resident if a in seen],
                        host_cached=[a for a in w.host_cached if a in seen],
                    )
                    for w in workers
                ]
            return ClusterStatus(
                workers=workers,
                adapters_registered=len(adapters),
                base_model=published[0].name if published else "",
                predictor_connected=self.events.connected,
            )
