"""The worker's serving logic behind its gRPC front door (:mod:`services.worker.server`).

:class:`WorkerCore` turns a generation request into an engine request (chat template,
tokenization, the context check), streams the engine's events while keeping the worker's
request metrics, and serves the adapter calls (load, unload, prefetch) and the status from the
store and the engine. It answers in domain values (the engine's
:class:`~services.worker.engine.TokenEvent`, the store's results) and fails with domain errors
(:class:`~services.common.errors.PLoRAError`); the front door converts both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.common.errors import (
    EMPTY_REQUEST,
    InvalidRequestError,
    PLoRAError,
    RequestCancelledError,
)
from services.common.grpc_util import ended_by_client, log_request_failure, remaining_or, status_for
from services.worker.adapter_api import AdapterRef
from services.worker.config import WorkerConfig
from services.worker.engine import Engine, EngineRequest, RequestStream, TokenEvent
from services.worker.metrics import WorkerMetrics
from services.worker.store import AdapterStore, PrefetchResult, StoreStats
from services.worker.tokenizer import Tokenizer

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


@dataclass(frozen=True)
class GenerateParams:
    """One generation request as the worker receives it (prompt not yet tokenized).

    Attributes:
        request_id: The id the gateway gave the call.
        prompt: Raw prompt text ("" when ``messages`` are given).
        messages: ``(role, content)`` chat turns, rendered with the model's chat template.
        adapter: The adapter to apply, None for the base model.
        tenant_id: The caller's tenant ("" = none; named in the failure log).
        The rest: :class:`~services.worker.engine.EngineRequest`'s.
    """

    request_id: str
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    adapter: AdapterRef | None = None
    tenant_id: str = ""


@dataclass(frozen=True)
class LoadResult:
    """How a LoadAdapter call found the adapter.

    Attributes:
        load_seconds: Seconds its load took (0 when it was resident).
        from_tier: ``"source"`` (loaded now) or ``"device"`` (resident already).
    """

    load_seconds: float
    from_tier: str


@dataclass(frozen=True)
class WorkerStatus:
    """The worker as GetWorkerStatus reports it.

    Attributes:
        worker_id: Registry id.
        queue_length: Requests waiting.
        running: Requests in the batch.
        resident: Sorted ids of the adapters resident in the device pool.
        pool: Pool statistics (:func:`pool_stats_dict`).
        device: The device it serves on.
    """

    worker_id: str
    queue_length: int
    running: int
    resident: list[str]
    pool: dict[str, object]
    device: str


class WorkerCore:
    """The worker's serving logic over its engine and adapter store.

    Args:
        config: The worker's settings.
        engine: The running engine.
        tokenizer: The served model's tokenizer.
        store: The adapter store.
        metrics: The worker's Prometheus series.
    """

    def __init__(
        self,
        config: WorkerConfig,
        engine: Engine,
        tokenizer: Tokenizer,
        store: AdapterStore,
        metrics: WorkerMetrics,
    ) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.store = store
        self.metrics = metrics

    def prompt_ids(self, prompt: str, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The prompt's token ids: ``messages`` rendered with the chat template, else the raw
        ``prompt``.

        Raises:
            InvalidRequestError: Neither is given, or the prompt cannot fit the context.
        """
        if messages:
            turns = [{"role": role, "content": content} for role, content in messages]
            text = self.tokenizer.render_chat(turns, add_generation_prompt=True)
        elif prompt:
            text = prompt
        else:
            raise InvalidRequestError(EMPTY_REQUEST)
        context = self.engine.max_model_len
        if self.tokenizer.min_tokens(len(text)) >= context:
            # refused before encoding: see Tokenizer.min_tokens
            raise InvalidRequestError(
                f"the prompt has {len(text)} characters, more than this worker's context of "
                f"{context} tokens (prompt + generated) can hold: shorten the prompt"
            )
        return self.tokenizer.encode(text)

    def generate(self, params: GenerateParams, client: Client) -> Generator[TokenEvent, None, None]:
        """Serve one generation request: the engine's events, the last with its finish.

        The request is counted (``plora_worker_requests_total`` by status) and, when it does
        not end OK, logged once; closing the generator early cancels the request (its KV
        slot and adapter lease are freed).

        Raises:
            PLoRAError: While iterating: the request was refused or failed.
        """
        received = time.monotonic()
        code = grpc.StatusCode.OK
        detail = ""
        stream: RequestStream | None = None
        try:
            stream = self.engine.submit(self._engine_request(params))
            client.add_callback(stream.cancel)
            first_at = None
            for event in stream:
                if event.error is not None:
                    raise event.error
                if first_at is None and event.token_ids:
                    first_at = time.monotonic()
                    self.metrics.ttft.observe(first_at - received)
                self._observe(event, first_at)
                yield event
        except Exception as exc:
            code = status_for(exc)
            detail = str(exc) if isinstance(exc, PLoRAError) else repr(exc)
            if isinstance(exc, RequestCancelledError) and not client.is_active():
                # the call ended under it: its deadline, or the client (the gateway, which
                # cancels when its own client's deadline passes, a moment before this one's)
                code, detail = ended_by_client(client), ""
            raise
        finally:
            if stream is not None:
                stream.cancel()  # no-op when finished; frees KV and the lease otherwise
            if code is grpc.StatusCode.OK and not client.is_active():
                code = ended_by_client(client)
            self.metrics.requests.labels(code.name).inc()
            if code is not grpc.StatusCode.OK:
                log_request_failure(
                    logger,
                    params.request_id,
                    code,
                    detail,
                    time.monotonic() - received,
                    params.adapter.adapter_id if params.adapter else "",
                    params.tenant_id,
                )

    def _engine_request(self, params: GenerateParams) -> EngineRequest:
        return EngineRequest(
            request_id=params.request_id,
            prompt_token_ids=self.prompt_ids(params.prompt, params.messages),
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=params.stop,
            adapter=params.adapter,
        )

    def _observe(self, event: TokenEvent, first_at: float | None) -> None:
        """The metrics of one event: tokens, and at the finish the prompt, the time per
        output token and the cold start."""
        if event.token_ids:
            self.metrics.tokens.inc(len(event.token_ids))
        if event.finish_reason is None:
            return
        self.metrics.prompt_tokens.inc(event.prompt_tokens)
        if first_at is not None and event.completion_tokens >= 2:
            self.metrics.tpot.observe((time.monotonic() - first_at) / (event.completion_tokens - 1))
        if event.adapter_cold:
            self.metrics.cold_starts.labels(cause=event.adapter_cold_cause or "unloaded").inc()
            self.metrics.cold_start_wait.observe(event.adapter_wait_seconds)

    def load_adapter(self, ref: AdapterRef, client: Client) -> LoadResult:
        """Make an adapter resident, waiting for its load up to the client's deadline (else
        ``load_wait_timeout_s``).

        Raises:
            PLoRAError: The load failed or did not finish in time.
        """
        start = time.monotonic()
        lease = self.store.acquire(ref)
        try:
            lease.wait(remaining_or(client, self.config.load_wait_timeout_s))
            error = lease.error()
            if error is not None:
                raise error
            return LoadResult(
                load_seconds=time.monotonic() - start if lease.cold else 0.0,
                from_tier="source" if lease.cold else "device",
            )
        finally:
            lease.release()

    def unload_adapter(self, adapter_id: str, below_version: int) -> bool:
        """Drop an adapter (or its versions below ``below_version``); whether one was held."""
        return self.store.unload(adapter_id, below_version)

    def prefetch(self, items: Sequence[tuple[AdapterRef, float]]) -> PrefetchResult:
        """Queue low-priority loads of ``(adapter, expected requests)``, counted by outcome."""
        result = self.store.prefetch(items)
        for outcome, n in result._asdict().items():
            self.metrics.prefetch_requests.labels(outcome).inc(n)
        return result

    def status(self) -> WorkerStatus:
        """The worker's queue, residency and pool as of now."""
        return WorkerStatus(
            worker_id=self.config.worker_id,
            queue_length=self.engine.queue_length,
            running=self.engine.running,
            resident=resident_ids(self.store),
            pool=pool_stats_dict(self.store.stats(), self.config),
            device=str(self.engine.config.device),
        )


def resident_ids(store: AdapterStore) -> list[str]:
    """Sorted ids of the adapters resident in the device pool."""
    return sorted({r.adapter_id for r in store.resident_adapters()})


def pool_stats_dict(s: StoreStats, config: WorkerConfig) -> dict[str, object]:
    """A store statistics snapshot as ``plora.v1.PoolStats`` keys (heartbeat JSON)."""
    return {
        "allocator": config.allocator,
        "eviction": config.eviction,
        "pool_bytes": s.pool_bytes,
        "page_bytes": s.page_bytes,
        "pages_total": s.pages_total,
        "pages_used": s.pages_used,
        "pages_free": s.pages_free,
        "live_bytes": s.live_bytes,
        "utilization": s.utilization,
        "external_fragmentation": s.external_fragmentation,
        "internal_waste": s.internal_waste,
        "utilization_under_pressure": s.utilization_under_pressure,
        "loads": sum(s.loads_by_tier.values()),
        "evictions": sum(s.evictions_by_reason.values()),
        "compactions": s.compactions,
        "cold_starts": s.cold_starts,
    }
