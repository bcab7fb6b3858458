"""The HTTP door's request path on a live cluster, through the official ``openai`` client: the
model name resolved against the base model's, the conversion's refusals and the core's, all
answered with OpenAI's status and error object, and the caller's request id echoed. (The
request is built and started in the thread that reads its stream: these pin that a failure
there still becomes the right HTTP answer.)"""

from __future__ import annotations

import httpx2
import openai
import pytest

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.grpc_util import client_channel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(cluster: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster["openai_base_url"], api_key="unused", max_retries=0)


def _grpc_text(cluster: dict, adapter_id: str, prompt: str, max_new_tokens: int) -> str:
    request = gateway_pb2.GenerateRequest(
        adapter_id=adapter_id, temperature=0.0, max_new_tokens=max_new_tokens
    )
    request.messages.add(role="user", content=prompt)
    with client_channel(cluster["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return "".join(r.text for r in stub.Generate(request, timeout=120))


def test_the_base_models_id_serves_the_base_model_streamed_and_whole(
    cluster: dict, client: openai.OpenAI
) -> None:
    """``model`` = the id /v1/models lists first is the base model (gRPC ``adapter_id`` ""):
    the same greedy text streamed and whole, and the caller's X-Request-Id comes back."""
    base = client.models.list().data[0].id
    expected = _grpc_text(cluster, "", "Name a colour.", 6)
    stream = client.chat.completions.create(
        model=base,
        messages=[{"role": "user", "content": "Name a colour."}],
        temperature=0,
        max_tokens=6,
        stream=True,
        extra_headers={"X-Request-Id": "path-test-1"},
    )
    assert stream.response.headers["x-request-id"] == "path-test-1"
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = client.chat.completions.with_raw_response.create(
        model=base,
        messages=[{"role": "user", "content": "Name a colour."}],
        temperature=0,
        max_tokens=6,
        extra_headers={"X-Request-Id": "path-test-2"},
    )
    assert whole.headers["x-request-id"] == "path-test-2"
    assert streamed == whole.parse().choices[0].message.content == expected != ""


def test_a_role_the_conversion_refuses_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "tool", "content": "42"}],
            max_tokens=2,
            stream=True,
        )
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].role"
    assert "messages[0].role='tool' is not supported: use one of" in body["message"]


def test_an_unknown_model_is_a_404_from_the_core(cluster: dict, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["param"] == "model" and body["code"] == "model_not_found"
    assert "no-such-adapter" in body["message"]
    # the same refusal streamed: a status before any event, not a stream that fails
    with httpx2.Client(trust_env=False, timeout=60) as http:
        response = http.post(
            f"{cluster['openai_base_url']}/completions",
            json={"model": "no-such-adapter", "prompt": "Hi", "max_tokens": 2, "stream": True},
        )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
