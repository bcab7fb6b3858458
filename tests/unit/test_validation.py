"""Table-driven tests of the gateway's request validation."""

from __future__ import annotations

import pytest

from plora.v1 import gateway_pb2
from services.common.errors import InvalidRequestError, quoted
from services.gateway import validation
from services.gateway.config import GatewayConfig
from services.gateway.validation import validate_generate

CONFIG = GatewayConfig(max_new_tokens_limit=256)


def chat(**kw: object) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(**kw)
    req.messages.add(role="user", content="hi")
    return req


def user(content: str) -> gateway_pb2.ChatMessage:
    return gateway_pb2.ChatMessage(role="user", content=content)


VALID = [
    gateway_pb2.GenerateRequest(prompt="hi"),
    chat(),
    chat(max_new_tokens=1),
    chat(max_new_tokens=256),
    chat(temperature=0.0),
    chat(temperature=1.5, top_p=1.0, top_k=40, seed=7),
    chat(top_p=0.01),
    chat(stop=["\n", "END"]),
    gateway_pb2.GenerateRequest(prompt=" hi\n"),
    gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="system", content=" "), user("hi")]
    ),
]

INVALID = [
    (gateway_pb2.GenerateRequest(), "the prompt is empty and no messages were given"),
    (gateway_pb2.GenerateRequest(prompt=""), "the prompt is empty and no messages were given"),
    (chat(prompt="x"), "not both"),
    (gateway_pb2.GenerateRequest(prompt=" \n\t"), "the prompt is only whitespace"),
    (gateway_pb2.GenerateRequest(messages=[user("  ")]), "every message is empty or only"),
    (chat(temperature=float("inf")), "temperature=inf"),
    (chat(max_new_tokens=0), "max_new_tokens=0"),
    (chat(max_new_tokens=-1), "max_new_tokens=-1"),
    (chat(max_new_tokens=257), "1..256"),
    (chat(temperature=-0.1), "temperature"),
    (chat(temperature=float("nan")), "temperature"),
    (chat(top_p=0.0), "top_p"),
    (chat(top_p=1.01), "top_p"),
    (chat(top_p=-1.0), "top_p"),
    (chat(top_k=-1), "top_k"),
    (chat(stop=[""]), "stop[0]"),
    (chat(stop=["x" * 300]), "stop[0]"),
    (chat(stop=["s"] * 17), "at most 16"),
]


@pytest.mark.parametrize("request_", VALID)
def test_valid_requests_pass(request_: gateway_pb2.GenerateRequest) -> None:
    validate_generate(request_, CONFIG)


@pytest.mark.parametrize(("request_", "needle"), INVALID)
def test_invalid_requests_name_the_field(request_: gateway_pb2.GenerateRequest, needle: str):
    with pytest.raises(InvalidRequestError) as err:
        validate_generate(request_, CONFIG)
    assert needle in str(err.value)


def test_unknown_role_is_refused() -> None:
    req = gateway_pb2.GenerateRequest()
    req.messages.add(role="robot", content="x")
    with pytest.raises(InvalidRequestError, match="role"):
        validate_generate(req, CONFIG)


def test_echoed_user_strings_are_bounded() -> None:
    """Error messages repeated huge user input whole (a 5,000-character adapter id came back
    in full); :func:`quoted` keeps the first 64 characters and says how long it was."""
    assert quoted("abc") == "'abc'"
    assert quoted("x" * 64) == repr("x" * 64)
    assert quoted("x" * 5000) == f"{'x' * 64!r}... (5000 characters)"
    assert quoted("a\0b" * 100, 4) == "'a\\x00ba'... (300 characters)"
    req = gateway_pb2.GenerateRequest()
    req.messages.add(role="r" * 10_000, content="x")
    with pytest.raises(InvalidRequestError) as err:
        validate_generate(req, CONFIG)
    assert "(10000 characters)" in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("/tmp/" + "a" * 300, "(File name too long)"),
        ("/tmp/a\0b", "(embedded null byte)"),
        ("/tmp/" + "abc/" * 25_000, "(File name too long)"),
    ],
    ids=["300-character name", "NUL byte", "100,000-character path"],
)
def test_a_source_the_system_cannot_look_up_is_refused(source: str, reason: str) -> None:
    """RegisterAdapter gave INTERNAL and a traceback (OSError ENAMETOOLONG, ValueError)."""
    with pytest.raises(InvalidRequestError) as err:
        validation.adapter_source(source)
    message = str(err.value)
    assert message.startswith("source '/tmp/") and reason in message, message
    assert "\n" not in message and len(message) < 500


def test_a_source_is_made_absolute(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert validation.adapter_source("~/x/../y") == str(tmp_path.resolve() / "y")
    with pytest.raises(InvalidRequestError, match="source is required"):
        validation.adapter_source("")


@pytest.mark.parametrize("adapter_id", ["../../x", "a b", "-a", "a" * 129])
def test_generate_applies_the_adapter_id_rule_of_register(adapter_id: str) -> None:
    """``adapter_id="../../x"`` in Generate was looked up (NOT_FOUND) instead of refused."""
    with pytest.raises(InvalidRequestError) as err:
        validate_generate(gateway_pb2.GenerateRequest(adapter_id=adapter_id, prompt="hi"), CONFIG)
    with pytest.raises(InvalidRequestError) as register:
        validation.check_adapter_id(adapter_id)
    assert str(err.value) == str(register.value)
    assert str(err.value).startswith(f"adapter_id {adapter_id[:64]!r}")
    validate_generate(gateway_pb2.GenerateRequest(adapter_id="a" * 128, prompt="hi"), CONFIG)


@pytest.mark.parametrize(
    "tenant_id", ["a b", "a\tb", "a\nb", "a\x00b", "a\x7f", "a\u2003b", "t" * 129]
)
def test_a_tenant_id_with_whitespace_control_characters_or_too_long_is_refused(
    tenant_id: str,
) -> None:
    with pytest.raises(InvalidRequestError, match=r"^tenant_id .* is invalid: use at most 128"):
        validate_generate(gateway_pb2.GenerateRequest(tenant_id=tenant_id, prompt="hi"), CONFIG)


@pytest.mark.parametrize("tenant_id", ["", "acme", "t" * 128, "équipe/ß-1", "a:b@c"])
def test_a_tenant_id_within_the_rule_is_accepted(tenant_id: str) -> None:
    validation.check_tenant_id(tenant_id)
    validate_generate(gateway_pb2.GenerateRequest(tenant_id=tenant_id, prompt="hi"), CONFIG)


def test_the_per_field_checks_are_the_rules_validate_generate_applies() -> None:
    """``plora generate`` checks its flags with these same functions (one rule, one place);
    without a limit, ``max_new_tokens`` is checked only from below (the gateway knows its
    limit)."""
    validation.check_max_new_tokens(10**6)
    with pytest.raises(InvalidRequestError, match=r"max_new_tokens=0 is out of range: use 1 or"):
        validation.check_max_new_tokens(0)
    with pytest.raises(InvalidRequestError, match=r"use 1\.\.256"):
        validation.check_max_new_tokens(257, 256)
    with pytest.raises(InvalidRequestError, match="a stop string must be 1..256 characters"):
        validation.check_stop("")
    assert validation.blank(" \n\t") and validation.blank("") and not validation.blank(" a ")
