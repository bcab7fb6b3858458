"""The OpenAI wire format of the gateway's HTTP door: request bodies in, ``plora.v1``
requests out, and the JSON objects OpenAI's API answers with.

Only conversion lives here. What a request may ask for (token bounds, sampling values, stop
strings, roles, the prompt's length) is checked by the gateway core
(:mod:`services.gateway.validation`) and the worker, for both doors, with the same messages.
This module refuses only what the wire format itself gets wrong (a field of the wrong type)
and the OpenAI features P-LoRA does not serve (``n`` > 1, ``logprobs``, ``tools``, ...), with
a 400 naming the field, so a client never gets silently less than it asked for. Unknown fields
are ignored, as OpenAI's API does.

Sources: the OpenAI API reference for ``/v1/completions``, ``/v1/chat/completions`` (and its
streamed ``chat.completion.chunk`` objects), ``/v1/models`` and the error object.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plora.v1 import gateway_pb2
from services.common.errors import InvalidRequestError, PLoRAError, quoted
from services.common.registry import AdapterRecord
from services.gateway.results import GenerateChunk, Usage

#: ``finish_reason`` as OpenAI names it, for each of the core's
#: (:data:`services.gateway.results.FINISH_REASONS`): an end-of-sequence token is a natural
#: stop, a full context window a length limit.
FINISH_REASONS = {"length": "length", "stop": "stop", "eos": "stop", "context": "length"}

#: OpenAI's chat roles P-LoRA renders, and the role each becomes in the chat template
#: ("developer" is OpenAI's newer name for the system turn).
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

#: Who owns the base model and shared adapters in ``/v1/models``.
OWNER = "plora"


class UnsupportedFieldError(InvalidRequestError):
    """A request asks for an OpenAI feature P-LoRA does not serve (HTTP 400 naming the field).

    Attributes:
        param: The field, as OpenAI's error object names it.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    """Fields both generation endpoints share. Values are type-checked (a number where a
    number belongs, strictly: ``"1"`` is not a number); unknown fields are kept and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension vLLM and TGI accept too
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    def check_served(self) -> None:
        """Refuse the features P-LoRA does not serve.

        Raises:
            UnsupportedFieldError: naming the first such field.
        """
        if self.n not in (None, 1):
            raise UnsupportedFieldError(
                "n", f"n={self.n} is not supported: one choice per request; send n=1 or omit it"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedFieldError(name, f"{name} is not supported: omit it or send 0")
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias", "logit_bias is not supported: omit it")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError(
                "stream_options", "stream_options is only allowed with stream=true"
            )
        if self.stream_options is not None:
            include = self.stream_options.get("include_usage", False)
            if not isinstance(include, bool):
                raise UnsupportedFieldError(
                    "stream_options.include_usage", "stream_options.include_usage must be a boolean"
                )

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk carrying ``usage``."""
        options = self.stream_options or {}
        return bool(self.stream and options.get("include_usage"))

    def sampling(self, request: gateway_pb2.GenerateRequest, max_tokens: int | None) -> None:
        """Copy the sampling fields into ``request`` (OpenAI's defaults: temperature 1,
        top_p 1; no ``max_tokens`` = the gateway's default)."""
        request.temperature = 1.0 if self.temperature is None else self.temperature
        if self.top_p is not None:
            request.top_p = self.top_p
        if self.top_k is not None:
            request.top_k = self.top_k
        if self.seed is not None:
            request.seed = self.seed
        if max_tokens is not None:
            request.max_new_tokens = max_tokens
        if isinstance(self.stop, str):
            request.stop.append(self.stop)
        elif self.stop:
            request.stop.extend(self.stop)


class CompletionBody(_Body):
    """A ``POST /v1/completions`` body."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_served(self) -> None:
        super().check_served()
        if self.echo:
            raise UnsupportedFieldError("echo", "echo is not supported: omit it or send false")
        if self.logprobs is not None:
            raise UnsupportedFieldError("logprobs", "logprobs is not supported: omit it")
        if self.best_of not in (None, 1):
            raise UnsupportedFieldError(
                "best_of", f"best_of={self.best_of} is not supported: omit it or send 1"
            )
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported: omit it")

    def prompt_text(self) -> str:
        """The one prompt, as text.

        Raises:
            UnsupportedFieldError: several prompts, or token ids instead of text.
        """
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise UnsupportedFieldError(
                    "prompt",
                    "prompt must be one string (or a list of one string): batches of prompts "
                    "and token ids are not supported; send one request per prompt",
                )
            prompt = prompt[0]
        assert isinstance(prompt, str)
        return prompt


class TextPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessageBody(BaseModel):
    """One message of a chat request."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[TextPart] | None = None


class ChatBody(_Body):
    """A ``POST /v1/chat/completions`` body."""

    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None

    def check_served(self) -> None:
        super().check_served()
        if self.logprobs or self.top_logprobs:
            field = "logprobs" if self.logprobs else "top_logprobs"
            raise UnsupportedFieldError(field, f"{field} is not supported: omit it")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise UnsupportedFieldError(
                    name, f"{name} (tool calling) is not supported: omit it"
                )
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise UnsupportedFieldError(name, f"{name} is not supported: omit it")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise UnsupportedFieldError(
                "response_format",
                f"response_format type {quoted(str(kind))} is not supported: only text",
            )
        if self.modalities not in (None, ["text"]):
            raise UnsupportedFieldError(
                "modalities", 'modalities other than ["text"] are not supported: omit it'
            )

    def chat_turns(self) -> list[gateway_pb2.ChatMessage]:
        """The messages as ``plora.v1.ChatMessage`` turns (text parts joined).

        Raises:
            UnsupportedFieldError: a role P-LoRA does not render (tool, function) or a
                content part other than text.
        """
        turns = []
        for i, message in enumerate(self.messages):
            role = CHAT_ROLES.get(message.role)
            if role is None:
                raise UnsupportedFieldError(
                    f"messages[{i}].role",
                    f"messages[{i}].role={quoted(message.role)} is not supported: use one of "
                    f"{sorted(CHAT_ROLES)}",
                )
            content = message.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise UnsupportedFieldError(
                            f"messages[{i}].content[{j}]",
                            f"messages[{i}].content[{j}] of type {quoted(part.type)} is not "
                            "supported: only text parts",
                        )
                content = "".join(part.text or "" for part in content)
            turns.append(gateway_pb2.ChatMessage(role=role, content=content or ""))
        return turns


def parse_body(kind: type[_Body], data: object) -> Any:
    """A request body, type-checked, with the features P-LoRA does not serve refused.

    Args:
        kind: :class:`CompletionBody` or :class:`ChatBody`.
        data: The decoded JSON.

    Raises:
        UnsupportedFieldError: A field of the wrong type or out of range (``max_tokens`` < 1),
            or a feature not served; the message and ``param`` name the field.
    """
    if not isinstance(data, dict):
        raise UnsupportedFieldError("", "the request body must be a JSON object")
    try:
        body = kind.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = _param_name(error["loc"])
        if error["type"] == "missing":
            raise UnsupportedFieldError(param, f"{param} is required") from None
        raise UnsupportedFieldError(
            param, f"{param}: {error['msg']} (got {_shown(error.get('input'))})"
        ) from None
    body.check_served()
    return body


def _param_name(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``; pydantic's type-union branch
    names (``str``, ``list[str]``) left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _BRANCHES or "[" in part or part.startswith(("function-", "tagged")):
            continue
        else:
            out += f".{part}" if out else part
    return out


_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none", "TextPart"}


def _shown(value: object) -> str:
    """A rejected value for an error message: its JSON type, and short values themselves."""
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__} of {len(text)} characters"


def completion_request(body: CompletionBody, adapter_id: str) -> gateway_pb2.GenerateRequest:
    """The ``plora.v1.GenerateRequest`` of a ``/v1/completions`` body (raw prompt, no chat
    template).

    Raises:
        UnsupportedFieldError: The prompt is not one string.
    """
    request = gateway_pb2.GenerateRequest(adapter_id=adapter_id, prompt=body.prompt_text())
    body.sampling(request, body.max_tokens)
    return request


def chat_request(body: ChatBody, adapter_id: str) -> gateway_pb2.GenerateRequest:
    """The ``plora.v1.GenerateRequest`` of a ``/v1/chat/completions`` body (the messages,
    which the worker renders with the model's chat template). ``max_completion_tokens`` wins
    over the older ``max_tokens``.

    Raises:
        UnsupportedFieldError: A role or content part not served.
    """
    request = gateway_pb2.GenerateRequest(adapter_id=adapter_id)
    request.messages.extend(body.chat_turns())
    max_tokens = body.max_completion_tokens if body.max_completion_tokens else body.max_tokens
    body.sampling(request, max_tokens)
    return request


# -- answers ---------------------------------------------------------------------------------


def usage_json(usage: Usage | None) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    prompt = usage.prompt_tokens if usage else 0
    completion = usage.completion_tokens if usage else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_reason(chunk: GenerateChunk) -> str | None:
    """OpenAI's ``finish_reason`` of a chunk (None before the last)."""
    return FINISH_REASONS[chunk.finish_reason] if chunk.finish_reason else None


class Answer:
    """The objects of one request's answer, whole or streamed.

    Args:
        chat: A chat completion (else a text completion).
        request_id: The request's id; the answer's ``id`` is ``cmpl-<id>`` /
            ``chatcmpl-<id>``.
        model: The ``model`` the client asked for.
    """

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, last: GenerateChunk) -> dict[str, Any]:
        """The non-streamed answer: the whole ``text``, ending as ``last`` says."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason(last),
            }
            head = self._head("chat.completion")
        else:
            finish = finish_reason(last)
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage_json(last.usage)}

    def chunk(
        self, text: str, finish: str | None, include_usage: bool, first: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk: ``text`` added; ``finish`` on the last; ``usage: null`` on each
        when the stream ends with a usage chunk; the chat stream's first chunk names the
        role."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            out = {**self._head("text_completion"), "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        """The chunk ``stream_options.include_usage`` adds at the end: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_json(usage)}


def model_json(model_id: str, created_s: int, owner: str, parent: str | None) -> dict[str, Any]:
    """One ``/v1/models`` entry; ``parent`` is the base model of an adapter (None for the
    base model itself), ``root`` the base model either way, as vLLM lists LoRA adapters."""
    return {
        "id": model_id,
        "object": "model",
        "created": created_s,
        "owned_by": owner,
        "root": parent or model_id,
        "parent": parent,
    }


def adapter_model_json(record: AdapterRecord, base_model: str) -> dict[str, Any]:
    """The ``/v1/models`` entry of a registered adapter."""
    return model_json(
        record.adapter_id, record.created_unix_ms // 1000, record.tenant_id or OWNER, base_model
    )


#: OpenAI's error ``type`` for each HTTP status the door answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}

#: The HTTP status of each gRPC status code a domain error carries.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ABORTED": 409,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def http_status(exc: PLoRAError) -> int:
    """The HTTP status of a domain error (500 for a code without one)."""
    return HTTP_STATUS.get(exc.status_code_name, 500)


def error_json(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param or None,
            "code": code,
        }
    }
