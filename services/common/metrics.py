"""Prometheus helpers shared by the services' own ``metrics.py`` modules.

Each service instance owns a ``CollectorRegistry`` (so several services can run in one test
process) and serves it over HTTP. Names follow ``plora_<service>_<what>_<unit>`` with base units;
counters are declared without ``_total`` (the client library appends it).
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

logger = logging.getLogger(__name__)

# No ``*_created`` series beside every counter and histogram: the metric tables in docs/metrics.md
# list what is exported, and a start timestamp per series doubles what Prometheus stores for
# nothing PromQL's rate() needs.
disable_created_metrics()

#: TTFT / latency buckets in seconds: from 5 ms (warm GPU) to 2 min (cold CPU with queueing).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


def service_registry() -> CollectorRegistry:
    """A new registry for one service instance, with the client library's standard process
    series (``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
    ``process_open_fds``, ...; Linux ``/proc``), ``python_info`` and ``python_gc_*``, as the
    library's default registry has them: operators compare a service's CPU and memory with
    its work, and the replay bench reads each service's CPU seconds from them."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    if GC_COLLECTOR is not None:
        GCCollector(registry=registry)
    return registry


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[WSGIServer, int]:
    """Serve ``registry`` as Prometheus text on ``http://host:port/metrics``.

    Args:
        registry: The service instance's registry.
        host: Interface to bind.
        port: TCP port; 0 picks a free one.

    Returns:
        ``(server, bound_port)``; call ``server.shutdown()`` to stop.
    """
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    logger.info("metrics at http://%s:%d/metrics", host, bound)
    return server, bound
