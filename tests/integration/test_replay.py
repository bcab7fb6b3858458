"""End to end: ``plora bench replay`` replays real Azure Functions 2021 rows against a fresh live
cluster per policy (real Redis, predictor, workers with the real base model, gateway) and writes
the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.replay import bench
from services.replay.report import COMPARISON_KEYS, POLICY_KEYS
from tests.conftest import shared_data
from tests.helpers import replay_args

pytestmark = pytest.mark.slow

POLICIES = ("plora", "baseline")


def test_replay_azure2021_slice_end_to_end(tmp_path: Path, model_dir: Path) -> None:
    trace = shared_data("traces", "azure_functions_2021_first998.csv")
    out = tmp_path / "replay"
    # 240 s of the trace (from 40 s on) compressed 20x: 27 requests in 12 s, 11 function keys
    # mapped onto 4 adapters (ranks 8 and 16); the per-worker pool (a quarter of the adapters'
    # bytes, at least the largest) holds about one of them. One worker per cluster keeps the
    # test short (start-up is mostly model loading); the benchmark itself runs two.
    args = replay_args([
        "--trace", str(trace), "--format", "azure2021", "--time-scale", "20",
        "--start", "2", "--duration", "12", "--adapters", "4", "--ranks", "8,16",
        "--policies", ",".join(POLICIES), "--out", str(out), "--workers", "1",
        "--max-new-tokens", "4", "--concurrency", "64", "--seed", "0",
        "--model", str(model_dir), "--warmup", "2", "--progress-interval", "2",
    ])  # fmt: skip
    code = bench.run(args)
    report = json.loads((out / "report.json").read_text())
    errors = {p: report[p]["error"] for p in POLICIES if "error" in report[p]}
    assert code == 0 and not errors, f"policies failed: {errors}"

    n = report["trace"]["requests"]
    assert 20 <= n <= 60
    assert 0 < report["compulsory_cold_rate"] <= 1
    s = report["settings"]
    assert s["adapters"] == 4 and s["max_new_tokens"] == 4 and s["pool_bytes"] >= 16 << 20
    assert s["pool_bytes"] < s["adapter_bytes_total"]
    for p in POLICIES:
        missing = [k for k in POLICY_KEYS if k not in report[p]]
        assert not missing, f"{p} lacks {missing}"
        assert report[p]["requests"] == n
        assert report[p]["completed"] > 0 and report[p]["ttft_mean_s"] > 0
        assert report[p]["status_samples"] >= 5
        usage = report[p]["service_usage"]
        assert usage["worker-0"]["cpu_s"] > 0 and usage["gateway"]["rss_bytes"] > 0
    assert set(COMPARISON_KEYS) <= set(report["comparison"])

    served = {p: _served(out / p / "requests.jsonl") for p in POLICIES}
    lost = served["baseline"] - served["plora"]
    assert not lost, f"plora failed requests the baseline served: {sorted(lost)}"
    for p in POLICIES:
        for line in (out / p / "requests.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["status"] == "OK":
                assert 1 <= r["completion_tokens"] <= 4
                assert r["worker_id"].startswith("worker-")
                assert r["first_token_s"] >= r["sent_s"]
    for name in (
        "report.md",
        "ttft_cdf.png",
        "cold_starts_over_time.png",
        "pool_utilization_over_time.png",
    ):
        assert (out / name).stat().st_size > 0, name


def _served(path: Path) -> set[int]:
    return {
        r["index"]
        for line in path.read_text().splitlines()
        if (r := json.loads(line))["status"] == "OK"
    }
