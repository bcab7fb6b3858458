"""The OpenAI wire format of the gateway's HTTP door (no cluster): bodies parsed and
type-checked, every feature not served refused naming its field, the conversion to
``plora.v1.GenerateRequest``, the answers' JSON checked against the official ``openai``
package's own types, and the error object and statuses."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.common import errors
from services.common.registry import AdapterRecord
from services.gateway.openai_schema import (
    ERROR_TYPES,
    HTTP_STATUS,
    Answer,
    ChatBody,
    CompletionBody,
    UnsupportedFieldError,
    adapter_model_json,
    chat_request,
    completion_request,
    error_json,
    http_status,
    model_json,
    parse_body,
)
from services.gateway.results import GenerateChunk, Usage

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Once", **fields}


def refused(kind: type, data: object) -> UnsupportedFieldError:
    with pytest.raises(UnsupportedFieldError) as err:
        parse_body(kind, data)
    assert err.value.status_code_name == "INVALID_ARGUMENT"
    return err.value


# -- parsing ---------------------------------------------------------------------------------


def test_a_minimal_body_of_each_kind_parses_and_unknown_fields_are_ignored() -> None:
    body = parse_body(ChatBody, chat(metadata={"k": "v"}, store=False, service_tier="auto"))
    assert body.model == "m" and body.stream is False and not body.include_usage
    body = parse_body(CompletionBody, completion(user="u-1", unknown_extension=[1, 2]))
    assert body.prompt == "Once"


@pytest.mark.parametrize(
    ("kind", "data", "param", "phrase"),
    [
        (CompletionBody, completion(max_tokens="5"), "max_tokens", "valid integer"),
        (CompletionBody, completion(max_tokens=True), "max_tokens", "valid integer"),
        (CompletionBody, completion(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (ChatBody, chat(max_completion_tokens=0), "max_completion_tokens", "greater than"),
        (ChatBody, chat(temperature="hot"), "temperature", "valid number"),
        (ChatBody, chat(top_p=[1]), "top_p", "valid number"),
        (ChatBody, chat(seed=-1), "seed", "greater than or equal to 0"),
        (ChatBody, chat(seed=1 << 64), "seed", "less than"),
        (ChatBody, chat(stream="true"), "stream", "valid boolean"),
        (ChatBody, chat(stop=5), "stop", "got 5"),
        (ChatBody, {"model": "m", "messages": "Hi"}, "messages", "valid list"),
        (ChatBody, {"model": "m", "messages": []}, "messages", "at least 1 item"),
        (ChatBody, {"model": "m"}, "messages", "messages is required"),
        (ChatBody, chat(messages=[{"content": "Hi"}]), "messages[0].role", "is required"),
        (ChatBody, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", ""),
        (CompletionBody, {"prompt": "Once"}, "model", "model is required"),
        (CompletionBody, completion(model=""), "model", "at least 1 character"),
        (CompletionBody, completion(prompt={"text": "x"}), "prompt", ""),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_refused_naming_it(
    kind: type, data: dict, param: str, phrase: str
) -> None:
    err = refused(kind, data)
    assert err.param == param
    assert str(err).startswith(param) and phrase in str(err), str(err)


def test_a_long_rejected_value_is_described_not_echoed() -> None:
    err = refused(ChatBody, chat(temperature="x" * 10_000))
    assert "x" * 100 not in str(err) and "str of 10002 characters" in str(err)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    for data in ([1, 2], "text", None, 5):
        err = refused(ChatBody, data)
        assert str(err) == "the request body must be a JSON object"
        assert error_json(400, str(err), err.param)["error"]["param"] is None


def test_numbers_may_be_json_integers_where_floats_belong() -> None:
    body = parse_body(ChatBody, chat(temperature=0, top_p=1))
    assert body.temperature == 0 and body.top_p == 1


#: (kind, field, value, param): features P-LoRA does not serve.
UNSUPPORTED = [
    (ChatBody, "n", 2, "n"),
    (CompletionBody, "n", 3, "n"),
    (ChatBody, "presence_penalty", 0.5, "presence_penalty"),
    (CompletionBody, "frequency_penalty", -1.0, "frequency_penalty"),
    (ChatBody, "logit_bias", {"42": 10}, "logit_bias"),
    (ChatBody, "logprobs", True, "logprobs"),
    (ChatBody, "top_logprobs", 2, "top_logprobs"),
    (ChatBody, "tools", [{"type": "function", "function": {"name": "f"}}], "tools"),
    (ChatBody, "functions", [{"name": "f"}], "functions"),
    (ChatBody, "tool_choice", "auto", "tool_choice"),
    (ChatBody, "function_call", "auto", "function_call"),
    (ChatBody, "response_format", {"type": "json_object"}, "response_format"),
    (ChatBody, "modalities", ["text", "audio"], "modalities"),
    (CompletionBody, "echo", True, "echo"),
    (CompletionBody, "logprobs", 1, "logprobs"),
    (CompletionBody, "best_of", 2, "best_of"),
    (CompletionBody, "suffix", "end", "suffix"),
    (ChatBody, "stream_options", {"include_usage": True}, "stream_options"),  # no stream
]


@pytest.mark.parametrize(
    ("kind", "field", "value", "param"),
    UNSUPPORTED,
    ids=[f"{k.__name__}.{f}" for k, f, _, _ in UNSUPPORTED],
)
def test_each_feature_not_served_is_refused_naming_its_field(
    kind: type, field: str, value: object, param: str
) -> None:
    base = chat() if kind is ChatBody else completion()
    err = refused(kind, {**base, field: value})
    assert err.param == param
    assert str(err).startswith(param), str(err)
    assert error_json(400, str(err), err.param)["error"]["param"] == param


def test_neutral_values_of_those_features_are_accepted() -> None:
    parse_body(
        ChatBody,
        chat(
            n=1,
            presence_penalty=0,
            frequency_penalty=0.0,
            logit_bias={},
            logprobs=False,
            tools=[],
            tool_choice="none",
            response_format={"type": "text"},
            modalities=["text"],
            stream=True,
            stream_options={"include_usage": False},
        ),
    )
    parse_body(CompletionBody, completion(echo=False, best_of=1, suffix="", n=None))


def test_include_usage_must_be_a_boolean_and_counts_only_when_streaming() -> None:
    err = refused(ChatBody, chat(stream=True, stream_options={"include_usage": "yes"}))
    assert err.param == "stream_options.include_usage"
    body = parse_body(ChatBody, chat(stream=True, stream_options={"include_usage": True}))
    assert body.include_usage
    assert not parse_body(ChatBody, chat(stream=True)).include_usage


# -- chat messages ---------------------------------------------------------------------------


def test_roles_map_to_the_chat_templates_and_developer_is_the_system_turn() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
    ]
    request = chat_request(parse_body(ChatBody, chat(messages=messages)), "a1")
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("system", "Answer in French."),
        ("user", "Hi"),
        ("assistant", ""),
    ]


@pytest.mark.parametrize("role", ["tool", "function", "robot"])
def test_a_role_not_rendered_is_refused_naming_the_message(role: str) -> None:
    messages = [*USER, {"role": role, "content": "x"}]
    body = parse_body(ChatBody, chat(messages=messages))
    with pytest.raises(UnsupportedFieldError) as err:
        chat_request(body, "")
    assert err.value.param == "messages[1].role"
    assert role in str(err.value) and "'developer'" in str(err.value)


def test_text_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    body = parse_body(ChatBody, chat(messages=[{"role": "user", "content": parts}]))
    assert chat_request(body, "").messages[0].content == "What is 2+2?"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "text"},  # a text part without its text
    ],
)
def test_a_content_part_other_than_text_is_refused_naming_it(part: dict) -> None:
    content = [{"type": "text", "text": "Look:"}, part]
    body = parse_body(ChatBody, chat(messages=[*USER, {"role": "user", "content": content}]))
    with pytest.raises(UnsupportedFieldError) as err:
        chat_request(body, "")
    assert err.value.param == "messages[1].content[1]"
    assert "only text parts" in str(err.value)


# -- conversion to plora.v1 ------------------------------------------------------------------


def test_chat_request_carries_every_served_field() -> None:
    body = parse_body(
        ChatBody,
        chat(max_tokens=9, temperature=0.5, top_p=0.9, top_k=20, seed=7, stop=["\n", "END"]),
    )
    request = chat_request(body, "adapter-1")
    assert request.adapter_id == "adapter-1" and not request.prompt
    assert request.max_new_tokens == 9
    assert request.temperature == pytest.approx(0.5)
    assert request.top_p == pytest.approx(0.9) and request.top_k == 20
    assert request.HasField("seed") and request.seed == 7
    assert list(request.stop) == ["\n", "END"]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    body = parse_body(ChatBody, chat(max_tokens=50, max_completion_tokens=5))
    assert chat_request(body, "").max_new_tokens == 5


def test_omitted_fields_take_openais_defaults_or_the_gateways() -> None:
    """temperature 1 (OpenAI's default, not gRPC's greedy 0); no max_tokens, top_p or seed:
    left unset for the gateway's default."""
    request = chat_request(parse_body(ChatBody, chat()), "")
    assert request.temperature == 1.0
    assert not request.HasField("max_new_tokens")
    assert not request.HasField("top_p") and not request.HasField("seed")
    assert request.top_k == 0 and list(request.stop) == []
    assert chat_request(parse_body(ChatBody, chat(temperature=0)), "").temperature == 0.0


def test_completion_request_takes_one_prompt_as_text() -> None:
    body = parse_body(CompletionBody, completion(prompt=["Once upon"], stop="."))
    request = completion_request(body, "")
    assert request.prompt == "Once upon" and not request.messages and request.adapter_id == ""
    assert list(request.stop) == ["."]


@pytest.mark.parametrize("prompt", [["a", "b"], [1, 2, 3], [[1, 2]], []])
def test_batched_prompts_and_token_ids_are_refused_naming_prompt(prompt: object) -> None:
    body = parse_body(CompletionBody, completion(prompt=prompt))
    with pytest.raises(UnsupportedFieldError) as err:
        completion_request(body, "")
    assert err.value.param == "prompt" and "one request per prompt" in str(err.value)


# -- answers, checked against the openai package's types ------------------------------------


def last_chunk(reason: str, prompt: int = 12, completion: int = 5) -> GenerateChunk:
    return GenerateChunk(
        request_id="r1", text="!", finish_reason=reason, usage=Usage(prompt, completion)
    )


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("length", "length"), ("stop", "stop"), ("eos", "stop"), ("context", "length")],
)
def test_a_whole_chat_answer_is_a_chat_completion(reason: str, expected: str) -> None:
    answer = Answer(chat=True, request_id="r1", model="adapter-1")
    data = answer.whole("Paris!", last_chunk(reason))
    parsed = ChatCompletion.model_validate(data)
    assert parsed.id == "chatcmpl-r1" and parsed.object == "chat.completion"
    assert parsed.model == "adapter-1"
    (choice,) = parsed.choices
    assert choice.index == 0 and choice.finish_reason == expected
    assert choice.message.role == "assistant" and choice.message.content == "Paris!"
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (12, 5)
    assert parsed.usage.total_tokens == 17


def test_a_whole_text_answer_is_a_completion() -> None:
    answer = Answer(chat=False, request_id="r2", model="base")
    parsed = Completion.model_validate(answer.whole(" Paris.", last_chunk("eos", 4, 2)))
    assert parsed.id == "cmpl-r2" and parsed.object == "text_completion"
    assert parsed.choices[0].text == " Paris." and parsed.choices[0].finish_reason == "stop"
    assert parsed.usage is not None and parsed.usage.total_tokens == 6


def test_a_chat_stream_names_the_role_first_then_adds_text_then_usage() -> None:
    answer = Answer(chat=True, request_id="r3", model="a")
    first = ChatCompletionChunk.model_validate(answer.chunk("", None, True, first=True))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert first.usage is None and first.object == "chat.completion.chunk"
    middle = answer.chunk("Par", None, True)
    assert middle["usage"] is None and middle["choices"][0]["delta"] == {"content": "Par"}
    ChatCompletionChunk.model_validate(middle)
    end = answer.chunk("", "stop", False)
    assert "usage" not in end and end["choices"][0]["delta"] == {}
    assert ChatCompletionChunk.model_validate(end).choices[0].finish_reason == "stop"
    usage = ChatCompletionChunk.model_validate(answer.usage_chunk(Usage(7, 3)))
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 10
    assert {first.id, usage.id} == {"chatcmpl-r3"}


def test_a_text_stream_chunk_and_its_usage_chunk_are_completions() -> None:
    answer = Answer(chat=False, request_id="r4", model="a")
    chunk = Completion.model_validate(answer.chunk(" Paris", "length", False))
    assert chunk.choices[0].text == " Paris" and chunk.choices[0].finish_reason == "length"
    usage = Completion.model_validate(answer.usage_chunk(None))
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 0


def test_model_entries_are_openai_models_with_the_base_as_parent() -> None:
    base = Model.model_validate(model_json("SmolLM2", 0, "plora", None))
    assert base.id == "SmolLM2" and base.object == "model"
    assert base.parent is None and base.root == "SmolLM2"  # type: ignore[attr-defined]
    shared = adapter_model_json(
        AdapterRecord(adapter_id="a1", source="/x", created_unix_ms=1_700_000_000_999), "SmolLM2"
    )
    parsed = Model.model_validate(shared)
    assert parsed.id == "a1" and parsed.created == 1_700_000_000
    assert parsed.owned_by == "plora" and parsed.parent == "SmolLM2"  # type: ignore[attr-defined]
    owned = adapter_model_json(AdapterRecord(adapter_id="a2", source="/y", tenant_id="acme"), "B")
    assert owned["owned_by"] == "acme" and "source" not in owned


# -- errors ----------------------------------------------------------------------------------


def test_error_json_is_openais_error_object() -> None:
    assert error_json(404, "no such model", "model", "model_not_found") == {
        "error": {
            "message": "no such model",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error_json(400, "bad", "")["error"]["param"] is None
    assert error_json(418, "odd")["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (errors.InvalidRequestError("x"), 400),
        (errors.InvalidAdapterError("x"), 400),
        (errors.IncompatibleAdapterError("x"), 400),
        (errors.UnauthenticatedError("x"), 401),
        (errors.AdapterPermissionError("x"), 403),
        (errors.TenantMismatchError("x"), 403),
        (errors.AdapterNotFoundError("x"), 404),
        (errors.RegistrationConflictError("x"), 409),
        (errors.OverloadedError("x"), 429),
        (errors.PoolExhaustedError("x"), 429),
        (errors.NoHealthyWorkerError("x"), 503),
        (errors.DeadlineExceededError("x"), 504),
        (errors.PLoRAError("x"), 500),
    ],
)
def test_each_domain_error_gets_its_http_status(error: errors.PLoRAError, status: int) -> None:
    assert http_status(error) == status


def test_every_grpc_status_maps_to_a_status_with_its_own_error_type() -> None:
    """A worker's failure carries any gRPC code: each becomes an HTTP status whose OpenAI
    error type is named (a client error is never typed ``server_error``)."""
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        status = HTTP_STATUS.get(code.name, 500)
        assert status in ERROR_TYPES, code.name
        if status < 500:
            assert ERROR_TYPES[status] != "server_error", code.name
    for status in (400, 401, 403, 404, 405, 413, 429):
        assert ERROR_TYPES[status] != "server_error", status
