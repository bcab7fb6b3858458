"""The worker's Prometheus metrics (one registry per worker instance)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS, service_registry
from services.worker.cold import COLD_CAUSES
from services.worker.store_types import EVICTION_REASONS, LOAD_TIERS

#: Decode inter-token latency buckets (seconds): GPU steps are 10-50 ms, CPU ones 50-500 ms.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class WorkerMetrics:
    """Every series the worker exports; names ``plora_worker_*``."""

    def __init__(self) -> None:
        self.registry = service_registry()
        r = self.registry
        self.requests = Counter(
            "plora_worker_requests",
            "Generate requests finished, by gRPC status code",
            ["code"],
            registry=r,
        )
        self.ttft = Histogram(
            "plora_worker_ttft_seconds",
            "Worker receipt to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "plora_worker_time_per_output_token_seconds",
            "Mean time between a request's output tokens after its first (decode), one "
            "observation per finished request of 2+ tokens",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.service_estimate = Gauge(
            "plora_worker_service_estimate_seconds",
            "This worker's service figures: prefill (a request's share of the steps until "
            "its first token) and cold_wait (a cold request's adapter wait), which it "
            "publishes with its heartbeat for routing, and decode_row (what one more "
            "decoding sequence adds to a step); 0 until measured",
            ["figure"],
            registry=r,
        )
        self.tokens = Counter(
            "plora_worker_generated_tokens", "Completion tokens generated", registry=r
        )
        self.prompt_tokens = Counter(
            "plora_worker_prompt_tokens", "Prompt tokens prefilled", registry=r
        )
        self.queue_length = Gauge(
            "plora_worker_queue_length", "Requests waiting to join the running batch", registry=r
        )
        self.running = Gauge(
            "plora_worker_running_requests", "Requests in the running batch", registry=r
        )
        self.kv_cache_tokens = Gauge(
            "plora_worker_kv_cache_tokens",
            "KV cache positions: total, and held by running sequences (paged: blocks taken "
            "or reserved; slot: whole slots)",
            ["state"],
            registry=r,
        )
        self.cold_starts = Counter(
            "plora_worker_cold_starts",
            "Requests whose adapter was not resident when scheduled, by cause "
            "(services/worker/cold.py: prefetch_late, first_use, evicted_recency, "
            "evicted_forecast, evicted_for_prefetch, unloaded)",
            ["cause"],
            registry=r,
        )
        for cause in COLD_CAUSES:
            self.cold_starts.labels(cause=cause)
        self.cold_start_wait = Histogram(
            "plora_worker_cold_start_wait_seconds",
            "Time a cold request waited for its adapter",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.resident = Gauge(
            "plora_worker_resident_adapters", "Adapters resident in the device pool", registry=r
        )
        self.heartbeat_age = Gauge(
            "plora_worker_heartbeat_age_seconds",
            "Seconds since the last successful heartbeat",
            registry=r,
        )
        self.engine_stalled = Gauge(
            "plora_worker_engine_stalled_seconds",
            "Seconds the engine's step loop has gone without progress while it had requests "
            "(0 when idle or stepping; past --stall-timeout-s the worker exits to be restarted)",
            registry=r,
        )
        self.heartbeat_failures = Counter(
            "plora_worker_heartbeat_failures", "Heartbeats that could not reach Redis", registry=r
        )
        self.prefetch_requests = Counter(
            "plora_worker_prefetch_requests",
            "PrefetchAdapters items by outcome",
            ["outcome"],
            registry=r,
        )
        # Pool gauges (definitions in docs/metrics.md), refreshed every heartbeat.
        self.pool_pages = Gauge(
            "plora_worker_pool_pages", "Device pool pages by state", ["state"], registry=r
        )
        self.pool_bytes = Gauge(
            "plora_worker_pool_bytes",
            "Device pool bytes by kind (total, live; room: what a load could take now without "
            "waiting, free plus unleased resident adapters)",
            ["kind"],
            registry=r,
        )
        self.loads_waiting_for_room = Gauge(
            "plora_worker_adapter_loads_waiting_for_room",
            "Demand loads parked because every resident adapter is leased",
            registry=r,
        )
        self.pool_utilization = Gauge(
            "plora_worker_pool_utilization_ratio", "Live adapter bytes / pool bytes", registry=r
        )
        self.pool_utilization_pressure = Gauge(
            "plora_worker_pool_utilization_under_pressure_ratio",
            "Pool utilization sampled while a load waited or an eviction happened",
            registry=r,
        )
        self.pool_fragmentation = Gauge(
            "plora_worker_pool_external_fragmentation_ratio",
            "1 - largest allocatable extent / free bytes (paged: after compaction around "
            "adapters in use, or split over free runs between tensors)",
            registry=r,
        )
        self.pool_free_run_fragmentation = Gauge(
            "plora_worker_pool_free_run_fragmentation_ratio",
            "1 - largest free run as it stands / free bytes",
            registry=r,
        )
        self.pool_extents = Gauge(
            "plora_worker_pool_extents_per_adapter",
            "Mean page runs per adapter allocation in the pool (1 unless split)",
            registry=r,
        )
        self.pool_internal_waste = Gauge(
            "plora_worker_pool_internal_waste_ratio",
            "(allocated - live) / allocated bytes",
            registry=r,
        )
        self.loads = Counter(
            "plora_worker_adapter_loads",
            "Adapter loads by the tier they came from",
            ["tier"],
            registry=r,
        )
        self.load_latency = Histogram(
            "plora_worker_adapter_load_seconds",
            "Adapter load latency by source tier",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        for tier in LOAD_TIERS:  # at 0 from the start: a query sees no gap before the first
            self.loads.labels(tier)
            self.load_latency.labels(tier)
        self.host_stages = Counter(
            "plora_worker_host_stages",
            "Adapters read from the source tier into the host cache ahead of demand",
            registry=r,
        )
        self.host_stage_latency = Histogram(
            "plora_worker_host_stage_seconds",
            "Source read + check + pack time of one host staging read",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.host_stage_failures = Counter(
            "plora_worker_host_stage_failures",
            "Host staging reads that failed (a missing, changed or broken source; that version "
            "is not staged again for 5 minutes)",
            registry=r,
        )
        self.source_refused = Counter(
            "plora_worker_adapter_source_refused",
            "Adapter source reads refused because the registered source is not under the "
            "worker's adapter roots (--adapter-root), or a file in it resolves outside them or "
            "cannot be opened there, or a remote source is not under --adapter-source-allow (a "
            "registry record pointing elsewhere)",
            registry=r,
        )
        self.download_bytes = Counter(
            "plora_worker_adapter_download_bytes",
            "Bytes downloaded from s3:// and hf:// adapter sources into the adapter cache",
            registry=r,
        )
        self.download_seconds = Histogram(
            "plora_worker_adapter_download_seconds",
            "Time of one verified download of a remote adapter into the adapter cache "
            "(both files, sha256 checked)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.download_failures = Counter(
            "plora_worker_adapter_download_failures",
            "Remote adapter downloads that failed and were discarded, by reason (missing, "
            "checksum, too_large, invalid, unreachable, truncated, error)",
            ["reason"],
            registry=r,
        )
        self.adapter_cache_hits = Counter(
            "plora_worker_adapter_cache_hits",
            "Loads of a remote adapter found in the node-local adapter cache",
            registry=r,
        )
        self.adapter_cache_misses = Counter(
            "plora_worker_adapter_cache_misses",
            "Loads of a remote adapter not in the adapter cache (downloaded, or waiting for "
            "the download in flight)",
            registry=r,
        )
        self.adapter_cache_bytes = Gauge(
            "plora_worker_adapter_cache_bytes",
            "Bytes of the adapters held in the node-local adapter cache",
            registry=r,
        )
        self.adapter_cache_evictions = Counter(
            "plora_worker_adapter_cache_evictions",
            "Adapters removed from the node-local adapter cache to make room (least recently "
            "used first)",
            registry=r,
        )
        self.load_failures = Counter(
            "plora_worker_adapter_load_failures",
            "Adapter loads into the device pool that failed, by error (AdapterSourceError: "
            "files gone or changed; PoolExhaustedError: no room in time; ...)",
            ["reason"],
            registry=r,
        )
        self.host_stages_queued = Gauge(
            "plora_worker_host_stages_queued",
            "Host staging reads queued for the staging thread",
            registry=r,
        )
        self.host_cache_bytes = Gauge(
            "plora_worker_host_cache_bytes",
            "Host adapter cache bytes by kind (total: its bound; used)",
            ["kind"],
            registry=r,
        )
        self.evictions = Counter(
            "plora_worker_adapter_evictions",
            "Adapters evicted from the device pool, by reason",
            ["reason"],
            registry=r,
        )
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason)
        self.compactions = Counter("plora_worker_pool_compactions", "Pool compactions", registry=r)
        self.bytes_moved = Counter(
            "plora_worker_pool_compaction_moved_bytes", "Bytes moved by compaction", registry=r
        )
        self.split_allocations = Counter(
            "plora_worker_pool_split_allocations",
            "Adapter allocations spread over several page runs (each tensor kept whole)",
            registry=r,
        )
        self.prefetches = Counter(
            "plora_worker_prefetches",
            "Prefetched adapters by fate (issued, used, wasted, ignored)",
            ["fate"],
            registry=r,
        )
        self.internal_auth_refused = Counter(
            "plora_worker_internal_auth_refused",
            "Calls refused for a missing or wrong internal token, by method",
            ["method"],
            registry=r,
        )
