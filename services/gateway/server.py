"""The gateway's gRPC front door: the client-facing ``plora.v1.Gateway`` service.

Each RPC converts its request, makes one call into :class:`~services.gateway.core.GatewayCore`
(which holds every serving rule) and converts the answer; a domain error becomes its status in
one place (:func:`services.common.grpc_util.abort`). With API keys
(:mod:`services.gateway.auth`), a call without a known key is refused before it gets here, and
each RPC acts as the tenant of its caller's key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common import convert
from services.common.config import settings_line
from services.common.errors import InvalidRequestError, PLoRAError
from services.common.grpc_util import (
    abort,
    create_server,
    map_errors,
    set_serving,
    tls_server_credentials,
)
from services.common.lifecycle import run_service, write_ready_file
from services.common.metrics import serve_metrics
from services.common.registry import Registry, connect
from services.gateway.admission import server_threads
from services.gateway.auth import (
    ApiKeyInterceptor,
    KeyRing,
    Principal,
    effective_tenant,
    sees_everything,
)
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_http import HttpServer, OpenAIApp
from services.gateway.results import GenerateChunk

logger = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name

#: Services answered without an API key: health (load balancers, ``plora up``) and reflection.
OPEN_SERVICES = (
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
    "grpc.reflection.v1.ServerReflection",
)

GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"

_FINISH = {
    "length": gateway_pb2.FINISH_REASON_LENGTH,
    "stop": gateway_pb2.FINISH_REASON_STOP,
    "eos": gateway_pb2.FINISH_REASON_EOS,
    "context": gateway_pb2.FINISH_REASON_CONTEXT,
}


def generate_response(chunk: GenerateChunk) -> gateway_pb2.GenerateResponse:
    """A :class:`~services.gateway.results.GenerateChunk` as a ``plora.v1.GenerateResponse``."""
    response = gateway_pb2.GenerateResponse(
        text=chunk.text,
        token_ids=chunk.token_ids,
        adapter_cold=chunk.adapter_cold,
        request_id=chunk.request_id,
        worker_id=chunk.worker_id,
        adapter_wait_seconds=chunk.adapter_wait_seconds,
        worker_ttft_seconds=chunk.worker_ttft_seconds,
    )
    if chunk.finish_reason is not None:
        response.finish_reason = _FINISH[chunk.finish_reason]
    if chunk.usage is not None:
        response.usage.CopyFrom(
            gateway_pb2.Usage(
                prompt_tokens=chunk.usage.prompt_tokens,
                completion_tokens=chunk.usage.completion_tokens,
            )
        )
    return response


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Implements ``plora.v1.Gateway`` over a :class:`~services.gateway.core.GatewayCore`.

    Args:
        core: The serving rules.
        keyring: The API keys; None = no keys, every caller trusted (each request's
            ``tenant_id`` is taken as given).
    """

    def __init__(self, core: GatewayCore, keyring: KeyRing | None = None) -> None:
        self.core = core
        self.keyring = keyring

    def _caller(self, context: grpc.ServicerContext) -> Principal | None:
        """Whom the call's API key acts as (None without keys).

        Raises:
            UnauthenticatedError: no known key (the interceptor refuses such calls first).
        """
        if self.keyring is None:
            return None
        return self.keyring.authenticate(context.invocation_metadata())

    def Generate(  # noqa: N802 - gRPC method name
        self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        try:
            request.tenant_id = effective_tenant(self._caller(context), request.tenant_id)
        except PLoRAError as exc:
            abort(context, exc)
        generation = self.core.generate(request, context)
        try:
            for chunk in generation:
                yield generate_response(chunk)
        except Exception as exc:  # noqa: BLE001 - every failure becomes its status here
            abort(context, exc, generation.request_id)
        finally:
            generation.close()

    @map_errors
    def RegisterAdapter(  # noqa: N802
        self, request: gateway_pb2.RegisterAdapterRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.RegisterAdapterResponse:
        caller = self._caller(context)
        record = self.core.register_adapter(
            request.adapter_id,
            request.source,
            effective_tenant(caller, request.tenant_id),
            confine_to_tenant=not sees_everything(caller),
        )
        return gateway_pb2.RegisterAdapterResponse(
            adapter=convert.adapter_info(record, with_source=sees_everything(caller))
        )

    @map_errors
    def GetAdapter(  # noqa: N802
        self, request: gateway_pb2.GetAdapterRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.GetAdapterResponse:
        caller = self._caller(context)
        status = self.core.get_adapter(
            request.adapter_id, effective_tenant(caller, request.tenant_id)
        )
        return gateway_pb2.GetAdapterResponse(
            adapter=convert.adapter_info(status.record, with_source=sees_everything(caller)),
            resident_on_workers=status.resident_on,
            placed_on_workers=status.placed_on,
        )

    @map_errors
    def ListAdapters(  # noqa: N802
        self, request: gateway_pb2.ListAdaptersRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.ListAdaptersResponse:
        caller = self._caller(context)
        records = self.core.list_adapters(effective_tenant(caller, request.tenant_id))
        with_source = sees_everything(caller)
        return gateway_pb2.ListAdaptersResponse(
            adapters=[convert.adapter_info(r, with_source=with_source) for r in records]
        )

    @map_errors
    def DeleteAdapter(  # noqa: N802
        self, request: gateway_pb2.DeleteAdapterRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.DeleteAdapterResponse:
        tenant_id = effective_tenant(self._caller(context), request.tenant_id)
        version = self.core.delete_adapter(request.adapter_id, tenant_id)
        return gateway_pb2.DeleteAdapterResponse(version=version)

    @map_errors
    def GetClusterStatus(  # noqa: N802
        self, request: gateway_pb2.GetClusterStatusRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.GetClusterStatusResponse:
        caller = self._caller(context)
        everything = sees_everything(caller)
        status = self.core.cluster_status("" if caller is None else effective_tenant(caller, ""))
        return gateway_pb2.GetClusterStatusResponse(
            workers=[convert.worker_status(w, with_addresses=everything) for w in status.workers],
            adapters_registered=status.adapters_registered,
            base_model=status.base_model,
            predictor_connected=status.predictor_connected,
        )


class RefuseWhenFullInterceptor(grpc.ServerInterceptor):
    """Serves ``Generate`` so that a call the gateway has no place for is refused before its
    request is read (:meth:`GatewayCore.refuse_if_full`).

    A sync gRPC server reads a unary request before it calls the handler: the pool thread
    asks for the message and waits for the server's polling thread to hand it over, two
    wake-ups under the GIL per call. Here ``Generate`` is served as a handler of a request
    stream (the same bytes on the wire; a client sees no difference), which checks for room
    first and reads its one request only when there is room. Under a flood of refused calls
    that takes about 40 % off the gateway's CPU time per refusal and lets the refusals
    come back sooner (docs/security.md, "Measured"). Other methods pass through unchanged.

    Args:
        core: The core whose admission counts decide.
    """

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        # (the servicer's handler, its wrapper): built once, not per call
        self._wrapped: tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler] | None = None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if (
            handler is None
            or handler.unary_stream is None  # only a unary-request, streamed-response method
            or handler_call_details.method != GENERATE_METHOD
        ):
            return handler
        wrapped = self._wrapped
        if wrapped is None or wrapped[0] is not handler:
            refusing = self._refusing_first(handler, handler.unary_stream)
            wrapped = self._wrapped = (handler, refusing)
        return wrapped[1]

    def _refusing_first(
        self,
        handler: grpc.RpcMethodHandler,
        serve: Callable[[gateway_pb2.GenerateRequest, grpc.ServicerContext], Any],
    ) -> grpc.RpcMethodHandler:
        """``Generate``'s ``handler``, whose behaviour is ``serve``, as a request-stream
        handler that asks the core for room before it reads the request."""
        core = self.core

        def generate(
            requests: Iterator[gateway_pb2.GenerateRequest], context: grpc.ServicerContext
        ) -> Iterator[gateway_pb2.GenerateResponse]:
            try:
                core.refuse_if_full()
            except PLoRAError as exc:
                abort(context, exc)
            request = next(requests, None)
            if request is None:  # only a hand-made client can half-close without a request
                abort(context, InvalidRequestError("Generate takes one GenerateRequest; none came"))
                return  # abort raised
            yield from serve(request, context)

        return grpc.stream_stream_rpc_method_handler(
            generate, handler.request_deserializer, handler.response_serializer
        )


class GatewayService:
    """A running gateway: gRPC server, OpenAI-compatible HTTP server (both over one
    :class:`~services.gateway.core.GatewayCore`), metrics endpoint and event stream.

    Args:
        config: The gateway's settings.

    Raises:
        RegistryUnavailableError: Redis cannot be reached.
        OSError: A port cannot be bound.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.registry = Registry(connect(config.redis_url))
        config.check_security()
        keyring = KeyRing.from_file(config.api_keys_file) if config.api_keys_file else None
        credentials = (
            tls_server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
            if config.tls_cert
            else None
        )
        self.core = GatewayCore(config, self.registry, self.metrics)
        self.servicer = GatewayServicer(self.core, keyring)

        def register(server: grpc.Server) -> list[str]:
            gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, server)
            return [SERVICE_NAME]

        # the key is checked first: a caller without one learns nothing, not even that the
        # gateway is full
        interceptors: list[grpc.ServerInterceptor] = []
        if keyring is not None:
            interceptors.append(
                ApiKeyInterceptor(keyring, OPEN_SERVICES, self.metrics.unauthenticated.inc)
            )
        interceptors.append(RefuseWhenFullInterceptor(self.core))
        self.server, self.port, self.health = create_server(
            register,
            host=config.host,
            port=config.port,
            max_workers=server_threads(config.max_concurrent_requests),
            credentials=credentials,
            interceptors=interceptors,
        )
        self.openai = OpenAIApp(
            self.core,
            keyring,
            self.metrics,
            threads=server_threads(config.max_concurrent_requests),
            max_body_bytes=config.http_max_body_bytes,
        )
        try:
            self.http = HttpServer(
                self.openai,
                config.host,
                config.http_port,
                tls_cert=config.tls_cert,
                tls_key=config.tls_key,
                tls_client_ca=config.tls_client_ca,
            )
        except OSError:
            self.server.stop(None)  # give the gRPC port back
            self.openai.close()
            raise
        self.http_port = self.http.port
        self.metrics_server, self.metrics_port = serve_metrics(
            self.metrics.registry, config.host, config.metrics_port
        )

    def start(self) -> GatewayService:
        """Start serving and mark the service SERVING."""
        self.server.start()
        self.http.start()
        self.core.start()
        set_serving(self.health, [SERVICE_NAME], True)
        if self.config.ready_file:
            write_ready_file(
                self.config.ready_file, self.port, self.metrics_port, http_port=self.http_port
            )
        logger.info(
            "gateway serving gRPC on %s:%d, OpenAI HTTP on port %d (%s, %s)",
            self.config.host,
            self.port,
            self.http_port,
            "TLS" if self.config.tls_cert else "plaintext",
            "API keys" if self.config.api_keys_file else "no API keys",
        )
        logger.info("settings: %s", settings_line(self.config))
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting requests, let in-flight ones finish within ``grace`` seconds; those
        still streaming a second before it ends are ended with UNAVAILABLE saying why
        (:meth:`GatewayCore.begin_drain`)."""
        set_serving(self.health, [SERVICE_NAME], False)
        self.core.begin_drain(grace, max(0.0, grace - 1.0))
        stopped = self.server.stop(grace)
        self.http.stop(grace)
        stopped.wait()
        self.openai.close()
        self.core.close()
        self.metrics_server.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``plora serve gateway``."""
    return run_service("gateway", GatewayConfig, GatewayService, argv)
