"""The worker: ``plora.v1.Worker`` over the engine and the paged adapter store.

One worker per accelerator. It loads the base model, publishes its shape to Redis (the gateway
validates adapters against it), runs the continuous-batching engine and the adapter store, and
heartbeats its queue, residency and pool statistics to Redis. Each RPC converts its request,
makes one call into :class:`~services.worker.core.WorkerCore` and converts the answer; a domain
error becomes its status in one place (:func:`services.common.grpc_util.abort`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from plora.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc
from services.common import convert
from services.common.adapters import load_lora_weights
from services.common.config import settings_line
from services.common.errors import (
    AdapterSourceError,
    IncompatibleAdapterError,
    InvalidAdapterError,
)
from services.common.grpc_util import (
    abort,
    create_server,
    map_errors,
    set_serving,
)
from services.common.internal_auth import resolve_token, server_interceptors
from services.common.lifecycle import run_service, write_ready_file
from services.common.metrics import serve_metrics
from services.common.registry import (
    Registry,
    RegistryUnavailableError,
    WorkerLease,
    WorkerLeaseKeeper,
    WorkerRecord,
    connect,
)
from services.common.remote_sources import SourceAllowList, is_remote
from services.common.sources import Confinement, SourceRefusedError, redact
from services.common.types import LoRAWeights, ModelSpec
from services.worker.adapter_api import AdapterRef
from services.worker.adapter_cache import AdapterCache, CacheMetrics, DownloadError
from services.worker.config import WorkerConfig
from services.worker.core import GenerateParams, WorkerCore, pool_stats_dict, resident_ids
from services.worker.engine import Engine, EngineConfig, TokenEvent
from services.worker.metrics import WorkerMetrics
from services.worker.model import DecoderModel
from services.worker.model_loader import default_cache_dir, model_display_name, resolve_model
from services.worker.store import (
    HOST_STAGING_INTERVAL_S,
    AdapterStore,
    StoreConfig,
    StoreEvent,
    StoreStats,
)
from services.worker.store_types import staging_key
from services.worker.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

#: Seconds between two checks of the adapters a worker holds against the registry
#: (:meth:`~services.worker.store.AdapterStore.reconcile`; with host staging on, every staging
#: pass checks too): an adapter deleted or registered again while the gateway's unload could
#: not reach this worker is dropped within this long.
RECONCILE_INTERVAL_S = 10.0
_FINISH = {
    "length": gateway_pb2.FINISH_REASON_LENGTH,
    "stop": gateway_pb2.FINISH_REASON_STOP,
    "eos": gateway_pb2.FINISH_REASON_EOS,
    "context": gateway_pb2.FINISH_REASON_CONTEXT,
}


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` when a CUDA device exists, else ``cpu``; anything else as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> float32 on CPU, bfloat16 on CUDA; else the named dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def generate_params(request: worker_pb2.WorkerGenerateRequest) -> GenerateParams:
    """A ``plora.v1.WorkerGenerateRequest`` as the core takes it (unset fields: defaults)."""
    req = request.request
    return GenerateParams(
        request_id=req.request_id,
        prompt=req.prompt,
        messages=tuple((m.role, m.content) for m in req.messages),
        max_new_tokens=req.max_new_tokens if req.HasField("max_new_tokens") else 64,
        temperature=float(req.temperature),
        top_p=float(req.top_p) if req.HasField("top_p") else 1.0,
        top_k=int(req.top_k),
        seed=int(req.seed) if req.HasField("seed") else None,
        stop=tuple(req.stop),
        adapter=AdapterRef.of(request.adapter) if request.adapter.adapter_id else None,
        tenant_id=req.tenant_id,
    )


def generate_response(
    event: TokenEvent, request_id: str, worker_id: str
) -> gateway_pb2.GenerateResponse:
    """An engine event as a ``plora.v1.GenerateResponse`` (the last one with the finish, the
    usage and the worker's figures)."""
    response = gateway_pb2.GenerateResponse(
        text=event.text,
        token_ids=event.token_ids,
        request_id=request_id,
        adapter_cold=event.adapter_cold,  # on every message: TTFT's label
    )
    if event.finish_reason is not None:
        response.finish_reason = _FINISH[event.finish_reason]
        response.usage.prompt_tokens = event.prompt_tokens
        response.usage.completion_tokens = event.completion_tokens
        response.worker_id = worker_id
        response.adapter_wait_seconds = event.adapter_wait_seconds
        response.worker_ttft_seconds = event.ttft_seconds or 0.0
    return response


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Implements ``plora.v1.Worker`` over a :class:`~services.worker.core.WorkerCore`."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def Generate(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        request_id = request.request.request_id
        events = self.core.generate(generate_params(request), context)
        try:
            for event in events:
                yield generate_response(event, request_id, self.core.config.worker_id)
        except Exception as exc:  # noqa: BLE001 - every failure becomes its status here
            abort(context, exc, request_id)
        finally:
            events.close()

    @map_errors
    def LoadAdapter(  # noqa: N802
        self, request: worker_pb2.LoadAdapterRequest, context: grpc.ServicerContext
    ) -> worker_pb2.LoadAdapterResponse:
        result = self.core.load_adapter(AdapterRef.of(request.adapter), context)
        return worker_pb2.LoadAdapterResponse(
            load_seconds=result.load_seconds, from_tier=result.from_tier
        )

    @map_errors
    def UnloadAdapter(  # noqa: N802
        self, request: worker_pb2.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> worker_pb2.UnloadAdapterResponse:
        dropped = self.core.unload_adapter(request.adapter_id, int(request.below_version))
        return worker_pb2.UnloadAdapterResponse(was_loaded=dropped)

    @map_errors
    def PrefetchAdapters(  # noqa: N802
        self, request: worker_pb2.PrefetchAdaptersRequest, context: grpc.ServicerContext
    ) -> worker_pb2.PrefetchAdaptersResponse:
        items = [(AdapterRef.of(i.adapter), float(i.expected_count)) for i in request.items]
        result = self.core.prefetch(items)
        return worker_pb2.PrefetchAdaptersResponse(**result._asdict())

    @map_errors
    def GetWorkerStatus(  # noqa: N802
        self, request: worker_pb2.GetWorkerStatusRequest, context: grpc.ServicerContext
    ) -> worker_pb2.GetWorkerStatusResponse:
        status = self.core.status()
        return worker_pb2.GetWorkerStatusResponse(
            worker_id=status.worker_id,
            queue_length=status.queue_length,
            running=status.running,
            resident_adapters=status.resident,
            pool=convert.pool_stats(status.pool),
            device=status.device,
        )


class WorkerService:
    """A running worker: model, engine, store, gRPC server, metrics and heartbeats.

    Raises:
        RegistryUnavailableError: Redis cannot be reached (checked before the model loads).
        WorkerIdInUseError: a live worker holds ``config.worker_id`` (checked before the model
            loads; the message names that worker's pid, host and address).
        ConfigError: the model cannot be found or its family is not served, or the internal token
            cannot be read (checked before the model loads).
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        internal_token = resolve_token(config.internal_token_file, config.internal_token)
        self._stop = threading.Event()
        #: How the stall watchdog and the loss of the id end the process (``os._exit``: the
        #: engine thread may hold locks a normal exit would wait on).
        self._exit = os._exit
        self.metrics = WorkerMetrics()
        #: Adapter roots every source read must lie under; None = none configured.
        self.confinement = Confinement(config.adapter_roots) if config.adapter_roots else None
        #: Remote sources (s3://, hf://) this worker downloads.
        self.source_allow = SourceAllowList(config.adapter_source_allow)
        self.adapter_cache: AdapterCache | None = None
        self.registry = Registry(connect(config.redis_url))
        self.lease = self._claim_id()
        try:
            self._build(config, internal_token)
        except BaseException:
            self.lease.release()  # the id is free again at once: nothing served under it
            raise

    def _claim_id(self) -> WorkerLeaseKeeper:
        """Claim the worker id before anything slow (the model) and keep it renewed from then
        on (:meth:`~services.common.registry.Registry.claim_worker_id`).

        Raises:
            WorkerIdInUseError: a live worker holds the id (the message names it).
            RegistryUnavailableError: Redis cannot be reached.
        """
        c = self.config
        logger.info("claiming worker id %s", c.worker_id)
        lease = self.registry.claim_worker_id(
            c.worker_id, c.address, c.heartbeat_ttl_s, c.heartbeat_interval_s
        )
        return WorkerLeaseKeeper(
            self.registry, lease, c.heartbeat_ttl_s, c.heartbeat_interval_s, self._on_id_lost
        ).start()

    def _on_id_lost(self, holder: WorkerLease | None) -> None:
        """Another process took this worker's id over (this one was frozen or cut off from
        Redis longer than the lease's TTL): stop serving under it and exit with
        :data:`EXIT_WORKER_ID_LOST`, without deregistering (the record is the new holder's)."""
        logger.critical(
            "worker id %s was taken over by %s while this worker could not renew its lease "
            "(frozen or cut off from Redis for over %g s): exiting with status %d so that two "
            "workers never serve under one id",
            self.config.worker_id,
            holder.describe() if holder else "another process",
            self.config.heartbeat_ttl_s,
            EXIT_WORKER_ID_LOST,
        )
        self._stop.set()
        health = getattr(self, "health", None)
        if health is not None:
            set_serving(health, [SERVICE_NAME], False)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(EXIT_WORKER_ID_LOST)

    def _build(self, config: WorkerConfig, internal_token: str) -> None:
        """Load the model and build the store, the engine, the servers and the heartbeat."""
        if config.adapter_source_allow:
            self.adapter_cache = self._open_adapter_cache(config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads or os.cpu_count() or 1)
        cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        logger.info("resolving base model %s", config.model)
        model_dir = resolve_model(config.model, cache)
        self.tokenizer = Tokenizer(model_dir)
        self.model = DecoderModel.from_dir(
            model_dir, device=self.device, dtype=self.dtype, name=model_display_name(model_dir)
        )
        self.spec: ModelSpec = self.model.spec
        logger.info("base model %s loaded on %s (%s)", self.spec.name, self.device, self.dtype)
        self.store = AdapterStore(
            StoreConfig(
                allocator=config.allocator,
                eviction=config.eviction,
                pool_bytes=config.pool_bytes,
                page_bytes=config.page_bytes,
                host_cache_bytes=config.host_cache_bytes,
                device=str(self.device),
                dtype=str(self.dtype).removeprefix("torch."),
                load_wait_timeout_s=config.load_wait_timeout_s,
                host_staging=config.host_staging == "on",
            ),
            loader=self._load_adapter,
            on_event=self._on_store_event,
        )
        self.engine = Engine(
            self.model,
            self.tokenizer,
            self.store,
            EngineConfig(
                device=str(self.device),
                dtype=self.dtype,
                max_batch_size=config.max_batch_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=min(config.max_model_len, self.spec.max_position_embeddings),
                max_new_tokens_limit=config.max_new_tokens_limit,
                max_queue=config.max_queue,
                adapter_wait_timeout_s=config.load_wait_timeout_s,
                lora_kernel=config.lora_kernel,
                attention_kernel=config.attention_kernel,
                cuda_graphs=config.cuda_graphs,
                kv_cache=config.kv_cache,
                kv_block_size=config.kv_block_size,
                kv_cache_tokens=config.kv_cache_tokens or None,
            ),
        )
        self.core = WorkerCore(config, self.engine, self.tokenizer, self.store, self.metrics)
        self.servicer = WorkerServicer(self.core)

        def register(server: grpc.Server) -> list[str]:
            worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, server)
            return [SERVICE_NAME]

        refused = self.metrics.internal_auth_refused
        self.server, self.port, self.health = create_server(
            register,
            host=config.host,
            port=config.port,
            max_workers=config.server_threads,
            interceptors=server_interceptors(
                internal_token,
                lambda method: refused.labels(method=method).inc(),
            ),
        )
        self.metrics_server, self.metrics_port = serve_metrics(
            self.metrics.registry, config.host, config.metrics_port
        )
        self.lease.set_address(self.address)
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name="heartbeat", daemon=True
        )
        self._last_heartbeat = time.monotonic()
        self._last_staging = -HOST_STAGING_INTERVAL_S
        self._last_reconcile = -RECONCILE_INTERVAL_S
        self._published = False  # a heartbeat has reached the registry

    def _open_adapter_cache(self, config: WorkerConfig) -> AdapterCache:
        """The node-local cache of remote adapters, its events wired to the metrics.

        Raises:
            ConfigError: the directory cannot be used or another worker holds it.
        """
        m = self.metrics
        hooks = CacheMetrics()
        hooks.on_hit = m.adapter_cache_hits.inc
        hooks.on_miss = m.adapter_cache_misses.inc
        hooks.on_bytes = m.download_bytes.inc
        hooks.on_download = m.download_seconds.observe
        hooks.on_failure = lambda reason: m.download_failures.labels(reason).inc()
        hooks.on_size = m.adapter_cache_bytes.set
        hooks.on_evict = m.adapter_cache_evictions.inc
        base = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        directory = config.adapter_cache_dir or str(base / "adapter-cache" / config.worker_id)
        cache = AdapterCache(directory, config.adapter_cache_bytes, config.inspection_limits, hooks)
        logger.info(
            "adapter cache %s: %d bytes held of %d",
            directory,
            cache.size_bytes,
            config.adapter_cache_bytes,
        )
        return cache

    def _on_store_event(self, event: StoreEvent) -> None:
        """Store events -> Prometheus, and a source load's time -> the routing estimates
        (called under the store lock: counters and one float only)."""
        m = self.metrics
        if event.kind == "load":
            m.loads.labels(event.tier).inc()
            m.load_latency.labels(event.tier).observe(event.seconds)
            if event.tier == "source":
                self.engine.estimates.observe_source_load(event.seconds)
        elif event.kind == "evict":
            m.evictions.labels(event.reason).inc()
        elif event.kind == "compact":
            m.compactions.inc()
            m.bytes_moved.inc(event.nbytes)
        elif event.kind == "split":
            m.split_allocations.inc()
        elif event.kind.startswith("prefetch_"):
            m.prefetches.labels(event.kind.removeprefix("prefetch_")).inc()
        elif event.kind == "host_stage":
            m.host_stages.inc()
            m.host_stage_latency.observe(event.seconds)
        elif event.kind == "host_stage_failed":
            m.host_stage_failures.inc()
        elif event.kind == "load_failed":
            m.load_failures.labels(event.reason).inc()

    def _load_adapter(self, ref: AdapterRef) -> LoRAWeights:
        """Read a registered adapter's source.

        Raises:
            AdapterSourceError: its files are gone or no longer the registered bytes (the
                registry's sha256 pins them: a file replaced after registration is refused
                rather than served under the registered version); the request that needed it
                gets FAILED_PRECONDITION, not INVALID_ARGUMENT, since the request is fine.
                A source outside the adapter roots (a registry record pointing elsewhere) is
                refused the same way and counted in
                ``plora_worker_adapter_source_refused_total``. No message names a server path
                (the worker's log does).
            IncompatibleAdapterError: the files do not fit the served model.
        """
        what = f"registered adapter {ref.adapter_id!r} (v{ref.version}) can no longer be loaded"
        if is_remote(ref.source):
            return self._load_remote(ref, what)
        try:
            return load_lora_weights(
                ref.source,
                self.spec,
                adapter_id=ref.adapter_id,
                version=ref.version,
                dtype=self.dtype,
                expected_sha256=ref.sha256 or None,
                confinement=self.confinement,
                limits=self.config.inspection_limits,
            )
        except SourceRefusedError as exc:
            self.metrics.source_refused.inc()
            logger.warning(
                "adapter %s v%d: source %r refused (not under the adapter roots %s, or a file "
                "in it resolves outside them or cannot be opened)",
                ref.adapter_id,
                ref.version,
                ref.source,
                list(self.config.adapter_roots),
            )
            raise AdapterSourceError(
                f"{what}: its source is not an adapter directory this worker may read; "
                "register it again from a directory under the adapter roots"
            ) from exc
        except IncompatibleAdapterError as exc:
            raise IncompatibleAdapterError(f"{what}: {redact(str(exc), ref.source)}") from exc
        except InvalidAdapterError as exc:
            logger.warning(
                "adapter %s v%d from %r: %s", ref.adapter_id, ref.version, ref.source, exc
            )
            raise AdapterSourceError(
                f"{what}: {redact(str(exc), ref.source)}; restore its files or register it again"
            ) from exc
        except OSError as exc:
            logger.warning(
                "adapter %s v%d from %r: %s", ref.adapter_id, ref.version, ref.source, exc
            )
            raise AdapterSourceError(
                f"{what}: its files cannot be read ({exc.strerror or type(exc).__name__}); "
                "restore them or register it again"
            ) from exc

    def _load_remote(self, ref: AdapterRef, what: str) -> LoRAWeights:
        """Load a registered ``s3://`` / ``hf://`` adapter through the node-local cache: a
        verified download (shared by concurrent loads), then the local loader on the entry.

        Raises:
            AdapterSourceError: the source is not allowed here (counted in
                ``plora_worker_adapter_source_refused_total``), its objects are gone, changed
                since registration (sha256), or could not be downloaded; nothing is cached
                then (FAILED_PRECONDITION).
            IncompatibleAdapterError: the files do not fit the served model.
        """
        try:
            remote = self.source_allow.check(ref.source)
        except SourceRefusedError as exc:
            self.metrics.source_refused.inc()
            logger.warning(
                "adapter %s v%d: remote source %r refused (not under --adapter-source-allow %s)",
                ref.adapter_id,
                ref.version,
                ref.source,
                list(self.config.adapter_source_allow),
            )
            raise AdapterSourceError(
                f"{what}: its source is not one this worker may read; allow it with "
                "--adapter-source-allow on every worker, as on the gateway"
            ) from exc
        assert self.adapter_cache is not None  # allowed sources imply a cache
        try:
            with self.adapter_cache.pinned(remote, ref.sha256) as path:
                try:
                    return load_lora_weights(
                        path,
                        self.spec,
                        adapter_id=ref.adapter_id,
                        version=ref.version,
                        dtype=self.dtype,
                        expected_sha256=ref.sha256 or None,
                        limits=self.config.inspection_limits,
                    )
                except IncompatibleAdapterError as exc:
                    raise IncompatibleAdapterError(f"{what}: {redact(str(exc), path)}") from exc
                except (InvalidAdapterError, OSError) as exc:
                    raise AdapterSourceError(
                        f"{what}: {redact(str(exc), path)}; register it again"
                    ) from exc
        except DownloadError as exc:
            logger.warning(
                "adapter %s v%d from %s: %s", ref.adapter_id, ref.version, ref.source, exc
            )
            raise AdapterSourceError(f"{what}: {exc}") from exc

    @property
    def address(self) -> str:
        """``host:port`` the gateway dials."""
        return f"{self.config.advertise_host or self.config.host}:{self.port}"

    def start(self) -> WorkerService:
        """Start the engine and the server, publish the model, begin heartbeats."""
        self.engine.start()
        self.server.start()
        self.heartbeat()
        self._heartbeat_thread.start()
        set_serving(self.health, [SERVICE_NAME], True)
        if self.config.ready_file:
            write_ready_file(self.config.ready_file, self.port, self.metrics_port)
        logger.info("worker %s serving on %s", self.config.worker_id, self.address)
        logger.info("settings: %s", settings_line(self.config))
        return self

    def heartbeat(self) -> None:
        """Publish the served model and this worker's status to Redis, and pull the latest
        forecast for predictive eviction.

        The model is published with every heartbeat (in its round trip), not once: a Redis
        that restarted empty learns it again (the gateway refuses registrations until some
        worker published it).

        Raises:
            RegistryUnavailableError: Redis cannot be reached (the gauges are still updated).
        """
        snapshot = self.store.stats()  # one snapshot for the heartbeat and the gauges
        resident = resident_ids(self.store)
        room = self.store.room_bytes()
        # Gauges first: they stay current even while Redis is unreachable.
        self._export_metrics(snapshot, len(resident), room)
        record = WorkerRecord(
            worker_id=self.config.worker_id,
            address=self.address,
            metrics_url=f"http://{self.config.advertise_host or self.config.host}:"
            f"{self.metrics_port}/metrics",
            device=str(self.device),
            queue_length=self.engine.queue_length,
            running=self.engine.running,
            resident=resident,
            loading=self.store.loading_adapters(),
            room_bytes=room,
            host_cached=self.store.host_cached_adapters(),
            pool=pool_stats_dict(snapshot, self.config),
            prefill_s=self.engine.estimates.prefill_s,
            cold_wait_s=self.engine.estimates.cold_wait_s,
            source_load_s=self.engine.estimates.source_load_s,
        )
        known = self.registry.heartbeat(
            record,
            self.config.heartbeat_ttl_s,
            model=(self.spec, str(self.dtype).removeprefix("torch.")),
        )
        if not known and self._published:
            # Redis lost its data (restarted without persistence, or flushed): its adapters
            # will be registered again with versions from 1, which this worker's copies and
            # version memory would refuse as superseded. Forget them all.
            dropped = self.store.unload_all()
            logger.warning(
                "the adapter registry lost this worker's record (Redis restarted empty or was "
                "flushed): dropped its %d adapters; they load again once registered again",
                dropped,
            )
        self._published = True
        forecast = self.registry.get_forecast()
        expected: dict[str, float] = {}
        if forecast is not None:
            expected = {k: float(v) for k, v in forecast["expected"].items()}
            self.store.set_forecast(expected)
        now = time.monotonic()
        staging = (
            self.store.config.host_staging and now - self._last_staging >= HOST_STAGING_INTERVAL_S
        )
        if staging or now - self._last_reconcile >= RECONCILE_INTERVAL_S:
            # one listing of the registry serves both: staging's candidates, and dropping what
            # was deleted or replaced while this worker missed the gateway's unload
            records = self.registry.list_adapters()
            self._last_reconcile = now
            dropped = self.store.reconcile({r.adapter_id: r.version for r in records}, now)
            if dropped:
                logger.info(
                    "dropped %d adapters deleted or registered again while this worker missed "
                    "the gateway's unload",
                    dropped,
                )
            if staging:
                self._last_staging = now
                wid = self.config.worker_id
                records.sort(key=lambda r: staging_key(r.adapter_id, wid))
                self.store.stage([AdapterRef.of(r) for r in records])
        self._last_heartbeat = now

    def _export_metrics(self, s: StoreStats, resident: int, room: int) -> None:
        m = self.metrics
        m.queue_length.set(self.engine.queue_length)
        m.running.set(self.engine.running)
        total, held = self.engine.kv_tokens
        m.kv_cache_tokens.labels("total").set(total)
        m.kv_cache_tokens.labels("held").set(held)
        m.resident.set(resident)
        est = self.engine.estimates
        m.service_estimate.labels("prefill").set(est.prefill_s)
        m.service_estimate.labels("cold_wait").set(est.cold_wait_s)
        m.service_estimate.labels("decode_row").set(est.decode_row_s)
        m.pool_pages.labels("total").set(s.pages_total)
        m.pool_pages.labels("used").set(s.pages_used)
        m.pool_pages.labels("free").set(s.pages_free)
        m.pool_bytes.labels("total").set(s.pool_bytes)
        m.pool_bytes.labels("live").set(s.live_bytes)
        m.pool_bytes.labels("room").set(room)
        m.loads_waiting_for_room.set(s.waiting_loads)
        m.host_stages_queued.set(s.host_stages_queued)
        m.host_cache_bytes.labels("total").set(s.host_cache_bytes)
        m.host_cache_bytes.labels("used").set(s.host_cache_used_bytes)
        m.pool_utilization.set(s.utilization)
        m.pool_utilization_pressure.set(s.utilization_under_pressure)
        m.pool_fragmentation.set(s.external_fragmentation)
        m.pool_free_run_fragmentation.set(s.free_run_fragmentation)
        m.pool_extents.set(s.mean_extents_per_adapter)
        m.pool_internal_waste.set(s.internal_waste)

    def _watch_engine(self) -> bool:
        """The stall watchdog (every heartbeat interval): past ``stall_timeout_s`` without
        progress while the engine has requests (a deadlock, a device call that never returns,
        its thread dead), log every thread's stack, stop serving, leave the registry and exit
        with :data:`EXIT_ENGINE_STALLED`, so the supervisor (``plora up``, Docker's restart
        policy) starts a fresh worker; its streams end UNAVAILABLE and the gateway sends
        requests that had no token yet to another worker (a stalled worker would otherwise go
        on heartbeating healthy, and every request routed to it wait out its deadline).

        Returns:
            Whether it ended the worker (only seen where ``_exit`` returns: tests).
        """
        stalled = self.engine.stalled_for()
        self.metrics.engine_stalled.set(stalled)
        limit = self.config.stall_timeout_s
        if not limit or stalled <= limit or self._stop.is_set():
            return False
        logger.critical(
            "the engine made no progress for %.0f s with %d running and %d waiting requests "
            "(--stall-timeout-s %g): exiting with status %d for the supervisor to restart this "
            "worker; every thread's stack follows",
            stalled,
            self.engine.running,
            self.engine.queue_length,
            limit,
            EXIT_ENGINE_STALLED,
        )
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():  # noqa: SLF001 - the stacks to debug
            stack = "".join(traceback.format_stack(frame))
            logger.critical("thread %s:\n%s", names.get(ident, ident), stack.rstrip())
        set_serving(self.health, [SERVICE_NAME], False)
        try:
            self.registry.deregister_worker(self.config.worker_id)
        except Exception as exc:  # noqa: BLE001 - exiting anyway; its liveness key expires
            logger.warning("could not deregister: %s", exc)
        self.lease.release()  # its restart takes the id back at once
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(EXIT_ENGINE_STALLED)
        return True

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            if self._watch_engine() or self.lease.lost:
                return
            try:
                self.heartbeat()
            except RegistryUnavailableError:  # the registry logs the outage, not each call
                self.metrics.heartbeat_failures.inc()
            except Exception as exc:  # noqa: BLE001 - keep serving, try again next interval
                self.metrics.heartbeat_failures.inc()
                logger.warning("heartbeat failed: %s", exc)
            self.metrics.heartbeat_age.set(time.monotonic() - self._last_heartbeat)

    def stop(self, grace: float = 5.0) -> None:
        """Deregister, stop accepting requests, finish in-flight ones within ``grace``."""
        self._stop.set()
        set_serving(self.health, [SERVICE_NAME], False)
        if not self.lease.lost:  # else the record is another process's
            try:
                self.registry.deregister_worker(self.config.worker_id)
            except Exception as exc:  # noqa: BLE001
                logger.warning("could not deregister: %s", exc)
        self.server.stop(grace).wait()
        self.engine.stop()
        self.store.close()
        if self.adapter_cache is not None:
            self.adapter_cache.close()
        self.metrics_server.shutdown()
        self.lease.release()  # last: a successor may claim the id at once


#: The worker's exit status when its stall watchdog ended it (``EX_SOFTWARE`` of sysexits.h).
EXIT_ENGINE_STALLED = 70

#: The worker's exit status when another process took its id over while it could not renew
#: its lease (``EX_UNAVAILABLE`` of sysexits.h).
EXIT_WORKER_ID_LOST = 69


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``plora serve worker``."""
    return run_service("worker", WorkerConfig, WorkerService, argv, log_name=lambda c: c.worker_id)
