"""The worker's gRPC conversions (services.worker.server) around its core."""

from __future__ import annotations

from plora.v1 import gateway_pb2, worker_pb2
from services.worker.adapter_api import AdapterRef
from services.worker.core import GenerateParams
from services.worker.engine import TokenEvent
from services.worker.server import generate_params, generate_response


def test_unset_fields_take_the_engine_defaults() -> None:
    request = worker_pb2.WorkerGenerateRequest(
        request=gateway_pb2.GenerateRequest(request_id="r~1", prompt="hi", tenant_id="t")
    )
    assert generate_params(request) == GenerateParams(request_id="r~1", prompt="hi", tenant_id="t")


def test_every_field_reaches_the_core() -> None:
    request = worker_pb2.WorkerGenerateRequest(
        request=gateway_pb2.GenerateRequest(
            request_id="r",
            messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
            max_new_tokens=5,
            temperature=0.5,
            top_p=0.75,
            top_k=3,
            seed=7,
            stop=["x"],
        ),
        adapter=gateway_pb2.AdapterInfo(adapter_id="a", version=2, source="/s", size_bytes=9),
    )
    assert generate_params(request) == GenerateParams(
        request_id="r",
        messages=(("user", "hi"),),
        max_new_tokens=5,
        temperature=0.5,
        top_p=0.75,
        top_k=3,
        seed=7,
        stop=("x",),
        adapter=AdapterRef("a", 2, "/s", 9),
    )


def test_only_the_last_event_carries_the_finish_and_the_workers_figures() -> None:
    token = generate_response(TokenEvent("he", [1, 2], adapter_cold=True), "r", "w0")
    assert token == gateway_pb2.GenerateResponse(
        text="he", token_ids=[1, 2], request_id="r", adapter_cold=True
    )
    last = generate_response(
        TokenEvent(
            "",
            [3],
            finish_reason="eos",
            prompt_tokens=4,
            completion_tokens=3,
            adapter_wait_seconds=0.5,
            ttft_seconds=None,
        ),
        "r",
        "w0",
    )
    assert last.finish_reason == gateway_pb2.FINISH_REASON_EOS
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 3)
    assert (last.worker_id, last.adapter_wait_seconds, last.worker_ttft_seconds) == ("w0", 0.5, 0)
