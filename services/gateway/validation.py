"""Validation of client requests at the gateway: pure functions, one rule per check.

Every refusal raises :class:`~services.common.errors.InvalidRequestError` (INVALID_ARGUMENT)
with a message naming the field, the value and the allowed range. Checks that need the
tokenizer (prompt longer than the context) are made by the worker, which owns it.
"""

from __future__ import annotations

import math

from plora.v1 import gateway_pb2
from services.common.errors import EMPTY_REQUEST, InvalidRequestError
from services.gateway.config import GatewayConfig

CHAT_ROLES = frozenset({"system", "user", "assistant"})
MAX_STOP_LENGTH = 256


def validate_generate(request: gateway_pb2.GenerateRequest, config: GatewayConfig) -> None:
    """Check a ``GenerateRequest``'s fields.

    Raises:
        InvalidRequestError: a field is missing or out of range.
    """
    has_prompt = bool(request.prompt)
    has_messages = len(request.messages) > 0
    if not has_prompt and not has_messages:
        raise InvalidRequestError(EMPTY_REQUEST)  # ``plora generate`` refuses "" before sending
    if has_prompt and has_messages:
        raise InvalidRequestError("set either prompt or messages, not both")
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role={message.role!r}: use one of {sorted(CHAT_ROLES)}"
            )
    if has_messages and not any(m.content for m in request.messages):
        raise InvalidRequestError("every message is empty: give some content")
    if request.HasField("max_new_tokens") and not (
        1 <= request.max_new_tokens <= config.max_new_tokens_limit
    ):
        raise InvalidRequestError(
            f"max_new_tokens={request.max_new_tokens} is out of range: "
            f"use 1..{config.max_new_tokens_limit}"
        )
    if math.isnan(request.temperature) or request.temperature < 0:
        raise InvalidRequestError(
            f"temperature={request.temperature} is invalid: use 0 (greedy) or a positive value"
        )
    if request.HasField("top_p") and not (0.0 < request.top_p <= 1.0):
        raise InvalidRequestError(f"top_p={request.top_p} is out of range: use (0, 1]")
    if request.top_k < 0:
        raise InvalidRequestError(f"top_k={request.top_k} is invalid: use 0 (off) or a positive k")
    if len(request.stop) > config.max_stop_strings:
        raise InvalidRequestError(
            f"{len(request.stop)} stop strings: at most {config.max_stop_strings} are allowed"
        )
    for i, stop in enumerate(request.stop):
        if not stop or len(stop) > MAX_STOP_LENGTH:
            raise InvalidRequestError(f"stop[{i}] must be 1..{MAX_STOP_LENGTH} characters long")
