"""Gateway configuration: one frozen dataclass built from flags with ``PLORA_*`` fallbacks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.common.config import (
    DEFAULT_REDIS_URL,
    add_server_arguments,
    choice_or_env,
    env_float,
    env_or,
    int_flag_or_env,
    require_at_least_one,
    require_seconds,
    require_server_ports,
)
from services.common.errors import ConfigError

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
        ready_file: Where to write ``{"grpc_port", "metrics_port"}`` once serving (launcher).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9100
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
    ready_file: str = ""

    def __post_init__(self) -> None:
        require_server_ports("gateway", self.port, self.metrics_port)
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

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the gateway's flags (defaults None: the env fallback applies).

        Each help ends ``(env PLORA_X; default D)``, D being the field default above
        (tests/unit/test_config.py checks both against ``from_args`` and the dataclass).
        """
        add_server_arguments(parser, "gateway", GatewayConfig.port, GatewayConfig.metrics_port)
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
        parser.add_argument(
            "--ready-file",
            help="write {grpc_port, metrics_port} as JSON here once serving, for the launcher "
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
            ready_file=args.ready_file or "",
        )
