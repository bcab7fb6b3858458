"""``plora up``: the supervisor loop under SIGTERM (real signals, real child processes) and
the flags that make each service run a policy."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from plora import launcher
from plora.launcher import (
    POLICY_FLAG_ENV,
    REGISTRY_RETRY_S,
    Child,
    Cluster,
    _cli_command,
    add_arguments,
    check_service_flags,
    overridden_policy_env,
    policy_flags,
    prometheus_targets,
    try_command,
)
from plora.policies import POLICIES, PolicySpec, get_policy
from services.common.errors import ConfigError
from services.common.redis_server import EmbeddedRedis
from services.gateway.config import GatewayConfig
from services.predictor.config import PredictorConfig
from services.worker.config import WorkerConfig
from tests.conftest import REPO, OwnRedis, _pid_alive
from tests.helpers import config_from_flags

# Runs in a child interpreter so a deadlock fails the test by timeout instead of hanging it.
SCRIPT = textwrap.dedent(
    """
    import argparse, os, random, signal, subprocess, sys, time
    from pathlib import Path
    from plora.launcher import Child, Cluster, add_arguments

    tmp = Path(sys.argv[1])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cluster = Cluster(parser.parse_args(["--state-file", str(tmp / "cluster.json")]))
    signal.signal(signal.SIGTERM, lambda *_: cluster.request_stop())
    random.seed(0)
    for _ in range(20):  # signals landing anywhere in the loop, the sleep included
        cluster._stop_requested = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, lambda *_: cluster.request_stop())
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0005, 0.02))
        assert cluster.watch() == 0
    # a child dying from the same SIGTERM (as under `kill -TERM -<pgid>`) is not restarted
    child = Child("worker-0", [sys.executable, "-c", "import time; time.sleep(60)"],
                  tmp / "w.log", tmp / "w.ready")
    child.start(dict(os.environ))
    cluster.children = [child]
    cluster._stop_requested = False
    signal.signal(signal.SIGALRM, lambda *_: (child.proc.terminate(), child.proc.wait(),
                                             cluster.request_stop()))
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    started = time.monotonic()
    assert cluster.watch() == 0
    assert child.proc.returncode is not None and time.monotonic() - started < 5
    assert "restarting" not in (tmp / "w.log").read_text()
    print("ok")
    """
)


def test_watch_stops_on_a_signal_without_deadlock_or_restarts(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
    assert "restarting" not in out.stdout


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_flags_make_every_service_run_the_policy(name: str) -> None:
    """Each service's own parser turns the launcher's flags into the policy's pieces."""
    spec = POLICIES[name]
    flags = policy_flags(spec)

    worker = config_from_flags(WorkerConfig, *flags["worker"])
    assert (worker.allocator, worker.eviction) == (spec.allocator, spec.eviction)
    assert worker.host_staging == ("on" if spec.host_staging else "off")
    assert config_from_flags(GatewayConfig, *flags["gateway"]).routing == spec.routing
    assert ("predictor" in flags) == spec.predictor
    if spec.predictor:
        predictor = config_from_flags(PredictorConfig, *flags["predictor"])
        assert predictor.prefetch == ("on" if spec.prefetch else "off")


def test_plora_up_without_policy_leaves_policy_settings_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``plora up`` without ``--policy`` runs plora, but a ``PLORA_*`` policy variable the user
    set reaches its service (the README's "flags, then environment"); an explicit policy (and
    every benchmark cluster) passes all its flags, which win over the environment."""
    env = {"PLORA_ALLOCATOR": "contiguous", "PLORA_ROUTING": "round_robin"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plora = POLICIES["plora"]

    kept = policy_flags(plora, keep_env=env)
    assert "--allocator" not in kept["worker"] and "--routing" not in kept["gateway"]
    worker = config_from_flags(WorkerConfig, *kept["worker"])
    assert (worker.allocator, worker.eviction) == ("contiguous", plora.eviction)
    assert config_from_flags(GatewayConfig, *kept["gateway"]).routing == "round_robin"
    assert overridden_policy_env(env) == env

    # every variable the launcher defers to is the one its service reads
    every = {
        "PLORA_ALLOCATOR": "contiguous",
        "PLORA_EVICTION": "lru",
        "PLORA_HOST_STAGING": "off",
        "PLORA_ROUTING": "round_robin",
        "PLORA_PREDICTOR_PREFETCH": "off",
    }
    assert set(every) == set(POLICY_FLAG_ENV.values())
    for name, value in every.items():
        monkeypatch.setenv(name, value)
    kept = policy_flags(plora, keep_env=every)
    assert kept == {"worker": [], "gateway": [], "predictor": []}
    worker = config_from_flags(WorkerConfig)
    assert (worker.allocator, worker.eviction, worker.host_staging) == ("contiguous", "lru", "off")
    assert config_from_flags(GatewayConfig).routing == "round_robin"
    assert config_from_flags(PredictorConfig).prefetch == "off"

    forced = policy_flags(plora)
    assert config_from_flags(WorkerConfig, *forced["worker"]).allocator == plora.allocator
    assert config_from_flags(GatewayConfig, *forced["gateway"]).routing == plora.routing


def test_an_inconsistent_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="prefetch needs the predictor"):
        PolicySpec("x", "paged", "lru", "rank_aware", predictor=False, prefetch=True)
    with pytest.raises(ValueError, match="allocator"):
        PolicySpec("x", "buddy", "lru", "rank_aware", predictor=False, prefetch=False)
    with pytest.raises(ValueError, match="unknown policy 'plora-fast'"):
        get_policy("plora-fast")


def test_ready_hint_names_a_plora_the_shell_can_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make up`` runs ``.venv/bin/plora`` without activating the venv: the "try: ..." hint
    must name that path, and plain ``plora`` only when PATH finds this same script."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "plora"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert _cli_command() == "venv/bin/plora"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert _cli_command() == "plora"


def test_ready_hint_names_a_non_default_state_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--state-file elsewhere.json`` the "try: plora generate ..." hint used to read
    the default state file, so it reached another cluster or none; it now sets
    PLORA_STATE_FILE. ``plora up`` itself writes to $PLORA_STATE_FILE when no flag is given."""
    monkeypatch.setattr(launcher, "_cli_command", lambda: "plora")
    assert try_command(Path(".plora/cluster.json")) == "plora"
    assert try_command(Path("my dir/c.json")) == "PLORA_STATE_FILE='my dir/c.json' plora"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv("PLORA_STATE_FILE", raising=False)
    assert Cluster(parser.parse_args([])).state_file == Path(".plora/cluster.json")
    monkeypatch.setenv("PLORA_STATE_FILE", str(tmp_path / "env.json"))
    assert Cluster(parser.parse_args([])).state_file == tmp_path / "env.json"
    flag = ["--state-file", str(tmp_path / "flag.json")]
    assert Cluster(parser.parse_args(flag)).state_file == tmp_path / "flag.json"


def test_a_child_shows_only_its_own_log_lines_and_leaves_no_ready_file(tmp_path: Path) -> None:
    """The logs under ``.plora/logs`` are appended to across runs: a start-up failure shows
    the lines of this start, not an earlier run's; a stopped child's ready file is removed."""
    log = tmp_path / "logs" / "worker-0.log"
    log.parent.mkdir()
    log.write_text("ERROR an earlier run's failure\n")
    ready = tmp_path / "run" / "worker-0.ready.json"
    ready.parent.mkdir()
    code = (
        f"import pathlib, time; print('INFO this run', flush=True); "
        f"pathlib.Path({str(ready)!r}).write_text('{{}}'); time.sleep(60)"
    )
    child = Child("worker-0", [sys.executable, "-c", code], log, ready)
    child.start(dict(os.environ))
    try:
        for _ in range(200):
            if child.poll_ready() and "this run" in child.log_tail():
                break
            time.sleep(0.05)
        tail = child.log_tail()
        assert "INFO this run" in tail and "earlier run" not in tail
        assert "earlier run" in log.read_text()  # kept in the file, marked off by a header
        assert "plora up: starting worker-0" in log.read_text()
    finally:
        child.stop(timeout=5)
    assert not ready.exists()


def test_plora_up_refuses_to_start_over_a_running_cluster(tmp_path: Path) -> None:
    """A second ``plora up`` used to start beside the first on the same gateway port (gRPC's
    SO_REUSEPORT) and split its requests, then remove its state file when stopped. It is now
    refused before anything starts, and the first cluster's state file is left alone."""

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    state = tmp_path / "cluster.json"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state.write_text(json.dumps({"launcher_pid": other.pid, "gateway": "127.0.0.1:1"}))
        cluster = Cluster(parser.parse_args(["--state-file", str(state), "--gateway-port", "0"]))
        with pytest.raises(RuntimeError, match=f"running with .*kill -TERM {other.pid}"):
            cluster.start()
        cluster.stop()
        assert json.loads(state.read_text())["launcher_pid"] == other.pid
    finally:
        other.kill()
        other.wait()

    with socket.socket() as listener:  # the gateway port is taken by something else
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        cluster = Cluster(
            parser.parse_args(["--state-file", str(state), "--gateway-port", str(port)])
        )
        with pytest.raises(RuntimeError, match=f"gateway port 127.0.0.1:{port} is in use"):
            cluster.start()
        cluster.stop()
    assert cluster.redis is None and not cluster.children

    # an address that is not this machine's, a demo-adapter directory that cannot be made, and
    # a state file whose directory cannot be (it was a FileNotFoundError traceback)
    for argv, message in [
        (["--host", "nonexistent.invalid"], "--host 'nonexistent.invalid' is not an address of"),
        (["--host", "192.0.2.1"], "--host '192.0.2.1' is not an address of this machine"),
        (["--adapters-dir", "/proc/nope"], "--adapters-dir /proc/nope: cannot create it"),
        (
            ["--state-file", "/proc/nope/cluster.json"],
            "--state-file /proc/nope/cluster.json: cannot create its directory /proc/nope (No "
            "such file or directory); give a state file in a writable directory",
        ),
    ]:
        cluster = Cluster(
            parser.parse_args(["--state-file", str(state), "--gateway-port", "0", *argv])
        )
        with pytest.raises(RuntimeError, match=re.escape(message)):
            cluster.start()
        cluster.stop()
        assert cluster.redis is None and not cluster.children


def test_plora_up_takes_its_gateway_port_from_plora_gateway_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plora up`` always bound 50051 unless given --gateway-port (the gateway's own
    PLORA_GATEWAY_PORT was overridden by the flag it passes), so ``make up`` could not move.
    Without the flag the variable is the port, checked like the flag."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    state = tmp_path / "cluster.json"
    monkeypatch.setenv("PLORA_GATEWAY_PORT", "99999")
    cluster = Cluster(parser.parse_args(["--state-file", str(state)]))
    with pytest.raises(ConfigError, match=r"^--port / PLORA_GATEWAY_PORT must be a port 0\.\."):
        cluster.start()
    cluster.stop()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        monkeypatch.setenv("PLORA_GATEWAY_PORT", str(port))
        cluster = Cluster(parser.parse_args(["--state-file", str(state)]))
        with pytest.raises(RuntimeError, match=f"gateway port 127.0.0.1:{port} is in use"):
            cluster.start()
        cluster.stop()
    assert cluster.redis is None and not cluster.children and not state.exists()


def test_plora_up_refuses_a_bad_setting_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad policy variable or ``--worker-arg`` used to surface only once Redis had started
    and the model had loaded (~10 s), as a worker's start-up failure naming a dataclass field;
    it is now refused up front, naming the service and the setting."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    state = tmp_path / "cluster.json"
    cases = [
        ({"PLORA_ALLOCATOR": "foo"}, [], r"^worker: PLORA_ALLOCATOR='foo' is not one of"),
        ({"PLORA_ROUTING": "random"}, [], r"^gateway: PLORA_ROUTING='random' is not one of"),
        ({"PLORA_PREDICTOR_PREFETCH": "yes"}, [], r"^predictor: PLORA_PREDICTOR_PREFETCH="),
        ({}, ["--worker-arg", "--max-batch-size x"], r"^worker: argument --max-batch-size"),
        ({}, ["--worker-arg", "--no-such-flag 1"], r"^worker: unknown flag\(s\) --no-such-flag"),
        ({}, ["--worker-arg=--max-batch-size=0"], r"^worker: --max-batch-size / PLORA_MAX"),
        ({}, ["--pool-bytes", "lots"], r"^worker: --pool-bytes / PLORA_POOL_BYTES: 'lots' is"),
        ({}, ["--pool-bytes", "0"], r"^worker: --pool-bytes / PLORA_POOL_BYTES must be at least"),
        ({}, ["--model", "/nonexistent.gguf"], r"^model file /nonexistent.gguf does not exist"),
        # a new operator's PLORA_MODEL was ignored by plora up, which served SmolLM2
        ({"PLORA_MODEL": "/nonexistent.gguf"}, [], r"^model file /nonexistent.gguf does not"),
        ({}, ["--adapter-root", "/nonexistent"], r"^--adapter-root / PLORA_ADAPTER_ROOTS: "),
        ({"PLORA_ADAPTER_ROOTS": "/nonexistent"}, [], r"adapter root '/nonexistent' is not"),
    ]
    for env, argv, message in cases:
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            cluster = Cluster(
                parser.parse_args(["--state-file", str(state), "--gateway-port", "0", *argv])
            )
            with pytest.raises(ConfigError, match=message):
                cluster.start()
            cluster.stop()
        assert cluster.redis is None and not cluster.children
        assert not state.exists()


def test_plora_up_passes_its_adapter_roots_and_its_demo_directory_to_gateway_and_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--adapter-root`` (else ``PLORA_ADAPTER_ROOTS``) reaches the gateway and every worker
    as flags, with the demo adapters' directory added so they register; no root: no flag, the
    services read sources wherever they are, as before."""
    monkeypatch.delenv("PLORA_ADAPTER_ROOTS", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    demo = tmp_path / "demo"
    base = ["--state-file", str(tmp_path / "c.json"), "--adapters-dir", str(demo)]

    def roots_passed(argv: list[str]) -> dict[str, list[str]]:
        plan = Cluster(parser.parse_args([*base, *argv]))._plan()
        return {
            service: [f[i + 1] for i, x in enumerate(f) if x == "--adapter-root"]
            for service, f in plan.flags.items()
        }

    assert roots_passed([]) == {"gateway": [], "worker": [], "predictor": []}
    both = [str(tmp_path), str(demo)]
    assert roots_passed(["--adapter-root", str(tmp_path)]) == {
        "gateway": both, "worker": both, "predictor": []
    }  # fmt: skip
    assert roots_passed(["--adapter-root", str(tmp_path), "--demo-adapters", "0"])["worker"] == [
        str(tmp_path)
    ]
    monkeypatch.setenv("PLORA_ADAPTER_ROOTS", os.pathsep.join([str(tmp_path), "/"]))
    assert roots_passed([])["gateway"] == [str(tmp_path), "/", str(demo)]


def test_plora_up_refuses_a_demo_rank_above_the_model_s_before_starting_anything(
    tmp_path: Path,
) -> None:
    """``plora up --demo-ranks 100000 --demo-adapters 1`` allocated adapters until the OOM
    killer ended it (after Redis and every service had started); the rank is now refused once
    the model is known, before Redis starts, naming the flag and the largest rank."""
    from tests.helpers import tiny_llama  # noqa: PLC0415

    model_dir = tmp_path / "tiny-model"
    tiny_llama(0).save_pretrained(str(model_dir))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    state = tmp_path / "cluster.json"
    adapters = tmp_path / "adapters"
    argv = ["--state-file", str(state), "--model", str(model_dir), "--gateway-port", "0"]
    argv += ["--adapters-dir", str(adapters)]
    cluster = Cluster(parser.parse_args([*argv, "--demo-ranks", "100000", "--demo-adapters", "1"]))
    with pytest.raises(
        ConfigError,
        match=r"^--demo-ranks 100000: the largest rank tiny-model allows is 32, "
        r"min\(in_features, out_features\) of k_proj \(64 x 32\)",
    ):
        cluster.start()
    cluster.stop()
    assert cluster.redis is None and not cluster.children and not state.exists()
    assert not any(adapters.iterdir())


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--workers", "0"], "argument --workers: expected a whole number of workers, 1.."),
        (["--workers", "-1"], "argument --workers: expected a whole number of workers, 1.."),
        (["--workers", "100000"], "(4 per core of this machine: each worker holds its own"),
        (["--gateway-port", "99999"], "argument --gateway-port: expected a port 0..65535"),
        (["--gateway-port", "-1"], "argument --gateway-port: expected a port 0..65535"),
        (["--demo-ranks", "8,abc"], "argument --demo-ranks: expected comma-separated positive"),
        (["--demo-ranks", "8,0"], "argument --demo-ranks: expected comma-separated positive"),
        (["--demo-ranks", ","], "argument --demo-ranks: expected comma-separated positive"),
        (["--demo-adapters", "-5"], "argument --demo-adapters: expected a whole number of"),
        (["--demo-relative-delta", "0"], "argument --demo-relative-delta: expected a positive"),
        (["--demo-relative-delta", "nan"], "argument --demo-relative-delta: expected a positive"),
        (["--startup-timeout", "0"], "argument --startup-timeout: expected a positive number"),
        (["--startup-timeout", "inf"], "argument --startup-timeout: expected a positive number"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)
def test_plora_up_refuses_meaningless_numbers_as_usage_errors(
    flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's ``plora up --workers 0`` failed after ~20 s with a misleading message,
    ``--gateway-port 99999`` with an OverflowError traceback and ``--demo-ranks 8,abc`` with a
    ValueError one; each is now refused by argparse (exit 2) before anything starts."""
    from plora import cli  # noqa: PLC0415

    state = tmp_path / "cluster.json"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--state-file", str(state), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: plora up") and needle in err, err
    assert "Traceback" not in err and not tmp_path.joinpath("logs").exists()


def test_plora_up_accepts_the_edges_of_its_ranges() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workers", "1", "--gateway-port", "65535", "--demo-ranks", "1,128"])
    assert (args.workers, args.gateway_port, args.demo_ranks) == (1, 65535, [1, 128])
    assert parser.parse_args(["--gateway-port", "0"]).gateway_port == 0
    assert parser.parse_args(["--demo-adapters", "0"]).demo_adapters == 0
    assert parser.parse_args([]).demo_ranks == [8, 16, 32, 64]


KILLED_PARENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from services.common.redis_server import EmbeddedRedis
    from plora.launcher import Child

    tmp = Path(sys.argv[1])
    child = Child("worker-0", [sys.executable, "-c", "import time; time.sleep(120)"],
                  tmp / "w.log", tmp / "w.ready")
    child.start(dict(os.environ))
    redis = EmbeddedRedis(stop_with_parent=True).start()
    print(child.proc.pid, redis.proc.pid, flush=True)
    time.sleep(120)
    """
)


def test_children_and_redis_stop_when_plora_up_is_killed(tmp_path: Path) -> None:
    """``kill -9`` of ``plora up`` used to leave its services and Redis running, holding the
    ports; its children now get SIGTERM when it dies (prctl PR_SET_PDEATHSIG)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", KILLED_PARENT, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(_pid_alive(p) for p in pids)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _pid_alive(p)]
    for p in left:
        os.kill(p, 9)
    assert not left, f"still running after their parent was killed: {left}"

    # what `plora serve worker` accepts besides the config's flags is accepted here too
    check_service_flags("worker", ["--log-level", "DEBUG", "--log-json", "--pool-bytes", "1GiB"])


def test_prometheus_targets_label_each_service_and_worker() -> None:
    groups = prometheus_targets({
        "predictor": "http://127.0.0.1:41001/metrics",
        "worker-0": "http://127.0.0.1:41002/metrics",
        "worker-1": "http://127.0.0.1:41003/metrics",
        "gateway": "http://127.0.0.1:41004/metrics",
    })  # fmt: skip
    assert groups == [
        {"targets": ["127.0.0.1:41001"], "labels": {"service": "predictor"}},
        {"targets": ["127.0.0.1:41002"], "labels": {"service": "worker", "worker": "worker-0"}},
        {"targets": ["127.0.0.1:41003"], "labels": {"service": "worker", "worker": "worker-1"}},
        {"targets": ["127.0.0.1:41004"], "labels": {"service": "gateway"}},
    ]


def test_plora_up_stops_when_its_redis_dies(tmp_path: Path, capsys) -> None:
    """``kill -9`` of the embedded redis-server: the supervisor says so and stops with a
    nonzero code (an empty registry under running workers is not restarted), naming the
    server by its URL without the password."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cluster = Cluster(parser.parse_args(["--state-file", str(tmp_path / "cluster.json")]))
    password = "redis-password-of-this-test"
    cluster.redis = EmbeddedRedis(password=password).start()
    cluster.redis_url = cluster.redis.url
    cluster.public_redis_url = cluster.redis.public_url
    try:
        assert cluster.redis.proc is not None
        cluster.redis.proc.kill()
        started = time.monotonic()
        assert cluster.watch() == 1
        assert time.monotonic() - started < 5
    finally:
        cluster.stop()
    out = capsys.readouterr().out
    assert f"plora up: redis-server ({cluster.redis.public_url}) exited (code -9)" in out
    assert "stopping" in out and password not in out


@pytest.mark.slow
def test_a_service_that_cannot_reach_an_external_redis_is_retried_not_the_cluster_stopped(
    own_redis: OwnRedis, tmp_path: Path, capsys
) -> None:
    """With an external Redis down, a service that died could not start again (it checks
    Redis first) and ``plora up`` stopped the whole cluster, the services still serving
    included (new-user trial). Its restart is now tried again every few seconds, uncounted,
    and it comes back once Redis does."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cluster = Cluster(parser.parse_args(["--state-file", str(tmp_path / "cluster.json")]))
    cluster.redis_url = own_redis.url
    env = dict(os.environ, PLORA_REDIS_URL=own_redis.url, PYTHONUNBUFFERED="1")
    flags = ["--host", "127.0.0.1", "--port", "0"]
    predictor = cluster._child("predictor", "predictor", [*flags, "--metrics-port", "0"])
    predictor.start(env)
    watched: list[int] = []
    try:
        cluster._wait_ready([predictor], 120)
        own_redis.kill()
        assert predictor.proc is not None
        predictor.proc.kill()
        predictor.proc.wait()
        watcher = threading.Thread(target=lambda: watched.append(cluster.watch()))
        watcher.start()
        deadline = time.monotonic() + 60
        out = ""
        while "cannot start while the adapter registry" not in out:
            out += capsys.readouterr().out
            assert watcher.is_alive(), "plora up stopped"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(2.5 * REGISTRY_RETRY_S)  # two more tries fail the same way
        out += capsys.readouterr().out
        # the service's own error line is echoed once, not once per try
        assert len([ln for ln in out.splitlines() if " ERROR " in ln]) == 1, out
        own_redis.start()
        deadline = time.monotonic() + 90
        out = ""
        while "started again" not in out:
            out += capsys.readouterr().out
            assert watcher.is_alive(), out
            assert time.monotonic() < deadline, out
            time.sleep(0.2)
        assert predictor.alive()
        cluster.request_stop()
        watcher.join(30)
        assert watched == [0]
    finally:
        cluster.request_stop()
        cluster.stop()


def test_watch_echoes_the_warnings_and_errors_of_serving_services(tmp_path: Path, capsys) -> None:
    """A Redis outage, a failed load: once the cluster serves, a service's warnings and errors
    reach the `plora up` terminal too (they went only to .plora/logs/, so the terminal of
    `make up` showed nothing during an outage); its INFO lines do not."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cluster = Cluster(parser.parse_args(["--state-file", str(tmp_path / "cluster.json")]))
    script = (
        "import time; time.sleep(0.3)\n"
        "print('03:00:00 [worker-0] INFO services.worker.server: routine', flush=True)\n"
        "print('03:00:01 [worker-0] WARNING services.common.registry: Redis is gone', "
        "flush=True)\n"
        "time.sleep(60)\n"
    )
    child = Child("worker-0", [sys.executable, "-c", script], tmp_path / "w.log", tmp_path / "r")
    child.start(dict(os.environ))
    cluster.children = [child]
    watched: list[int] = []
    watcher = threading.Thread(target=lambda: watched.append(cluster.watch()))
    watcher.start()
    try:
        deadline = time.monotonic() + 20
        out = ""
        while "Redis is gone" not in out:
            out += capsys.readouterr().out
            assert time.monotonic() < deadline, out
            time.sleep(0.1)
        assert "  03:00:01 [worker-0] WARNING services.common.registry: Redis is gone" in out
        assert "routine" not in out
    finally:
        cluster.request_stop()
        watcher.join(10)
        assert child.proc is not None
        child.proc.kill()
        child.proc.wait()
    assert watched == [0]


def test_a_crash_looping_worker_is_paused_while_another_worker_serves(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that keeps failing stopped the whole cluster, the healthy worker and the
    gateway included (new-user trial: ``kill -9`` of one worker four times took every
    tenant's traffic down). While another worker serves, it is now left stopped for a pause
    that doubles at each failure, and tried again after it."""
    monkeypatch.setattr(launcher, "CRASH_PAUSE_S", 0.5)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cluster = Cluster(parser.parse_args(["--state-file", str(tmp_path / "cluster.json")]))
    run = tmp_path / "run"

    def child(name: str, code: str) -> Child:
        return Child(name, [sys.executable, "-c", code], run / f"{name}.log", run / name)

    serving = child("worker-0", "import time; time.sleep(120)")
    failing = child("worker-1", "import sys; print('bad adapter file', flush=True); sys.exit(3)")
    cluster.children = [serving, failing]
    env = dict(os.environ)
    serving.start(env)
    failing.start(env)
    watched: list[int] = []
    watcher = threading.Thread(target=lambda: watched.append(cluster.watch()))
    try:
        watcher.start()
        deadline = time.monotonic() + 30
        out = ""
        while out.count("leaving worker-1 stopped") < 3:
            out += capsys.readouterr().out
            assert watcher.is_alive(), out
            assert time.monotonic() < deadline, out
            time.sleep(0.1)
        assert "leaving worker-1 stopped for 0.5s while worker-0 serves, then" in out
        assert "stopped for 1s" in out and "stopped for 2s" in out  # doubling
        assert "bad adapter file" in out  # its last log lines, to say why
        assert "stopping" not in out.replace("leaving worker-1 stopped", "")
        assert serving.alive()
    finally:
        cluster.request_stop()
        watcher.join(30)
        for c in cluster.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
    assert watched == [0]


def test_plora_up_refuses_unsafe_or_incomplete_gateway_security_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway on a non-loopback address without keys (naming both flags), a certificate
    without its key, mutual TLS without a client certificate for plora up's own checks, and
    keys without an operator key for the demo adapters stop ``plora up`` before Redis starts
    or the model loads; the flags reach the gateway's command line as absolute paths."""
    for name in list(os.environ):
        if name.startswith("PLORA_"):
            monkeypatch.delenv(name)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    state = tmp_path / "cluster.json"
    keys = tmp_path / "keys.json"
    tenant_key = hashlib.sha256(b"tenant-key").hexdigest()
    keys.write_text(json.dumps({"keys": [{"sha256": tenant_key, "tenant": "acme"}]}))
    bad_keys = tmp_path / "bad.json"
    bad_keys.write_text('{"keys": []}')
    base = ["--state-file", str(state), "--gateway-port", "0", "--adapters-dir", str(tmp_path)]
    for argv, message in [
        (["--host", "0.0.0.0"], "--api-keys-file / PLORA_API_KEYS_FILE .* --insecure-no-auth"),
        (["--tls-cert", "c.pem"], "--tls-cert / PLORA_TLS_CERT and --tls-key"),
        (
            ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"],
            "set PLORA_TLS_CLIENT_CERT and PLORA_TLS_CLIENT_KEY",
        ),
        (["--api-keys-file", str(bad_keys)], f"PLORA_API_KEYS_FILE '{bad_keys}': no keys"),
        (["--api-keys-file", str(keys)], "set PLORA_API_KEY to one or pass --demo-adapters 0"),
        (["--api-keys-file", str(keys)], "PLORA_API_KEY to one \\(it is not an operator key"),
    ]:
        if "operator" in message:
            monkeypatch.setenv("PLORA_API_KEY", "tenant-key")
        cluster = Cluster(parser.parse_args([*base, *argv]))
        with pytest.raises(ConfigError, match=message):
            cluster.start()
        cluster.stop()
        assert cluster.redis is None and not cluster.children
    cluster = Cluster(parser.parse_args([*base, "--host", "0.0.0.0", "--insecure-no-auth"]))
    flags = cluster._plan().flags["gateway"]
    assert "--insecure-no-auth" in flags
    cluster = Cluster(parser.parse_args([*base, "--api-keys-file", "keys.yaml"]))
    flags = cluster._plan().flags["gateway"]
    assert flags[flags.index("--api-keys-file") + 1] == str(Path("keys.yaml").resolve())


def test_secrets_reach_the_children_by_environment_and_files_only_for_the_owner(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An external Redis with a password (given in PLORA_REDIS_URL): ``plora up`` names it
    without the password, hands the URL and its internal token to the children in their
    environment only (a PLORA_INTERNAL_TOKEN_FILE of the user's would win over the run's
    token, so it is dropped), and writes the state file without either, both files 0600."""
    import stat
    from urllib.parse import urlsplit

    from services.common.internal_auth import resolve_token

    password = "external-redis-password-0123456789"
    monkeypatch.setenv("PLORA_INTERNAL_TOKEN_FILE", str(tmp_path / "users-token"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    state_file = tmp_path / "cluster.json"
    with EmbeddedRedis(password=password) as server:
        monkeypatch.setenv("PLORA_REDIS_URL", server.url)
        cluster = Cluster(parser.parse_args(["--state-file", str(state_file)]))
        assert cluster._start_redis() == server.url
        out = capsys.readouterr().out
        assert f"using Redis at redis://:***@{server.host}:{server.port}/0" in out
        assert password not in out
        env = cluster._child_env()
        assert env["PLORA_REDIS_URL"] == server.url
        token = env["PLORA_INTERNAL_TOKEN"]
        assert "PLORA_INTERNAL_TOKEN_FILE" not in env
        assert resolve_token("", token) == token == cluster.internal_token
        child = cluster._child("gateway", "gateway", [*cluster._common_flags(), "--port", "0"])
        assert not any(password in arg or token in arg for arg in child.cmd)
        child.ports = {"grpc_port": 1, "metrics_port": 2, "http_port": 3}  # never started
        state = cluster._write_state(launcher._Plan("plora", {}, {}), "127.0.0.1:1", [])
    text = state_file.read_text()
    assert password not in text and token not in text
    assert urlsplit(json.loads(text)["redis_url"]).password is None
    assert state["redis_url"] == server.public_url
    credentials = launcher.read_credentials(state_file)
    assert credentials == {"redis_url": server.url, "internal_token": token}
    assert Path(state["credentials_file"]) == launcher.credentials_path(state_file)
    for path in (state_file, launcher.credentials_path(state_file)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    cluster.stop()
    assert not state_file.exists() and not launcher.credentials_path(state_file).exists()


def test_a_wildcard_host_is_dialled_and_published_as_loopback(tmp_path: Path) -> None:
    """With ``--host 0.0.0.0`` (or ``::``) the address plora up dials, and writes to the state
    file for the CLI, is 127.0.0.1: one a TLS certificate can name; a named host stays."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    state = ["--state-file", str(tmp_path / "cluster.json")]
    for host, dialled in (("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("10.1.2.3", "10.1.2.3")):
        cluster = Cluster(parser.parse_args([*state, "--host", host]))
        assert cluster._dial(50051) == f"{dialled}:50051"


def test_read_credentials_takes_a_path_or_a_string(tmp_path: Path) -> None:
    """:func:`plora.launcher.read_credentials` reads ``<stem>-credentials.json`` beside the
    state file named as a ``Path`` or a ``str``, and refuses a file of another shape."""
    state_file = tmp_path / "cluster.json"
    secrets = {"redis_url": "redis://:pw@127.0.0.1:1/0", "internal_token": "t" * 32}
    launcher.credentials_path(state_file).write_text(json.dumps(secrets))
    assert launcher.read_credentials(state_file) == secrets
    assert launcher.read_credentials(str(state_file)) == secrets
    launcher.credentials_path(state_file).write_text("[]")
    with pytest.raises(ValueError, match="not a plora up credentials file"):
        launcher.read_credentials(str(state_file))
