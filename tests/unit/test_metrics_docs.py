"""The metrics tables of docs/metrics.md against the services' Prometheus registries.

Every series a service exports (its own, not the client library's process/platform/GC ones) has
a row in docs/metrics.md with its exposed name (counters with ``_total``), its type and exactly
its label names; and no page of the documentation (README.md, docs/*.md) names a ``plora_*``
series that no service exports.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import Counter

from services.gateway.metrics import GatewayMetrics
from services.predictor.metrics import PredictorMetrics
from services.worker.metrics import WorkerMetrics

REPO = Path(__file__).resolve().parents[2]
SERVICES = {"gateway": GatewayMetrics, "worker": WorkerMetrics, "predictor": PredictorMetrics}


METRICS_DOC = REPO / "docs" / "metrics.md"
#: Every page of the documentation, where a series may be named.
DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _tables() -> str:
    text = METRICS_DOC.read_text()
    assert re.search(r"^# Metrics\n", text, re.M), "docs/metrics.md has no `# Metrics` title"
    return text


def _rows() -> dict[str, tuple[str, set[str]]]:
    """``name -> (type, label names)`` from the table rows of docs/metrics.md."""
    rows = {}
    for line in _tables().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (m := re.fullmatch(r"`(plora_\w+)`", cells[0])):
            rows[m.group(1)] = (cells[1], set(re.findall(r"`(\w+)` =", cells[2])))
    return rows


def _exported() -> dict[str, tuple[str, set[str]]]:
    out = {}
    for cls in SERVICES.values():
        registry = cls().registry
        for collector in list(registry._collector_to_names):  # noqa: SLF001 - the registry's own list
            name = getattr(collector, "_name", None)
            if not name or not name.startswith("plora_"):
                continue  # process, platform and GC collectors
            kind = type(collector).__name__.lower()
            exposed = f"{name}_total" if isinstance(collector, Counter) else name
            out[exposed] = (kind, set(collector._labelnames))  # noqa: SLF001
    return out


@pytest.mark.parametrize("name", sorted(_exported()))
def test_every_series_is_documented_with_its_type_and_labels(name: str) -> None:
    rows = _rows()
    assert name in rows, f"docs/metrics.md has no row for `{name}`"
    assert rows[name] == _exported()[name], f"docs/metrics.md row of `{name}` (type, labels)"


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_docs_name_no_series_that_is_not_exported(page: Path) -> None:
    named = set(re.findall(r"`(plora_[a-z0-9_]+)`", page.read_text()))
    stale = named - set(_exported())
    assert not stale, f"{page.relative_to(REPO)} names series no service exports: {sorted(stale)}"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_no_created_series_beside_the_documented_ones(service: str) -> None:
    """A new user found a ``*_created`` series beside every counter and histogram, in no
    table; they are switched off (``disable_created_metrics``), so a scrape holds only the
    documented names (and the client library's process/GC ones)."""
    from prometheus_client import generate_latest  # noqa: PLC0415

    text = generate_latest(SERVICES[service]().registry).decode()
    assert "plora_" in text
    assert "_created" not in text


def test_store_failures_reach_the_worker_counters() -> None:
    """Failed loads and staging reads are counted, not only logged: an operator's dashboard
    needs a series for them. The worker counts the store's events."""
    from types import SimpleNamespace

    from services.worker.server import WorkerService
    from services.worker.store import StoreEvent

    metrics = WorkerMetrics()
    worker = SimpleNamespace(metrics=metrics)
    for event in (
        StoreEvent("load_failed", "a", 1, reason="AdapterSourceError"),
        StoreEvent("load_failed", "b", 1, reason="PoolExhaustedError"),
        StoreEvent("load_failed", "a", 2, reason="AdapterSourceError"),
        StoreEvent("host_stage_failed", "c", 1),
    ):
        WorkerService._on_store_event(worker, event)  # type: ignore[arg-type]
    value = metrics.registry.get_sample_value
    assert value("plora_worker_adapter_load_failures_total", {"reason": "AdapterSourceError"}) == 2
    assert value("plora_worker_adapter_load_failures_total", {"reason": "PoolExhaustedError"}) == 1
    assert value("plora_worker_host_stage_failures_total") == 1


def test_series_of_known_label_values_are_exported_at_zero_from_the_start() -> None:
    """A worker that has not yet evicted, loaded or had a cold start still exports every
    eviction reason, load tier and cold cause at 0: a rate or an alert over them has a series
    from the first scrape, not a gap until the first event."""
    from services.worker.cold import COLD_CAUSES
    from services.worker.store_types import EVICTION_REASONS, LOAD_TIERS

    value = WorkerMetrics().registry.get_sample_value
    for reason in EVICTION_REASONS:
        assert value("plora_worker_adapter_evictions_total", {"reason": reason}) == 0
    for tier in LOAD_TIERS:
        assert value("plora_worker_adapter_loads_total", {"tier": tier}) == 0
        assert value("plora_worker_adapter_load_seconds_count", {"tier": tier}) == 0
    for cause in COLD_CAUSES:
        assert value("plora_worker_cold_starts_total", {"cause": cause}) == 0
