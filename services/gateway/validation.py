"""Validation of client requests at the gateway: pure functions, one rule per check.

Every refusal raises :class:`~services.common.errors.InvalidRequestError` (INVALID_ARGUMENT)
with a message naming the field, the value and the allowed range. Checks that need the
tokenizer (prompt longer than the context) are made by the worker, which owns it.
``plora generate`` checks its flags with the same per-field functions (``check_*``,
:func:`blank`) before sending: one rule, in one place, for the CLI and every other client.
"""

from __future__ import annotations

import math
import re
import unicodedata
from pathlib import Path

from plora.v1 import gateway_pb2
from services.common.errors import EMPTY_REQUEST, MAX_ECHO_PATH, InvalidRequestError, quoted
from services.common.sources import Confinement
from services.gateway.config import GatewayConfig

CHAT_ROLES = frozenset({"system", "user", "assistant"})
MAX_STOP_LENGTH = 256
MAX_TENANT_ID_LENGTH = 128
_ADAPTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def blank(text: str) -> bool:
    """Whether ``text`` (a prompt, a message's content) is empty or only whitespace: it gives
    the model nothing to answer, so it is refused (``plora generate`` refuses it too)."""
    return not text.strip()


def check_max_new_tokens(value: int, limit: int | None = None) -> None:
    """Refuse ``max_new_tokens`` below 1, or above ``limit`` when given.

    Raises:
        InvalidRequestError: out of range.
    """
    if value < 1 or (limit is not None and value > limit):
        allowed = f"1..{limit}" if limit is not None else "1 or more"
        raise InvalidRequestError(f"max_new_tokens={value} is out of range: use {allowed}")


def check_temperature(value: float) -> None:
    """Refuse a ``temperature`` that is negative or not finite (0 = greedy).

    Raises:
        InvalidRequestError: out of range.
    """
    if not math.isfinite(value) or value < 0:
        raise InvalidRequestError(
            f"temperature={value} is invalid: use 0 (greedy) or a positive number"
        )


def check_top_p(value: float) -> None:
    """Refuse a ``top_p`` outside (0, 1] (NaN included).

    Raises:
        InvalidRequestError: out of range.
    """
    if not 0.0 < value <= 1.0:
        raise InvalidRequestError(f"top_p={value} is out of range: use (0, 1]")


def check_top_k(value: int) -> None:
    """Refuse a negative ``top_k`` (0 = off).

    Raises:
        InvalidRequestError: out of range.
    """
    if value < 0:
        raise InvalidRequestError(f"top_k={value} is invalid: use 0 (off) or a positive k")


def check_stop(text: str, name: str = "a stop string") -> None:
    """Refuse a stop string that is empty or longer than :data:`MAX_STOP_LENGTH` characters.

    Args:
        text: The stop string.
        name: What the message calls it (the gateway: ``stop[i]``).

    Raises:
        InvalidRequestError: empty or too long.
    """
    if not text or len(text) > MAX_STOP_LENGTH:
        raise InvalidRequestError(
            f"{name} must be 1..{MAX_STOP_LENGTH} characters long, got {len(text)}"
        )


def check_adapter_id(adapter_id: str) -> None:
    """Refuse an adapter id that is not 1-128 letters, digits and ``. _ - : /`` starting with a
    letter or digit (every RPC that names an adapter; Generate only when it names one).

    Raises:
        InvalidRequestError: the id breaks the rule.
    """
    if not _ADAPTER_ID.match(adapter_id):
        raise InvalidRequestError(
            f"adapter_id {quoted(adapter_id)} is invalid: use only letters, digits and "
            "'.', '_', '-', ':', '/' (1-128 characters, starting with a letter or digit)"
        )


def check_tenant_id(tenant_id: str) -> None:
    """Refuse a ``tenant_id`` longer than :data:`MAX_TENANT_ID_LENGTH` characters or holding
    whitespace or control characters (empty = no tenant, allowed).

    Raises:
        InvalidRequestError: the tenant id breaks the rule.
    """
    if len(tenant_id) > MAX_TENANT_ID_LENGTH or any(
        c.isspace() or unicodedata.category(c) == "Cc" for c in tenant_id
    ):
        raise InvalidRequestError(
            f"tenant_id {quoted(tenant_id)} is invalid: use at most {MAX_TENANT_ID_LENGTH} "
            "characters with no whitespace or control characters (or none, for no tenant)"
        )


def adapter_source(source: str, confinement: Confinement | None = None) -> str:
    """The absolute path of a RegisterAdapter ``source`` (``~`` expanded, links resolved).
    Without ``confinement`` it only looks the path up: whether it holds an adapter is for
    :func:`~services.common.adapters.inspect_adapter` to say. With ``confinement`` (adapter
    roots configured) the directory and its two files must resolve under a root
    (``ROOT/<tenant>/`` for a tenant): :func:`~services.common.sources.confine`.

    Raises:
        InvalidRequestError: empty, or (without ``confinement``) a path the system refuses to
            look up (a NUL byte, a name or a path too long, a directory it may not search).
        SourceRefusedError: refused by ``confinement``, with one message whatever the cause
            (missing, not a directory, a file missing or outside the roots, no permission),
            naming no path (INVALID_ARGUMENT).
    """
    if not source:
        raise InvalidRequestError("source is required: a directory in PEFT layout")
    if confinement is not None:
        return str(confinement.directory(source))
    try:
        path = Path(source).expanduser().resolve()
        path.exists()  # raises for a name too long; a missing path is inspect_adapter's
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidRequestError(
            f"source {quoted(source, MAX_ECHO_PATH)} is not a usable path ({reason}): give "
            "the directory in PEFT layout that holds the adapter"
        ) from None
    return str(path)


def validate_generate(request: gateway_pb2.GenerateRequest, config: GatewayConfig) -> None:
    """Check a ``GenerateRequest``'s fields.

    Raises:
        InvalidRequestError: a field is missing or out of range.
    """
    if request.adapter_id:
        check_adapter_id(request.adapter_id)
    check_tenant_id(request.tenant_id)
    has_prompt = bool(request.prompt)
    has_messages = len(request.messages) > 0
    if not has_prompt and not has_messages:
        raise InvalidRequestError(EMPTY_REQUEST)  # ``plora generate`` refuses "" before sending
    if has_prompt and has_messages:
        raise InvalidRequestError("set either prompt or messages, not both")
    if has_prompt and blank(request.prompt):
        raise InvalidRequestError("the prompt is only whitespace: give some text")
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role={quoted(message.role)}: use one of {sorted(CHAT_ROLES)}"
            )
    if has_messages and all(blank(m.content) for m in request.messages):
        raise InvalidRequestError("every message is empty or only whitespace: give some content")
    if request.HasField("max_new_tokens"):
        check_max_new_tokens(request.max_new_tokens, config.max_new_tokens_limit)
    check_temperature(request.temperature)
    if request.HasField("top_p"):
        check_top_p(request.top_p)
    check_top_k(request.top_k)
    if len(request.stop) > config.max_stop_strings:
        raise InvalidRequestError(
            f"{len(request.stop)} stop strings: at most {config.max_stop_strings} are allowed"
        )
    for i, stop in enumerate(request.stop):
        check_stop(stop, f"stop[{i}]")
