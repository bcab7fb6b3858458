"""The README's Metrics tables against the services' Prometheus registries.

Every series a service exports (its own, not the client library's process/platform/GC ones) has
a row in the README with its exposed name (counters with ``_total``), its type and exactly its
label names; and the README names no ``plora_*`` series that no service exports.
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


def _section() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(r"^## Metrics\n(.*?)^## ", text, re.S | re.M)
    assert match, "README.md has no `## Metrics` section followed by another section"
    return match.group(1)


def _rows() -> dict[str, tuple[str, set[str]]]:
    """``name -> (type, label names)`` from the section's table rows."""
    rows = {}
    for line in _section().splitlines():
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
    assert name in rows, f"README's Metrics section has no row for `{name}`"
    assert rows[name] == _exported()[name], f"README row of `{name}` (type, labels)"


def test_the_readme_names_no_series_that_is_not_exported() -> None:
    named = set(re.findall(r"`(plora_[a-z0-9_]+)`", _section()))
    stale = named - set(_exported())
    assert not stale, f"README names series no service exports: {sorted(stale)}"


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
    """Failed loads and staging reads were only logged (new-user trial 20): an operator's
    dashboard had no series for them. The worker counts the store's events."""
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
