"""docker-compose.yml and the Prometheus config, checked statically against the real services.

No Docker engine runs here, so this test is what keeps the compose file honest: every command is
parsed by the service's real argument parser, every ``PLORA_*`` variable is one the services
read, published container ports match the ports the commands bind, and Prometheus scrapes every
service's metrics port.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from services.gateway.config import GatewayConfig
from services.predictor.config import PredictorConfig
from services.worker.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
PROMETHEUS = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
CONFIGS = {"gateway": GatewayConfig, "worker": WorkerConfig, "predictor": PredictorConfig}
PLORA_SERVICES = {"gateway", "predictor", "worker-0", "worker-1"}


def _env_vars_read_by_services() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "services").rglob("*.py"):
        names |= set(re.findall(r'"(PLORA_[A-Z0-9_]+)"', path.read_text()))
    return names


def _parse(service: str) -> tuple[str, argparse.Namespace]:
    command = COMPOSE["services"][service]["command"]
    assert command[0] == "serve", f"{service}: command must be `serve <service>`"
    kind = command[1]
    parser = argparse.ArgumentParser()
    CONFIGS[kind].add_arguments(parser)
    parser.add_argument("--log-level")
    parser.add_argument("--log-json", action="store_true")
    return kind, parser.parse_args(command[2:])


def test_every_part_of_the_cluster_is_there() -> None:
    assert {"redis", "prometheus", *PLORA_SERVICES} <= set(COMPOSE["services"])


@pytest.mark.parametrize("service", sorted(PLORA_SERVICES))
def test_commands_parse_with_the_real_flags_and_build_a_config(service: str) -> None:
    kind, args = _parse(service)
    config = CONFIGS[kind].from_args(args)
    assert config.host == "0.0.0.0"  # reachable from the other containers


@pytest.mark.parametrize("service", sorted(PLORA_SERVICES))
def test_environment_variables_are_ones_the_services_read(service: str) -> None:
    known = _env_vars_read_by_services()
    env = COMPOSE["services"][service].get("environment", {})
    assert env, f"{service} sets no environment"
    for name in env:
        assert name in known, f"{service}: {name} is not read by any service"
    assert env["PLORA_REDIS_URL"].startswith("redis://redis:")


@pytest.mark.parametrize("service", sorted(PLORA_SERVICES))
def test_published_ports_match_the_bound_ports(service: str) -> None:
    _kind, args = _parse(service)
    container_ports = {int(p.split(":")[1]) for p in COMPOSE["services"][service]["ports"]}
    assert {args.port, args.metrics_port} == container_ports


@pytest.mark.parametrize("service", sorted(PLORA_SERVICES))
def test_health_checks_probe_the_grpc_port(service: str) -> None:
    _kind, args = _parse(service)
    test = COMPOSE["services"][service]["healthcheck"]["test"]
    assert "services.common.healthcheck" in test and f"127.0.0.1:{args.port}" in test


def test_gateway_finds_the_predictor_and_waits_for_workers() -> None:
    gw = COMPOSE["services"]["gateway"]
    _kind, predictor_args = _parse("predictor")
    assert gw["environment"]["PLORA_PREDICTOR_ADDRESS"] == f"predictor:{predictor_args.port}"
    for dep in ("worker-0", "worker-1", "predictor", "redis"):
        assert gw["depends_on"][dep]["condition"] == "service_healthy"


def test_workers_advertise_their_container_names() -> None:
    for w in ("worker-0", "worker-1"):
        env = COMPOSE["services"][w]["environment"]
        assert env["PLORA_WORKER_ID"] == w and env["PLORA_WORKER_ADVERTISE_HOST"] == w


def test_prometheus_scrapes_every_service_metrics_port() -> None:
    targets = {
        t
        for job in PROMETHEUS["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    for service in PLORA_SERVICES:
        _kind, args = _parse(service)
        assert f"{service}:{args.metrics_port}" in targets, service
    mounted = COMPOSE["services"]["prometheus"]["volumes"][0]
    assert mounted.startswith("./deploy/prometheus.yml:")


def test_gpu_reservation_is_opt_in() -> None:
    gpu = yaml.safe_load((REPO / "docker-compose.gpu.yml").read_text())
    for w in ("worker-0", "worker-1"):
        devices = gpu["services"][w]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert "deploy" not in COMPOSE["services"][w]


def test_dockerfile_builds_with_the_make_targets() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert "make setup" in text and 'ENTRYPOINT ["plora"]' in text
