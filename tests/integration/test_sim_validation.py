"""The simulator against the live cluster: a short real replay per policy, then the same slice
simulated with the ``cpu`` preset fitted to the machine as it was during each policy's replay;
TTFT mean and cold start rate must agree within 25 % for every policy (issue 7's validation).

The machine's speed (prefill and decode step, adapter load, gateway overhead) is read from the
replay's *solo* requests only, those alone on their worker (see
:mod:`plora.simulator.calibrate`); the validated figures come from everything else:
queueing, batching, residency, eviction, prefetch and routing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plora.replay import bench
from plora.simulator import run as sim_run
from plora.simulator.run import fit_presets_to_replay, validate_against_replay
from tests.conftest import shared_data
from tests.helpers import replay_args

pytestmark = pytest.mark.slow

POLICIES = ("plora", "baseline")
RANKS = (8, 16, 32, 64)
TOLERANCE = 0.25


def test_simulator_matches_a_live_replay(tmp_path: Path, model_dir: Path) -> None:
    trace = shared_data("traces", "alibaba_genai2026_lora_requests_nov.csv")
    out = tmp_path / "replay"
    # 3,600 s of the trace (from day 4.2) compressed 30x: 142 requests over 120 s (1.2/s, up
    # to 31 in 10 s), 38 keys onto 8 adapters of ranks 8-64, pool = 1/4 of their bytes per
    # worker, 2 workers, 2 new tokens: about 2 minutes of cluster time per policy, the workers
    # busy but not saturated (near saturation TTFT swings with every percent of machine speed).
    args = replay_args([
        "--trace", str(trace), "--format", "alibaba", "--time-scale", "30",
        "--start", "12000", "--duration", "120", "--adapters", "8",
        "--ranks", ",".join(map(str, RANKS)), "--policies", ",".join(POLICIES),
        "--workers", "2", "--max-new-tokens", "2", "--seed", "0",
        "--model", str(model_dir), "--warmup", "2", "--progress-interval", "10",
        "--ttft-probes", "2", "--out", str(out),
    ])  # fmt: skip
    code = bench.run(args)
    report = json.loads((out / "report.json").read_text())
    errors = {p: report[p]["error"] for p in POLICIES if "error" in report[p]}
    assert code == 0 and not errors, f"policies failed: {errors}"

    presets, fits = fit_presets_to_replay(report, out)
    for p in POLICIES:
        assert fits[p]["solo"] >= 20, fits[p]  # enough of the run to read the machine from
    result = validate_against_replay(report, preset=presets, tolerance=TOLERANCE)
    result["fits"] = fits
    (tmp_path / "validation.json").write_text(json.dumps(result, indent=1, default=str))
    table = {
        p: {k: (v["sim"], v["replay"], v["rel_error"]) for k, v in block.items()}
        for p, block in result["policies"].items()
    }
    print("validation (sim, live, rel. error):", json.dumps(table))
    assert set(result["policies"]) == set(POLICIES)
    # `plora simulate --replay-report DIR/report.json --out OUT`, as the README writes it (it
    # required --trace and --format, then simulated those instead of the replay's slice)
    cli_out = tmp_path / "cli"
    assert sim_run.main(["--replay-report", str(out / "report.json"), "--out", str(cli_out)]) == 0
    cli = json.loads((cli_out / "report.json").read_text())["validation"]
    assert cli["policies"] == json.loads(json.dumps(result["policies"], default=str))
    for p in POLICIES:
        assert report[p]["completed"] == report[p]["requests"] > 100
        for key, v in result["policies"][p].items():
            assert v["within"], f"{p} {key}: sim {v['sim']} vs live {v['replay']} ({table})"
