"""Gateway configuration: one frozen dataclass built from flags with ``PLORA_*`` fallbacks."""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass, field

from services.common.config import (
    DEFAULT_REDIS_URL,
    adapter_roots_or_env,
    add_adapter_root_argument,
    add_adapter_source_allow_argument,
    add_server_arguments,
    bytes_flag_or_env,
    choice_or_env,
    env_bool,
    env_float,
    env_or,
    inspection_size_limits,
    int_flag_or_env,
    port_number,
    require_at_least_one,
    require_inspection_sizes,
    require_seconds,
    require_server_ports,
    source_allow_or_env,
)
from services.common.errors import ConfigError
from services.common.peft_config import (
    MAX_CONFIG_BYTES,
    MAX_HEADER_BYTES,
    MAX_LORA_RANK,
    InspectionLimits,
)
from services.common.remote_sources import SourceAllowList
from services.common.sources import resolve_roots

ROUTING_POLICIES = ("rank_aware", "round_robin")

#: ``max_new_tokens`` of a request that leaves it unset, unless configured or above the limit.
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of one gateway process.

    Attributes:
        host: Interface of the gRPC server (``PLORA_GATEWAY_HOST``).
        port: gRPC port; 0 = any free port (``PLORA_GATEWAY_PORT``).
        metrics_port: Prometheus port; 0 = any free port (``PLORA_GATEWAY_METRICS_PORT``).
        http_port: Port of the OpenAI-compatible HTTP API, on ``host``; 0 = any free port
            (``PLORA_GATEWAY_HTTP_PORT``; :mod:`services.gateway.openai_http`).
        http_max_body_bytes: Largest HTTP request body read; larger ones get 413
            (``PLORA_GATEWAY_HTTP_MAX_BODY_BYTES``).
        redis_url: Metadata store (``PLORA_REDIS_URL``).
        internal_token_file: File holding the internal token
            (``PLORA_INTERNAL_TOKEN_FILE``; :mod:`services.common.internal_auth`).
        internal_token: The internal token itself (``PLORA_INTERNAL_TOKEN``; the file wins);
            with neither, internal authentication is off. Never logged.
        predictor_address: ``host:port`` of the predictor; empty = none
            (``PLORA_PREDICTOR_ADDRESS``).
        routing: ``rank_aware`` (residency-, placement- and queue-aware) or ``round_robin``
            (the rank-oblivious baseline) (``PLORA_ROUTING``).
        max_new_tokens_limit: Largest ``max_new_tokens`` accepted (``PLORA_MAX_NEW_TOKENS_LIMIT``).
        default_max_new_tokens: Used when a request leaves it unset
            (``PLORA_DEFAULT_MAX_NEW_TOKENS``; unset: 64, or the limit when that is lower).
        event_queue_size: Bound of the queue of request events to the predictor; events beyond
            it are dropped and counted, never waited for.
        request_timeout_s: Deadline applied to a worker call when the client set none.
        worker_cache_s: How long the list of workers read from Redis is reused.
        adapter_cache_s: How long an adapter record read from Redis is reused.
        registry_stale_s: While Redis is unreachable, Generate goes on using the adapter
            records, worker list and placement read at most this many seconds before; 0 =
            fail every request at once (``PLORA_REGISTRY_STALE_S``).
        max_stop_strings: Most stop strings per request.
        adapter_roots: Directories adapter sources must lie under, every symlink followed
            (``--adapter-root``, repeatable; ``PLORA_ADAPTER_ROOTS``, ``os.pathsep``-separated);
            resolved to real paths; empty = sources are read wherever they are.
        adapter_source_allow: Prefixes of the remote sources (``s3://``, ``hf://``)
            RegisterAdapter may read (``--adapter-source-allow``, comma-separated and
            repeatable; ``PLORA_ADAPTER_SOURCE_ALLOW``), normalized; empty = every remote
            source refused (:class:`~services.common.remote_sources.SourceAllowList`).
        max_adapter_config_bytes: Largest ``adapter_config.json`` RegisterAdapter reads
            (``PLORA_MAX_ADAPTER_CONFIG_BYTES``).
        max_safetensors_header_bytes: Largest safetensors header it reads
            (``PLORA_MAX_SAFETENSORS_HEADER_BYTES``).
        max_lora_rank: Largest LoRA rank it registers (``PLORA_MAX_LORA_RANK``).
        max_concurrent_requests: Generate streams served at once; more are refused with
            RESOURCE_EXHAUSTED (``PLORA_MAX_CONCURRENT_REQUESTS``; default 256: the default
            worker's batch of 32 and queue of 256 over a few workers, while the gateway's thread
            pool, one thread per stream plus a reserve, stays a few hundred threads).
        max_concurrent_per_tenant: Generate streams of one ``tenant_id`` at once ("" counts as
            one tenant); 0 = no per-tenant bound (``PLORA_MAX_CONCURRENT_PER_TENANT``; default
            0: without API keys the tenant id is the caller's own claim, so the bound is only
            meaningful where keys decide the tenant, and the operator sizes it to the tenants).
        max_adapters_per_tenant: Adapters one ``tenant_id`` may have registered; registering a
            new id beyond it is refused, replacing one of its own is not; 0 = no bound
            (``PLORA_MAX_ADAPTERS_PER_TENANT``; default 0, for the same reason).
        ready_file: Where to write ``{"grpc_port", "metrics_port", "http_port"}`` once
            serving (launcher).
        api_keys_file: JSON or YAML file of the API keys' sha256 hashes and whom each key
            acts as (:class:`services.gateway.auth.KeyRing`); empty = no keys, every caller
            trusted (``PLORA_API_KEYS_FILE``).
        insecure_no_auth: Serve on a non-loopback address without API keys
            (``PLORA_INSECURE_NO_AUTH``).
        tls_cert: PEM certificate (chain) the gRPC server presents; empty = plaintext
            (``PLORA_TLS_CERT``).
        tls_key: PEM private key of ``tls_cert`` (``PLORA_TLS_KEY``).
        tls_client_ca: PEM CA bundle client certificates must chain to; set = mutual TLS,
            a client without a certificate is refused (``PLORA_TLS_CLIENT_CA``).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9100
    http_port: int = 8000
    http_max_body_bytes: int = 4 << 20
    redis_url: str = DEFAULT_REDIS_URL
    internal_token_file: str = ""
    internal_token: str = field(default="", repr=False)
    predictor_address: str = ""
    routing: str = "rank_aware"
    max_new_tokens_limit: int = 512
    default_max_new_tokens: int = 0  # 0 = min(DEFAULT_MAX_NEW_TOKENS, max_new_tokens_limit)
    event_queue_size: int = 10_000
    request_timeout_s: float = 600.0
    worker_cache_s: float = 0.25
    adapter_cache_s: float = 1.0
    registry_stale_s: float = 300.0
    max_stop_strings: int = 16
    adapter_roots: tuple[str, ...] = ()
    adapter_source_allow: tuple[str, ...] = ()
    max_adapter_config_bytes: int = MAX_CONFIG_BYTES
    max_safetensors_header_bytes: int = MAX_HEADER_BYTES
    max_lora_rank: int = MAX_LORA_RANK
    max_concurrent_requests: int = 256
    max_concurrent_per_tenant: int = 0
    max_adapters_per_tenant: int = 0
    ready_file: str = ""
    api_keys_file: str = ""
    insecure_no_auth: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapter_roots", resolve_roots(self.adapter_roots))
        object.__setattr__(
            self,
            "adapter_source_allow",
            SourceAllowList.parse(self.adapter_source_allow).prefixes,
        )
        require_server_ports("gateway", self.port, self.metrics_port)
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(
                "--http-port / PLORA_GATEWAY_HTTP_PORT must be a port 0..65535 (0 = any free "
                f"port), got {self.http_port}"
            )
        require_at_least_one(
            self.http_max_body_bytes, "--http-max-body-bytes", "PLORA_GATEWAY_HTTP_MAX_BODY_BYTES"
        )
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        require_at_least_one(
            self.max_new_tokens_limit, "--max-new-tokens-limit", "PLORA_MAX_NEW_TOKENS_LIMIT"
        )
        if self.default_max_new_tokens == 0:
            object.__setattr__(
                self,
                "default_max_new_tokens",
                min(DEFAULT_MAX_NEW_TOKENS, self.max_new_tokens_limit),
            )
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise ConfigError(
                f"--default-max-new-tokens / PLORA_DEFAULT_MAX_NEW_TOKENS must be in "
                f"1..{self.max_new_tokens_limit} (the max-new-tokens limit), "
                f"got {self.default_max_new_tokens}"
            )
        require_seconds(self.registry_stale_s, "", "PLORA_REGISTRY_STALE_S", zero_ok=True)
        require_seconds(self.request_timeout_s, "", "PLORA_REQUEST_TIMEOUT_S")
        if self.event_queue_size < 1:
            raise ConfigError("event_queue_size must be >= 1")
        require_at_least_one(
            self.max_concurrent_requests,
            "--max-concurrent-requests",
            "PLORA_MAX_CONCURRENT_REQUESTS",
        )
        for value, flag, env in (
            (
                self.max_concurrent_per_tenant,
                "--max-concurrent-per-tenant",
                "PLORA_MAX_CONCURRENT_PER_TENANT",
            ),
            (
                self.max_adapters_per_tenant,
                "--max-adapters-per-tenant",
                "PLORA_MAX_ADAPTERS_PER_TENANT",
            ),
        ):
            if value < 0:
                raise ConfigError(f"{flag} / {env} must be >= 0 (0 = no bound), got {value}")
        require_inspection_sizes(self.max_adapter_config_bytes, self.max_safetensors_header_bytes)
        require_at_least_one(self.max_lora_rank, "--max-lora-rank", "PLORA_MAX_LORA_RANK")

    @property
    def inspection_limits(self) -> InspectionLimits:
        """The bounds RegisterAdapter reads an adapter within."""
        return InspectionLimits(
            max_config_bytes=self.max_adapter_config_bytes,
            max_header_bytes=self.max_safetensors_header_bytes,
            max_lora_rank=self.max_lora_rank,
        )

    def check_security(self) -> None:
        """Refuse an unsafe or incomplete security setting; the gateway calls it before it
        binds, ``plora up`` before anything starts.

        The rules: a certificate needs its key and a key its certificate; a client CA
        (mutual TLS) needs a certificate; a gateway reachable from other hosts (``host`` not
        loopback) needs API keys unless ``insecure_no_auth`` says it knowingly serves
        without them, as anyone who reaches it then acts as any tenant.

        Raises:
            ConfigError: a rule is broken; the message names the flags that fix it.
        """
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                "--tls-cert / PLORA_TLS_CERT and --tls-key / PLORA_TLS_KEY go together: give "
                "both the server certificate and its private key (PEM files), or neither"
            )
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError(
                "--tls-client-ca / PLORA_TLS_CLIENT_CA (mutual TLS) needs TLS: give "
                "--tls-cert and --tls-key too"
            )
        if not self.api_keys_file and not self.insecure_no_auth and not is_loopback(self.host):
            raise ConfigError(
                f"the gateway binds {self.host!r}, reachable from other hosts, without API "
                "keys: anyone who reaches it could act as any tenant. Give --api-keys-file / "
                "PLORA_API_KEYS_FILE (see docs/security.md), or pass --insecure-no-auth / "
                "PLORA_INSECURE_NO_AUTH=1 to serve without authentication knowingly"
            )

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the gateway's flags (defaults None: the env fallback applies).

        Each help ends ``(env PLORA_X; default D)``, D being the field default above
        (tests/unit/test_config.py checks both against ``from_args`` and the dataclass).
        """
        add_server_arguments(parser, "gateway", GatewayConfig.port, GatewayConfig.metrics_port)
        parser.add_argument(
            "--http-port",
            type=port_number,
            help="port of the OpenAI-compatible HTTP API (/v1/...), 0 = any free port "
            "(env PLORA_GATEWAY_HTTP_PORT; default 8000)",
        )
        parser.add_argument(
            "--http-max-body-bytes",
            help="largest HTTP request body read, e.g. 4MiB; larger ones get 413 "
            "(env PLORA_GATEWAY_HTTP_MAX_BODY_BYTES; default 4MiB)",
        )
        parser.add_argument(
            "--predictor-address",
            help="host:port of the predictor that gets the request events; empty = none "
            "(env PLORA_PREDICTOR_ADDRESS; default none)",
        )
        parser.add_argument(
            "--routing",
            choices=ROUTING_POLICIES,
            help="rank_aware (residency-, placement- and queue-aware) or round_robin, the "
            "baseline (env PLORA_ROUTING; default rank_aware)",
        )
        parser.add_argument(
            "--max-new-tokens-limit",
            type=int,
            help="largest max_new_tokens accepted (env PLORA_MAX_NEW_TOKENS_LIMIT; default 512)",
        )
        parser.add_argument(
            "--default-max-new-tokens",
            type=int,
            help="max_new_tokens of a request that leaves it unset "
            "(env PLORA_DEFAULT_MAX_NEW_TOKENS; default 64, or the limit if lower)",
        )
        add_adapter_root_argument(parser)
        add_adapter_source_allow_argument(parser)
        parser.add_argument(
            "--max-adapter-config-bytes",
            help="largest adapter_config.json RegisterAdapter reads, e.g. 1MiB "
            "(env PLORA_MAX_ADAPTER_CONFIG_BYTES; default 1MiB)",
        )
        parser.add_argument(
            "--max-safetensors-header-bytes",
            help="largest safetensors header RegisterAdapter reads, e.g. 16MiB "
            "(env PLORA_MAX_SAFETENSORS_HEADER_BYTES; default 16MiB)",
        )
        parser.add_argument(
            "--max-lora-rank",
            type=int,
            help="largest LoRA rank (r and rank_pattern values) RegisterAdapter accepts "
            "(env PLORA_MAX_LORA_RANK; default 256)",
        )
        parser.add_argument(
            "--api-keys-file",
            metavar="FILE",
            help="JSON or YAML file of API key hashes, {keys: [{sha256, tenant | operator: "
            "true}]}: every call but health needs 'authorization: Bearer <key>' and acts as "
            "its key's tenant (env PLORA_API_KEYS_FILE; default none)",
        )
        parser.add_argument(
            "--insecure-no-auth",
            action="store_true",
            default=None,
            help="serve on a non-loopback --host without API keys; anyone who reaches the "
            "gateway acts as any tenant (env PLORA_INSECURE_NO_AUTH; default off)",
        )
        parser.add_argument(
            "--tls-cert",
            metavar="PEM",
            help="certificate (chain) the gRPC server presents; with --tls-key, clients must "
            "use TLS (env PLORA_TLS_CERT; default none)",
        )
        parser.add_argument(
            "--tls-key",
            metavar="PEM",
            help="private key of --tls-cert (env PLORA_TLS_KEY; default none)",
        )
        parser.add_argument(
            "--tls-client-ca",
            metavar="PEM",
            help="CA bundle client certificates must chain to: mutual TLS, a client without "
            "one is refused (env PLORA_TLS_CLIENT_CA; default none)",
        )
        parser.add_argument(
            "--max-concurrent-requests",
            type=int,
            help="Generate streams served at once; more get RESOURCE_EXHAUSTED at once "
            "(env PLORA_MAX_CONCURRENT_REQUESTS; default 256)",
        )
        parser.add_argument(
            "--max-concurrent-per-tenant",
            type=int,
            help="Generate streams of one tenant_id at once; 0 = no per-tenant bound "
            "(env PLORA_MAX_CONCURRENT_PER_TENANT; default 0)",
        )
        parser.add_argument(
            "--max-adapters-per-tenant",
            type=int,
            help="adapters one tenant_id may register; 0 = no bound "
            "(env PLORA_MAX_ADAPTERS_PER_TENANT; default 0)",
        )
        parser.add_argument(
            "--ready-file",
            help="write {grpc_port, metrics_port, http_port} as JSON here once serving, for "
            "the launcher "
            "(no env variable; default none)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        """Flags first, then ``PLORA_*`` environment variables, then defaults."""
        d = cls()

        return cls(
            host=args.host or env_or("PLORA_GATEWAY_HOST", d.host) or d.host,
            port=int_flag_or_env(args.port, "PLORA_GATEWAY_PORT", d.port),
            metrics_port=int_flag_or_env(
                args.metrics_port, "PLORA_GATEWAY_METRICS_PORT", d.metrics_port
            ),
            http_port=int_flag_or_env(args.http_port, "PLORA_GATEWAY_HTTP_PORT", d.http_port),
            http_max_body_bytes=bytes_flag_or_env(
                args.http_max_body_bytes,
                "--http-max-body-bytes",
                "PLORA_GATEWAY_HTTP_MAX_BODY_BYTES",
                d.http_max_body_bytes,
            ),
            redis_url=args.redis_url or env_or("PLORA_REDIS_URL", d.redis_url) or d.redis_url,
            internal_token_file=args.internal_token_file
            or env_or("PLORA_INTERNAL_TOKEN_FILE", "")
            or "",
            internal_token=env_or("PLORA_INTERNAL_TOKEN", "") or "",
            predictor_address=args.predictor_address
            if args.predictor_address is not None
            else env_or("PLORA_PREDICTOR_ADDRESS", "") or "",
            routing=choice_or_env(
                args.routing, "--routing", "PLORA_ROUTING", d.routing, ROUTING_POLICIES
            ),
            max_new_tokens_limit=int_flag_or_env(
                args.max_new_tokens_limit, "PLORA_MAX_NEW_TOKENS_LIMIT", d.max_new_tokens_limit
            ),
            default_max_new_tokens=int_flag_or_env(
                args.default_max_new_tokens, "PLORA_DEFAULT_MAX_NEW_TOKENS", 0
            ),
            request_timeout_s=env_float("PLORA_REQUEST_TIMEOUT_S", d.request_timeout_s),
            registry_stale_s=env_float("PLORA_REGISTRY_STALE_S", d.registry_stale_s),
            adapter_roots=adapter_roots_or_env(args.adapter_roots, "PLORA_ADAPTER_ROOTS"),
            adapter_source_allow=source_allow_or_env(
                args.adapter_source_allow, "PLORA_ADAPTER_SOURCE_ALLOW"
            ),
            **inspection_size_limits(args),
            max_lora_rank=int_flag_or_env(
                args.max_lora_rank, "PLORA_MAX_LORA_RANK", d.max_lora_rank
            ),
            max_concurrent_requests=int_flag_or_env(
                args.max_concurrent_requests,
                "PLORA_MAX_CONCURRENT_REQUESTS",
                d.max_concurrent_requests,
            ),
            max_concurrent_per_tenant=int_flag_or_env(
                args.max_concurrent_per_tenant,
                "PLORA_MAX_CONCURRENT_PER_TENANT",
                d.max_concurrent_per_tenant,
            ),
            max_adapters_per_tenant=int_flag_or_env(
                args.max_adapters_per_tenant,
                "PLORA_MAX_ADAPTERS_PER_TENANT",
                d.max_adapters_per_tenant,
            ),
            ready_file=args.ready_file or "",
            api_keys_file=args.api_keys_file or env_or("PLORA_API_KEYS_FILE", "") or "",
            insecure_no_auth=args.insecure_no_auth
            or env_bool("PLORA_INSECURE_NO_AUTH", "--insecure-no-auth", False),
            tls_cert=args.tls_cert or env_or("PLORA_TLS_CERT", "") or "",
            tls_key=args.tls_key or env_or("PLORA_TLS_KEY", "") or "",
            tls_client_ca=args.tls_client_ca or env_or("PLORA_TLS_CLIENT_CA", "") or "",
        )


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only: ``localhost`` or a loopback
    address (``127.0.0.0/8``, ``::1``). Any other name counts as reachable from elsewhere,
    as does ``0.0.0.0`` / ``::`` (every interface)."""
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
