"""deploy/kubernetes, rendered with kubectl's kustomize and checked offline.

No cluster runs here, so this is what keeps the manifests honest: both overlays render, every
object validates (strictly: no unknown field) against the Kubernetes schemas of the oldest
supported release and the newest the validator knows, every P-LoRA container's command is
parsed by the service's real argument parser and builds its config from the environment the
pod would give it (downward API and Secrets included), ports, probes, scrape annotations and
Services agree, every container runs unprivileged, the gpu overlay gives each worker one GPU,
Redis keeps its append-only file on a volume (its script runs here against the real
redis-server), no Secret value is committed and every Secret referenced is one that
docs/deploy-kubernetes.md says how to create.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.common import grpc_util
from services.common.lifecycle import service_parser
from services.common.redis_server import redis_server_binary
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService
from services.predictor.config import PredictorConfig
from services.worker.config import WorkerConfig
from services.worker.engine import Engine
from services.worker.server import WorkerService
from tests.helpers import password_redis_up

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE = REPO / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
DOC = REPO / "docs" / "deploy-kubernetes.md"
CONFIGS: dict[str, Any] = {
    "gateway": GatewayConfig,
    "worker": WorkerConfig,
    "predictor": PredictorConfig,
}
#: Kubernetes releases validated against: the oldest the manifests support (gRPC probes are
#: GA from 1.27) and the newest the validator ships schemas for.
OLDEST = "1.27.0"
#: What the tests put in the Secrets and the downward API.
SECRET_VALUES = {
    ("plora-redis", "password"): "k8s-redis-password-0123456789abcdef",
    ("plora-redis-url", "url"): "redis://:k8s-external-password-0123@redis.example:6380/2",
}
POD_IP = "10.1.2.3"


def _render_dir(path: Path) -> list[dict[str, Any]]:
    for tool in (["kubectl", "kustomize"], ["kustomize", "build"]):
        if shutil.which(tool[0]):
            out = subprocess.run(
                [*tool, str(path)], capture_output=True, text=True, timeout=120, check=False
            )
            assert out.returncode == 0, f"{' '.join(tool)} {path} failed:\n{out.stderr}"
            return [d for d in yaml.safe_load_all(out.stdout) if d]
    pytest.skip("neither kubectl nor kustomize is installed")


_RENDERED: dict[str, list[dict[str, Any]]] = {}


def _render(overlay: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize deploy/kubernetes/overlays/<overlay>`` prints (cached;
    callers get their own copy)."""
    if overlay not in _RENDERED:
        _RENDERED[overlay] = _render_dir(KUSTOMIZE / "overlays" / overlay)
    return copy.deepcopy(_RENDERED[overlay])


def _render_with_components(tmp_path: Path, overlay: str, *components: str) -> list[dict]:
    """``overlay`` with ``components`` added, as a user adds them in their own kustomization
    (kustomize wants paths relative to it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(KUSTOMIZE, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"{rel}/overlays/{overlay}"],
                "components": [f"{rel}/components/{c}" for c in components],
            }
        )
    )
    return _render_dir(tmp_path)


def _one(objects: list[dict], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def _workloads(objects: list[dict]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def _plora_containers(objects: list[dict]) -> list[tuple[dict, dict, str]]:
    """(workload, container, service kind) of every container that runs ``plora serve X``."""
    out = []
    for w in _workloads(objects):
        for c in w["spec"]["template"]["spec"]["containers"]:
            args = c.get("args", [])
            if args[:1] == ["serve"]:
                out.append((w, c, args[1]))
    return out


def _env_vars_read_by_services() -> set[str]:
    names: set[str] = set()
    for path in [*(REPO / "services").rglob("*.py"), *(REPO / "plora").rglob("*.py")]:
        names |= set(re.findall(r'"(PLORA_[A-Z0-9_]+)"', path.read_text()))
    return names


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _pod_env(workload: dict, container: dict, pod_name: str) -> dict[str, str]:
    """The environment Kubernetes gives ``container`` in pod ``pod_name``: literal values with
    ``$(VAR)`` expanded from the variables before them, the downward API, Secret keys."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"]
            )
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            env[name] = {"metadata.name": pod_name, "status.podIP": POD_IP}[field]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[name] = SECRET_VALUES[(ref["name"], ref["key"])]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, _, resource = ref["resource"].partition(".")
            quantity = container["resources"][kind][resource]
            divisor = _cpus(str(ref.get("divisor", "1")))
            env[name] = str(math.ceil(_cpus(str(quantity)) / divisor))
        else:
            raise AssertionError(f"{name}: unexpected source {source}")
    return env


def _mounts(workload: dict, container: dict) -> dict[str, dict[str, Any]]:
    """``mountPath -> volume`` of ``container``."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        volumes[claim["metadata"]["name"]] = {"claimTemplate": claim}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def _secret_file(workload: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file ``path`` that a Secret volume mounts in ``container``."""
    directory, _, key = path.rpartition("/")
    volume = _mounts(workload, container).get(directory)
    assert volume and "secret" in volume, f"{path} is not in a mounted Secret"
    return volume["secret"]["secretName"], key


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _pod_name(workload: dict) -> str:
    name = workload["metadata"]["name"]
    return f"{name}-0" if workload["kind"] == "StatefulSet" else f"{name}-5d9c7b-x2x4q"


def _config(
    workload: dict, container: dict, kind: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Any:
    """The service config ``plora serve <kind>`` builds in the pod, from its real parser."""
    for name in list(os.environ):
        if name.startswith("PLORA_"):
            monkeypatch.delenv(name)
    env = _pod_env(workload, container, _pod_name(workload))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "PLORA_ADAPTER_ROOTS" in env:  # the mount point; not a directory on this machine
        monkeypatch.setenv("PLORA_ADAPTER_ROOTS", str(tmp_path))
    args = service_parser(kind, CONFIGS[kind], exit_on_error=False).parse_args(
        container["args"][2:]
    )
    return CONFIGS[kind].from_args(args)


# ------------------------------------------------------------------ rendering and schemas
@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", [OLDEST, "latest"])
def test_overlay_renders_and_every_object_validates_strictly(overlay: str, version: str) -> None:
    version = kubernetes_validate.utils.latest_version() if version == "latest" else version
    objects = _render(overlay)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_refuses_an_unknown_field() -> None:
    """Strict validation is what catches a misspelt field (Kubernetes drops those silently)."""
    worker = _one(_render("cpu"), "StatefulSet", "plora-worker")
    worker["spec"]["template"]["spec"]["securityContext"]["runAsNonroot"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, OLDEST, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_whole_cluster_is_there(overlay: str) -> None:
    objects = _render(overlay)
    assert _one(objects, "Deployment", "plora-gateway")
    assert _one(objects, "Deployment", "plora-predictor")["spec"]["replicas"] == 1
    assert _one(objects, "StatefulSet", "plora-worker")
    assert _one(objects, "StatefulSet", "plora-redis")["spec"]["replicas"] == 1
    for name in ("plora-gateway", "plora-predictor", "plora-worker", "plora-redis"):
        assert _one(objects, "Service", name)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {
        "plora"
    }


# ------------------------------------------------------------------ commands and environment
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_parse_with_the_real_flags_and_build_a_config(
    overlay: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    containers = _plora_containers(_render(overlay))
    assert sorted(kind for _w, _c, kind in containers) == ["gateway", "predictor", "worker"]
    known = _env_vars_read_by_services()
    for workload, container, kind in containers:
        assert "command" not in container, "the image's entry point (plora) must run"
        for item in container.get("env", []):
            if item["name"].startswith("PLORA_"):
                assert item["name"] in known, f"{kind}: no service reads {item['name']}"
        config = _config(workload, container, kind, monkeypatch, tmp_path)
        ports = _ports(container)
        assert config.host == "0.0.0.0"
        assert (config.port, config.metrics_port) == (ports["grpc"], ports["metrics"])
        # the same Redis for every service, with the password from the Secret
        url = urlsplit(config.redis_url)
        assert (url.hostname, url.port) == ("plora-redis", 6379)
        assert url.password == SECRET_VALUES[("plora-redis", "password")]
        # the internal token from a file of the Secret plora-internal-token
        assert config.internal_token_file and not config.internal_token
        assert _secret_file(workload, container, config.internal_token_file) == (
            "plora-internal-token",
            "token",
        )
        if kind == "gateway":
            config.check_security()
            assert config.http_port == ports["http"]
            assert _secret_file(workload, container, config.api_keys_file) == (
                "plora-api-keys",
                "keys.yaml",
            )
            assert not config.insecure_no_auth
            predictor = _one(_render(overlay), "Service", "plora-predictor")
            grpc_port = next(p["port"] for p in predictor["spec"]["ports"] if p["name"] == "grpc")
            assert config.predictor_address == f"plora-predictor:{grpc_port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_adapter_sources_are_confined_to_the_mounted_adapters_volume(overlay: str) -> None:
    for workload, container, kind in _plora_containers(_render(overlay)):
        if kind == "predictor":
            continue
        env = _pod_env(workload, container, _pod_name(workload))
        root = env["PLORA_ADAPTER_ROOTS"]
        volume = _mounts(workload, container)[root]
        assert volume["persistentVolumeClaim"]["claimName"] == "plora-adapters", kind
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == root)
        assert mount.get("readOnly") is True, kind


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_worker_pod_is_its_own_worker_and_advertises_its_pod_ip(
    overlay: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    objects = _render(overlay)
    worker = _one(objects, "StatefulSet", "plora-worker")
    container = worker["spec"]["template"]["spec"]["containers"][0]
    config = _config(worker, container, "worker", monkeypatch, tmp_path)
    assert config.worker_id == "plora-worker-0"  # the pod's name: stable across restarts
    assert config.address == f"{POD_IP}:{config.port}"
    requested = _cpus(str(container["resources"]["requests"]["cpu"]))
    assert config.threads == math.ceil(requested) >= 1  # 0 would mean every core of the node
    assert worker["spec"]["podManagementPolicy"] == "Parallel"
    # workers are found through Redis; the headless Service names the pods
    service = _one(objects, "Service", "plora-worker")
    assert service["spec"]["clusterIP"] == "None"
    assert worker["spec"]["serviceName"] == "plora-worker"


def test_cpu_workers_stay_on_the_cpu_and_gpu_workers_get_one_gpu_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cpu = _one(_render("cpu"), "StatefulSet", "plora-worker")
    container = cpu["spec"]["template"]["spec"]["containers"][0]
    assert _config(cpu, container, "worker", monkeypatch, tmp_path).device == "cpu"
    for kind in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container["resources"].get(kind, {})

    gpu = _one(_render("gpu"), "StatefulSet", "plora-worker")
    spec = gpu["spec"]["template"]["spec"]
    container = spec["containers"][0]
    config = _config(gpu, container, "worker", monkeypatch, tmp_path)
    assert (config.device, config.dtype) == ("cuda", "bfloat16")
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert str(container["resources"]["requests"]["nvidia.com/gpu"]) == "1"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    # nothing else of the cluster asks for a GPU
    for w in _workloads(_render("gpu")):
        if w["metadata"]["name"] != "plora-worker":
            for c in w["spec"]["template"]["spec"]["containers"]:
                assert "nvidia.com/gpu" not in str(c.get("resources"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_and_gateways_spread_across_nodes(overlay: str) -> None:
    objects = _render(overlay)
    spec = _one(objects, "StatefulSet", "plora-worker")["spec"]["template"]["spec"]
    constraints = spec["topologySpreadConstraints"]
    keys = [(c["topologyKey"], c["whenUnsatisfiable"]) for c in constraints]
    assert len(keys) == len(set(keys)) and len(constraints) == 1
    assert constraints[0]["topologyKey"] == "kubernetes.io/hostname"
    assert constraints[0]["maxSkew"] == 1
    labels = _one(objects, "StatefulSet", "plora-worker")["spec"]["template"]["metadata"]
    assert constraints[0]["labelSelector"]["matchLabels"].items() <= labels["labels"].items()
    if overlay == "gpu":  # even: 20 workers on 5 nodes are 4 on each
        assert constraints[0]["whenUnsatisfiable"] == "DoNotSchedule"
    gateway = _one(objects, "Deployment", "plora-gateway")["spec"]["template"]["spec"]
    term = gateway["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"


# ------------------------------------------------------------------ probes, ports, scraping
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_plora_probes_are_grpc_health_checks_on_the_grpc_port(overlay: str) -> None:
    for _workload, container, kind in _plora_containers(_render(overlay)):
        grpc_port = _ports(container)["grpc"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port, f"{kind} {probe}"
        if kind == "worker":  # the port opens once the model is loaded (minutes, first start)
            startup = container["startupProbe"]
            assert startup["grpc"]["port"] == grpc_port
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_plora_pod_is_scraped_on_its_metrics_port(overlay: str) -> None:
    objects = _render(overlay)
    for workload, container, kind in _plora_containers(objects):
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", kind
        assert int(annotations["prometheus.io/port"]) == _ports(container)["metrics"], kind
        assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_their_pods_and_target_named_ports(overlay: str) -> None:
    objects = _render(overlay)
    for service in (o for o in objects if o["kind"] == "Service"):
        selected = [
            w
            for w in _workloads(objects)
            if service["spec"]["selector"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, service["metadata"]["name"]
        ports = _ports(selected[0]["spec"]["template"]["spec"]["containers"][0])
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"], service["metadata"]["name"]
    gateway = _one(objects, "Service", "plora-gateway")
    assert {p["name"] for p in gateway["spec"]["ports"]} == {"grpc", "http", "metrics"}


# ------------------------------------------------------------------ security
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_unprivileged(overlay: str) -> None:
    for workload in _workloads(_render(overlay)):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        pod_context = pod["securityContext"]
        assert pod_context["runAsNonRoot"] is True, name
        assert pod_context["runAsUser"] > 0, name
        assert pod_context["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod.get("automountServiceAccountToken") is False, name
        for c in pod.get("initContainers", []) + pod["containers"]:
            context = c["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in context["capabilities"], name
            assert context.get("privileged") is not True, name
            assert context.get("runAsUser", pod_context["runAsUser"]) > 0, name
            # a read-only root: what they write is on a volume
            assert "/tmp" in _mounts(workload, c), name
        for c in pod["containers"]:
            assert c["resources"]["requests"]["cpu"], name
            assert c["resources"]["requests"]["memory"], name
            assert c["resources"]["limits"]["memory"], name


def test_the_plora_pods_run_as_the_images_user() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    user = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)[-1]
    for workload, _container, kind in _plora_containers(_render("cpu")):
        context = workload["spec"]["template"]["spec"]["securityContext"]
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user, kind
        assert str(context["fsGroup"]) == user[1], kind  # volumes it writes are its group's


def _secret_references(objects: list[dict]) -> dict[str, tuple[set[str], bool]]:
    """``Secret name -> (keys read, optional)`` over every workload."""
    refs: dict[str, tuple[set[str], bool]] = {}

    def add(name: str, key: str | None, optional: bool) -> None:
        keys, was_optional = refs.get(name, (set(), True))
        refs[name] = (keys | ({key} if key else set()), was_optional and optional)

    for workload in _workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                add(volume["secret"]["secretName"], None, volume["secret"].get("optional", False))
        for c in pod["containers"]:
            for item in c.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    add(ref["name"], ref["key"], ref.get("optional", False))
            for source in c.get("envFrom", []):
                if "secretRef" in source:
                    ref = source["secretRef"]
                    add(ref["name"], None, ref.get("optional", False))
            for mount_path, volume in _mounts(workload, c).items():
                if "secret" in volume:  # the files read from it are its keys
                    for arg in c.get("args", []) + [e.get("value", "") for e in c.get("env", [])]:
                        if arg.startswith(mount_path + "/"):
                            add(volume["secret"]["secretName"], arg.rpartition("/")[2], False)
    return refs


def _documented_secrets() -> dict[str, set[str]]:
    """``name -> keys`` of every ``kubectl ... create secret generic`` in the guide."""
    text = DOC.read_text().replace("\\\n", " ")
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if "create secret generic" not in line:
            continue
        words = shlex.split(line.split("#", 1)[0])
        name = words[words.index("generic") + 1]
        keys = {
            w.split("=", 2)[1] for w in words if w.startswith(("--from-file=", "--from-literal="))
        }
        out[name] = keys
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_value_is_committed_and_the_guide_creates_every_secret(overlay: str) -> None:
    objects = _render(overlay)
    for obj in objects:
        if obj["kind"] == "Secret":
            assert not obj.get("data") and not obj.get("stringData"), obj["metadata"]["name"]
    refs = _secret_references(objects)
    assert {"plora-internal-token", "plora-redis", "plora-api-keys"} <= set(refs)
    documented = _documented_secrets()
    for name, (keys, optional) in refs.items():
        if optional:
            assert name in DOC.read_text(), f"the guide never names the Secret {name}"
            continue
        assert name in documented, f"docs/deploy-kubernetes.md never creates the Secret {name}"
        assert keys <= documented[name], f"{name}: the guide creates {documented[name]}"
    # and no value a test or an example uses ends up in the manifests
    text = "".join(p.read_text() for p in KUSTOMIZE.rglob("*.yaml"))
    for value in SECRET_VALUES.values():
        assert value not in text


# ------------------------------------------------------------------ Redis
def _redis_container(objects: list[dict]) -> tuple[dict, dict]:
    redis_set = _one(objects, "StatefulSet", "plora-redis")
    return redis_set, redis_set["spec"]["template"]["spec"]["containers"][0]


def test_redis_keeps_its_append_only_file_on_a_persistent_volume() -> None:
    redis_set, container = _redis_container(_render("cpu"))
    assert re.fullmatch(r"redis:7\.4\.\d+(-alpine)?", container["image"])
    script = container["args"][0]
    assert "--appendonly yes" in script and "--dir /data" in script
    volume = _mounts(redis_set, container)["/data"]
    assert volume["claimTemplate"]["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_redis_script_requires_the_password_and_keeps_it_off_the_command_line(
    tmp_path: Path,
) -> None:
    """The Redis container's script, run here with the real redis-server on a free port and
    the environment its pod gets: a client without the password gets NOAUTH, one with it PONG
    and an append-only file in the data directory, and the password is not in the server's
    command line."""
    _set, container = _redis_container(_render("cpu"))
    assert container["command"] == ["sh", "-c"] and len(container["args"]) == 1
    env = _pod_env(_set, container, "plora-redis-0")
    password = env["PLORA_REDIS_PASSWORD"]
    assert env["REDISCLI_AUTH"] == password  # the probes' redis-cli authenticates with it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = container["args"][0].replace(
        "redis-server - --dir /data",
        f"{shlex.quote(redis_server_binary())} - --port {port} --bind 127.0.0.1 "
        f"--dir {shlex.quote(str(tmp_path))}",
    )
    assert script != container["args"][0]
    proc = subprocess.Popen(
        ["sh", "-c", script],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        authed = password_redis_up(proc, port, password)
        authed.set("k", "v")
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline and password.encode() not in cmdline
        deadline = time.monotonic() + 10
        while not any(tmp_path.rglob("*.aof")):
            assert time.monotonic() < deadline, "no append-only file written"
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ------------------------------------------------------------------ optional components
def test_external_redis_replaces_the_in_cluster_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = _render_with_components(tmp_path / "k", "cpu", "external-redis")
    for obj in objects:
        kubernetes_validate.validate(obj, OLDEST, strict=True)
    assert not [o for o in objects if o["metadata"]["name"] == "plora-redis"]
    containers = _plora_containers(objects)
    assert len(containers) == 3
    for workload, container, kind in containers:
        assert "REDIS_PASSWORD" not in {e["name"] for e in container["env"]}, kind
        config = _config(workload, container, kind, monkeypatch, tmp_path)
        assert config.redis_url == SECRET_VALUES[("plora-redis-url", "url")], kind
    assert "plora-redis" not in _secret_references(objects)
    assert "create secret generic plora-redis-url" in DOC.read_text()


def test_the_service_monitor_scrapes_every_plora_service(tmp_path: Path) -> None:
    objects = _render_with_components(tmp_path / "k", "gpu", "servicemonitor")
    monitor = _one(objects, "ServiceMonitor", "plora")
    assert monitor["metadata"]["namespace"] == "plora"
    port = monitor["spec"]["endpoints"][0]["port"]
    selected = []
    for service in (o for o in objects if o["kind"] == "Service"):
        labels = service["metadata"]["labels"]
        if all(
            labels.get(e["key"]) in e["values"]
            for e in monitor["spec"]["selector"]["matchExpressions"]
        ):
            selected.append(service["metadata"]["name"])
            assert port in {p["name"] for p in service["spec"]["ports"]}
    assert sorted(selected) == ["plora-gateway", "plora-predictor", "plora-worker"]


# ------------------------------------------------------------------ the guide's own overlay
def test_the_guides_overlay_deploys_20_workers_and_2_gateways(tmp_path: Path) -> None:
    """docs/deploy-kubernetes.md's step 3, as written: its kustomization.yaml with the image
    and replicas it sets, rendered and validated."""
    text = DOC.read_text()
    heredoc = re.search(r"cat > kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    by_hand = re.search(r"add the same by hand:\n\n```yaml\n(.*?)```", text, re.S)
    assert heredoc and by_hand, "step 3 of the guide lost its kustomization"
    kustomization = yaml.safe_load(heredoc.group(1))
    kustomization.update(yaml.safe_load(by_hand.group(1)))
    assert kustomization["resources"] == ["../gpu"]
    overlay = tmp_path / "prod"
    overlay.mkdir()
    kustomization["resources"] = [os.path.relpath(KUSTOMIZE / "overlays" / "gpu", overlay)]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = _render_dir(overlay)
    for obj in objects:
        kubernetes_validate.validate(obj, OLDEST, strict=True)
    assert _one(objects, "StatefulSet", "plora-worker")["spec"]["replicas"] == 20
    assert _one(objects, "Deployment", "plora-gateway")["spec"]["replicas"] == 2
    claim = _one(objects, "PersistentVolumeClaim", "plora-adapters")
    assert claim["spec"]["storageClassName"] and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for _workload, container, _kind in _plora_containers(objects):
        assert container["image"] == "registry.example.com/plora:0.1.0"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_guides_scrape_config_is_valid_and_names_the_alerts_jobs(tmp_path: Path) -> None:
    text = DOC.read_text()
    block = next(
        b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "kubernetes_sd_configs" in b
    )
    config = yaml.safe_load(block)
    # Debian's promtool is built without Kubernetes discovery: check the job and its
    # relabelling with the discovery swapped for a static target
    checked = copy.deepcopy(config)
    for job in checked["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs")[0]["role"] == "pod"
        job["static_configs"] = [{"targets": ["10.1.2.3:9101"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(checked))
    out = subprocess.run(
        ["promtool", "check", "config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (job,) = config["scrape_configs"]
    relabel = next(r for r in job["relabel_configs"] if r.get("target_label") == "job")
    components = {
        w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for w, _c, _k in _plora_containers(_render("cpu"))
    }
    jobs = {relabel["replacement"].replace("$1", c) for c in components}
    assert jobs == {"plora-gateway", "plora-worker", "plora-predictor"}


def test_the_guides_shutdown_figures_are_the_codes() -> None:
    """What docs/deploy-kubernetes.md says happens when a worker or a gateway goes away, in
    the figures the code uses, and the pods' grace periods long enough for it."""
    text = " ".join(DOC.read_text().split())

    def default(function: Any, name: str) -> float:
        return float(inspect.signature(function).parameters[name].default)

    worker_grace = default(WorkerService.stop, "grace")
    gateway_grace = default(GatewayService.stop, "grace")
    assert f"for a {worker_grace:g}-s grace period" in text
    assert f"gives the streams it relays a {gateway_grace:g}-s grace period" in text
    assert f"reuse it for {GatewayConfig.worker_cache_s:g} s" in text
    assert f"within {GatewayConfig.worker_cache_s:g} s" in text
    assert f"expires {WorkerConfig.heartbeat_ttl_s:g} s after its last heartbeat" in text
    assert f"at its next tick ({PredictorConfig.tick_s:g} s)" in text
    ping_s = grpc_util.KEEPALIVE_TIME_MS / 1000
    answer_s = grpc_util.KEEPALIVE_TIMEOUT_MS / 1000
    assert f"a ping every {ping_s:g} s, answered within {answer_s:g} s" in text
    objects = _render("gpu")
    worker = _one(objects, "StatefulSet", "plora-worker")["spec"]["template"]["spec"]
    engine_stop = default(Engine.stop, "timeout")
    assert worker["terminationGracePeriodSeconds"] >= worker_grace + engine_stop + 5
    assert f"`terminationGracePeriodSeconds` ({worker['terminationGracePeriodSeconds']} s)" in text
    gateway = _one(objects, "Deployment", "plora-gateway")["spec"]["template"]["spec"]
    pre_stop = gateway["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and f"serving for {pre_stop[1]} s (`preStop`)" in text
    assert gateway["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + gateway_grace + 5
