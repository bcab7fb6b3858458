"""Config parsing: byte sizes, env fallbacks and cross-field checks."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import os
import re
import socket
from typing import Any

import pytest

from services.common.config import inspection_size_limits, parse_bytes
from services.common.errors import ConfigError
from services.gateway.config import DEFAULT_MAX_NEW_TOKENS, GatewayConfig
from services.predictor.config import PredictorConfig
from services.worker.config import WorkerConfig, default_worker_id
from tests.conftest import REPO
from tests.helpers import config_from_flags


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1048576", 1 << 20),
        ("4MiB", 4 << 20),
        ("4M", 4 << 20),
        ("1.5GiB", 3 << 29),
        ("512KiB", 512 << 10),
        ("2MB", 2_000_000),
        (7, 7),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "4XB", "MiB"])
def test_parse_bytes_rejects_garbage(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(text)


def test_worker_flags_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLORA_POOL_BYTES", "64MiB")
    monkeypatch.setenv("PLORA_ALLOCATOR", "contiguous")
    cfg = config_from_flags(WorkerConfig, "--allocator", "paged")
    assert cfg.pool_bytes == 64 << 20 and cfg.allocator == "paged"


def test_worker_host_cache_must_cover_pool() -> None:
    with pytest.raises(ConfigError, match="--host-cache-bytes / PLORA_HOST_CACHE_BYTES"):
        WorkerConfig(pool_bytes=1 << 30, host_cache_bytes=1 << 20)


def test_worker_stall_timeout_is_a_flag_or_env_and_not_negative(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert config_from_flags(WorkerConfig).stall_timeout_s == 60.0
    monkeypatch.setenv("PLORA_STALL_TIMEOUT_S", "0")
    assert config_from_flags(WorkerConfig).stall_timeout_s == 0.0  # never
    assert config_from_flags(WorkerConfig, "--stall-timeout-s", "300").stall_timeout_s == 300.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="--stall-timeout-s / PLORA_STALL_TIMEOUT_S"):
            WorkerConfig(stall_timeout_s=bad)


_SECONDS = "must be a number of seconds > 0"


@pytest.mark.parametrize(
    ("config", "variable", "value", "message"),
    [
        (GatewayConfig, "PLORA_REQUEST_TIMEOUT_S", "0", f"^PLORA_REQUEST_TIMEOUT_S {_SECONDS}"),
        (GatewayConfig, "PLORA_REQUEST_TIMEOUT_S", "-5", f"^PLORA_REQUEST_TIMEOUT_S {_SECONDS}"),
        (PredictorConfig, "PLORA_PREDICTOR_TICK_S", "-1", f"PLORA_PREDICTOR_TICK_S {_SECONDS}"),
        (PredictorConfig, "PLORA_PREDICTOR_HORIZON_S", "inf", "^--horizon-s / PLORA_PREDICTOR_HO"),
        (WorkerConfig, "PLORA_WORKER_THREADS", "-2", "^--threads / PLORA_WORKER_THREADS must be"),
        (WorkerConfig, "PLORA_LOAD_WAIT_TIMEOUT_S", "0", f"PLORA_LOAD_WAIT_TIMEOUT_S {_SECONDS}"),
        (
            WorkerConfig,
            "PLORA_MAX_NUM_BATCHED_TOKENS",
            "16",
            r"^--max-num-batched-tokens / PLORA_MAX_NUM_BATCHED_TOKENS \(16\) must be >= "
            r"--max-batch-size / PLORA_MAX_BATCH_SIZE \(32\)",
        ),
        (WorkerConfig, "PLORA_MAX_MODEL_LEN", "1", "^--max-model-len / PLORA_MAX_MODEL_LEN must"),
        (WorkerConfig, "PLORA_KV_BLOCK_SIZE", "0", "^--kv-block-size / PLORA_KV_BLOCK_SIZE must"),
        (WorkerConfig, "PLORA_KV_CACHE_TOKENS", "-1", "^--kv-cache-tokens / PLORA_KV_CACHE_TOK"),
        (
            WorkerConfig,
            "PLORA_KV_CACHE_TOKENS",
            "1000",
            r"^--kv-cache-tokens / PLORA_KV_CACHE_TOKENS \(1000\) cannot hold one "
            r"--max-model-len \(2048\) sequence",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) and x.startswith("PLORA_") else "",
)
def test_out_of_range_settings_are_refused_naming_flag_and_variable(
    config: Any, variable: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new operator's ``PLORA_REQUEST_TIMEOUT_S=0`` (or -5) started a cluster whose every
    request without a client deadline failed DEADLINE_EXCEEDED at once, and
    ``PLORA_MAX_NUM_BATCHED_TOKENS=16`` failed only once the workers had loaded the model, with
    a message naming neither; others named a field, not the flag and variable. Each is now
    refused before anything starts, naming both."""
    _without_plora_env(monkeypatch)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=message):
        config_from_flags(config)


def test_worker_host_staging_is_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_flags(WorkerConfig).host_staging == "on"
    monkeypatch.setenv("PLORA_HOST_STAGING", "off")
    assert config_from_flags(WorkerConfig).host_staging == "off"
    assert config_from_flags(WorkerConfig, "--host-staging", "on").host_staging == "on"
    with pytest.raises(ConfigError, match="host_staging"):
        WorkerConfig(host_staging="yes")


def test_gateway_rejects_unknown_routing() -> None:
    with pytest.raises(ConfigError, match="routing"):
        GatewayConfig(routing="random")


def test_gateway_default_max_new_tokens_follows_a_lower_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A limit below the default of 64 lowers the default with it (it used to stop the
    gateway from starting); an explicit default above the limit is refused by name."""
    assert config_from_flags(GatewayConfig).default_max_new_tokens == 64
    monkeypatch.setenv("PLORA_MAX_NEW_TOKENS_LIMIT", "16")
    cfg = config_from_flags(GatewayConfig)
    assert (cfg.max_new_tokens_limit, cfg.default_max_new_tokens) == (16, 16)
    monkeypatch.setenv("PLORA_DEFAULT_MAX_NEW_TOKENS", "8")
    assert config_from_flags(GatewayConfig).default_max_new_tokens == 8
    assert (
        config_from_flags(GatewayConfig, "--default-max-new-tokens", "12").default_max_new_tokens
        == 12
    )
    with pytest.raises(ConfigError, match="PLORA_DEFAULT_MAX_NEW_TOKENS must be in 1..16"):
        config_from_flags(GatewayConfig, "--default-max-new-tokens", "32")
    with pytest.raises(ConfigError, match="PLORA_MAX_NEW_TOKENS_LIMIT must be >= 1"):
        GatewayConfig(max_new_tokens_limit=-3)


def test_predictor_prefetch_is_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_flags(PredictorConfig).prefetch == "on"
    monkeypatch.setenv("PLORA_PREDICTOR_PREFETCH", "off")
    assert config_from_flags(PredictorConfig).prefetch == "off"
    assert config_from_flags(PredictorConfig, "--prefetch", "on").prefetch == "on"
    with pytest.raises(ConfigError, match="prefetch"):
        PredictorConfig(prefetch="maybe")


@pytest.mark.parametrize(
    ("config", "variable", "flag"),
    [
        (WorkerConfig, "PLORA_DTYPE", "--dtype"),
        (WorkerConfig, "PLORA_LORA_KERNEL", "--lora-kernel"),
        (WorkerConfig, "PLORA_ALLOCATOR", "--allocator"),
        (WorkerConfig, "PLORA_EVICTION", "--eviction"),
        (WorkerConfig, "PLORA_HOST_STAGING", "--host-staging"),
        (GatewayConfig, "PLORA_ROUTING", "--routing"),
        (PredictorConfig, "PLORA_FORECASTER", "--forecaster"),
        (PredictorConfig, "PLORA_PREDICTOR_PREFETCH", "--prefetch"),
    ],
)
def test_a_bad_choice_in_the_environment_is_refused_by_its_name(
    monkeypatch: pytest.MonkeyPatch, config: Any, variable: str, flag: str
) -> None:
    """argparse checks a flag's choices but not the variable behind it; the refusal used to
    name only the dataclass field (``allocator must be one of ...``), leaving the user to
    guess where the value came from. A flag given on the command line still wins."""
    monkeypatch.setenv(variable, "no-such-value")
    with pytest.raises(ConfigError, match=rf"^{variable}='no-such-value' is not one of .*{flag}"):
        config_from_flags(config)
    choices = next(a.choices for a in _parser(config)._actions if flag in a.option_strings)
    assert getattr(config_from_flags(config, flag, choices[-1]), _field(flag)) == choices[-1]


def _parser(config: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return parser


def _field(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _documented_variables() -> set[str]:
    """``PLORA_*`` names in docs/configuration.md, with ``PLORA_{A,B}_{X,Y}`` expanded."""
    names: set[str] = set()
    text = (REPO / "docs" / "configuration.md").read_text()
    for m in re.finditer(r"PLORA_[A-Z0-9_{},]+", text):
        parts = re.split(r"(\{[^}]*\})", m.group(0).rstrip("_,"))
        options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
        names.update("".join(c) for c in itertools.product(*options))
    return names


def test_every_variable_the_services_read_is_documented() -> None:
    """The configuration table of docs/configuration.md names every ``PLORA_*`` variable the
    services and the tools (the CLI, ``plora up``, the benchmarks) read (a new user found six
    that it did not)."""
    read = {
        m.group(1)
        for path in [*(REPO / "services").rglob("*.py"), *(REPO / "plora").rglob("*.py")]
        for m in re.finditer(r'"(PLORA_[A-Z0-9_]+)"', path.read_text())
    }
    assert len(read) > 30
    missing = read - _documented_variables()
    assert not missing, f"not in docs/configuration.md: {sorted(missing)}"


SERVICE_CONFIGS = [GatewayConfig, WorkerConfig, PredictorConfig]

#: How every service flag's help reads: what it does, then the variable it falls back to (or
#: "no env variable") and its default - "512MiB", "64, or the limit if lower", "none".
FLAG_HELP = re.compile(
    r"(?P<what>\S.*) \((?:env (?P<env>PLORA_[A-Z0-9_]+)|no env variable); "
    r"default (?P<default>[^()]+)\)"
)

#: Fields whose dataclass default is a placeholder resolved in ``__post_init__``: the default
#: their help states instead.
RESOLVED_DEFAULTS = {"default_max_new_tokens": DEFAULT_MAX_NEW_TOKENS}

#: Fields whose help states "none" and which, unset, get a value made per process: its form.
GENERATED_DEFAULTS = {"worker_id": re.compile(r"[A-Za-z0-9._-]+-[0-9a-f]{6}")}

#: Variables a ``from_args`` reads that no flag falls back to.
ENV_ONLY = {
    GatewayConfig: {"PLORA_REQUEST_TIMEOUT_S", "PLORA_REGISTRY_STALE_S", "PLORA_INTERNAL_TOKEN"},
    WorkerConfig: {"PLORA_INTERNAL_TOKEN"},
    PredictorConfig: {"PLORA_INTERNAL_TOKEN"},
}


def _without_plora_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PLORA_"):
            monkeypatch.delenv(name)


def _flag_helps(config: Any) -> dict[str, tuple[argparse.Action, str | None, str]]:
    """``dest -> (option, env variable its help names or None, default its help states)`` for
    every option ``config.add_arguments`` adds but ``-h``; fails on a help not in that form."""
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    helps = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert action.default is None, f"{flag}: its default must stay None (the env fallback)"
        match = FLAG_HELP.fullmatch(action.help or "")
        assert match, (
            f"{flag}: help should read '... (env PLORA_X; default D)' or "
            f"'... (no env variable; default D)', got {action.help!r}"
        )
        helps[action.dest] = (action, match["env"], match["default"])
    return helps


def _stated_value(stated: str, field: dataclasses.Field) -> object:
    """The value a help's ``default D`` means, as ``field`` holds it ("none" = empty)."""
    word = re.match(r"[^\s,]+", stated).group(0)
    if word == "none":
        return () if isinstance(field.default, tuple) else ""
    if field.name.endswith("_bytes"):
        return parse_bytes(word)
    if isinstance(field.default, bool):
        return {"on": True, "off": False}[word]
    return type(field.default)(word)


def _other_value(action: argparse.Action, default: Any) -> tuple[str, object]:
    """A valid value for ``action``'s field other than ``default``: (as env text, as the
    config holds it)."""
    if action.choices:
        other = next(c for c in action.choices if c != default)
        return other, other
    if action.dest.endswith("_bytes"):
        return f"{2 * default >> 10}KiB", 2 * default
    if action.dest.endswith("_probability"):
        return str(default / 2), default / 2
    if action.dest == "kv_cache_tokens":  # 0 = the default size; else one context at least
        return "65536", 65536
    if isinstance(default, (int, float)):
        return str(default + 1), default + 1
    if action.dest == "adapter_source_allow":  # remote source prefixes
        return "s3://bucket/a,hf://org", ("s3://bucket/a/", "hf://org/")
    if isinstance(default, tuple):  # a list of directories (adapter roots)
        dirs = [REPO / "docs", REPO / "tests"]
        return os.pathsep.join(map(str, dirs)), tuple(os.path.realpath(d) for d in dirs)
    return f"{action.dest}-from-env", f"{action.dest}-from-env"


@pytest.mark.parametrize("config", SERVICE_CONFIGS, ids=lambda c: c.__name__)
def test_every_flag_has_help_stating_its_default(
    config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plora serve <service> --help`` explains every flag (a new user found most of them
    bare), and the default it states is the dataclass's - and what the service gets unset."""
    _without_plora_env(monkeypatch)
    fields = {f.name: f for f in dataclasses.fields(config)}
    unset = config_from_flags(config)
    for dest, (action, _env, stated) in _flag_helps(config).items():
        flag = action.option_strings[0]
        expected = RESOLVED_DEFAULTS.get(dest, fields[dest].default)
        assert _stated_value(stated, fields[dest]) == expected, (
            f"{flag}: help says default {stated!r}, the dataclass {expected!r}"
        )
        if dest in GENERATED_DEFAULTS:
            made = getattr(unset, dest)
            assert GENERATED_DEFAULTS[dest].fullmatch(made), f"{flag}: unset, made {made!r}"
            continue
        assert getattr(unset, dest) == expected, f"{flag}: unset, it is not {expected!r}"


@pytest.mark.parametrize("config", SERVICE_CONFIGS, ids=lambda c: c.__name__)
def test_the_env_variable_in_a_flags_help_is_the_one_it_falls_back_to(
    config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variable a flag's help names, set alone, lands in that flag's field; and every
    ``PLORA_*`` variable ``from_args`` reads is named by a flag's help (or is env-only)."""
    _without_plora_env(monkeypatch)
    named = set()
    for dest, (action, env, _stated) in _flag_helps(config).items():
        if env is None:
            continue
        named.add(env)
        flag = action.option_strings[0]
        text, value = _other_value(action, getattr(config(), dest))
        with monkeypatch.context() as m:
            m.setenv(env, text)
            assert getattr(config_from_flags(config), dest) == value, (
                f"{flag}: help names {env}, but {env}={text} does not set {dest} to {value!r}"
            )
    source = inspect.getsource(config.from_args)
    if "inspection_size_limits(" in source:  # the size bounds the gateway and workers share
        source += inspect.getsource(inspection_size_limits)
    read = set(re.findall(r'"(PLORA_[A-Z0-9_]+)"', source))
    assert read - ENV_ONLY.get(config, set()) == named


def test_worker_refuses_sizes_below_one_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at parse time, before the model loads, with the flag and variable named (the
    engine's later refusal named an internal ``max_queue``)."""
    monkeypatch.setenv("PLORA_MAX_NEW_TOKENS_LIMIT", "0")
    with pytest.raises(ConfigError, match="--max-new-tokens-limit / PLORA_MAX_NEW_TOKENS_LIMIT"):
        config_from_flags(WorkerConfig)
    with pytest.raises(ConfigError, match="--max-batch-size / PLORA_MAX_BATCH_SIZE must be >= 1"):
        WorkerConfig(max_batch_size=-1)


def test_a_flag_set_to_zero_is_not_taken_for_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--max-batch-size 0`` used to fall through to the variable or the default (``args.x or
    env``), so a bad flag was served silently; a given flag is now the value, and refused."""
    monkeypatch.setenv("PLORA_MAX_BATCH_SIZE", "8")
    with pytest.raises(ConfigError, match="--max-batch-size / PLORA_MAX_BATCH_SIZE must be >= 1"):
        config_from_flags(WorkerConfig, "--max-batch-size", "0")
    assert config_from_flags(WorkerConfig).max_batch_size == 8
    with pytest.raises(ConfigError, match="--tick-s / PLORA_PREDICTOR_TICK_S must be a number"):
        config_from_flags(PredictorConfig, "--tick-s", "0")


@pytest.mark.parametrize("config", SERVICE_CONFIGS, ids=lambda c: c.__name__)
def test_ports_outside_0_to_65535_are_refused_naming_the_flag_or_variable(
    config: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plora serve gateway --port 99999`` used to end in an OverflowError traceback; a port
    flag is now a usage error (exit 2) naming the flag and 0..65535, and its variable a
    ConfigError naming both. 0 (any free port) and 65535 are accepted."""
    _without_plora_env(monkeypatch)
    service = config.__name__.removesuffix("Config").lower()
    for flag in ("--port", "--metrics-port"):
        for bad in ("99999", "-1", "65536", "http"):
            with pytest.raises(SystemExit) as exit_:
                config_from_flags(config, flag, bad)
            assert exit_.value.code == 2
            err = capsys.readouterr().err
            assert f"argument {flag}: expected a port 0..65535 (0 = any free port)" in err, err
        assert getattr(config_from_flags(config, flag, "0"), _field(flag)) == 0
        assert getattr(config_from_flags(config, flag, "65535"), _field(flag)) == 65535
        variable = f"PLORA_{service.upper()}_{_field(flag).upper()}"
        with monkeypatch.context() as m:
            m.setenv(variable, "99999")
            with pytest.raises(ConfigError, match=rf"^{flag} / {variable} must be a port 0..65535"):
                config_from_flags(config)


def test_registry_stale_s_refuses_negative_or_infinite_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for bad in ("-1", "inf", "nan"):
        monkeypatch.setenv("PLORA_REGISTRY_STALE_S", bad)
        with pytest.raises(ConfigError, match="PLORA_REGISTRY_STALE_S must be a number"):
            config_from_flags(GatewayConfig)
    monkeypatch.setenv("PLORA_REGISTRY_STALE_S", "0")
    assert config_from_flags(GatewayConfig).registry_stale_s == 0.0


@pytest.mark.parametrize("service", [WorkerConfig, GatewayConfig, PredictorConfig])
def test_settings_line_gives_every_effective_setting_without_the_redis_password(
    service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each service logs this line at start: every field, after env and flags merged."""
    from services.common.config import settings_line

    monkeypatch.setenv("PLORA_REDIS_URL", "redis://tenant:s3cret@redis.internal:6379/2")
    config = config_from_flags(service)
    line = settings_line(config)
    names = [m.group(1) for m in re.finditer(r"(?:^|, )(\w+)=", line)]
    assert names == [f.name for f in dataclasses.fields(config)]
    assert "s3cret" not in line and "redis_url='redis://tenant:***@redis.internal:6379/2'" in line
    with pytest.raises(TypeError, match="configuration dataclass"):
        settings_line(type(config))


def test_a_worker_without_an_id_gets_a_unique_one_and_a_given_id_is_kept_as_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset: ``<host name>-<6 hex digits>``, another per process (two workers on one host
    never share an id); a given id (a StatefulSet's pod name) is used unchanged."""
    _without_plora_env(monkeypatch)
    made = {config_from_flags(WorkerConfig).worker_id for _ in range(20)}
    assert len(made) == 20
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-")
    assert all(re.fullmatch(rf"{re.escape(host)}-[0-9a-f]{{6}}", m) for m in made), made
    assert re.fullmatch(r"gpu-node_3-[0-9a-f]{6}", default_worker_id("gpu node_3"))
    assert re.fullmatch(r"worker-[0-9a-f]{6}", default_worker_id("%%"))
    monkeypatch.setenv("PLORA_WORKER_ID", "plora-worker-7")
    assert config_from_flags(WorkerConfig).worker_id == "plora-worker-7"
    assert config_from_flags(WorkerConfig, "--worker-id", "w-1").worker_id == "w-1"
