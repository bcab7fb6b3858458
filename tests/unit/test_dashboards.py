"""The Grafana dashboard (deploy/grafana/plora.json) and the alert rules
(deploy/prometheus/alerts.yml) against the metrics the services register.

Every series a query names is one a service exports (read from the services' own Prometheus
registries: a counter as ``_total``, a histogram as ``_bucket`` / ``_sum`` / ``_count``), every
label a query matches, groups by or prints in a legend is one of that series' labels or a
target label Prometheus adds, the dashboard covers what operators asked for, docker-compose.yml
provisions both, and where ``promtool`` is installed it parses every query and the rules
fire as intended on synthetic series (``promtool test rules``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram

from services.gateway.metrics import GatewayMetrics
from services.predictor.metrics import PredictorMetrics
from services.worker.metrics import WorkerMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = REPO / "deploy" / "grafana" / "plora.json"
ALERTS_PATH = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = json.loads(DASHBOARD_PATH.read_text())
ALERTS = yaml.safe_load(ALERTS_PATH.read_text())
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
PROMETHEUS = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())

#: Labels Prometheus attaches to every scraped series (``job``, ``instance``) or that a
#: Kubernetes scrape config commonly adds from the pod.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service"}
#: Series Prometheus makes itself for each target.
SYNTHETIC = {"up": set(), "scrape_duration_seconds": set(), "scrape_samples_scraped": set()}
#: PromQL words that are not series names.
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}


def _exported() -> dict[str, set[str]]:
    """Every series name the services expose -> its label names."""
    out: dict[str, set[str]] = dict(SYNTHETIC)
    for cls in (GatewayMetrics, WorkerMetrics, PredictorMetrics):
        registry = cls().registry
        for collector in list(registry._collector_to_names):  # noqa: SLF001 - the registry's list
            name = getattr(collector, "_name", None)
            if name is None:  # process, platform and GC collectors: their samples as exposed
                for family in collector.collect():
                    for sample in family.samples:
                        out.setdefault(sample.name, set()).update(sample.labels)
                continue
            labels = set(collector._labelnames)  # noqa: SLF001
            if isinstance(collector, Counter):
                out[f"{name}_total"] = labels
            elif isinstance(collector, Gauge):
                out[name] = labels
            elif isinstance(collector, Histogram):
                out[f"{name}_bucket"] = labels | {"le"}
                out[f"{name}_sum"] = labels
                out[f"{name}_count"] = labels
            else:
                raise AssertionError(f"{name}: a {type(collector).__name__} this test cannot map")
    return out


EXPORTED = _exported()


def _dashboard_panels() -> list[dict[str, Any]]:
    panels = []
    for panel in DASHBOARD["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return panels


def _dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, expression, legend) of every dashboard query."""
    return [
        (panel["title"], target["expr"], target.get("legendFormat", ""))
        for panel in _dashboard_panels()
        for target in panel.get("targets", [])
    ]


def _alert_rules() -> list[dict[str, Any]]:
    return [rule for group in ALERTS["groups"] for rule in group["rules"]]


def _parse(expr: str) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """``(series, grouping labels, series -> matched labels)`` of a PromQL expression.

    Enough of PromQL for these queries: selectors with matchers, range and offset brackets,
    function calls, aggregations with ``by`` / ``without`` and binary operators with
    ``on`` / ``ignoring`` / ``group_left`` / ``group_right``.
    """
    text = expr.replace("$__rate_interval", "5m")
    matched: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}", text):
        labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
        matched.setdefault(name, set()).update(labels)
    text = re.sub(r"\{[^}]*\}", " ", text)  # matchers (their strings go with them)
    text = re.sub(r'"[^"]*"', " ", text)  # other strings (label_replace arguments)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    grouping: set[str] = set()
    for clause in re.findall(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text
    ):
        grouping |= {label.strip() for label in clause.split(",") if label.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    series = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in KEYWORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        series.add(word)
    series |= {name for name in matched if name}
    return series, grouping, matched


def _check(where: str, expr: str, legend: str = "") -> set[str]:
    """Assert every series and label ``expr`` (and ``legend``) uses exists; return the series."""
    series, grouping, matched = _parse(expr)
    assert series, f"{where}: no series found in {expr!r}"
    unknown = sorted(series - set(EXPORTED))
    assert not unknown, f"{where}: no service exports {unknown}"
    for name, labels in matched.items():
        assert name, f"{where}: a selector without a series name in {expr!r}"
        missing = labels - EXPORTED[name] - TARGET_LABELS
        assert not missing, f"{where}: {name} has no label {sorted(missing)}"
    available = set().union(*(EXPORTED[name] for name in series)) | TARGET_LABELS
    assert grouping <= available, f"{where}: grouped by {sorted(grouping - available)}"
    legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    assert legend_labels <= available, f"{where}: legend {legend!r} names a label no series has"
    return series


# ------------------------------------------------------------------ series and labels
@pytest.mark.parametrize(
    "title,expr,legend", _dashboard_queries(), ids=[q[0] for q in _dashboard_queries()]
)
def test_every_dashboard_query_uses_series_the_services_export(
    title: str, expr: str, legend: str
) -> None:
    _check(f"panel {title!r}", expr, legend)


@pytest.mark.parametrize("rule", _alert_rules(), ids=lambda r: r["alert"])
def test_every_alert_uses_series_the_services_export(rule: dict[str, Any]) -> None:
    series = _check(f"alert {rule['alert']}", rule["expr"])
    # the labels its text prints are ones its series carry
    available = set().union(*(EXPORTED[name] for name in series)) | TARGET_LABELS
    text = " ".join(rule["annotations"].values())
    printed = set(re.findall(r"\$labels\.(\w+)", text))
    assert printed <= available, f"{rule['alert']}: prints {sorted(printed - available)}"
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_parser_finds_what_a_query_names() -> None:
    """The checks above are only as good as this reading of PromQL."""
    series, grouping, matched = _parse(
        "histogram_quantile(0.95, sum by (le, adapter_cold) (rate(plora_gateway_ttft_seconds_"
        'bucket{adapter_cold="true", job=~"plora-.*"}[$__rate_interval]))) / on (instance) '
        "max without (code) (plora_worker_queue_length offset 5m) > 0 and up == 0"
    )
    assert series == {"plora_gateway_ttft_seconds_bucket", "plora_worker_queue_length", "up"}
    assert grouping == {"le", "adapter_cold", "instance", "code"}
    assert matched == {"plora_gateway_ttft_seconds_bucket": {"adapter_cold", "job"}}
    with pytest.raises(AssertionError, match="no service exports"):
        _check("x", "rate(plora_gateway_ttft_seconds[5m])")  # a histogram without a suffix
    with pytest.raises(AssertionError, match="no service exports"):
        _check("x", "plora_worker_requests")  # a counter without _total
    with pytest.raises(AssertionError, match="has no label"):
        _check("x", 'plora_worker_requests_total{reason="x"}')
    with pytest.raises(AssertionError, match="grouped by"):
        _check("x", "sum by (cause) (plora_worker_queue_length)")


# ------------------------------------------------------------------ coverage
def test_the_dashboard_shows_what_operators_watch() -> None:
    used = set()
    for _title, expr, _legend in _dashboard_queries():
        series, _grouping, matched = _parse(expr)
        used |= series
        if "plora_gateway_ttft_seconds_bucket" in series:
            assert "adapter_cold" in expr  # warm and cold apart
    assert {
        "plora_gateway_ttft_seconds_bucket",  # TTFT warm vs cold
        "plora_worker_cold_start_wait_seconds_bucket",  # cold-start waits
        "plora_worker_pool_utilization_ratio",  # pool utilization
        "plora_worker_pool_external_fragmentation_ratio",  # fragmentation
        "plora_worker_prefetches_total",  # prefetch used vs wasted
        "plora_predictor_recall_at_3_ratio",  # forecast hit rate
        "plora_gateway_worker_queue_length",  # per-worker queues
        "plora_worker_adapter_load_failures_total",  # load failures
    } <= used


def test_the_dashboard_is_well_formed() -> None:
    assert DASHBOARD["uid"] == "plora" and DASHBOARD["title"]
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in _dashboard_panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in _dashboard_panels():
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]


def test_the_alerts_cover_what_operators_asked_for() -> None:
    names = {rule["alert"] for rule in _alert_rules()}
    assert {
        "PLoRAWorkerDown",
        "PLoRAEngineStalled",
        "PLoRARegistryStale",
        "PLoRAPoolThrashing",
        "PLoRAAdapterLoadsFailing",
    } <= names
    assert len(names) == len(_alert_rules()), "alert names must be unique"
    # the job regex of the rules matches every job the compose Prometheus scrapes
    jobs = [job["job_name"] for job in PROMETHEUS["scrape_configs"]]
    assert jobs and all(re.fullmatch(r"plora-.*", job) for job in jobs)


# ------------------------------------------------------------------ compose provisions both
def _mounts(service: str) -> dict[str, str]:
    """``container path -> host path`` of a compose service's bind mounts."""
    out = {}
    for entry in COMPOSE["services"][service]["volumes"]:
        source, target, *_mode = entry.split(":")
        out[target] = source
    return out


def test_compose_prometheus_loads_the_alert_rules() -> None:
    mounts = _mounts("prometheus")
    (rule_file,) = PROMETHEUS["rule_files"]
    assert mounts[rule_file] == "./deploy/prometheus/alerts.yml"
    assert mounts["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus.yml"


def test_compose_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    grafana = COMPOSE["services"]["grafana"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])
    assert all(str(p).startswith("127.0.0.1:") for p in grafana["ports"])
    mounts = _mounts("grafana")
    provisioning = REPO / mounts["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    prometheus_port = COMPOSE["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{prometheus_port}"
    providers = yaml.safe_load((provisioning / "dashboards" / "plora.yml").read_text())
    (provider,) = providers["providers"]
    folder = provider["options"]["path"]
    dashboards = {t: s for t, s in mounts.items() if t.startswith(folder + "/")}
    assert list(dashboards.values()) == ["./deploy/grafana/plora.json"]


# ------------------------------------------------------------------ promtool
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
def test_promtool_checks_the_alert_rules() -> None:
    out = _promtool("check", "rules", str(ALERTS_PATH))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query as a recording rule: promtool parses its PromQL as Prometheus would."""
    rules = [
        {"record": f"plora:dashboard:{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, (_title, expr, _legend) in enumerate(_dashboard_queries())
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = _promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_checks_the_compose_prometheus_config(tmp_path: Path) -> None:
    config = dict(PROMETHEUS, rule_files=[str(ALERTS_PATH)])
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = _promtool("check", "config", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


ALERTS_DESCRIPTIONS = {rule["alert"]: rule["annotations"]["description"] for rule in _alert_rules()}

#: ``promtool test rules`` cases: synthetic series in, the alerts that must fire (and when).
ALERT_CASES: dict[str, Any] = {
    "rule_files": [str(ALERTS_PATH)],
    "evaluation_interval": "15s",
    "tests": [
        {
            "interval": "15s",
            "input_series": [
                {
                    "series": 'plora_worker_engine_stalled_seconds{job="plora-worker",'
                    'instance="w0:9101"}',
                    "values": "0 15 30 45",
                },
                {
                    "series": 'plora_gateway_worker_down_total{job="plora-gateway",'
                    'instance="g:9100",worker="worker-1"}',
                    "values": "0 0 1 1",
                },
                {
                    "series": 'plora_gateway_registry_stale_reads_total{job="plora-gateway",'
                    'instance="g:9100",record="adapter"}',
                    "values": "0+5x20",
                },
                {
                    "series": 'plora_worker_cold_starts_total{job="plora-worker",'
                    'instance="w0:9101",cause="evicted_recency"}',
                    "values": "0+15x80",  # one a second
                },
                {
                    "series": 'plora_worker_cold_starts_total{job="plora-worker",'
                    'instance="w1:9101",cause="first_use"}',
                    "values": "0+15x80",  # not thrashing: never evicted
                },
                {
                    "series": 'up{job="plora-worker",instance="w2:9101"}',
                    "values": "1 1 0 0 0 0 0 0",
                },
            ],
            "alert_rule_test": [
                {
                    "eval_time": "15s",
                    "alertname": "PLoRAEngineStalled",
                    "exp_alerts": [],
                },
                {
                    "eval_time": "45s",
                    "alertname": "PLoRAEngineStalled",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "critical",
                                "job": "plora-worker",
                                "instance": "w0:9101",
                            },
                            "exp_annotations": {
                                "summary": "the engine of w0:9101 has made no progress for 45 s",
                                "description": ALERTS_DESCRIPTIONS["PLoRAEngineStalled"],
                            },
                        }
                    ],
                },
                {
                    "eval_time": "1m",
                    "alertname": "PLoRAWorkerDown",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "worker": "worker-1"},
                            "exp_annotations": {
                                "summary": "worker worker-1 went down",
                                "description": ALERTS_DESCRIPTIONS["PLoRAWorkerDown"].replace(
                                    "{{ $labels.worker }}", "worker-1"
                                ),
                            },
                        }
                    ],
                },
                {
                    "eval_time": "4m",
                    "alertname": "PLoRARegistryStale",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "critical",
                                "job": "plora-gateway",
                                "instance": "g:9100",
                            },
                            "exp_annotations": {
                                "summary": "gateway g:9100 serves from its cache: Redis is "
                                "unreachable",
                                "description": ALERTS_DESCRIPTIONS["PLoRARegistryStale"],
                            },
                        }
                    ],
                },
                {
                    "eval_time": "20m",
                    "alertname": "PLoRAPoolThrashing",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "warning",
                                "job": "plora-worker",
                                "instance": "w0:9101",
                            },
                            "exp_annotations": {
                                "summary": "w0:9101 keeps evicting adapters it needs again",
                                "description": ALERTS_DESCRIPTIONS["PLoRAPoolThrashing"],
                            },
                        }
                    ],
                },
                {
                    "eval_time": "105s",
                    "alertname": "PLoRATargetDown",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": "warning",
                                "job": "plora-worker",
                                "instance": "w2:9101",
                            },
                            "exp_annotations": {
                                "summary": "plora-worker target w2:9101 is not answering scrapes",
                                "description": ALERTS_DESCRIPTIONS["PLoRATargetDown"].replace(
                                    "{{ $labels.instance }}", "w2:9101"
                                ),
                            },
                        }
                    ],
                },
            ],
        }
    ],
}


@needs_promtool
def test_the_alerts_fire_on_synthetic_series(tmp_path: Path) -> None:
    """``promtool test rules``: a stalled engine, a worker gone down, a gateway reading a
    stale registry, a pool evicting what it needs again (and not a worker whose cold starts
    are first uses), a target that stopped answering, each firing its alert when it should."""
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(ALERT_CASES, width=1000))
    out = _promtool("test", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
