"""Long tools (``plora simulate``, ``plora eval predictor``, ``plora bench pool``) draw a
progress bar on stderr when it is a terminal, and write nothing of it anywhere else."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plora import evaluate
from plora.bench import pool as bench_pool
from plora.simulator import run as simulate
from services.worker.pool import DEFAULT_PAGE_BYTES


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _azure2021(path: Path) -> Path:
    """A small trace in the Azure Functions 2021 layout (one row per invocation)."""
    rng = np.random.default_rng(0)
    rows = ["app,func,end_timestamp,duration"]
    for f in range(6):
        for start in np.sort(rng.uniform(0.0, 30.0, 10)).tolist():
            rows.append(f"app{f % 2},func{f},{start + 0.5:.3f},0.5")
    path.write_text("\n".join(rows) + "\n")
    return path


def _alibaba(path: Path) -> Path:
    """A small trace in the Alibaba GenAI layout: 60 requests over 8 tenants."""
    rows = ["gmt_create,groupId"]
    rows += [f"2024-11-15 16:{i // 60:02d}:{i % 60:02d},G{i % 8:04d}" for i in range(60)]
    path.write_text("\n".join(rows) + "\n")
    return path


def _run(module: Any, argv: list[str]) -> Callable[[], int]:
    """The tool ``module``'s ``run`` on ``argv`` (parsed by its ``add_arguments``), to call."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    return lambda: int(module.run(args))


def _tools(tmp: Path) -> dict[str, tuple[Callable[[], int], tuple[str, ...]]]:
    """Each tool on a tiny input, with what its bar says."""
    trace = _azure2021(tmp / "azure2021.csv")
    return {
        "simulate": (
            _run(simulate, [
                "--trace", str(trace), "--format", "azure2021", "--preset", "cpu",
                "--workers", "1", "--adapters", "6", "--policies", "baseline,plora",
                "--forecaster", "ewma", "--search-max-workers", "2", "--out", str(tmp / "sim"),
            ]),
            ("simulate:", "baseline: simulate", "plora: search 2 workers"),
        ),
        "eval": (
            _run(evaluate, [
                "--trace", str(trace), "--format", "azure2021", "--forecasters", "frequency",
                "--bench-ids", "20", "--bench-seconds", "5", "--out", str(tmp / "eval.json"),
            ]),
            ("forecasters:", "tick frequency:"),
        ),
        "pool": (
            _run(bench_pool, [
                "--trace", str(_alibaba(tmp / "alibaba.csv")), "--page-sweep", "",
                "--compaction-max-ratio", "0", "--ranks", "8,16", "--pool-fraction", "0.5",
                "--out", str(tmp / "pool.json"),
            ]),
            (f"paged {DEFAULT_PAGE_BYTES >> 10} KiB pages:", "contiguous:", "/60 "),
        ),
    }  # fmt: skip


@pytest.mark.parametrize("tool", ["simulate", "eval", "pool"])
def test_progress_bar_on_a_terminal(
    tool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, says = _tools(tmp_path)[tool]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert run() == 0
    shown = terminal.getvalue()
    for text in says:
        assert text in shown, (text, shown[-2000:])


@pytest.mark.parametrize("tool", ["simulate", "eval", "pool"])
def test_no_progress_output_when_stderr_is_not_a_terminal(
    tool: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, says = _tools(tmp_path)[tool]
    assert run() == 0
    out = capsys.readouterr()
    for text in says:
        assert text not in out.err and text not in out.out
    assert "\r" not in out.err
