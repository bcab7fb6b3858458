"""End to end: ``plora bench replay`` replays real Azure Functions 2021 rows against a fresh live
cluster per policy (real Redis, predictor, workers with the real base model, gateway) and writes
the report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plora.replay import bench
from plora.replay.report import COMPARISON_KEYS, POLICY_KEYS
from tests.conftest import REPO, _pid_alive, shared_data
from tests.helpers import replay_args

pytestmark = pytest.mark.slow

POLICIES = ("plora", "baseline")


def test_replay_azure2021_slice_end_to_end_in_two_rounds(tmp_path: Path, model_dir: Path) -> None:
    """The CI smoke test of issue 6 on Azure Functions 2021 rows, run with ``--repeats 2``:
    each round replays both policies (the second round in the reverse order) and writes its own
    report, and the top level reports the rounds' means and their spread. (One run for both:
    every cluster start costs ~20 s of the suite.)"""
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
        "--ttft-probes", "2", "--repeats", "2",
    ])  # fmt: skip
    code = bench.run(args)
    report = json.loads((out / "report.json").read_text())
    rounds = [json.loads((out / f"round-{i}" / "report.json").read_text()) for i in (1, 2)]
    errors = {
        (i, p): r[p]["error"] for i, r in enumerate(rounds, 1) for p in POLICIES if "error" in r[p]
    }
    assert code == 0 and not errors, f"policies failed: {errors}"

    for i, rnd in enumerate(rounds, 1):
        _check_round(rnd, out / f"round-{i}")
    assert rounds[0]["trace"]["requests"] == rounds[1]["trace"]["requests"]

    assert [r["settings"]["round"] for r in rounds] == [1, 2]
    assert report["settings"]["repeats"] == 2 and "round" not in report["settings"]
    rep = report["repeats"]
    assert rep["rounds"] == 2 and rep["order"] == [list(POLICIES), list(reversed(POLICIES))]
    assert rep["comparison_per_round"] == [r["comparison"] for r in rounds]
    ttft = [r["comparison"]["ttft_mean_reduction"] for r in rounds]
    assert rep["spread"]["ttft_mean_reduction"]["min"] == min(ttft)
    assert set(COMPARISON_KEYS) <= set(report["comparison"])
    for p in POLICIES:
        assert report[p]["rounds"] == 2
        for k in ("ttft_mean_s", "cold_starts", "throughput_req_s"):
            want = (rounds[0][p][k] + rounds[1][p][k]) / 2
            assert report[p][k] == pytest.approx(want), (p, k)
    # The second round ran the baseline first.
    done = {
        (i, p): (out / f"round-{i}" / p / "requests.jsonl").stat().st_mtime
        for i in (1, 2)
        for p in POLICIES
    }
    assert done[1, "plora"] < done[1, "baseline"] < done[2, "baseline"] < done[2, "plora"]
    md = (out / "report.md").read_text()
    assert "Over 2 rounds" in md and "| ttft_mean_reduction |" in md
    for name in ("ttft_cdf.png", "cold_starts_over_time.png", "pool_utilization_over_time.png"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "plora").exists()  # rounds live under round-<i>/ only


def _check_round(report: dict, out: Path) -> None:
    """One round's report (``out/report.json``, already read) and files: every key, every
    policy's requests, nothing plora lost that the baseline served, the plots."""
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
        assert report[p]["ttft_uncontended_probes"] == 2
        # plora's workers stage the adapters; the probes and the replay wait for it
        settle = report[p]["phase_seconds"]["settle_s"]
        assert (4 <= settle < 120) if p == "plora" else settle < 1, (p, settle)
        assert 0 < report[p]["ttft_uncontended_s"] < 60
    assert set(COMPARISON_KEYS) <= set(report["comparison"])
    assert report["comparison"]["ttft_mean_reduction_ceiling"] < 1

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


def _ppid(pid: int) -> int:
    """The parent process id of ``pid`` (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            out[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace")
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the child processes")
def test_sigterm_stops_the_benchmark_cluster(tmp_path: Path, model_dir: Path) -> None:
    """A benchmark killed with SIGTERM (a CI timeout, ``kill``) stops the cluster it started:
    no service and no Redis server outlives it."""
    trace = shared_data("traces", "azure_functions_2021_first998.csv")
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "plora.cli", "bench", "replay", "--trace", str(trace),
            "--format", "azure2021", "--time-scale", "20", "--start", "2", "--duration", "12",
            "--adapters", "2", "--ranks", "8", "--policies", "plora,baseline", "--out", str(out),
            "--workers", "1", "--max-new-tokens", "4", "--model", str(model_dir),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        ready = out / "plora" / "run" / "gateway.ready.json"
        deadline = time.monotonic() + 300
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), "the cluster never came up"
        procs = _cmdlines()
        children = {pid: c for pid, c in procs.items() if str(out) in c}
        assert len(children) >= 3, children  # predictor, worker, gateway
        # the embedded Redis: a redis-server the benchmark started (its URL and password
        # reach the services in their environment, never on a command line)
        redis = [p for p, c in procs.items() if "redis-server" in c and _ppid(p) == proc.pid]
        assert len(redis) == 1, "the embedded Redis server was not found"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # failed before the SIGTERM: Ctrl-C stops its cluster too
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, output[-2000:]
    assert "[plora] interrupted (SIGTERM)" in output
    assert not (out / "report.json").exists()
    left = [pid for pid in [*children, *redis] if _pid_alive(pid)]
    for pid in left:  # do not leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the benchmark exited: {left}"
