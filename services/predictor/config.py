"""Predictor configuration: one frozen dataclass built from flags with ``PLORA_*`` fallbacks."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.common.config import (
    DEFAULT_REDIS_URL,
    add_server_arguments,
    choice_or_env,
    env_or,
    float_flag_or_env,
    int_flag_or_env,
    require_seconds,
    require_server_ports,
)
from services.common.errors import ConfigError
from services.predictor.forecast import DEFAULT_FORECASTER, FORECASTER_NAMES


@dataclass(frozen=True)
class PredictorConfig:
    """Settings of the predictor process.

    Attributes:
        host / port / metrics_port: Interfaces (``PLORA_PREDICTOR_PORT``, ...); 0 = any port.
        redis_url: Metadata store (``PLORA_REDIS_URL``).
        internal_token_file: File holding the internal token
            (``PLORA_INTERNAL_TOKEN_FILE``; :mod:`services.common.internal_auth`).
        internal_token: The internal token itself (``PLORA_INTERNAL_TOKEN``; the file wins);
            with neither, internal authentication is off. Never logged.
        forecaster: ``frequency``, ``ewma``, ``lstm`` or ``ensemble`` (``PLORA_FORECASTER``).
        tick_s: Seconds between forecasts / prefetch rounds (default 1 s, as in the paper).
        horizon_s: Forecast horizon in seconds (default 5 s).
        prefetch_min_expected: Expected count over the horizon above which an adapter is
            prefetched; an adapter already chosen stays until it falls below half of it
            (hysteresis).
        prefetch_min_probability: Calibrated probability of a request within the horizon
            (:class:`~services.predictor.calibration.ForecastCalibrator`, learnt online from
            what arrived) an adapter needs to be prefetched: a prefetch saves a cold start
            with that probability and costs a load and an eviction otherwise.
        max_prefetch_per_worker: Most adapters sent per worker per tick.
        prefetch: ``on``: send each tick's prefetch choice to the workers; ``off``: forecast,
            place and publish only (``PLORA_PREDICTOR_PREFETCH``; the ``plora-no-prefetch``
            ablation).
        train_budget_s: Seconds of online training allowed per tick (after the forecast).
        persist_every_s: How often the model and recent counts are saved to Redis.
        ready_file: Where to write the bound ports once serving (launcher).
    """

    host: str = "127.0.0.1"
    port: int = 50071
    metrics_port: int = 9102
    redis_url: str = DEFAULT_REDIS_URL
    internal_token_file: str = ""
    internal_token: str = field(default="", repr=False)
    forecaster: str = DEFAULT_FORECASTER
    tick_s: float = 1.0
    horizon_s: float = 5.0
    prefetch_min_expected: float = 0.1
    prefetch_min_probability: float = 0.75
    max_prefetch_per_worker: int = 8
    prefetch: str = "on"
    train_budget_s: float = 0.05
    persist_every_s: float = 10.0
    ready_file: str = ""

    def __post_init__(self) -> None:
        require_server_ports("predictor", self.port, self.metrics_port)
        if self.forecaster not in FORECASTER_NAMES:
            raise ConfigError(f"forecaster must be one of {FORECASTER_NAMES}")
        require_seconds(self.tick_s, "--tick-s", "PLORA_PREDICTOR_TICK_S")
        require_seconds(self.horizon_s, "--horizon-s", "PLORA_PREDICTOR_HORIZON_S")
        if not 0.0 <= self.prefetch_min_probability <= 1.0:
            raise ConfigError(
                "--prefetch-min-probability / PLORA_PREDICTOR_PREFETCH_MIN_PROBABILITY must be "
                f"in [0, 1], got {self.prefetch_min_probability}"
            )
        if self.prefetch not in ("on", "off"):
            raise ConfigError(f"prefetch must be 'on' or 'off', got {self.prefetch!r}")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the predictor's flags (defaults None: the env fallback applies).

        Each help ends ``(env PLORA_X; default D)``, D being the field default above
        (tests/unit/test_config.py checks both against ``from_args`` and the dataclass).
        """
        d = PredictorConfig
        add_server_arguments(parser, "predictor", d.port, d.metrics_port)
        parser.add_argument(
            "--forecaster",
            choices=FORECASTER_NAMES,
            help="demand forecaster (env PLORA_FORECASTER; default ensemble)",
        )
        parser.add_argument(
            "--tick-s",
            type=float,
            help="seconds between forecast / prefetch rounds "
            "(env PLORA_PREDICTOR_TICK_S; default 1)",
        )
        parser.add_argument(
            "--horizon-s",
            type=float,
            help="forecast horizon in seconds (env PLORA_PREDICTOR_HORIZON_S; default 5)",
        )
        parser.add_argument(
            "--prefetch",
            choices=("on", "off"),
            help="on: send each tick's prefetch choice to the workers; off: forecast, place and "
            "publish only, the plora-no-prefetch ablation "
            "(env PLORA_PREDICTOR_PREFETCH; default on)",
        )
        parser.add_argument(
            "--prefetch-min-probability",
            type=float,
            help="calibrated probability of a request within the horizon an adapter needs to be "
            "prefetched; 0 prefetches every adapter the forecast makes hot "
            "(env PLORA_PREDICTOR_PREFETCH_MIN_PROBABILITY; default 0.75)",
        )
        parser.add_argument(
            "--ready-file",
            help="write {grpc_port, metrics_port} as JSON here once serving, for the launcher "
            "(no env variable; default none)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PredictorConfig:
        """Flags first, then ``PLORA_*`` environment variables, then defaults."""
        d = cls()
        return cls(
            host=args.host or env_or("PLORA_PREDICTOR_HOST", d.host) or d.host,
            port=int_flag_or_env(args.port, "PLORA_PREDICTOR_PORT", d.port),
            metrics_port=int_flag_or_env(
                args.metrics_port, "PLORA_PREDICTOR_METRICS_PORT", d.metrics_port
            ),
            redis_url=args.redis_url or env_or("PLORA_REDIS_URL", d.redis_url) or d.redis_url,
            internal_token_file=args.internal_token_file
            or env_or("PLORA_INTERNAL_TOKEN_FILE", "")
            or "",
            internal_token=env_or("PLORA_INTERNAL_TOKEN", "") or "",
            forecaster=choice_or_env(
                args.forecaster, "--forecaster", "PLORA_FORECASTER", d.forecaster, FORECASTER_NAMES
            ),
            tick_s=float_flag_or_env(args.tick_s, "PLORA_PREDICTOR_TICK_S", d.tick_s),
            horizon_s=float_flag_or_env(args.horizon_s, "PLORA_PREDICTOR_HORIZON_S", d.horizon_s),
            prefetch=choice_or_env(
                args.prefetch, "--prefetch", "PLORA_PREDICTOR_PREFETCH", d.prefetch, ("on", "off")
            ),
            prefetch_min_probability=float_flag_or_env(
                args.prefetch_min_probability,
                "PLORA_PREDICTOR_PREFETCH_MIN_PROBABILITY",
                d.prefetch_min_probability,
            ),
            ready_file=args.ready_file or "",
        )
