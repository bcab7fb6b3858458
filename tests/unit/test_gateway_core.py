"""The gateway's pure pieces: the retry decision, tenancy, and the chunk conversions."""

from __future__ import annotations

import pytest

from plora.v1 import gateway_pb2
from services.common.errors import AdapterPermissionError
from services.common.registry import AdapterRecord
from services.gateway.retry import Retry, should_retry
from services.gateway.server import generate_response
from services.gateway.tenancy import check_owner, check_tenant, visible_to
from services.gateway.workers import _chunk

E, R, G, C = Retry.ELSEWHERE, Retry.REFRESH_ADAPTER, Retry.GIVE_UP, Retry.CLIENT_GONE


@pytest.mark.parametrize(
    ("code", "first_token_sent", "client_active", "has_adapter", "refreshed", "expected"),
    [
        # a worker that died, stopped or froze before the first token: another worker
        ("UNAVAILABLE", False, True, True, False, E),
        ("UNAVAILABLE", False, True, False, False, E),
        ("UNAVAILABLE", False, True, True, True, E),
        # after it: the client has tokens, a retry would repeat them
        ("UNAVAILABLE", True, True, True, False, G),
        # a version the worker refused as superseded: read the record again, once
        ("NOT_FOUND", False, True, True, False, R),
        ("NOT_FOUND", False, True, True, True, G),
        ("NOT_FOUND", False, True, False, False, G),  # no adapter to read again
        ("NOT_FOUND", True, True, True, False, G),
        # every other status is the request's own
        ("RESOURCE_EXHAUSTED", False, True, True, False, G),
        ("DEADLINE_EXCEEDED", False, True, True, False, G),
        ("INVALID_ARGUMENT", False, True, False, False, G),
        ("FAILED_PRECONDITION", False, True, True, False, G),
        ("INTERNAL", False, True, True, False, G),
        ("CANCELLED", True, True, True, False, G),
        # the client has gone: nothing to answer, whatever the status
        ("UNAVAILABLE", False, False, True, False, C),
        ("NOT_FOUND", False, False, True, False, C),
        ("INTERNAL", True, False, True, False, C),
        ("CANCELLED", False, False, False, False, C),
    ],
)
def test_retry_table(
    code: str,
    first_token_sent: bool,
    client_active: bool,
    has_adapter: bool,
    refreshed: bool,
    expected: Retry,
) -> None:
    got = should_retry(
        code,
        first_token_sent=first_token_sent,
        client_active=client_active,
        has_adapter=has_adapter,
        refreshed=refreshed,
    )
    assert got is expected


def test_tenancy() -> None:
    shared = AdapterRecord("s", "/x")
    owned = AdapterRecord("o", "/x", tenant_id="acme")
    check_tenant(shared, "")
    check_tenant(shared, "acme")
    check_tenant(owned, "acme")
    with pytest.raises(AdapterPermissionError, match="belongs to another tenant"):
        check_tenant(owned, "")
    check_owner(shared, "", "deletes")
    check_owner(owned, "acme", "replaces")
    with pytest.raises(AdapterPermissionError, match="is shared .*; choose another id"):
        check_owner(shared, "acme", "replaces")
    with pytest.raises(AdapterPermissionError, match="owned by another tenant: .* deletes it$"):
        check_owner(owned, "", "deletes")
    assert [visible_to(r, "") for r in (shared, owned)] == [True, True]
    assert [visible_to(r, "acme") for r in (shared, owned)] == [True, True]
    assert [visible_to(r, "other") for r in (shared, owned)] == [True, False]


@pytest.mark.parametrize(
    "response",
    [
        gateway_pb2.GenerateResponse(
            text="he", token_ids=[1, 2], request_id="r", adapter_cold=True
        ),
        gateway_pb2.GenerateResponse(request_id="r"),
        gateway_pb2.GenerateResponse(
            text="!",
            token_ids=[3],
            request_id="r~1",
            finish_reason=gateway_pb2.FINISH_REASON_EOS,
            usage=gateway_pb2.Usage(prompt_tokens=5, completion_tokens=3),
            worker_id="w0",
            adapter_cold=True,
            adapter_wait_seconds=0.25,
            worker_ttft_seconds=0.5,
        ),
        gateway_pb2.GenerateResponse(
            finish_reason=gateway_pb2.FINISH_REASON_LENGTH, usage=gateway_pb2.Usage()
        ),
    ],
    ids=["token", "empty", "last", "last-zero-usage"],
)
def test_a_worker_message_passes_through_the_core_unchanged(
    response: gateway_pb2.GenerateResponse,
) -> None:
    """What a worker streams comes out of the gRPC front door as it went in (the gateway's
    own request id aside): every field, and whether ``usage`` is set."""
    back = generate_response(_chunk(response))
    assert back == response
    assert back.HasField("usage") == response.HasField("usage")
