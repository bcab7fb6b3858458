"""The internal plane's credential: a shared token the cluster's own services send each other.

The gateway, the predictor and the workers call each other over gRPC. When an internal token
is configured (``plora up`` always makes one; compose and Kubernetes give one through
``PLORA_INTERNAL_TOKEN`` or ``--internal-token-file``), every internal call carries it in the
metadata key :data:`TOKEN_METADATA_KEY`, and the Worker and Predictor servers refuse a call
without it, or with another, as UNAUTHENTICATED (:class:`InternalTokenInterceptor`). The
standard health and reflection services stay open: load balancers, ``docker compose`` health
checks and ``grpcurl`` need them, and they reveal no data. With no token configured (a service
started by hand on loopback) internal authentication is off. docs/security.md, "Internal
plane", says what this protects and what it does not.
"""

from __future__ import annotations

import collections
import hmac
import logging
import string
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc

from services.common.errors import ConfigError
from services.common.grpc_util import MetadataSender, refusing_handler

logger = logging.getLogger(__name__)

#: gRPC metadata key the internal token travels in (metadata keys are lower case).
TOKEN_METADATA_KEY = "x-plora-internal-token"

#: Shortest token accepted: ``secrets.token_urlsafe(32)`` gives 43 characters.
MIN_TOKEN_CHARS = 16

#: Services any caller may reach: health checks and reflection (no data, no side effects).
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

#: What a refused caller is told: the rule and how to meet it, nothing about the server.
REFUSAL = (
    "this service answers only the cluster's own services: send the cluster's internal "
    f"token in the {TOKEN_METADATA_KEY!r} metadata (docs/security.md, 'Internal plane')"
)

#: Seconds between two log lines about refused calls (a flood of them writes one a period).
_REFUSAL_LOG_PERIOD_S = 10.0

_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "-_.~+/=")


def check_token(token: str, source: str) -> str:
    """``token`` if it can be an internal token, for :func:`resolve_token`.

    A token travels as gRPC metadata, so it must be printable ASCII: letters, digits and
    ``-_.~+/=`` (what ``secrets.token_urlsafe`` and base64 produce), at least
    :data:`MIN_TOKEN_CHARS` long.

    Args:
        token: The token, surrounding whitespace already removed.
        source: Where it came from, for the message (``PLORA_INTERNAL_TOKEN``,
            ``--internal-token-file /run/secrets/x``).

    Raises:
        ConfigError: too short or with other characters; the message names ``source`` and
            how to make a token, never the token.
    """
    if len(token) < MIN_TOKEN_CHARS or not set(token) <= _TOKEN_CHARS:
        raise ConfigError(
            f"{source}: an internal token must be at least {MIN_TOKEN_CHARS} characters of "
            "letters, digits and -_.~+/= (make one with: python3 -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    return token


def resolve_token(token_file: str, token: str) -> str:
    """The internal token a service uses: the contents of ``token_file`` when set (a Docker
    or Kubernetes secret mounted as a file), else ``token`` (``PLORA_INTERNAL_TOKEN``); ``""``
    (internal authentication off) when both are empty.

    Args:
        token_file: ``--internal-token-file`` / ``PLORA_INTERNAL_TOKEN_FILE``; its contents,
            surrounding whitespace removed, are the token.
        token: ``PLORA_INTERNAL_TOKEN``.

    Raises:
        ConfigError: the file cannot be read or is empty, or the token is malformed
            (:func:`check_token`); the message names the setting, never the token.
    """
    if token_file:
        source = f"--internal-token-file / PLORA_INTERNAL_TOKEN_FILE {token_file}"
        try:
            text = Path(token_file).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not ASCII text"
            raise ConfigError(f"{source}: cannot read the internal token ({why})") from None
        return check_token(text, source)
    if token:
        return check_token(token.strip(), "PLORA_INTERNAL_TOKEN")
    return ""


def tokens_match(sent: str | bytes | None, expected: str) -> bool:
    """Whether ``sent`` is ``expected``, compared in constant time (``hmac.compare_digest``:
    the time taken does not tell how much of a guess was right)."""
    if sent is None:
        return False
    given = sent if isinstance(sent, bytes) else sent.encode("utf-8", "replace")
    return hmac.compare_digest(given, expected.encode())


class InternalTokenInterceptor(grpc.ServerInterceptor):
    """Server interceptor of the Worker and Predictor servers: a call to any method outside
    :data:`OPEN_SERVICES` must carry ``token`` in :data:`TOKEN_METADATA_KEY`, else it ends
    UNAUTHENTICATED with :data:`REFUSAL` before any servicer code runs and before its
    request is read or parsed (:func:`~services.common.grpc_util.refusing_handler`).

    Args:
        token: The cluster's internal token (non-empty).
        on_refused: Called once per refused call with the method's full name (a metrics
            counter); optional.

    Raises:
        ValueError: ``token`` is empty (an interceptor that lets everyone in is a mistake).
    """

    def __init__(self, token: str, on_refused: Callable[[str], None] | None = None) -> None:
        if not token:
            raise ValueError("InternalTokenInterceptor needs a non-empty token")
        self._token = token
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._last_log = -_REFUSAL_LOG_PERIOD_S
        self._unlogged: collections.Counter[str] = collections.Counter()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method.startswith(OPEN_SERVICES):
            return continuation(handler_call_details)
        sent = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                sent = value
                break
        handler = continuation(handler_call_details)
        if handler is None or tokens_match(sent, self._token):
            return handler
        self._refused(method, "missing" if sent is None else "wrong")
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    def _refused(self, method: str, why: str) -> None:
        """Count a refusal and log it (the method and whether the token was missing or
        wrong, never what was sent), at most one line per :data:`_REFUSAL_LOG_PERIOD_S`."""
        if self._on_refused is not None:
            self._on_refused(method)
        now = time.monotonic()
        with self._lock:
            self._unlogged[f"{method} ({why} token)"] += 1
            if now - self._last_log < _REFUSAL_LOG_PERIOD_S:
                return
            self._last_log = now
            summary = ", ".join(f"{n} x {m}" for m, n in self._unlogged.items())
            self._unlogged.clear()
        logger.warning("refused calls without the internal token: %s", summary)


def internal_channel(
    address: str, token: str, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A channel to another service of the cluster that sends ``token`` on every call.

    Args:
        address: ``host:port`` of a worker or the predictor.
        token: The internal token; ``""`` gives a plain channel (internal authentication off).
        options: gRPC channel options (:data:`services.common.grpc_util.CHANNEL_OPTIONS`).

    Returns:
        A channel; ``close()`` closes the underlying one.
    """
    channel = grpc.insecure_channel(address, options=options)
    if not token:
        return channel
    return grpc.intercept_channel(channel, MetadataSender(TOKEN_METADATA_KEY, token))


#: A generated gRPC stub class (``WorkerStub``): built from a channel.
StubT = TypeVar("StubT")


class InternalStubs(Generic[StubT]):
    """One channel and one stub per address, to the services of one kind (the workers),
    built on first use and kept: a stub binds a method object per RPC of its service, work
    worth doing once, not on every call. Thread-safe.

    Args:
        stub_type: The generated stub class (``worker_pb2_grpc.WorkerStub``).
        token: Sent on every call (:func:`internal_channel`); ``""`` when internal
            authentication is off.
        options: gRPC channel options (:data:`services.common.grpc_util.CHANNEL_OPTIONS`).
    """

    def __init__(
        self,
        stub_type: Callable[[grpc.Channel], StubT],
        token: str,
        options: Sequence[tuple[str, Any]] | None = None,
    ) -> None:
        self._stub_type = stub_type
        self._token = token
        self._options = options
        self._stubs: dict[str, tuple[grpc.Channel, StubT]] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> StubT:
        """The stub for ``address`` (``host:port``), its channel opened on first use."""
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                channel = internal_channel(address, self._token, options=self._options)
                entry = self._stubs[address] = (channel, self._stub_type(channel))
        return entry[1]

    def close(self) -> None:
        """Close every channel; a later :meth:`get` opens a new one."""
        with self._lock:
            entries, self._stubs = list(self._stubs.values()), {}
        for channel, _ in entries:
            channel.close()


def server_interceptors(
    token: str, on_refused: Callable[[str], None] | None = None
) -> list[grpc.ServerInterceptor]:
    """The interceptors a Worker or Predictor server runs: :class:`InternalTokenInterceptor`
    when ``token`` is set, none when it is empty (internal authentication off)."""
    return [InternalTokenInterceptor(token, on_refused)] if token else []
