"""The gateway's Prometheus metrics (one registry per gateway instance)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS, service_registry
from services.gateway.admission import MAX_CONCURRENT_REGISTRATIONS, REJECT_REASONS


class GatewayMetrics:
    """Every series the gateway exports; names ``plora_gateway_*``."""

    def __init__(self) -> None:
        self.registry = service_registry()
        r = self.registry
        self.requests = Counter(
            "plora_gateway_requests",
            "Generate requests finished, by gRPC status code",
            ["code"],
            registry=r,
        )
        self.ttft = Histogram(
            "plora_gateway_ttft_seconds",
            "Gateway receipt to first token sent to the client (every stream that got one)",
            ["adapter_cold"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "plora_gateway_request_duration_seconds",
            "Gateway receipt to last token sent (streams that finished)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "plora_gateway_generated_tokens", "Completion tokens relayed to clients", registry=r
        )
        self.rejected = Counter(
            "plora_gateway_requests_rejected",
            "Calls refused at once by admission control, by the bound they met: Generate "
            "streams beyond --max-concurrent-requests or --max-concurrent-per-tenant, "
            "registrations beyond --max-adapters-per-tenant or while "
            f"{MAX_CONCURRENT_REGISTRATIONS} are in progress",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:  # 0 until the first refusal, not absent
            self.rejected.labels(reason)
        self.in_flight = Gauge(
            "plora_gateway_requests_in_flight", "Generate requests being served", registry=r
        )
        self.retries = Counter(
            "plora_gateway_retries",
            "Requests sent to a worker again before their first token (another worker after one "
            "failed, or the adapter's newer version after a worker refused the old one)",
            registry=r,
        )
        self.http_requests = Counter(
            "plora_gateway_http_requests",
            "Requests answered by the OpenAI-compatible HTTP door, by route and HTTP status "
            "(generations are counted in plora_gateway_requests_total too, with either door's)",
            ["route", "code"],
            registry=r,
        )
        self.unauthenticated = Counter(
            "plora_gateway_unauthenticated",
            "Calls refused UNAUTHENTICATED: no API key, or one not in the keys file "
            "(only with --api-keys-file)",
            registry=r,
        )
        self.stale_reads = Counter(
            "plora_gateway_registry_stale_reads",
            "Registry records served from the gateway's cache because Redis was unreachable",
            ["record"],
            registry=r,
        )
        for record in ("adapter", "workers", "placement"):  # 0 until an outage, not absent
            self.stale_reads.labels(record)
        self.routed = Counter(
            "plora_gateway_routed",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.events_sent = Counter(
            "plora_gateway_predictor_events_sent",
            "Request events sent to the predictor",
            registry=r,
        )
        self.events_dropped = Counter(
            "plora_gateway_predictor_events_dropped",
            "Request events dropped because the predictor was slow or down",
            registry=r,
        )
        self.predictor_connected = Gauge(
            "plora_gateway_predictor_connected", "1 while the event stream is connected", registry=r
        )
        self.workers_healthy = Gauge(
            "plora_gateway_workers_healthy", "Workers with a live heartbeat", registry=r
        )
        self.worker_down = Counter(
            "plora_gateway_worker_down",
            "Times each worker was seen going from healthy to down (its liveness key expired: "
            "killed, frozen, stopped); a restart faster than the 5 s liveness TTL shows in the "
            "worker's own process_start_time_seconds instead",
            ["worker"],
            registry=r,
        )
        self.heartbeat_age = Gauge(
            "plora_gateway_worker_heartbeat_age_seconds",
            "Age of each worker's last heartbeat",
            ["worker"],
            registry=r,
        )
        self.worker_queue = Gauge(
            "plora_gateway_worker_queue_length",
            "Each worker's reported queue length",
            ["worker"],
            registry=r,
        )
        self.worker_pending = Gauge(
            "plora_gateway_worker_pending_requests",
            "Requests this gateway sent to each worker that have not had their first token yet "
            "(what rank-aware routing balances first)",
            ["worker"],
            registry=r,
        )
        self.resident = Gauge(
            "plora_gateway_worker_resident_adapters",
            "Adapters resident on each worker (0 while it is not healthy)",
            ["worker"],
            registry=r,
        )
