"""What the gateway does when a worker's call ends with an error: a pure decision.

A request is sent again only while the client has had nothing from it (no token yet), so a
retry can never duplicate or reorder what the client sees:

* ``UNAVAILABLE`` before the first token (the worker died, was stopped, or stopped answering):
  send it to another worker (:attr:`Retry.ELSEWHERE`); that worker is left out of routing
  until it heartbeats again.
* ``NOT_FOUND`` before the first token, for an adapter, once per request: the worker refused
  the adapter's version as superseded (a re-registration this gateway's cache had not seen, or
  it was dropped while loading): read the record again and, if it is newer, send the request
  with it (:attr:`Retry.REFRESH_ADAPTER`).
* Otherwise the worker's status is the request's (:attr:`Retry.GIVE_UP`), unless the client
  has gone (:attr:`Retry.CLIENT_GONE`: nothing is left to answer).
"""

from __future__ import annotations

import enum


class Retry(enum.Enum):
    """What to do after a worker's call failed."""

    #: Send the request to another worker.
    ELSEWHERE = "elsewhere"
    #: Read the adapter's record again; send the request again if it is a newer version.
    REFRESH_ADAPTER = "refresh_adapter"
    #: End the request with the worker's status.
    GIVE_UP = "give_up"
    #: The client has gone: end the request without an answer.
    CLIENT_GONE = "client_gone"


def should_retry(
    code: str,
    *,
    first_token_sent: bool,
    client_active: bool,
    has_adapter: bool,
    refreshed: bool,
) -> Retry:
    """Decide what follows a worker call that ended with status ``code``.

    Args:
        code: The status code's name (``"UNAVAILABLE"``, ``"NOT_FOUND"``, ...).
        first_token_sent: The client has had a token (or the finish) of this request.
        client_active: The client is still waiting for the answer.
        has_adapter: The request names an adapter (not the base model alone).
        refreshed: The adapter's record was already read again for this request.
    """
    if not client_active:
        return Retry.CLIENT_GONE
    if first_token_sent:
        return Retry.GIVE_UP
    if code == "UNAVAILABLE":
        return Retry.ELSEWHERE
    if code == "NOT_FOUND" and has_adapter and not refreshed:
        return Retry.REFRESH_ADAPTER
    return Retry.GIVE_UP
