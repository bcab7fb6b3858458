"""``plora up``: the whole local cluster in the foreground, stopped cleanly on Ctrl-C/SIGTERM.

Starts (in this order) Redis (embedded, unless ``--redis-url`` / ``PLORA_REDIS_URL`` names one),
converts the base model once, then the predictor, the workers and the gateway as child processes
on loopback (port 0; each writes its bound ports to a ready file), waits for every gRPC health
check, generates and registers the demo adapters, and writes the endpoints to the state file
(``.plora/cluster.json``). Every child's log goes to ``.plora/logs/<name>.log``; progress lines
are echoed while the model loads.

The internal plane is locked: the embedded Redis gets a random password and the services a
random internal token (:mod:`services.common.internal_auth`), both new each run. The children
get them in their environment (``PLORA_REDIS_URL``, ``PLORA_INTERNAL_TOKEN``), never on their
command lines; the state file holds no secret, and both go to the credentials file beside it
(``.plora/cluster-credentials.json``, mode 0600) for tools and tests that reach the internal
services directly.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, NotRequired, TypedDict

import grpc

from plora.policies import POLICIES, PolicySpec
from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.config import (
    DEFAULT_STATE_FILE,
    adapter_roots_or_env,
    checked_type,
    env_or,
    int_flag_or_env,
    parse_ranks,
    port_number,
    require_server_ports,
)
from services.common.errors import ConfigError, PLoRAError
from services.common.grpc_util import client_channel, wait_healthy
from services.common.lifecycle import (
    EXIT_REGISTRY_UNAVAILABLE,
    service_parser,
    stop_with_parent,
    write_json_atomic,
)
from services.common.redis_server import EmbeddedRedis
from services.common.registry import connect, redact_url, url_without_password
from services.common.sources import resolve_roots

if TYPE_CHECKING:
    from services.common.types import ModelSpec

logger = logging.getLogger(__name__)


#: The environment variable each policy flag falls back to in its service's configuration.
POLICY_FLAG_ENV = {
    "--allocator": "PLORA_ALLOCATOR",
    "--eviction": "PLORA_EVICTION",
    "--host-staging": "PLORA_HOST_STAGING",
    "--routing": "PLORA_ROUTING",
    "--prefetch": "PLORA_PREDICTOR_PREFETCH",
}


def policy_flags(
    spec: PolicySpec, keep_env: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """The flags that make each service run ``spec``.

    Args:
        spec: The policy.
        keep_env: When given (``plora up`` without ``--policy``), a flag whose environment
            variable (:data:`POLICY_FLAG_ENV`) is set there is left out, so the service reads
            the variable as its configuration says (flags, then ``PLORA_*``, then defaults).
            Without it (an explicit ``--policy``, every benchmark cluster) the policy's flags
            win over the environment.

    Returns:
        ``{"worker": [...], "gateway": [...], "predictor": [...]}``; no ``"predictor"`` key
        when the policy runs without one.
    """
    pairs = {
        "worker": [
            ("--allocator", spec.allocator),
            ("--eviction", spec.eviction),
            ("--host-staging", "on" if spec.host_staging else "off"),
        ],
        "gateway": [("--routing", spec.routing)],
    }
    if spec.predictor:
        pairs["predictor"] = [("--prefetch", "on" if spec.prefetch else "off")]
    env = keep_env if keep_env is not None else {}
    return {
        service: [
            x for flag, value in items if not env.get(POLICY_FLAG_ENV[flag]) for x in (flag, value)
        ]
        for service, items in pairs.items()
    }


def check_service_flags(service: str, flags: list[str]) -> None:
    """Parse one service's flags and ``PLORA_*`` environment as that service will, so a bad
    setting stops ``plora up`` before Redis starts and the model loads, naming the service.

    Args:
        service: ``worker``, ``gateway`` or ``predictor``.
        flags: Its command-line flags known before start-up (policy, threads, pool size,
            ``--worker-arg``); ports, Redis URL and model path are filled in later.

    Raises:
        ConfigError: an unknown flag, a value the flag or its variable does not accept, or a
            setting the service's config refuses.
    """
    from services.gateway.config import GatewayConfig  # noqa: PLC0415
    from services.predictor.config import PredictorConfig  # noqa: PLC0415
    from services.worker.config import WorkerConfig  # noqa: PLC0415

    configs: dict[str, type[WorkerConfig | GatewayConfig | PredictorConfig]] = {
        "worker": WorkerConfig,
        "gateway": GatewayConfig,
        "predictor": PredictorConfig,
    }
    config = configs[service]
    try:
        args, unknown = service_parser(service, config, exit_on_error=False).parse_known_args(flags)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{service}: {exc}") from exc
    if unknown:
        raise ConfigError(f"{service}: unknown flag(s) {' '.join(unknown)}")
    try:
        config.from_args(args)
    except ConfigError as exc:
        raise ConfigError(f"{service}: {exc}") from exc


def overridden_policy_env(env: Mapping[str, str]) -> dict[str, str]:
    """The policy settings ``env`` sets (:data:`POLICY_FLAG_ENV` names -> values)."""
    return {name: env[name] for name in POLICY_FLAG_ENV.values() if env.get(name)}


@dataclass
class Child:
    """One child service process."""

    name: str
    cmd: list[str]
    log_path: Path
    ready_file: Path
    proc: subprocess.Popen[bytes] | None = None
    ports: dict[str, int] = field(default_factory=dict)
    log_offset: int = 0  # where this start's lines begin in the (appended) log
    echoed: int = 0  # how far plora up has echoed the log to its terminal

    @property
    def is_worker(self) -> bool:
        """Whether this is one of the cluster's workers (``worker-<i>``)."""
        return self.name.startswith("worker-")

    def start(self, env: dict[str, str]) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"==== {stamp} plora up: starting {self.name} ====\n".encode())
        log.flush()
        self.log_offset = self.echoed = log.tell()
        self.proc = subprocess.Popen(
            stop_with_parent(self.cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        log.close()

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines this start wrote to its log (the logs are appended to
        across runs; an earlier run's lines are not this failure's)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(nothing logged)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll_ready(self) -> bool:
        if self.ready_file.is_file():
            self.ports = json.loads(self.ready_file.read_text())
            return True
        return False

    def signal_stop(self) -> None:
        """Send SIGTERM without waiting (several children stop in parallel)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL; then drop the ready file."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.ready_file.unlink(missing_ok=True)


#: Most workers ``plora up`` starts on this machine: each holds a copy of the model (0.5 GB
#: for the default) plus its adapter pool and runs its own decode loop, so beyond a few per
#: core they only share the cores ever more thinly (and hundreds exhaust memory).
MAX_WORKERS = 4 * max(1, os.cpu_count() or 1)

#: Log levels ``plora up`` echoes from a service starting, and from one serving.
_STARTUP = (" INFO ", " WARNING ", " ERROR ")
_SERVING = (" WARNING ", " ERROR ")

#: The gateway port of ``plora up`` when neither --gateway-port nor PLORA_GATEWAY_PORT is set.
DEFAULT_GATEWAY_PORT = 50051

#: The HTTP (OpenAI API) port of ``plora up`` when neither --http-port nor
#: PLORA_GATEWAY_HTTP_PORT is set; when it is taken, any free port.
DEFAULT_HTTP_PORT = 8000

#: Variables of plora up's own credentials as a client of the gateway, kept from the services.
_CLIENT_SECRETS = ("PLORA_API_KEY", "PLORA_TLS_CLIENT_KEY")

#: Seconds between tries to start again a service that could not reach an external Redis.
REGISTRY_RETRY_S = 5.0

#: Seconds a crash-looping worker is left stopped while other workers serve, doubled at each
#: pause up to CRASH_PAUSE_MAX_S (as Kubernetes backs off a CrashLoopBackOff container).
CRASH_PAUSE_S = 60.0
CRASH_PAUSE_MAX_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora up``."""
    parser.add_argument(
        "--state-file",
        default=None,
        help="where to write the endpoints JSON once healthy, for the client verbs "
        f"(default: $PLORA_STATE_FILE, which they read too, else {DEFAULT_STATE_FILE})",
    )
    parser.add_argument(
        "--workers",
        type=checked_type(
            int,
            lambda v: 1 <= v <= MAX_WORKERS,
            f"a whole number of workers, 1..{MAX_WORKERS} (4 per core of this machine: each "
            "worker holds its own copy of the model and runs its own decode loop)",
        ),
        default=2,
        help=f"number of workers, 1..{MAX_WORKERS} on this machine (default 2)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="base model: smollm2, a .gguf file, a Hugging Face directory, or a model id "
        "org/name[@revision] in the local Hugging Face cache (default: "
        "$PLORA_MODEL, as the workers read it, else smollm2)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="external Redis (else PLORA_REDIS_URL, else an embedded Redis)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface every service binds (default 127.0.0.1)"
    )
    parser.add_argument(
        "--gateway-port",
        type=port_number,
        default=None,
        help="gateway gRPC port, 0..65535; 0 = any free port (default: $PLORA_GATEWAY_PORT, as "
        f"the gateway reads it, else {DEFAULT_GATEWAY_PORT}; the other services always take "
        "free ports)",
    )
    parser.add_argument(
        "--http-port",
        type=port_number,
        default=None,
        help="port of the gateway's OpenAI-compatible HTTP API, 0..65535; 0 = any free port "
        "(default: $PLORA_GATEWAY_HTTP_PORT, else 8000, or any free port when 8000 is taken)",
    )
    parser.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=None,
        help="serving policy (plora/policies.py); its settings win over PLORA_* "
        "variables. Default: plora, where PLORA_ALLOCATOR, PLORA_EVICTION, PLORA_HOST_STAGING, "
        "PLORA_ROUTING and PLORA_PREDICTOR_PREFETCH, if set, replace its settings",
    )
    parser.add_argument(
        "--demo-adapters",
        type=checked_type(int, lambda v: v >= 0, "a whole number of adapters, 0 or more"),
        default=8,
        help="demo adapters to generate and register (0 = none; default 8)",
    )
    parser.add_argument(
        "--demo-ranks",
        type=parse_ranks,
        default="8,16,32,64",
        help="ranks of the demo adapters, comma-separated positive integers, cycled over them "
        "(default 8,16,32,64)",
    )
    parser.add_argument(
        "--demo-relative-delta",
        type=checked_type(float, lambda v: 0 < v < math.inf, "a positive number"),
        default=0.45,
        help="strength of the demo adapters (||dW x|| / ||W x|| scale); strong "
        "enough that most of them visibly change the base model's answers (default 0.45)",
    )
    parser.add_argument(
        "--adapters-dir",
        default=".plora/adapters",
        help="where the demo adapters are written (default .plora/adapters)",
    )
    parser.add_argument(
        "--adapter-root",
        action="append",
        default=None,
        metavar="DIR",
        help="directory adapter sources must lie under, passed to the gateway and every "
        "worker, repeatable; with any root, --adapters-dir is one too (default: "
        "$PLORA_ADAPTER_ROOTS, os.pathsep-separated, else none: sources are read anywhere)",
    )
    parser.add_argument("--pool-bytes", default=None, help="device adapter pool per worker")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag passed to every worker, repeatable; a flag with a value is one "
        "argument: --worker-arg=--max-batch-size=8 or --worker-arg '--max-batch-size 8' "
        "(default none)",
    )
    parser.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="the gateway's API keys file (JSON or YAML of key hashes, docs/security.md); the "
        "demo adapters are then registered with $PLORA_API_KEY, an operator key (default: "
        "$PLORA_API_KEYS_FILE, as the gateway reads it, else none)",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="let the gateway serve a non-loopback --host without API keys (default off)",
    )
    parser.add_argument(
        "--tls-cert",
        default=None,
        metavar="PEM",
        help="the gateway's TLS certificate; plora up's own checks trust $PLORA_TLS_CA, else "
        "this file (default: $PLORA_TLS_CERT, else plaintext)",
    )
    parser.add_argument(
        "--tls-key",
        default=None,
        metavar="PEM",
        help="private key of --tls-cert (default: $PLORA_TLS_KEY)",
    )
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PEM",
        help="mutual TLS: CA of the clients' certificates; plora up's own checks present "
        "$PLORA_TLS_CLIENT_CERT / $PLORA_TLS_CLIENT_KEY (default: $PLORA_TLS_CLIENT_CA, else "
        "none)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=checked_type(float, lambda v: 0 < v < math.inf, "a positive number of seconds"),
        default=600.0,
        help="seconds every service may take to become ready (default 600)",
    )


class _Plan(NamedTuple):
    """The policy, each service's flags so far and the policy variables in effect."""

    policy: str
    flags: dict[str, list[str]]
    policy_env: dict[str, str]


class ClusterState(TypedDict):
    """What :meth:`Cluster.start` writes to the state file (and returns): no secret.

    ``redis_url`` is the registry's URL without its password; ``credentials_file`` is the
    path of :class:`ClusterCredentials`.
    """

    gateway: str
    metrics: dict[str, str]
    redis_url: str
    credentials_file: str
    policy: str
    policy_env: dict[str, str]
    workers: dict[str, str]
    predictor: str
    adapters: list[str]
    pids: dict[str, int]
    launcher_pid: int
    openai_base_url: NotRequired[str]
    prometheus_targets: NotRequired[str]


class ClusterCredentials(TypedDict):
    """The secrets of one ``plora up`` run, in :func:`credentials_path` (mode 0600).

    ``redis_url`` is the registry's URL with its password; ``internal_token`` the token the
    worker and predictor servers require (:mod:`services.common.internal_auth`).
    """

    redis_url: str
    internal_token: str


def credentials_path(state_file: Path) -> Path:
    """Where ``plora up`` writes its :class:`ClusterCredentials`: beside the state file,
    ``<stem>-credentials.json`` (``.plora/cluster-credentials.json`` by default)."""
    return state_file.with_name(f"{state_file.stem}-credentials.json")


def read_credentials(state_file: Path | str) -> ClusterCredentials:
    """The :class:`ClusterCredentials` of the cluster whose state file is ``state_file``.

    Raises:
        OSError: the file cannot be read (no cluster, or another user's).
        ValueError: it is not the JSON object ``plora up`` writes.
    """
    path = credentials_path(Path(state_file))
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not {"redis_url", "internal_token"} <= set(data):
        raise ValueError(f"{path} is not a plora up credentials file")
    return ClusterCredentials(redis_url=data["redis_url"], internal_token=data["internal_token"])


class Cluster:
    """The running local cluster; :meth:`stop` ends every process it started."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state_file = Path(
            args.state_file or env_or("PLORA_STATE_FILE", None) or DEFAULT_STATE_FILE
        )
        self.run_dir = self.state_file.parent
        #: Prometheus file_sd targets of this cluster (:func:`prometheus_targets`).
        self.targets_file = self.run_dir / "prometheus.json"
        self.children: list[Child] = []
        self.credentials_file = credentials_path(self.state_file)
        self.redis: EmbeddedRedis | None = None
        #: The registry's URL with its password (a secret), and without it (to show).
        self.redis_url = ""
        self.public_redis_url = ""
        #: Required by the worker and predictor servers, sent by the gateway and predictor.
        self.internal_token = secrets.token_urlsafe(32)
        # Set from the SIGINT/SIGTERM handler: a plain flag, because a handler runs in the main
        # thread between bytecodes, and taking a lock there (threading.Event.set) deadlocks if
        # the main thread already holds it inside Event.wait.
        self._stop_requested = False
        self._wrote_state = False  # stop() removes only a state file this cluster wrote
        #: How plora up itself reaches the gateway: TLS credentials (None: plaintext) and API
        #: key ("" = none), settled by :meth:`_settle_gateway_client`.
        self.gateway_credentials: grpc.ChannelCredentials | None = None
        self.api_key = ""
        self.keys_on = False  # the gateway has an API keys file

    # -- start ------------------------------------------------------------------------------

    def _refuse_a_running_cluster(self) -> None:
        """Refuse to start over another ``plora up``: the same state file held by a live
        launcher, or a gateway port something already listens on.

        Raises:
            RuntimeError: with what is running and how to stop it or start beside it.
        """
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            state = {}
        pid = state.get("launcher_pid") if isinstance(state, dict) else None
        if isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
            raise RuntimeError(
                f"a cluster started by plora up (pid {pid}, gateway {state.get('gateway')}) is "
                f"running with {self.state_file}; stop it first (Ctrl-C in its terminal, or "
                f"kill -TERM {pid}), or start this one with another --state-file and "
                "--gateway-port"
            )
        a = self.args
        # Port 0 still binds: it checks the host even where no port is fixed.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((a.host, a.gateway_port))
            except OSError as exc:
                # a name that does not resolve, or an address no interface here has
                if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
                    raise RuntimeError(
                        f"--host {a.host!r} is not an address of this machine "
                        f"({exc.strerror}): give an interface to bind, e.g. 127.0.0.1 or "
                        "0.0.0.0"
                    ) from None
                raise RuntimeError(
                    f"gateway port {a.host}:{a.gateway_port} is in use ({exc.strerror}): "
                    "another cluster or service listens there; stop it, or pass "
                    "--gateway-port (0 = any free port)"
                ) from None
        if a.http_port and not _port_free(a.host, a.http_port):
            raise RuntimeError(
                f"HTTP port {a.host}:{a.http_port} is in use: another cluster or service "
                "listens there; stop it, or pass --http-port (0 = any free port)"
            )

    def _say(self, text: str) -> None:
        print(f"plora up: {text}", flush=True)

    def _child(self, name: str, service: str, flags: list[str]) -> Child:
        ready = self.run_dir / "run" / f"{name}.ready.json"
        cmd = [sys.executable, "-m", "plora.cli", "serve", service, *flags, "--ready-file"]
        cmd.append(str(ready))
        child = Child(name, cmd, self.run_dir / "logs" / f"{name}.log", ready)
        self.children.append(child)
        return child

    def _wait_ready(
        self, children: list[Child], timeout: float, echo: tuple[str, ...] = _STARTUP
    ) -> None:
        """Wait until every child answers its health check, echoing its log lines of the
        ``echo`` levels meanwhile (none: skipped, not kept for later).

        Raises:
            RuntimeError: a child exited or ``timeout`` seconds passed first.
            KeyboardInterrupt: a stop was requested.
        """
        deadline = time.monotonic() + timeout
        pending = list(children)
        while pending:
            for c in list(pending):
                c.echoed = self._echo_progress(c, c.echoed, echo)
                if c.poll_ready():
                    pending.remove(c)
                elif not c.alive():
                    raise RuntimeError(
                        f"{c.name} exited with code {c.proc.returncode if c.proc else '?'} "
                        f"during start-up; see {c.log_path}:\n{c.log_tail()}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"start-up timed out waiting for {[c.name for c in pending]}")
            if self._stop_after(0.2):
                raise KeyboardInterrupt
        for c in children:
            credentials = self.gateway_credentials if c.name == "gateway" else None
            wait_healthy(
                self._dial(c.ports["grpc_port"]),
                timeout=30,
                credentials=credentials,
            )

    def _echo_progress(self, child: Child, offset: int, levels: tuple[str, ...]) -> int:
        """Echo the lines of ``child``'s log from byte ``offset`` on whose level is one of
        ``levels`` (``" INFO "`` and up while it starts: model-load progress; warnings and
        errors once it serves: a Redis outage, a failed load); returns the new offset."""
        try:
            with open(child.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return offset
        for line in data.decode(errors="replace").splitlines():
            if any(level in line for level in levels):
                print(f"  {line}", flush=True)
        return offset + len(data)

    def start(self) -> ClusterState:
        """Start everything, in this order, and write the state file; returns what it wrote.
        Whatever started stays running on an error: the caller stops it with :meth:`stop`.

        Raises:
            ConfigError: a bad flag, variable, model or rank (before anything starts).
            RegistryUnavailableError: the external Redis does not answer.
            RuntimeError: another cluster runs here, a directory cannot be made, or a service
                exited or was not ready in time.
            TimeoutError: a service's health check never passed.
            grpc.RpcError: a demo adapter's registration failed.
            KeyboardInterrupt: a stop was requested while waiting for the services.
        """
        plan = self._plan()
        self._prepare_files()
        self._settle_gateway_client(plan.flags["gateway"])
        model_dir, spec = self._prepare_model()  # a bad --model is refused before Redis starts
        self._start_redis()
        env = self._child_env()
        predictor = self._start_predictor(plan, env)
        workers = self._start_workers(plan, model_dir, env)
        self._say(
            f"starting {'the predictor, ' if predictor else ''}{self.args.workers} workers "
            "(loading the model)..."
        )
        self._wait_ready([c for c in [predictor, *workers] if c], self.args.startup_timeout)
        gateway = self._start_gateway(plan, predictor, env)
        adapters = self._register_demo_adapters(gateway, spec)
        return self._write_state(plan, gateway, adapters)

    def _plan(self) -> _Plan:
        """Settle every service's flags (policy, the workers' share of the cores,
        ``--pool-bytes``, ``--worker-arg``) and check them as each service will. Unset
        ``--model`` and ``--gateway-port`` take the variables ``plora serve`` reads for them
        (``PLORA_MODEL``, ``PLORA_GATEWAY_PORT``): the children get explicit flags, which win.

        Raises:
            ConfigError: a flag or variable a service would refuse, or a bad gateway port.
        """
        a = self.args
        if a.model is None:
            a.model = env_or("PLORA_MODEL", None)
        if a.gateway_port is None:
            a.gateway_port = int_flag_or_env(None, "PLORA_GATEWAY_PORT", DEFAULT_GATEWAY_PORT)
            require_server_ports("gateway", a.gateway_port, 0)
        if a.http_port is None and env_or("PLORA_GATEWAY_HTTP_PORT", None) is not None:
            a.http_port = int_flag_or_env(None, "PLORA_GATEWAY_HTTP_PORT", 0)
            if not 0 <= a.http_port <= 65535:
                raise ConfigError(
                    f"PLORA_GATEWAY_HTTP_PORT must be a port 0..65535, got {a.http_port}"
                )
        elif a.http_port is None:
            a.http_port = DEFAULT_HTTP_PORT if _port_free(a.host, DEFAULT_HTTP_PORT) else 0
        set_in_env = overridden_policy_env(os.environ)
        flags = policy_flags(POLICIES[a.policy or "plora"], None if a.policy else os.environ)
        if set_in_env:
            shown = ", ".join(f"{k}={v}" for k, v in set_in_env.items())
            self._say(
                f"--policy {a.policy} overrides {shown}"
                if a.policy
                else f"policy plora with {shown} from the environment"
            )
        # Workers on one host split the cores: OpenMP threads beyond the cores spin-wait on
        # each other and decode several times slower. PLORA_WORKER_THREADS, when set, is the
        # user's choice and the workers read it.
        threads = max(1, (os.cpu_count() or 1) // max(1, a.workers))
        if not os.environ.get("PLORA_WORKER_THREADS"):
            flags["worker"] = ["--threads", str(threads), *flags["worker"]]
        if a.pool_bytes:
            flags["worker"] += ["--pool-bytes", a.pool_bytes]
        for extra in a.worker_arg:
            flags["worker"] += extra.split()
        flags["gateway"] += self._gateway_security_flags()
        for service, service_flags in flags.items():
            check_service_flags(service, service_flags)
        for root in self._adapter_roots():
            flags["gateway"] += ["--adapter-root", root]
            flags["worker"] += ["--adapter-root", root]
        return _Plan(a.policy or "plora", flags, {} if a.policy else set_in_env)

    def _adapter_roots(self) -> list[str]:
        """The adapter roots of the gateway and the workers: ``--adapter-root``, else
        ``PLORA_ADAPTER_ROOTS``; with any, the demo adapters' directory too (made by
        :meth:`_prepare_files`), so the demo adapters register. None: sources are read
        wherever they are, as the services do without roots.

        Raises:
            ConfigError: a root is not an existing directory.
        """
        a = self.args
        roots = list(adapter_roots_or_env(a.adapter_root, "PLORA_ADAPTER_ROOTS"))
        resolve_roots(roots)
        if roots and a.demo_adapters > 0:
            roots.append(os.path.abspath(a.adapters_dir))
        return roots

    def _gateway_security_flags(self) -> list[str]:
        """The gateway's API-key and TLS flags from ``plora up``'s (files as absolute
        paths); unset ones are left to the ``PLORA_*`` variables the gateway reads itself."""
        a = self.args
        out = []
        for flag, value in (
            ("--api-keys-file", a.api_keys_file),
            ("--tls-cert", a.tls_cert),
            ("--tls-key", a.tls_key),
            ("--tls-client-ca", a.tls_client_ca),
        ):
            if value:
                out += [flag, str(Path(value).resolve())]
        if a.insecure_no_auth:
            out.append("--insecure-no-auth")
        return out

    def _settle_gateway_client(self, gateway_flags: list[str]) -> None:
        """Check the gateway's security settings as it will (flags, then its ``PLORA_*``
        variables) and settle how ``plora up`` reaches it: over TLS trusting
        ``$PLORA_TLS_CA``, else the gateway's own certificate (a self-signed one, or a chain
        file that holds its CA); with ``$PLORA_API_KEY``.

        Raises:
            ConfigError: a setting the gateway would refuse (a non-loopback ``--host``
                without API keys, a certificate without its key, a malformed keys file, ...),
                mutual TLS without a client certificate for plora up, or API keys and demo
                adapters without an operator key in ``PLORA_API_KEY`` to register them with.
        """
        from plora.cli import client_security  # noqa: PLC0415
        from services.gateway.auth import KeyRing  # noqa: PLC0415
        from services.gateway.config import GatewayConfig  # noqa: PLC0415

        a = self.args
        parser = service_parser("gateway", GatewayConfig, exit_on_error=False)
        gateway = GatewayConfig.from_args(
            parser.parse_args([*gateway_flags, "--host", a.host, "--port", "0"])
        )
        gateway.check_security()
        if gateway.tls_client_ca and not env_or("PLORA_TLS_CLIENT_CERT", None):
            raise ConfigError(
                "with --tls-client-ca (mutual TLS) plora up checks the gateway with a client "
                "certificate: set PLORA_TLS_CLIENT_CERT and PLORA_TLS_CLIENT_KEY to one the "
                "client CA accepts"
            )
        ca = env_or("PLORA_TLS_CA", None) or gateway.tls_cert
        credentials, self.api_key = client_security(ca or None)
        self.gateway_credentials = credentials if gateway.tls_cert else None
        self.keys_on = bool(gateway.api_keys_file)
        if not self.keys_on:
            return
        ring = KeyRing.from_file(gateway.api_keys_file)  # a malformed file stops us here
        if a.demo_adapters > 0:
            principal = ring.principal_for(self.api_key) if self.api_key else None
            if principal is None or not principal.operator:
                raise ConfigError(
                    "with API keys (--api-keys-file / PLORA_API_KEYS_FILE) plora up registers "
                    "the demo adapters with an operator key: set PLORA_API_KEY to one "
                    f"{'(it is not an operator key of the file) ' if self.api_key else ''}"
                    "or pass --demo-adapters 0"
                )

    def _prepare_files(self) -> None:
        """Refuse to start over a running cluster, create the adapters' and the state file's
        directories, and remove a stale state file (its launcher is gone).

        Raises:
            RuntimeError: another cluster runs here, or a directory cannot be created.
        """
        a = self.args
        self._refuse_a_running_cluster()
        if a.demo_adapters > 0:
            hint = "give a writable directory for the demo adapters, or --demo-adapters 0"
            _make_dir(Path(a.adapters_dir), f"--adapters-dir {a.adapters_dir}", "it", hint)
        named = f"--state-file {a.state_file}"
        if not a.state_file:
            named = f"PLORA_STATE_FILE={self.state_file}"
        hint = "give a state file in a writable directory"
        _make_dir(self.run_dir, named, f"its directory {self.run_dir}", hint)
        self.state_file.unlink(missing_ok=True)
        self.credentials_file.unlink(missing_ok=True)

    def _prepare_model(self) -> tuple[Path, ModelSpec]:
        """The base model's directory (the first run converts the GGUF) and its shape; checks
        that the demo adapters' ranks fit it.

        Raises:
            ConfigError: the model cannot be found or converted, or a demo rank is too large.
        """
        self._say(
            "preparing the base model (first run converts the GGUF once; later runs reuse it)"
        )
        from services.worker import model_loader  # noqa: PLC0415

        model_dir = model_loader.resolve_model(self.args.model, model_loader.default_cache_dir())
        self._say(f"base model ready: {model_dir}")
        spec = model_loader.spec_from_dir(model_dir)
        if self.args.demo_adapters > 0:
            from plora.make_adapters import check_ranks  # noqa: PLC0415 - torch

            check_ranks(self.args.demo_ranks, spec, "--demo-ranks")
        return model_dir, spec

    def _start_redis(self) -> str:
        """Connect to the Redis of ``--redis-url`` / ``PLORA_REDIS_URL``, or start an embedded
        one that stops with this process; returns its URL.

        Raises:
            RegistryUnavailableError: the external Redis does not answer.
            ConfigError: its URL is malformed.
            RuntimeError: the embedded server exited or did not answer in time.
        """
        external = self.args.redis_url or env_or("PLORA_REDIS_URL", None)
        if external:
            connect(external)  # a clear RegistryUnavailableError when unreachable
            self.redis_url = external
            self.public_redis_url = url_without_password(external)
            self._say(f"using Redis at {redact_url(external)}")
        else:
            self.redis = EmbeddedRedis(
                host=self.args.host, stop_with_parent=True, password=secrets.token_urlsafe(32)
            ).start()
            self.redis_url = self.redis.url
            self.public_redis_url = self.redis.public_url
            self._say(
                f"started embedded Redis at {self.public_redis_url} (protected mode, with a "
                f"password new each run: see {self.credentials_file})"
            )
        return self.redis_url

    def _child_env(self) -> dict[str, str]:
        """The environment of every child: this one's, with the registry's URL (password
        included) and the internal token, which thus never appear on a command line, and
        without plora up's own client credentials (``PLORA_API_KEY``, ...)."""
        env = dict(os.environ, PLORA_REDIS_URL=self.redis_url)
        env["PLORA_INTERNAL_TOKEN"] = self.internal_token
        env.pop("PLORA_INTERNAL_TOKEN_FILE", None)  # it would win over this run's token
        for secret in _CLIENT_SECRETS:  # plora up's own client credentials: no service reads them
            env.pop(secret, None)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _start_predictor(self, plan: _Plan, env: dict[str, str]) -> Child | None:
        """Start the predictor without waiting for it (none when the policy has none).

        Raises:
            OSError: its process cannot be started or its log opened.
        """
        if "predictor" not in plan.flags:
            return None
        flags = [*self._common_flags(), "--port", "0", "--metrics-port", "0"]
        predictor = self._child("predictor", "predictor", [*flags, *plan.flags["predictor"]])
        predictor.start(env)
        return predictor

    def _start_workers(self, plan: _Plan, model_dir: Path, env: dict[str, str]) -> list[Child]:
        """Start the workers ``worker-<i>`` on ``model_dir`` without waiting for them.

        Raises:
            OSError: a process cannot be started or its log opened.
        """
        workers = []
        for i in range(self.args.workers):
            flags = [*self._common_flags(), "--worker-id", f"worker-{i}", "--port", "0"]
            flags += ["--metrics-port", "0", "--model", str(model_dir), *plan.flags["worker"]]
            workers.append(self._child(f"worker-{i}", "worker", flags))
            workers[-1].start(env)
        return workers

    def _start_gateway(self, plan: _Plan, predictor: Child | None, env: dict[str, str]) -> str:
        """Start the gateway on ``--gateway-port`` and wait until it serves; returns its address.

        Raises:
            RuntimeError: it exited or was not ready within 60 s.
            TimeoutError: its health check never passed.
            KeyboardInterrupt: a stop was requested meanwhile.
            OSError: its process cannot be started or its log opened.
        """
        a = self.args
        flags = [*self._common_flags(), "--port", str(a.gateway_port), "--metrics-port", "0"]
        flags += ["--http-port", str(a.http_port), *plan.flags["gateway"]]
        if predictor:
            flags += ["--predictor-address", f"{a.host}:{predictor.ports['grpc_port']}"]
        gateway = self._child("gateway", "gateway", flags)
        gateway.start(env)
        self._wait_ready([gateway], 60)
        return self._dial(gateway.ports["grpc_port"])

    def _dial(self, port: int) -> str:
        """The address a client on this host dials for a service of its own on ``port`` (what
        ``plora up`` dials, and the gateway address it writes to the state file): ``--host``,
        or 127.0.0.1 for a wildcard ``--host`` (``0.0.0.0``, ``::``), an address a TLS
        certificate can name."""
        host = self.args.host
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"{host}:{port}"

    def _common_flags(self) -> list[str]:
        """The flags every service gets: the interface to bind (the Redis URL and the internal
        token come in the environment, :meth:`_child_env`)."""
        return ["--host", self.args.host]

    def _write_state(self, plan: _Plan, gateway: str, adapters: list[str]) -> ClusterState:
        """Write the Prometheus targets, the credentials file and then the state file (each
        atomically; the last two mode 0600); returns the state.

        Raises:
            OSError: a file cannot be written.
        """
        host = self.args.host
        workers = [c for c in self.children if c.is_worker]
        predictor = next((c for c in self.children if c.name == "predictor"), None)
        state: ClusterState = {
            "gateway": gateway,
            "metrics": {
                c.name: f"http://{host}:{c.ports['metrics_port']}/metrics" for c in self.children
            },
            "redis_url": self.public_redis_url,
            "credentials_file": str(self.credentials_file),
            "policy": plan.policy,
            "policy_env": plan.policy_env,
            "workers": {w.name: f"{host}:{w.ports['grpc_port']}" for w in workers},
            "predictor": f"{host}:{predictor.ports['grpc_port']}" if predictor else "",
            "adapters": adapters,
            "pids": {c.name: c.proc.pid for c in self.children if c.proc},
            "launcher_pid": os.getpid(),
        }
        gateway_child = next(c for c in self.children if c.name == "gateway")
        scheme = "https" if self.gateway_credentials else "http"
        state["openai_base_url"] = f"{scheme}://{self._dial(gateway_child.ports['http_port'])}/v1"
        state["prometheus_targets"] = str(self.targets_file)
        write_json_atomic(self.targets_file, prometheus_targets(state["metrics"]), indent=2)
        credentials = ClusterCredentials(
            redis_url=self.redis_url, internal_token=self.internal_token
        )
        self._wrote_state = True
        write_json_atomic(self.credentials_file, credentials, indent=2, mode=0o600)
        write_json_atomic(self.state_file, state, indent=2, mode=0o600)
        return state

    def _register_demo_adapters(self, gateway: str, spec: ModelSpec) -> list[str]:
        """Write the ``--demo-adapters`` adapters for ``spec`` and register them with the
        gateway at ``gateway``; returns their ids.

        Raises:
            grpc.RpcError: the gateway refused or did not answer a registration.
            OSError: an adapter cannot be written.
        """
        a = self.args
        if a.demo_adapters <= 0:
            return []
        from plora.make_adapters import make_adapter_set  # noqa: PLC0415

        out = Path(a.adapters_dir)
        paths = make_adapter_set(
            out,
            spec,
            count=a.demo_adapters,
            ranks=a.demo_ranks,
            seed=0,
            relative_delta=a.demo_relative_delta,
        )
        ids = []
        port = int(gateway.rpartition(":")[2])
        address = self._dial(port)
        with client_channel(address, self.gateway_credentials, self.api_key) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for path in paths:
                adapter_id = Path(path).name
                stub.RegisterAdapter(
                    gateway_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=str(path)),
                    timeout=60,
                )
                ids.append(adapter_id)
        self._say(f"registered {len(ids)} demo adapters: {', '.join(ids)}")
        return ids

    # -- run and stop -----------------------------------------------------------------------

    def watch(self, max_restarts: int = 3, window_s: float = 300.0) -> int:
        """Supervise the children until a signal; returns the exit code.

        A child that dies is restarted on the same ports (so its peers reconnect to it), at most
        ``max_restarts`` times per ``window_s`` seconds; past that, or when its restart fails,
        a worker is left stopped for :data:`CRASH_PAUSE_S` (doubling up to
        :data:`CRASH_PAUSE_MAX_S`) and then tried again, as long as another worker serves;
        otherwise (the gateway, the predictor, the last worker) the whole cluster stops.
        A restart that fails because an external Redis is unreachable
        (:data:`~services.common.lifecycle.EXIT_REGISTRY_UNAVAILABLE`) is tried again every
        ``REGISTRY_RETRY_S`` seconds, uncounted, while the rest of the cluster goes on serving
        (the gateway from its cached records).
        The embedded Redis is not restarted: it keeps no data, and an empty registry under
        running workers would hand out adapter versions they have already seen (refused as
        stale, or a different adapter under a cached version), so its exit stops the cluster.
        """
        restarts: dict[str, list[float]] = {c.name: [] for c in self.children}
        # child name -> when to try again to start it (it could not reach Redis)
        waiting: dict[str, float] = {}
        # crash-looping worker -> when to try it again, and its last pause (seconds)
        paused: dict[str, float] = {}
        pause_s: dict[str, float] = {}

        def pause(c: Child, why: str) -> bool:
            """Leave worker ``c`` stopped for a while if another worker serves."""
            others = [o.name for o in self.children if o.is_worker and o is not c and o.alive()]
            if not c.is_worker or not others:
                return False
            pause_s[c.name] = min(CRASH_PAUSE_MAX_S, 2 * pause_s.get(c.name, CRASH_PAUSE_S / 2))
            paused[c.name] = time.monotonic() + pause_s[c.name]
            self._say(
                f"{why}; leaving {c.name} stopped for {pause_s[c.name]:g}s while "
                f"{', '.join(others)} {'serves' if len(others) == 1 else 'serve'}, then trying "
                f"again. Last log lines:\n{c.log_tail()}"
            )
            return True

        while not self._stop_after(0.5):
            redis_code = self.redis.exit_code() if self.redis is not None else None
            if redis_code is not None and not self._stop_requested:
                self._say(
                    f"redis-server ({self.public_redis_url}) exited (code {redis_code}); the "
                    "adapter registry and its contents are gone, so the cluster cannot go on: "
                    "stopping (start it again with plora up)"
                )
                return 1
            for c in self.children:
                if c.alive():
                    c.echoed = self._echo_progress(c, c.echoed, _SERVING)
                if c.alive() or self._stop_requested:  # dying from the same signal: no restart
                    continue
                code = c.proc.returncode if c.proc else "?"
                now = time.monotonic()
                if c.name in waiting:
                    if now < waiting[c.name]:
                        continue
                elif c.name in paused:
                    if now < paused[c.name]:
                        continue
                    del paused[c.name]
                    restarts[c.name] = [now]
                    self._say(f"{c.name}: pause over; starting it again on the same ports")
                else:
                    recent = [t for t in restarts[c.name] if now - t < window_s]
                    if len(recent) >= max_restarts:
                        n = len(recent) + 1
                        why = f"{c.name} exited (code {code}) {n} times within {window_s:.0f}s"
                        if pause(c, why):
                            continue
                        self._say(f"{why}; stopping. Last log lines:\n{c.log_tail()}")
                        return 1
                    restarts[c.name] = [*recent, now]
                    self._say(f"{c.name} exited (code {code}); restarting it on the same ports")
                try:
                    # a retry while Redis is unreachable fails the same way every 5 s: its
                    # start-up lines were echoed on the first try
                    self._restart(c, echo=() if c.name in waiting else _STARTUP)
                except (RuntimeError, TimeoutError) as exc:
                    if c.proc is None or c.proc.returncode != EXIT_REGISTRY_UNAVAILABLE:
                        if pause(c, f"restart of {c.name} failed: {exc}"):
                            continue
                        self._say(f"restart of {c.name} failed: {exc}; stopping")
                        return 1
                    if c.name not in waiting:
                        self._say(
                            f"{c.name} cannot start while the adapter registry "
                            f"({redact_url(self.redis_url)}) is unreachable; trying again "
                            f"every {REGISTRY_RETRY_S:g}s (the rest of the cluster goes on)"
                        )
                    waiting[c.name] = time.monotonic() + REGISTRY_RETRY_S
                    continue
                if waiting.pop(c.name, None) is not None:
                    self._say(f"{c.name} started again: the adapter registry is reachable")
        return 0

    def _restart(self, child: Child, echo: tuple[str, ...] = _STARTUP) -> None:
        child.cmd = _pin_ports(child.cmd, child.ports)
        child.start(self._child_env())
        self._wait_ready([child], self.args.startup_timeout, echo)
        if self.state_file.exists():
            state = json.loads(self.state_file.read_text())
            state["pids"][child.name] = child.proc.pid if child.proc else None
            write_json_atomic(self.state_file, state, indent=2, mode=0o600)

    def request_stop(self) -> None:
        """Ask :meth:`start` / :meth:`watch` to stop (safe in a signal handler: takes no lock)."""
        self._stop_requested = True

    def _stop_after(self, seconds: float) -> bool:
        """Sleep ``seconds`` (a signal's handler runs meanwhile), then whether a stop was
        requested."""
        if not self._stop_requested:
            time.sleep(seconds)
        return self._stop_requested

    def stop(self) -> None:
        """Stop the gateway first (no new requests), then the others together, then Redis."""
        gateways = [c for c in self.children if c.name == "gateway"]
        for c in gateways:
            c.stop()
        rest = [c for c in self.children if c.name != "gateway"]
        for c in rest:
            c.signal_stop()
        for c in rest:
            c.stop()
        if self.redis is not None:
            self.redis.stop()
        if self._wrote_state:
            self.state_file.unlink(missing_ok=True)
            self.targets_file.unlink(missing_ok=True)
            self.credentials_file.unlink(missing_ok=True)


def prometheus_targets(metrics: Mapping[str, str]) -> list[dict[str, object]]:
    """Prometheus file-based service discovery targets (``file_sd_configs``) of a cluster.

    Args:
        metrics: ``service name -> metrics URL`` (``http://host:port/metrics``), as in the state
            file's ``metrics``.

    Returns:
        One target group per service: ``{"targets": ["host:port"], "labels": {"service": ...}}``
        with ``service`` ``gateway``, ``predictor`` or ``worker``, and for a worker also
        ``worker`` (its id), so its series can be told apart without the port in ``instance``.
    """
    groups: list[dict[str, object]] = []
    for name, url in metrics.items():
        address = url.removeprefix("http://").removesuffix("/metrics")
        labels = (
            {"service": "worker", "worker": name}
            if name.startswith("worker")
            else {"service": name}
        )
        groups.append({"targets": [address], "labels": labels})
    return groups


def _make_dir(path: Path, named: str, what: str, hint: str) -> None:
    """Create the directory ``path`` (and its parents) before anything starts.

    Args:
        path: The directory.
        named: The setting it comes from, e.g. ``--adapters-dir DIR``.
        what: What the message calls the directory (``it``, ``its directory DIR``).
        hint: What to do instead.

    Raises:
        RuntimeError: it cannot be created; one line naming the setting, why, and ``hint``.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(f"{named}: cannot create {what} ({exc.strerror}); {hint}") from None


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (a probe: another process may take it after)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def _pin_ports(cmd: list[str], ports: dict[str, int]) -> list[str]:
    """``cmd`` with ``--port``/``--metrics-port`` set to the ports the child bound before."""
    out = list(cmd)
    for flag, key in (
        ("--port", "grpc_port"),
        ("--metrics-port", "metrics_port"),
        ("--http-port", "http_port"),
    ):
        if flag in out and key in ports:
            out[out.index(flag) + 1] = str(ports[key])
    return out


def _cli_command() -> str:
    """How the user can call this ``plora`` from their shell: ``plora`` when that name on
    PATH is this installation, else the script's path (``make up`` runs ``.venv/bin/plora``
    without activating the venv)."""
    script = Path(sys.executable).parent / "plora"
    on_path = shutil.which("plora")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "plora"
    if script.exists():
        try:
            return str(script.relative_to(Path.cwd()))
        except ValueError:
            return str(script)
    return "plora"


def try_command(state_file: Path) -> str:
    """The ``plora`` command the ready message suggests (:func:`_cli_command`), preceded by
    ``PLORA_STATE_FILE=<path>`` when the cluster's state file is not the default one, so the
    command reaches this cluster and not the default one (or none)."""
    command = _cli_command()
    if state_file != Path(DEFAULT_STATE_FILE):
        command = f"PLORA_STATE_FILE={shlex.quote(str(state_file))} {command}"
    return command


def run(args: argparse.Namespace) -> int:
    """``plora up``."""
    cluster = Cluster(args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: cluster.request_stop())
    try:
        state = cluster.start()
    except KeyboardInterrupt:
        print("plora up: interrupted during start-up; stopping", flush=True)
        cluster.stop()
        return 130
    except (PLoRAError, RuntimeError, TimeoutError, grpc.RpcError) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"plora up: failed: {detail}", file=sys.stderr, flush=True)
        cluster.stop()
        return 2
    needs = [
        *(["PLORA_TLS_CA (the gateway's CA)"] if cluster.gateway_credentials else []),
        *(["PLORA_API_KEY (a key of the keys file)"] if cluster.keys_on else []),
    ]
    if needs:
        print(f"plora up: the CLI needs {' and '.join(needs)} (docs/security.md)", flush=True)
    print(
        f"plora up: cluster ready - gateway {state['gateway']}, state in {cluster.state_file}\n"
        f'  try: {try_command(cluster.state_file)} generate "What is the capital of France?"\n'
        f"  OpenAI-compatible API: {state.get('openai_base_url', '-')}\n"
        f"  metrics: " + ", ".join(f"{k}={v}" for k, v in state["metrics"].items()) + "\n"
        "  Ctrl-C stops everything.",
        flush=True,
    )
    code = cluster.watch()
    print("plora up: stopping...", flush=True)
    cluster.stop()
    print("plora up: stopped", flush=True)
    return code
