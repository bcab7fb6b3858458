"""gRPC plumbing shared by every service: the server factory, error mapping, health waits.

The server factory follows gRPC's ``examples/python``: it binds a port (0 = any free port, used
by the tests), registers the standard health service and server reflection, and returns the
real port. Domain errors (``services.common.errors``) are mapped to status codes here and
nowhere else.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import ConfigError, PLoRAError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Milliseconds between a channel's keepalive pings, with or without calls in flight.
KEEPALIVE_TIME_MS = 10_000

#: Milliseconds a channel waits for a ping's answer (a keepalive ping, or the flow-control
#: ping gRPC sends with a call) before it closes the connection and fails its calls
#: UNAVAILABLE: a peer that stopped answering (a frozen process, a paused VM, a cable pulled)
#: is noticed within about this long (at most KEEPALIVE_TIME_MS more) instead of at the call's
#: deadline, and a worker's request that had no token yet is retried on another. Both
#: arguments are needed: with an unanswered flow-control ping in flight, grpc-core defers the
#: keepalive ping and waits ``grpc.http2.ping_timeout_ms`` (1 minute by default) instead.
KEEPALIVE_TIMEOUT_MS = 10_000

#: Longest wait (milliseconds) between a channel's attempts to reconnect to a peer that is down.
MAX_RECONNECT_BACKOFF_MS = 2_000


#: Message size limits of every channel and server: large messages are not expected.
_MESSAGE_LIMITS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]


def channel_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, Any]]:
    """Options of every channel: 16 MiB messages, keepalive pings every
    ``keepalive_time_ms`` even with no call in flight (so a dead peer is noticed before the
    next request, not by it), each answered within :data:`KEEPALIVE_TIMEOUT_MS` or the
    connection is closed (gRPC keepalive, A8 in grpc/proposal)."""
    return [
        *_MESSAGE_LIMITS,
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # a peer that was down a while (a worker paused after crash-looping, or restarting):
        # reconnect within 2 s of its coming back, not after grpc's backoff of up to 120 s
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


def server_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, Any]]:
    """Options of every server: accept the channels' keepalive pings, and one listener per port.

    A gRPC server by default accepts a ping on an idle connection only every 5 minutes and
    answers a third early one with GOAWAY ``too_many_pings`` ("ENHANCE_YOUR_CALM"), which
    would drop the gateway's idle worker channels within minutes and fail the next request on
    every worker at once (UNAVAILABLE, "no healthy worker"). Pings at half the channels'
    interval are allowed here. ``SO_REUSEPORT`` (on by default
    in gRPC) is off, so a second server on a taken port fails to bind instead of sharing the
    port and receiving half of the first one's requests (two ``plora up`` on 50051).
    """
    return [
        *_MESSAGE_LIMITS,
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_time_ms // 2),
        ("grpc.so_reuseport", 0),
    ]


#: Options for every channel (:func:`channel_options`).
CHANNEL_OPTIONS: list[tuple[str, Any]] = channel_options()


def status_for(exc: BaseException) -> grpc.StatusCode:
    """Map a domain error to its gRPC status code; anything else is INTERNAL."""
    if isinstance(exc, PLoRAError):
        return getattr(grpc.StatusCode, exc.status_code_name)
    return grpc.StatusCode.INTERNAL


def abort(context: grpc.ServicerContext, exc: BaseException, request_id: str = "") -> None:
    """Abort an RPC with the status for ``exc`` and a message a person can act on.

    Unknown exceptions are logged with their stack and reported as INTERNAL with a reference id,
    never with the stack itself.
    """
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL and not isinstance(exc, PLoRAError):
        ref = request_id or uuid.uuid4().hex[:12]
        logger.exception("internal error (ref %s)", ref, exc_info=exc)
        context.abort(code, f"internal error (ref {ref}); see the server log")
    context.abort(code, str(exc) or type(exc).__name__)


def refusing_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler, for ``handler``'s method, that ends every call with ``code`` and
    ``message`` before reading or parsing its request: for a server interceptor that refuses
    a call (no credentials, no room).

    Whatever the method's kind, the refusing handler takes a request stream (the same bytes
    on the wire, so a client sees only the status): a sync gRPC server reads a unary request
    before it calls the handler, which would both parse what an unauthenticated caller sent
    and cost the refusal two more hand-overs between the server's threads.

    Args:
        handler: The method's own handler (its codec is kept; it is never used).
        code: The status every call ends with.
        message: The status details.
    """

    def refuse(_requests: Iterable[Any], context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(
        refuse, handler.request_deserializer, handler.response_serializer
    )


def map_errors(method: Callable[..., T]) -> Callable[..., T]:
    """Decorate a unary servicer method so domain errors become their status codes."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> T:
        try:
            return method(self, request, context)
        except PLoRAError as exc:
            abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - mapped to INTERNAL with a reference id
            if already_aborted(context):
                raise
            abort(context, exc)
        raise AssertionError("unreachable")  # context.abort always raises

    return wrapper


class Deadline(Protocol):
    """What the deadline helpers read of a call: a ``grpc.ServicerContext``, or a front door's
    own stand-in for one."""

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline (None or huge: no deadline)."""
        ...


#: ``time_remaining()`` above this many seconds means the client set no deadline (grpcio
#: reports an "infinite" deadline as ~9.2e18 s rather than None).
_NO_DEADLINE_S = 1e9


def remaining_or(context: Deadline, default: float) -> float:
    """Seconds left before the client's deadline, or ``default`` when it set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE_S:
        return default
    return max(0.001, remaining)


#: A stream ended this close to its deadline (seconds) ended by the deadline: the client's
#: cancellation at its deadline can reach a server (and the gateway's, a worker) a little
#: before the server's own clock passes it.
DEADLINE_SLACK_S = 0.1


def log_request_failure(
    log: logging.Logger,
    request_id: str,
    code: grpc.StatusCode,
    detail: str,
    seconds: float,
    adapter_id: str = "",
    tenant_id: str = "",
) -> None:
    """One INFO line for a Generate call that did not end OK, so a request id a client
    reports can be found in the logs (the gateway logs the id the workers see,
    ``<caller's id>~<8 hex>``, so one grep finds both services' lines). INFO, not WARNING:
    what made requests fail (a worker down, a Redis outage, an adapter whose files are gone)
    is logged once as a warning where it happens, and a line per request at that level would
    flood ``plora up``'s terminal during an outage.

    Args:
        log: The service's logger.
        request_id: The id as this service knows it.
        code: The status the call ended with (not OK).
        detail: The status message ("" when the client ended it).
        seconds: Wall seconds from receipt to the end.
        adapter_id: The adapter asked for ("" = the base model).
        tenant_id: The caller's tenant ("" = none).
    """
    log.info(
        "request %s (adapter %s, tenant %s) ended %s after %.3f s%s",
        request_id,
        adapter_id or "-",
        tenant_id or "-",
        code.name,
        seconds,
        f": {detail}" if detail else "",
    )


def ended_by_client(context: Deadline) -> grpc.StatusCode:
    """Status to count for a stream the client ended before it finished:
    ``DEADLINE_EXCEEDED`` when the client's deadline has passed (within
    :data:`DEADLINE_SLACK_S`), else ``CANCELLED`` (the client cancelled or went away), the
    code the client saw."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def already_aborted(context: grpc.ServicerContext) -> bool:
    """True once ``context.abort`` ran: it raises a bare ``Exception`` that must propagate."""
    # ServicerContext.code() exists since grpcio 1.38; types-grpcio does not declare it yet
    code = context.code()  # type: ignore[attr-defined]
    return code is not None and code is not grpc.StatusCode.OK


def started_thread_pool(
    max_workers: int, thread_name_prefix: str = "grpc-server"
) -> futures.ThreadPoolExecutor:
    """A thread pool with all ``max_workers`` threads already running, for a gRPC server (or
    an event loop that hands blocking work to a pool).

    ``concurrent.futures.ThreadPoolExecutor`` starts a thread at a ``submit`` that finds none
    idle, and ``Thread.start`` blocks the caller until the new thread has run. A sync gRPC
    server submits from its one polling thread (the HTTP door from its event loop), so under
    the first burst of calls that thread waits for up to ``max_workers`` thread start-ups in a
    row, each needing the interpreter lock while the burst's handlers hold it, and every call
    behind waits with it (measured on the gateway: about a tenth of its lock time in a
    500-call flood, docs/security.md, "Measured"). Starting them here moves that cost to
    start-up.

    Args:
        max_workers: Threads (>= 1).
        thread_name_prefix: Names of the threads (``<prefix>_<n>``), as py-spy and
            ``threading.enumerate`` show them.

    Returns:
        The pool, with ``max_workers`` idle threads.

    Raises:
        RuntimeError: A thread could not be started (the threads started are stopped).
    """
    pool = futures.ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix)
    # each thread waits at the barrier until all have started, so no thread takes two tasks
    everyone = threading.Barrier(max_workers + 1)
    try:
        for _ in range(max_workers):
            pool.submit(everyone.wait)
        everyone.wait()
    except BaseException:
        everyone.abort()
        pool.shutdown(wait=False)
        raise
    return pool


def create_server(
    register: Callable[[grpc.Server], Iterable[str]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build a started-ready (not yet started) gRPC server with health and reflection.

    Args:
        register: Adds the service's servicers to the server and returns their full service
            names (``"plora.v1.Gateway"``), which are advertised by reflection and health.
        host: Interface to bind (``0.0.0.0`` in containers, loopback otherwise).
        port: TCP port; 0 picks a free port.
        max_workers: Threads serving RPCs (each streaming RPC holds one while it runs), all
            started here (:func:`started_thread_pool`) and ended once the server object is
            garbage collected.
        credentials: TLS of the port (:func:`tls_server_credentials`); None = plaintext.
        interceptors: Run on every call, health and reflection included, before its
            servicer (the gateway's API-key check; the internal token check of the worker
            and the predictor, :func:`services.common.internal_auth.server_interceptors`).

    Returns:
        ``(server, bound_port, health_servicer)``; statuses start NOT_SERVING: call
        :func:`set_serving` once the service is ready.

    Raises:
        OSError: the port could not be bound.
    """
    pool = started_thread_pool(max_workers)
    server = grpc.server(pool, options=server_options(), interceptors=list(interceptors))
    # grpc never shuts its pool down; its idle threads end with the server object
    weakref.finalize(server, pool.shutdown, wait=False)
    names = list(register(server))
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # grpcio >= 1.50 raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise OSError(
            f"could not bind gRPC port {host}:{port}: in use (another cluster or service on "
            "it? stop it or choose another port)"
        )
    return server, bound, health_servicer


def set_serving(
    health_servicer: health.HealthServicer, names: Iterable[str], serving: bool
) -> None:
    """Set the health status of the overall server ("") and each named service."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *names]:
        health_servicer.set(name, status)


def wait_healthy(
    address: str,
    timeout: float,
    service: str = "",
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Block until the server at ``address`` reports SERVING, or raise TimeoutError.

    Watches the standard health service under one deadline (no sleep-polling of ports);
    over TLS when ``credentials`` are given (:func:`tls_channel_credentials`).
    """
    with client_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        last = "no answer"
        try:
            for resp in stub.Watch(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
            ):
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as exc:
            last = f"{exc.code().name} after {last}"
    raise TimeoutError(f"{address} not healthy after {timeout:.0f}s (last: {last})")


def _read_pem(path: str, flag: str) -> bytes:
    """The bytes of a PEM file named by ``flag``.

    Raises:
        ConfigError: it cannot be read, or holds no PEM block.
    """
    try:
        data = open(path, "rb").read()  # noqa: SIM115 - small file, closed by refcount
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r}: cannot read it ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path!r}: not a PEM file (no -----BEGIN line)")
    return data


def tls_server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS of a server port from PEM files.

    Args:
        cert: The certificate (chain, leaf first) the server presents.
        key: Its private key.
        client_ca: CA bundle client certificates must chain to; given, the server requires
            one (mutual TLS) and refuses a client without it at the handshake.

    Raises:
        ConfigError: a file cannot be read or is not PEM (naming its flag).
    """
    pair = (_read_pem(key, "--tls-key"), _read_pem(cert, "--tls-cert"))
    if not client_ca:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair],
        root_certificates=_read_pem(client_ca, "--tls-client-ca"),
        require_client_auth=True,
    )


def tls_channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS of a client channel from PEM files.

    Args:
        ca: CA bundle the server's certificate must chain to; "" = the system's roots.
        cert: The client's certificate, for a server that requires one (mutual TLS).
        key: Its private key (given with ``cert``).

    Raises:
        ConfigError: a file cannot be read or is not PEM, or only one of cert and key.
    """
    if bool(cert) != bool(key):
        raise ConfigError(
            "PLORA_TLS_CLIENT_CERT and PLORA_TLS_CLIENT_KEY go together: give the client "
            "certificate and its key, or neither"
        )
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(ca, "--tls-ca / PLORA_TLS_CA") if ca else None,
        private_key=_read_pem(key, "PLORA_TLS_CLIENT_KEY") if key else None,
        certificate_chain=_read_pem(cert, "PLORA_TLS_CLIENT_CERT") if cert else None,
    )


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """A call's details with other metadata (gRPC's ``examples/python/interceptors``)."""


class MetadataSender(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client interceptor that adds one metadata entry to every call of a channel: an API
    key (:func:`bearer_token`), or the cluster's internal token
    (:func:`services.common.internal_auth.internal_channel`). It works over plaintext on
    loopback too, where gRPC's call credentials refuse to send anything.

    Args:
        key: The metadata key (lower case, as gRPC requires).
        value: Its value.
    """

    def __init__(self, key: str, value: str) -> None:
        self._entry = (key, value)

    def _with_entry(self, details: Any) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._entry],
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_entry(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_entry(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_entry(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_entry(details), requests)


def bearer_token(key: str) -> MetadataSender:
    """The interceptor that sends ``authorization: Bearer <key>`` (an API key) on every call."""
    return MetadataSender("authorization", f"Bearer {key}")


def client_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None = None,
    api_key: str = "",
) -> grpc.Channel:
    """A channel to ``address`` with :data:`CHANNEL_OPTIONS`: TLS with ``credentials``
    (plaintext without), and ``api_key`` sent on every call (:func:`bearer_token`)."""
    if credentials is None:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    if api_key:
        return grpc.intercept_channel(channel, bearer_token(api_key))
    return channel
