"""Conversions between registry records, engine types and ``plora.v1`` messages."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from plora.v1 import gateway_pb2
from services.common.registry import AdapterRecord, WorkerRecord


def adapter_info(record: AdapterRecord, with_source: bool = True) -> gateway_pb2.AdapterInfo:
    """``AdapterRecord`` -> ``plora.v1.AdapterInfo``; without ``source`` (the server's path)
    unless ``with_source``: a tenant's caller never sees where the server keeps files."""
    info = gateway_pb2.AdapterInfo(**asdict(record))
    if not with_source:
        info.ClearField("source")
    return info


def adapter_record(info: gateway_pb2.AdapterInfo) -> AdapterRecord:
    """``plora.v1.AdapterInfo`` -> ``AdapterRecord``."""
    return AdapterRecord(
        adapter_id=info.adapter_id,
        source=info.source,
        tenant_id=info.tenant_id,
        rank=info.rank,
        alpha=info.alpha,
        target_modules=list(info.target_modules),
        size_bytes=info.size_bytes,
        sha256=info.sha256,
        version=info.version,
        use_rslora=info.use_rslora,
        created_unix_ms=info.created_unix_ms,
        num_modules=info.num_modules,
    )


def pool_stats(pool: dict[str, Any]) -> gateway_pb2.PoolStats:
    """A worker's pool-stats dict (heartbeat JSON) -> ``plora.v1.PoolStats``; drops other keys."""
    fields = gateway_pb2.PoolStats.DESCRIPTOR.fields_by_name
    return gateway_pb2.PoolStats(**{k: v for k, v in pool.items() if k in fields})


def worker_status(record: WorkerRecord, with_addresses: bool = True) -> gateway_pb2.WorkerStatus:
    """``WorkerRecord`` -> ``plora.v1.WorkerStatus``; without the worker's gRPC address and
    metrics URL (the internal plane) unless ``with_addresses``."""
    return gateway_pb2.WorkerStatus(
        worker_id=record.worker_id,
        address=record.address if with_addresses else "",
        healthy=record.healthy,
        heartbeat_age_seconds=record.heartbeat_age_seconds,
        queue_length=record.queue_length,
        running=record.running,
        resident_adapters=sorted(record.resident),
        pool=pool_stats(record.pool),
        device=record.device,
        metrics_url=record.metrics_url if with_addresses else "",
    )
