"""Helpers for the per-service config dataclasses: documented ``PLORA_*`` environment fallbacks.

Each service has one frozen config dataclass (``services/<svc>/config.py``) built from CLI flags;
a flag left unset falls back to its ``PLORA_*`` environment variable, then to the default. This
module is the only place that reads ``os.environ`` for configuration.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.common.errors import ConfigError, quoted

#: Default Redis URL when neither --redis-url nor PLORA_REDIS_URL is given.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


#: Where ``plora up`` writes its endpoints and the client verbs read them, unless
#: ``--state-file`` / ``PLORA_STATE_FILE`` says otherwise.
DEFAULT_STATE_FILE = ".plora/cluster.json"

#: Highest TCP port number; a port flag takes 0..PORT_MAX (0 = any free port when binding).
PORT_MAX = 65535


def checked_type(
    convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str
) -> Callable[[str], Any]:
    """An argparse ``type`` that converts a flag's value and refuses it (a usage error, exit 2,
    naming the flag) unless ``ok(value)``, saying ``expected ..., got '<text>'``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {quoted(text)}")
        return value

    return parse


def _port_ok(value: int) -> bool:
    """Whether ``value`` is a port to bind: 0..65535 (0 = any free port)."""
    return 0 <= value <= PORT_MAX


#: The argparse ``type`` of a port to bind: 0..65535, 0 = any free port.
port_number = checked_type(int, _port_ok, f"a port 0..{PORT_MAX} (0 = any free port)")


#: gRPC target schemes whose address is not ``HOST:PORT`` (left for gRPC to parse).
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def address_port_ok(address: str) -> bool:
    """Whether a ``HOST:PORT`` address to dial has a port 1..65535 (gRPC fails late and vaguely
    on ``host:99999``). An address with a gRPC scheme (``unix:/path``, ``dns:///host:port``) or
    without a port (gRPC's default) is left to gRPC and counts as ok."""
    if address.startswith(_GRPC_SCHEMES):
        return True
    host, sep, port = address.rpartition(":")
    if not sep or (":" in host and not host.endswith("]")):  # no port, or a bare IPv6 address
        return True
    return bool(host) and port.isdigit() and 1 <= int(port) <= PORT_MAX


def parse_ranks(text: str) -> list[int]:
    """The argparse ``type`` of a list of LoRA ranks (``plora make-adapters --ranks``,
    ``plora up --demo-ranks``): comma-separated positive integers, as the workers accept an
    adapter's ``r``. The upper bound depends on the model: the verbs check it once the model is
    known (:func:`plora.make_adapters.check_ranks`).

    Raises:
        argparse.ArgumentTypeError: an empty list, or an item that is not a positive integer.
    """
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or any(r < 1 for r in out):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers (ranks), got {quoted(text)}"
        )
    return out


def require_server_ports(service: str, port: int, metrics_port: int) -> None:
    """Refuse a ``--port`` or ``--metrics-port`` of :func:`add_server_arguments` outside
    0..65535, naming the flag and its variable (the flags' own type refuses a bad value on the
    command line; this catches ``PLORA_<SERVICE>_PORT`` / ``_METRICS_PORT``).

    Raises:
        ConfigError: a port is not in 0..65535.
    """
    env = f"PLORA_{service.upper()}"
    for flag, name, value in (
        ("--port", f"{env}_PORT", port),
        ("--metrics-port", f"{env}_METRICS_PORT", metrics_port),
    ):
        if not _port_ok(value):
            raise ConfigError(
                f"{flag} / {name} must be a port 0..{PORT_MAX} (0 = any free port), got {value}"
            )


def add_server_arguments(
    parser: argparse.ArgumentParser, service: str, port: int, metrics_port: int
) -> None:
    """``--host``, ``--port``, ``--metrics-port``, ``--redis-url`` and
    ``--internal-token-file`` of one service, whose config reads ``PLORA_<SERVICE>_HOST`` /
    ``_PORT`` / ``_METRICS_PORT``, ``PLORA_REDIS_URL`` and ``PLORA_INTERNAL_TOKEN_FILE``
    (parser defaults None: flags, then environment, then defaults)."""
    env = f"PLORA_{service.upper()}"
    parser.add_argument(
        "--host", help=f"interface the gRPC server binds (env {env}_HOST; default 127.0.0.1)"
    )
    parser.add_argument(
        "--port",
        type=port_number,
        help=f"gRPC port, 0 = any free port (env {env}_PORT; default {port})",
    )
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        help=f"Prometheus metrics port, 0 = any free port (env {env}_METRICS_PORT; "
        f"default {metrics_port})",
    )
    parser.add_argument(
        "--redis-url", help=f"metadata store (env PLORA_REDIS_URL; default {DEFAULT_REDIS_URL})"
    )
    parser.add_argument(
        "--internal-token-file",
        help="file holding the cluster's internal token, which the gateway, predictor and "
        "workers send each other and the worker and predictor servers require; "
        "PLORA_INTERNAL_TOKEN gives the token itself; with neither, internal authentication "
        "is off (env PLORA_INTERNAL_TOKEN_FILE; default none)",
    )


def bytes_flag_or_env(flag_value: object, flag: str, env: str, default: int) -> int:
    """A byte size from its flag, else its ``PLORA_*`` variable, else ``default``; sizes as
    :func:`parse_bytes` reads them (``1MiB``, ``4096``).

    Raises:
        ConfigError: not a size, naming the flag and the variable.
    """
    text = str(flag_value) if flag_value not in (None, "") else env_or(env, None)
    try:
        return parse_bytes(text) if text else default
    except ConfigError as exc:
        raise ConfigError(f"{flag} / {env}: {exc}") from exc


def inspection_size_limits(args: argparse.Namespace) -> dict[str, int]:
    """``max_adapter_config_bytes`` and ``max_safetensors_header_bytes`` of the gateway's and
    the workers' configs, from ``--max-adapter-config-bytes`` /
    ``PLORA_MAX_ADAPTER_CONFIG_BYTES`` and ``--max-safetensors-header-bytes`` /
    ``PLORA_MAX_SAFETENSORS_HEADER_BYTES`` (defaults: those of
    :class:`~services.common.peft_config.InspectionLimits`).

    Raises:
        ConfigError: a value is not a size.
    """
    from services.common.peft_config import MAX_CONFIG_BYTES, MAX_HEADER_BYTES  # noqa: PLC0415

    return {
        "max_adapter_config_bytes": bytes_flag_or_env(
            args.max_adapter_config_bytes,
            "--max-adapter-config-bytes",
            "PLORA_MAX_ADAPTER_CONFIG_BYTES",
            MAX_CONFIG_BYTES,
        ),
        "max_safetensors_header_bytes": bytes_flag_or_env(
            args.max_safetensors_header_bytes,
            "--max-safetensors-header-bytes",
            "PLORA_MAX_SAFETENSORS_HEADER_BYTES",
            MAX_HEADER_BYTES,
        ),
    }


def require_inspection_sizes(max_config_bytes: int, max_header_bytes: int) -> None:
    """Check the size bounds of :func:`inspection_size_limits` (each at least one byte).

    Raises:
        ConfigError: a bound is below one, naming its flag and variable.
    """
    require_at_least_one(
        max_config_bytes, "--max-adapter-config-bytes", "PLORA_MAX_ADAPTER_CONFIG_BYTES"
    )
    require_at_least_one(
        max_header_bytes, "--max-safetensors-header-bytes", "PLORA_MAX_SAFETENSORS_HEADER_BYTES"
    )


def add_adapter_root_argument(parser: argparse.ArgumentParser) -> None:
    """``--adapter-root DIR`` (repeatable, into ``adapter_roots``) of the gateway and the
    workers, falling back to ``PLORA_ADAPTER_ROOTS`` (:func:`adapter_roots_or_env`)."""
    parser.add_argument(
        "--adapter-root",
        dest="adapter_roots",
        action="append",
        metavar="DIR",
        help="directory adapter sources must lie under, every symlink followed; repeatable, "
        f"the variable joins several with {os.pathsep!r}; none = sources are read wherever "
        "they are (env PLORA_ADAPTER_ROOTS; default none)",
    )


def add_adapter_source_allow_argument(parser: argparse.ArgumentParser) -> None:
    """``--adapter-source-allow PREFIXES`` (repeatable, comma-separated, into
    ``adapter_source_allow``) of the gateway and the workers, falling back to
    ``PLORA_ADAPTER_SOURCE_ALLOW`` (:func:`source_allow_or_env`)."""
    parser.add_argument(
        "--adapter-source-allow",
        dest="adapter_source_allow",
        action="append",
        metavar="PREFIXES",
        help="remote adapter sources this server may read, comma-separated prefixes such as "
        "s3://bucket/prefix/,hf://org/ ; repeatable; none = every s3:// and hf:// source "
        "refused (env PLORA_ADAPTER_SOURCE_ALLOW; default none)",
    )


def source_allow_or_env(
    flag_values: Sequence[str] | None, name: str, env: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The ``--adapter-source-allow`` flags when given, else the variable ``name``
    (``PLORA_ADAPTER_SOURCE_ALLOW``), else none (the config parses them:
    :meth:`SourceAllowList.parse <services.common.remote_sources.SourceAllowList.parse>`)."""
    if flag_values:
        return tuple(flag_values)
    value = env_or(name, "", env) or ""
    return (value,) if value else ()


def adapter_roots_or_env(
    flag_values: Sequence[str] | None, name: str, env: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The ``--adapter-root`` flags when given, else the variable ``name``
    (``PLORA_ADAPTER_ROOTS``) split on ``os.pathsep``, else none (the config resolves and
    checks them: :func:`services.common.sources.resolve_roots`)."""
    from services.common.sources import split_roots  # noqa: PLC0415

    if flag_values:
        return tuple(flag_values)
    return split_roots(env_or(name, "", env) or "")


def require_at_least_one(value: int, flag: str, env: str) -> None:
    """Refuse a count or limit below 1, naming the flag and the variable that set it.

    Raises:
        ConfigError: ``value < 1``.
    """
    if value < 1:
        raise ConfigError(f"{flag} / {env} must be >= 1, got {value}")


def require_seconds(value: float, flag: str, env: str, zero_ok: bool = False) -> None:
    """Refuse a duration that is not a finite number of seconds > 0 (>= 0 with ``zero_ok``),
    naming the flag (``""`` when there is none) and the variable that set it.

    Raises:
        ConfigError: ``value`` out of range, NaN or infinite.
    """
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        name = f"{flag} / {env}" if flag else env
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name} must be a number of seconds {bound}, got {value:g}")


def settings_line(config: Any) -> str:
    """A service's effective settings as one log line, ``name=value`` per dataclass field in
    declaration order, after flags, ``PLORA_*`` variables and defaults were merged (what an
    operator checks first when a cluster misbehaves: which batch size, threads, tick, ...).

    URL fields (``*_url``) are written without their password
    (:func:`services.common.registry.redact_url`); a secret field (declared with
    ``repr=False``, such as ``internal_token``) is written ``***`` when set, never its value.

    Args:
        config: A service configuration dataclass (``WorkerConfig``, ``GatewayConfig``,
            ``PredictorConfig``).

    Raises:
        TypeError: ``config`` is not a dataclass instance.
    """
    import dataclasses  # noqa: PLC0415

    from services.common.registry import redact_url  # noqa: PLC0415 - pulls in redis

    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"expected a configuration dataclass, got {type(config).__name__}")
    parts = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not f.repr:
            value = "***" if value else ""
        elif f.name.endswith("_url") and isinstance(value, str):
            value = redact_url(value)
        parts.append(f"{f.name}={value!r}" if isinstance(value, str) else f"{f.name}={value}")
    return ", ".join(parts)


def env_or(name: str, default: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """Return the environment variable ``name`` if set and non-empty, else ``default``."""
    value = (os.environ if env is None else env).get(name)
    return value if value not in (None, "") else default


def choice_or_env(
    flag_value: str | None,
    flag: str,
    name: str,
    default: str,
    choices: Sequence[str],
    env: Mapping[str, str] | None = None,
) -> str:
    """The flag's value if given, else the environment variable ``name``, else ``default``.

    argparse checks a flag against ``choices``; a variable bypasses it, so this checks the
    variable's value here, where the message can name it (the config's own check, later,
    could only name the field).

    Raises:
        ConfigError: the variable holds a value not in ``choices``.
    """
    if flag_value not in (None, ""):
        return str(flag_value)
    value = env_or(name, None, env)
    if value is None:
        return default
    if value not in choices:
        raise ConfigError(
            f"{name}={quoted(value)} is not one of {', '.join(choices)} (the variable sets {flag})"
        )
    return value


def int_flag_or_env(flag_value: int | None, name: str, default: int) -> int:
    """A numeric flag's value when given (0 included: it is a value, not "unset"), else
    :func:`env_int` of ``name``.

    Raises:
        ConfigError: the flag is unset and the variable is not an integer.
    """
    return flag_value if flag_value is not None else env_int(name, default)


def float_flag_or_env(flag_value: float | None, name: str, default: float) -> float:
    """As :func:`int_flag_or_env`, for a float flag (:func:`env_float`)."""
    return flag_value if flag_value is not None else env_float(name, default)


def env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """Integer environment fallback.

    Raises:
        ConfigError: the variable is set but is not an integer.
    """
    raw = env_or(name, None, env)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={quoted(raw)} is not an integer") from exc


#: Texts a yes/no variable accepts, and what they mean.
_BOOLEANS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def env_bool(name: str, flag: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """Yes/no environment fallback of the switch ``flag``: ``1``/``true``/``yes``/``on`` or
    ``0``/``false``/``no``/``off`` (any case).

    Raises:
        ConfigError: the variable is set to anything else.
    """
    raw = env_or(name, None, env)
    if raw is None:
        return default
    value = _BOOLEANS.get(raw.strip().lower())
    if value is None:
        raise ConfigError(
            f"{name}={quoted(raw)} is not a yes/no value: use 1 or 0 (the variable sets {flag})"
        )
    return value


def env_float(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """Float environment fallback.

    Raises:
        ConfigError: the variable is set but is not a number.
    """
    raw = env_or(name, None, env)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={quoted(raw)} is not a number") from exc


def parse_bytes(text: str | int) -> int:
    """Parse a byte size such as ``"512MiB"``, ``"4M"``, ``"1GiB"`` or ``"1048576"``.

    Binary units (KiB/MiB/GiB and K/M/G) are powers of 1024; KB/MB/GB are powers of 1000.

    Raises:
        ConfigError: the text is not a size.
    """
    if isinstance(text, int):
        return text
    s = text.strip()
    units = {
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "k": 1 << 10,
        "m": 1 << 20,
        "g": 1 << 30,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "b": 1,
    }
    lower = s.lower()
    for unit in sorted(units, key=len, reverse=True):
        if lower.endswith(unit):
            number = lower[: -len(unit)].strip()
            try:
                return int(float(number) * units[unit])
            except ValueError:
                break
    try:
        return int(s)
    except ValueError as exc:
        raise ConfigError(
            f"{quoted(text)} is not a byte size (examples: 512MiB, 4M, 1048576)"
        ) from exc
