"""``plora bench gpu --device cpu``: the GPU command's dry run, in its own process (the Triton
kernels run through Triton's interpreter there), on the tiny shape."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_gpu_dry_run_on_cpu(tmp_path: Path) -> None:
    if importlib.util.find_spec("peft") is None:
        pytest.skip("peft is not installed (the test extra)")
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "plora.cli", "bench", "gpu", "--device", "cpu"]
    proc = subprocess.run(
        [*cmd, "--batch-sizes", "2", "--out", str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    triton = importlib.util.find_spec("triton") is not None
    assert r["ok"] and r["settings"]["dry_run"] and r["settings"]["shape"] == "tiny"
    assert r["environment"]["kernels"] == (["torch", "triton"] if triton else ["torch"])
    if triton:
        assert {k: v["ok"] for k, v in r["kernels"].items()} == {"float32": True, "bfloat16": True}
        assert r["kernels"]["float32"]["max_rel_diff"] <= 1e-5
        assert {k: v["ok"] for k, v in r["attention"].items()} == {
            "float32": True,
            "bfloat16": True,
        }
        assert r["attention"]["float32"]["max_rel_diff"] <= 1e-5
    assert r["exactness"]["float32"]["max_rel_logit_diff"] <= 1e-4
    assert r["exactness"]["bfloat16"]["ok"]
    kinds = {"base", "peft_mixed"} | {f"mixed_{k}" for k in r["environment"]["kernels"]}
    if triton:  # the CUDA-graph variant (on the CPU: its static path without capture)
        kinds |= {"base_graphs", "mixed_triton_graphs"}
        assert r["graphs_tokens_agree"] is True and r["graph_steps"] > 0
        assert "mixed_over_base_b2" in r["ratios"]["triton_graphs"]
    assert set(r["tok_s"]) == kinds and all(v["2"] > 0 for v in r["tok_s"].values())
    assert set(r["decode_step_s"]) == {"base"} | {f"mixed_{k}" for k in r["environment"]["kernels"]}
    assert r["base_read_s"] > 0 and r["bandwidth_bytes_s"] > 0
    assert "mixed_over_peft_b2" in r["ratios"]["torch"]
    # the load path: per rank, the first acquire of each adapter reads the source and every
    # later one evicts the other adapter and loads from the host cache
    loads = r["loads"]
    assert sorted(loads["ranks"], key=int) == ["8", "16", "32", "64", "128"]
    for x in loads["ranks"].values():
        assert x["loads"] == {"source": 2, "host": 6}
        assert x["host_s"] > 0 and x["source_s"] > 0
    assert loads["ranks"]["128"]["bytes"] == 16 * loads["ranks"]["8"]["bytes"]
    assert loads["pinned_copy_bytes_s"] > 0 and loads["preset_h2d_bytes_s"] == 25e9
    assert "errors" not in r
    assert "decode step b2" in proc.stdout and f"wrote {out}" in proc.stdout
    assert "rank  128:" in proc.stdout


@pytest.mark.slow
def test_bench_gpu_refuses_cuda_without_cuda(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "plora.cli", "bench", "gpu", "--out", str(tmp_path / "x")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "CUDA is not available" in proc.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--adapters", "0"),
        ("--new-tokens", "-1"),
        ("--decode-batch", "x"),
        ("--ranks", "8,0"),
        ("--ranks", "8,x"),
        ("--batch-sizes", "1,0"),
        ("--batch-sizes", ","),
    ],
)
def test_bench_gpu_refuses_a_size_below_one(tmp_path: Path, flag: str, value: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, "-m", "plora.cli", "bench", "gpu", "--device", "cpu", flag, value]
        + ["--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"argument {flag}: expected" in proc.stderr and "positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
