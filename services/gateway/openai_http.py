"""The gateway's OpenAI-compatible HTTP door: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (server-sent events with ``stream: true``) and ``/health``.

Every generation is served by the same :class:`~services.gateway.core.GatewayCore` as the
gRPC door (:mod:`services.gateway.server`): validation, adapter resolution, tenancy,
admission, routing, retry before the first token, request events and metrics. This module
converts the wire format (:mod:`services.gateway.openai_schema`) and bridges the core, which
blocks on its worker's gRPC stream, to the event loop: each request's chunks are read in a
thread of a pool sized like the gRPC server's (one per admitted stream plus a reserve) and
handed to the loop as they come, so the loop never waits on a worker.

The ASGI stack is Starlette on uvicorn (httptools), in a thread of the gateway process.

A stream's response starts at its first token: a request refused or failed before it gets
its HTTP status and OpenAI's error object (400 invalid, 401 no key, 403 another tenant's
adapter, 404 unknown model, 429 overload, 503 no worker, 504 deadline) with the message the
gRPC door's status carries; a failure after it ends the stream with an ``error`` event. A
client that goes away cancels its request on the worker, as a cancelled gRPC call does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plora.v1 import gateway_pb2
from services.common.errors import (
    AdapterNotFoundError,
    NoHealthyWorkerError,
    PLoRAError,
    UnauthenticatedError,
)
from services.common.grpc_util import started_thread_pool
from services.gateway.auth import KeyRing, Principal, effective_tenant
from services.gateway.core import GatewayCore, Generation
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_schema import (
    Answer,
    ChatBody,
    CompletionBody,
    UnsupportedFieldError,
    adapter_model_json,
    chat_request,
    completion_request,
    error_json,
    finish_reason,
    http_status,
    model_json,
    parse_body,
)
from services.gateway.results import GenerateChunk

logger = logging.getLogger(__name__)

#: The refusal of a request without a known key over HTTP (the same for a missing, malformed
#: or unknown key).
UNAUTHENTICATED_MESSAGE = (
    "a valid API key is required: send the HTTP header 'Authorization: Bearer <key>'"
)

#: The refusal of a generation before any worker published the served model.
NO_MODEL_YET = (
    "no healthy worker is available (none has published the served model yet); check "
    "`plora status` and the workers' logs"
)

#: Routes, as the HTTP metric labels them (anything else is "other").
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health")

#: Request header whose value becomes the request id (for tracing; echoed in the response).
REQUEST_ID_HEADER = "x-request-id"

#: Connections the HTTP socket queues before the server accepts them (uvicorn's default).
BACKLOG = 2048


class HttpError(Exception):
    """A refusal of the HTTP layer itself (body too large, not JSON), with its status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_answer(
    exc: BaseException, request_id: str = ""
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The HTTP status, OpenAI error object and headers of a failure: a domain error's own
    status and message, a refusal of this layer's (:class:`HttpError`) as it says, anything
    else 500 with a reference (its stack in the log only, never in the answer)."""
    headers = {}
    code = None
    if isinstance(exc, HttpError):
        status, message, param = exc.status, str(exc), exc.param
    elif isinstance(exc, PLoRAError):
        status, message = http_status(exc), str(exc) or type(exc).__name__
        param = exc.param if isinstance(exc, UnsupportedFieldError) else None
        if isinstance(exc, AdapterNotFoundError):  # the model names an unknown adapter
            param, code = "model", "model_not_found"
        if status == 401:
            headers["www-authenticate"] = "Bearer"
    else:
        ref = request_id or uuid.uuid4().hex[:12]
        logger.error("internal error (ref %s)", ref, exc_info=exc)
        status, message, param = 500, f"internal error (ref {ref}); see the server log", None
    return status, error_json(status, message, param, code), headers


def _client_gone() -> JSONResponse:
    """The answer to a request whose client went away before it (nobody reads it)."""
    return JSONResponse(error_json(499, "the client closed the request"), 499)


class HttpCaller:
    """The caller of one HTTP request, as the core sees it (its ``Client`` protocol): active
    until :meth:`disconnect`, no deadline of its own (the core applies
    ``request_timeout_s``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = True
        self._callbacks: list[Callable[[], None]] = []

    def is_active(self) -> bool:
        """Whether the client still waits for the answer."""
        return self._active

    def time_remaining(self) -> float | None:
        """None: an HTTP request carries no deadline."""
        return None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` when the client goes away (at once if it has)."""
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
                return True
        callback()
        return False

    def disconnect(self) -> None:
        """The client went away: run the callbacks (they cancel the worker's stream)."""
        with self._lock:
            if not self._active:
                return
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one failing callback must not keep the others
                logger.exception("disconnect callback failed")


@dataclass(frozen=True)
class _Failed:
    """The request failed with ``error`` (in the pump thread)."""

    error: BaseException


_END = object()  # the generation ended (after its last chunk, or with the client gone)


def _pump(
    core: GatewayCore,
    message: Callable[[], gateway_pb2.GenerateRequest],
    started: list[Generation],
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue[object],
    caller: HttpCaller,
) -> None:
    """Build the request (``message``: it may read the base model's name from Redis), start
    it in the core, append the generation to ``started`` and hand each of its chunks to the
    loop's queue, all in one pool thread: the request reaches a worker without a hop back to
    the loop first."""

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped
            caller.disconnect()

    try:
        generation = core.generate(message(), caller)
    except BaseException as exc:  # noqa: BLE001 - handed to the loop, which answers with it
        put(_Failed(exc))
        return
    started.append(generation)  # before any chunk is put: the loop reads it after one
    try:
        for chunk in generation:
            put(chunk)
            if not caller.is_active():
                break
    except BaseException as exc:  # noqa: BLE001 - handed to the loop, which answers with it
        put(_Failed(exc))
    else:
        put(_END)
    finally:
        generation.close()


class OpenAIApp:
    """The Starlette application of the HTTP door.

    Args:
        core: The serving rules (shared with the gRPC door).
        keyring: The API keys; None = no keys (every caller acts as tenant "", which sees
            every adapter, as a gRPC call without ``tenant_id`` does).
        metrics: The gateway's series (``plora_gateway_http_requests_total`` is this door's).
        threads: Size of the pool that reads the core's streams, all started here.
        max_body_bytes: Largest request body read; beyond it, 413.
    """

    def __init__(
        self,
        core: GatewayCore,
        keyring: KeyRing | None,
        metrics: GatewayMetrics,
        threads: int,
        max_body_bytes: int,
    ) -> None:
        self.core = core
        self.keyring = keyring
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        # all started now: started per call, each start would hold the event loop
        self.executor = started_thread_pool(threads, thread_name_prefix="http-stream")
        routes = [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={HTTPException: self._http_exception},  # type: ignore[dict-item]
        )

    def close(self) -> None:
        """Stop the stream-reading pool (streams still in it end with the core's drain)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = "/v1/models" if path.startswith("/v1/models/") else path
        route = route if route in ROUTES else "other"
        status = 500

        async def counted_send(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.http_requests.labels(route, str(status)).inc()

    # -- helpers ----------------------------------------------------------------------------

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the pool (a Redis read), off the loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _principal(self, request: Request) -> Principal | None:
        """Whom the request's API key acts as (None without keys).

        Raises:
            UnauthenticatedError: keys are on and the request has no known key.
        """
        if self.keyring is None:
            return None
        header = request.headers.get("authorization", "")
        try:
            return self.keyring.authenticate([("authorization", header)])
        except UnauthenticatedError:
            self.metrics.unauthenticated.inc()
            raise UnauthenticatedError(UNAUTHENTICATED_MESSAGE) from None

    async def _json(self, request: Request) -> object:
        """The body as JSON, read within ``max_body_bytes``.

        Raises:
            HttpError: 413 beyond the bound, 400 not JSON.
        """
        too_large = HttpError(
            413,
            f"the request body is larger than this gateway's limit of {self.max_body_bytes} "
            "bytes: send a shorter prompt",
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large
        parts = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise too_large
            parts.append(part)
        try:
            return json.loads(b"".join(parts))
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"the request body is not valid JSON ({exc})") from None

    def _error(self, exc: BaseException, request_id: str = "") -> JSONResponse:
        """The OpenAI error response of a failure (:func:`error_answer`)."""
        status, body, headers = error_answer(exc, request_id)
        return JSONResponse(body, status, headers=headers)

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own refusals (unknown path, wrong method) as OpenAI error objects."""
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            message = (
                f"{request.method} is not allowed on {request.url.path}: use "
                f"{headers.get('Allow', 'another method')}"
            )
        elif exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}: this gateway serves /v1/models, "
                "/v1/completions, /v1/chat/completions and /health"
            )
        else:
            message = str(exc.detail)
        return JSONResponse(error_json(exc.status_code, message), exc.status_code, headers)

    # -- routes -----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """200 while the gateway can route to at least one worker, else 503."""
        try:
            ok = await self._blocking(self.core.can_route)
        except PLoRAError:
            ok = False
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, 503)

    async def list_models(self, request: Request) -> Response:
        """The base model, then every adapter the caller may use (``parent`` = the base)."""
        try:
            tenant = effective_tenant(self._principal(request), "")
            base, records = await self._blocking(self.core.models, tenant)
        except PLoRAError as exc:
            return self._error(exc)
        data = [model_json(base, 0, "plora", None)] if base else []
        data += [adapter_model_json(r, base) for r in records]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        """One entry of ``/v1/models`` (404 for a model the caller may not use)."""
        wanted = request.path_params["model"]
        try:
            tenant = effective_tenant(self._principal(request), "")
            base, records = await self._blocking(self.core.models, tenant)
        except PLoRAError as exc:
            return self._error(exc)
        if wanted == base:
            return JSONResponse(model_json(base, 0, "plora", None))
        for record in records:
            if record.adapter_id == wanted:
                return JSONResponse(adapter_model_json(record, base))
        return JSONResponse(
            error_json(404, f"model {wanted!r} does not exist; GET /v1/models lists them", "model"),
            404,
        )

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER, "")[:128]
        try:
            principal = self._principal(request)
            data = await self._json(request)
            body = parse_body(ChatBody if chat else CompletionBody, data)
            tenant = effective_tenant(principal, "")
            # a full gateway answers 429 here, on the event loop, without a thread's turn
            self.core.refuse_if_full()
        except (PLoRAError, HttpError) as exc:
            return self._error(exc, request_id)

        def message() -> gateway_pb2.GenerateRequest:
            """The request for the core (in the pump's thread: the base model's name may
            take a Redis read).

            Raises:
                PLoRAError: the registry cannot be read, or the body asks for what the
                    conversion refuses (an unsupported role or content part).
            """
            base = self.core.base_model()
            if not base:  # no worker has run yet: no model is known, none can be served
                raise NoHealthyWorkerError(NO_MODEL_YET)
            adapter_id = "" if body.model == base else body.model
            if chat:
                out = chat_request(body, adapter_id)
            else:
                out = completion_request(body, adapter_id)
            out.tenant_id = tenant
            out.request_id = request_id
            return out

        return await self._serve(request, message, body, chat, request_id)

    async def _serve(
        self,
        request: Request,
        message: Callable[[], gateway_pb2.GenerateRequest],
        body: ChatBody | CompletionBody,
        chat: bool,
        request_id: str,
    ) -> Response:
        """Run the request through the core; answer at its first chunk (or failure)."""
        caller = HttpCaller()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        started: list[Generation] = []
        self.executor.submit(_pump, self.core, message, started, loop, queue, caller)
        watcher = asyncio.create_task(_watch_disconnect(request.receive, caller))
        try:
            first = await queue.get()
        except asyncio.CancelledError:
            caller.disconnect()
            watcher.cancel()
            raise
        if isinstance(first, _Failed):
            watcher.cancel()
            return self._error(first.error, started[0].request_id if started else request_id)
        if first is _END:  # the client went away before the first token
            return _client_gone()
        generation = started[0]  # a chunk came: the pump started the generation first
        headers = {"x-request-id": generation.request_id}
        answer = Answer(chat, generation.request_id, body.model)
        if not body.stream:
            try:
                return await self._whole(first, queue, answer, headers, generation.request_id)
            finally:
                watcher.cancel()
        # Starlette watches for the client's disconnect while it streams, and cancels it
        watcher.cancel()
        events = _events(first, queue, answer, body.include_usage, caller, generation.request_id)
        headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _whole(
        self,
        first: object,
        queue: asyncio.Queue[object],
        answer: Answer,
        headers: dict[str, str],
        request_id: str,
    ) -> Response:
        """The non-streamed answer, once the last chunk came."""
        text = []
        last: GenerateChunk | None = None
        item = first
        while item is not _END:
            if isinstance(item, _Failed):
                return self._error(item.error, request_id)
            assert isinstance(item, GenerateChunk)
            text.append(item.text)
            last = item
            item = await queue.get()
        if last is None or last.finish_reason is None:  # ended without its last chunk
            return _client_gone()
        return JSONResponse(answer.whole("".join(text), last), headers=headers)


async def _watch_disconnect(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]], caller: HttpCaller
) -> None:
    """Wait for the client's ``http.disconnect`` (the body is read already), then cancel."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            caller.disconnect()
            return


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _events(
    first: object,
    queue: asyncio.Queue[object],
    answer: Answer,
    include_usage: bool,
    caller: HttpCaller,
    request_id: str,
) -> AsyncIterator[str]:
    """The server-sent events of a stream: a chunk per token batch the worker sent (those
    already waiting go out in one write), then the usage chunk when asked, then
    ``data: [DONE]``. Cancelled (the client went away), it cancels the request."""
    done = False
    try:
        if answer.chat:  # the chat stream names the role first
            yield _sse(answer.chunk("", None, include_usage, first=True))
        item = first
        while True:
            out = []
            while True:
                if item is _END:
                    done = True
                    break
                if isinstance(item, _Failed):
                    out.append(_sse(error_answer(item.error, request_id)[1]))
                    done = True
                    break
                assert isinstance(item, GenerateChunk)
                finish = finish_reason(item)
                if item.text or finish:
                    out.append(_sse(answer.chunk(item.text, finish, include_usage)))
                if finish and include_usage:
                    out.append(_sse(answer.usage_chunk(item.usage)))
                if queue.empty():
                    break
                item = queue.get_nowait()
            if done:
                out.append("data: [DONE]\n\n")
            if out:
                yield "".join(out)
            if done:
                return
            item = await queue.get()
    finally:
        if not done:
            caller.disconnect()


class HttpServer:
    """uvicorn serving an ASGI application in a thread of this process, on a socket bound at
    construction (so port 0 is resolved before :meth:`start`).

    Args:
        app: The ASGI application.
        host: Interface to bind (an IPv6 address works too).
        port: TCP port; 0 = any free port.
        tls_cert: PEM certificate; with ``tls_key``, HTTPS.
        tls_key: Its private key.
        tls_client_ca: Mutual TLS: client certificates must chain to this CA bundle.

    Raises:
        OSError: the port cannot be bound (taken by another process, or a privileged port);
            the message names the address and the flag that sets the port.
    """

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        tls_cert: str = "",
        tls_key: str = "",
        tls_client_ca: str = "",
    ) -> None:
        name = host.strip("[]")
        family = socket.AF_INET6 if ":" in name else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((name, port))
            # listening now, not at start: until a socket listens, Linux lets a second one
            # with SO_REUSEADDR bind the same port, and that server would fail only at start
            self.socket.listen(BACKLOG)
        except OSError as exc:
            self.socket.close()
            raise OSError(
                exc.errno,
                f"could not bind HTTP port {host}:{port}: {exc.strerror} (another cluster or "
                "service on it? stop it, or choose another port with --http-port / "
                "PLORA_GATEWAY_HTTP_PORT; 0 = any free port)",
            ) from None
        self.socket.set_inheritable(True)
        self.port = self.socket.getsockname()[1]
        self.tls = bool(tls_cert)
        config = uvicorn.Config(
            app,
            http="httptools",
            lifespan="off",
            backlog=BACKLOG,
            log_config=None,
            # uvicorn's INFO lines repeat the gateway's own, and its stop line tells to press
            # CTRL+C to force quit, which a gateway ignores: warnings and errors only
            log_level="warning",
            access_log=False,
            server_header=False,
            ssl_certfile=tls_cert or None,
            ssl_keyfile=tls_key or None,
            ssl_ca_certs=tls_client_ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Serve in a background thread; return once it accepts connections.

        Raises:
            RuntimeError: it did not start within ``timeout`` seconds.
        """
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start; see the log above")
            time.sleep(0.01)

    def stop(self, grace: float) -> None:
        """Stop accepting connections; let open ones finish within ``grace`` seconds."""
        self.server.config.timeout_graceful_shutdown = max(0, int(grace))
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(grace + 5.0)
        self.socket.close()
