"""The gateway's calls to the workers (``plora.v1.Worker``), in domain values and errors.

One channel per worker address, kept open. A streamed Generate comes back as
:class:`~services.gateway.results.GenerateChunk` s; a call that ends with a status raises
:class:`WorkerCallError`, which carries the worker's status code and message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import grpc

from plora.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc
from services.common.errors import PLoRAError
from services.common.grpc_util import CHANNEL_OPTIONS
from services.common.internal_auth import InternalStubs
from services.common.registry import WorkerRecord
from services.gateway.results import GenerateChunk, Usage

logger = logging.getLogger(__name__)

#: Seconds an UnloadAdapter call to one worker may take (adapter deletion and registration).
UNLOAD_TIMEOUT_S = 5.0

_FINISH_NAMES = {
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_EOS: "eos",
    gateway_pb2.FINISH_REASON_CONTEXT: "context",
}


class WorkerCallError(PLoRAError):
    """A worker's call ended with a status: its code and message, passed on as they are.

    Attributes:
        status_code_name: The status code's name (``"UNAVAILABLE"``, ...).
        details: The worker's message (None or "" when it gave none).
    """

    def __init__(self, code: str, details: str | None, message: str | None = None) -> None:
        super().__init__(message or details or code)
        self.status_code_name = code
        self.details = details


class WorkerStream:
    """One Generate call to a worker: iterate for its chunks (each iteration of the same
    call goes on where the last stopped); :meth:`cancel` ends it."""

    def __init__(self, call: Iterator[gateway_pb2.GenerateResponse]) -> None:
        self._call = call

    def __iter__(self) -> Iterator[GenerateChunk]:
        try:
            for response in self._call:
                yield _chunk(response)
        except grpc.RpcError as exc:
            raise WorkerCallError(exc.code().name, exc.details()) from None

    def cancel(self) -> None:
        """End the call (no-op once it ended)."""
        self._call.cancel()  # type: ignore[attr-defined]  # a grpc streaming call


def _chunk(response: gateway_pb2.GenerateResponse) -> GenerateChunk:
    return GenerateChunk(
        request_id=response.request_id,
        text=response.text,
        token_ids=list(response.token_ids),
        adapter_cold=response.adapter_cold,
        finish_reason=_FINISH_NAMES.get(response.finish_reason),
        usage=(
            Usage(response.usage.prompt_tokens, response.usage.completion_tokens)
            if response.HasField("usage")
            else None
        ),
        worker_id=response.worker_id,
        adapter_wait_seconds=response.adapter_wait_seconds,
        worker_ttft_seconds=response.worker_ttft_seconds,
    )


class WorkerClients:
    """Calls to the workers, over one channel and one stub per address, built on first use.

    Args:
        internal_token: Sent on every call (:mod:`services.common.internal_auth`); ``""``
            when internal authentication is off.
    """

    def __init__(self, internal_token: str = "") -> None:
        self._stubs = InternalStubs(
            worker_pb2_grpc.WorkerStub, internal_token, options=CHANNEL_OPTIONS
        )

    def close(self) -> None:
        """Close every channel."""
        self._stubs.close()

    def generate(
        self, address: str, request: worker_pb2.WorkerGenerateRequest, timeout: float
    ) -> WorkerStream:
        """Start a Generate call on the worker at ``address`` (``timeout`` seconds at most)."""
        return WorkerStream(self._stubs.get(address).Generate(request, timeout=timeout))

    def unload(
        self, workers: Sequence[WorkerRecord], adapter_id: str, below_version: int = 0
    ) -> None:
        """Drop an adapter (or, with ``below_version``, its versions older than that one)
        from ``workers``, in parallel, each call for at most :data:`UNLOAD_TIMEOUT_S`; a
        failure is logged, not raised (best effort)."""
        request = worker_pb2.UnloadAdapterRequest(
            adapter_id=adapter_id, below_version=below_version
        )
        calls = [
            (w, self._stubs.get(w.address).UnloadAdapter.future(request, timeout=UNLOAD_TIMEOUT_S))
            for w in workers
        ]
        for w, call in calls:
            try:
                call.result()
            except grpc.RpcError as exc:
                logger.warning(
                    "unload of %s on %s failed: %s", adapter_id, w.worker_id, exc.code().name
                )
