"""Simulator presets: the h100-8b preset's fitted load latencies ship with the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plora.simulator.presets import (
    ALIBABA_LOAD_LATENCY_MS,
    ALIBABA_LOAD_LATENCY_P,
    CPU_PRESET,
    H100_8B_PRESET,
    alibaba_load_latencies,
    fit_load_latency_quantiles,
    load_source_latencies,
    source_latencies,
)
from tests.conftest import REPO, SHARED_DATA

LATENCY_CSV = SHARED_DATA / "traces" / "alibaba_genai2026_lora_load_latency_ms.csv"


def test_fitted_quantile_function_is_well_formed() -> None:
    assert len(ALIBABA_LOAD_LATENCY_P) == len(ALIBABA_LOAD_LATENCY_MS) == 105
    assert ALIBABA_LOAD_LATENCY_P[0] == 0.0 and ALIBABA_LOAD_LATENCY_P[-1] == 1.0
    assert np.all(np.diff(ALIBABA_LOAD_LATENCY_P) > 0)
    assert np.all(np.diff(ALIBABA_LOAD_LATENCY_MS) >= 0)
    lat = alibaba_load_latencies()
    assert lat.dtype == np.float64 and np.all(np.diff(lat) >= 0)
    assert 0.631 <= lat[0] and lat[-1] <= 38.703
    assert np.median(lat) == pytest.approx(4.378, abs=1e-3)
    assert np.quantile(lat, 0.9) == pytest.approx(6.143, abs=1e-3)
    assert len(alibaba_load_latencies(7)) == 7
    with pytest.raises(ValueError, match="n must be >= 1"):
        alibaba_load_latencies(0)


def test_source_latencies_per_preset(tmp_path: Path) -> None:
    assert source_latencies(CPU_PRESET) is None
    np.testing.assert_array_equal(source_latencies(H100_8B_PRESET), alibaba_load_latencies())
    csv = tmp_path / "lat.csv"
    csv.write_text("timestamp_anon,value,container_ip\n1.0,4000.0,a\n2.0,2500.0,b\n")
    np.testing.assert_allclose(source_latencies(H100_8B_PRESET, csv), [4.0, 2.5])
    (tmp_path / "bad.csv").write_text("latency\n1\n")
    with pytest.raises(ValueError, match="no 'value' column"):
        load_source_latencies(tmp_path / "bad.csv")


def test_fit_matches_the_measurements() -> None:
    """The shipped numbers are the refit of the public measurements, and sampling them gives
    the measurements' distribution (the figures the fit's docstring states)."""
    if not LATENCY_CSV.exists():
        pytest.skip(f"{LATENCY_CSV} is absent (shared data not checked out)")
    assert fit_load_latency_quantiles(LATENCY_CSV) == ALIBABA_LOAD_LATENCY_MS
    data = np.sort(load_source_latencies(LATENCY_CSV))
    fit = alibaba_load_latencies()
    grid = np.concatenate([data, fit])
    ks = np.abs(
        np.searchsorted(data, grid, side="right") / len(data)
        - np.searchsorted(fit, grid, side="right") / len(fit)
    ).max()
    assert ks < 0.01
    assert fit.mean() == pytest.approx(data.mean(), rel=0.005)
    for q in (0.5, 0.9, 0.99):
        assert np.quantile(fit, q) == pytest.approx(np.quantile(data, q), abs=2e-3)


def _write_azure2021(path: Path, functions: int = 12, per_function: int = 25) -> None:
    """A small trace in the Azure Functions 2021 layout: one row per invocation."""
    rng = np.random.default_rng(0)
    rows = ["app,func,end_timestamp,duration"]
    for f in range(functions):
        for start in np.sort(rng.uniform(0.0, 60.0, per_function)).tolist():
            rows.append(f"app{f % 3},func{f},{start + 0.5:.3f},0.5")
    path.write_text("\n".join(rows) + "\n")


def test_simulate_h100_preset_runs_from_any_directory(tmp_path: Path) -> None:
    """``plora simulate --preset h100-8b`` needs nothing outside the package: run from an
    empty directory, with no ``../shared/data`` beside it, it simulates and writes its report."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    _write_azure2021(work / "trace.csv")
    env = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout, whatever the venv points at
    proc = subprocess.run(
        [
            sys.executable, "-m", "plora.cli", "simulate", "--preset", "h100-8b",
            "--trace", "trace.csv", "--format", "azure2021", "--workers", "2",
            "--adapters", "12", "--policies", "plora,baseline", "--forecaster", "ewma",
            "--search-max-workers", "0", "--out", "out",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote out/report.json" in proc.stdout
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["settings"]["preset"] == "h100-8b"
    assert report["settings"]["source_latencies"] is None
    for policy in ("plora", "baseline"):
        block = report[policy]
        assert block["requests"] == 12 * 25
        assert block["completed"] + block["failed"] == block["requests"]
        assert block["cold_starts"] > 0 and block["cold_start_wait_mean_s"] > 0
    # first loads are remote reads of seconds (the fitted distribution: median 4.4 s)
    assert report["baseline"]["cold_start_wait_mean_s"] > 0.5
    assert (work / "out" / "report.md").read_text().startswith("# Trace-driven")
    assert "simulate:" not in proc.stderr  # no progress bar when stderr is not a terminal
