"""What the gateway's core answers, independent of the front door that asked (gRPC today).

These are plain values: a front door converts them into its own messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.registry import AdapterRecord, WorkerRecord

#: Why a generation ended (``GenerateChunk.finish_reason``).
FINISH_REASONS = ("length", "stop", "eos", "context")


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class GenerateChunk:
    """One piece of a streamed completion.

    Attributes:
        request_id: The request's id (the caller's, or one the gateway made).
        text: Text added since the previous chunk (complete UTF-8 characters).
        token_ids: Token ids added since the previous chunk.
        adapter_cold: The request waited for its adapter to load (every chunk).
        finish_reason: One of :data:`FINISH_REASONS` on the last chunk, else None.
        usage: Token counts, on the last chunk.
        worker_id: The worker that served the request (last chunk).
        adapter_wait_seconds: Seconds the request waited for its adapter (last chunk).
        worker_ttft_seconds: Seconds from worker receipt to the first token (last chunk).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    adapter_cold: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    worker_id: str = ""
    adapter_wait_seconds: float = 0.0
    worker_ttft_seconds: float = 0.0


@dataclass(frozen=True)
class AdapterStatus:
    """An adapter's record and where it is.

    Attributes:
        record: As registered.
        resident_on: Healthy workers holding it in their device pool.
        placed_on: Workers the placement assigns it to.
    """

    record: AdapterRecord
    resident_on: list[str]
    placed_on: list[str]


@dataclass(frozen=True)
class ClusterStatus:
    """The cluster as the gateway sees it.

    Attributes:
        workers: Every known worker.
        adapters_registered: Adapters in the registry.
        base_model: The served base model's name ("" until a worker published it).
        predictor_connected: The gateway's event stream to the predictor is up.
    """

    workers: list[WorkerRecord]
    adapters_registered: int
    base_model: str
    predictor_connected: bool
