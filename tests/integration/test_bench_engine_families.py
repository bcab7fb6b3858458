"""``plora bench engine --model DIR`` runs on other families' small models (Qwen2's biases
and sliding window, Phi-3's fused projections and LongRoPE) and writes every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiny_models
from tests.conftest import REPO

pytestmark = pytest.mark.slow

#: Keys every run writes; with ``--threads 1`` the per-CPU-second ones too.
KEYS = {
    "engine_base_tok_s",
    "engine_mixed_tok_s",
    "hf_base_tok_s",
    "peft_mixed_tok_s",
    "ttft_prompt256_s",
    "ttft_prompt_tokens",
    "mixed_over_base_b8",
    "mixed_over_peft_b8",
    "base_over_hf_b8",
    "base_weight_bytes_per_step",
    "adapter_weight_bytes_per_step_b8",
    "mixed_over_base_weight_read_bound",
    "engine_base_tok_per_cpu_s",
    "engine_mixed_tok_per_cpu_s",
    "mixed_over_base_b8_cpu",
    "kv",
}


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_bench_engine_runs_on_the_family(tmp_path: Path, family: str) -> None:
    tiny_models.save(family, tmp_path / "model")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "plora.cli", "bench", "engine", "--model"]
    cmd += [str(tmp_path / "model"), "--out", str(out), "--batch-sizes", "1,2"]
    cmd += ["--new-tokens", "3", "--threads", "1", "--adapter-ranks", "2,4", "--kv-slots", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert KEYS <= set(result), KEYS - set(result)
    for key in ("engine_base_tok_s", "engine_mixed_tok_s", "hf_base_tok_s", "peft_mixed_tok_s"):
        assert set(result[key]) == {"1", "2"} and min(result[key].values()) > 0, key
    # the tiny models' context is 256 positions: the TTFT prompt is cut to fit
    assert result["ttft_prompt_tokens"] == 255
    assert result["adapter_ranks"] == [2, 4]
    assert 0 < result["mixed_over_base_weight_read_bound"] < 1
    # KV admission: 2 slots of the 256-token context hold eight 64-token chats when paged
    kv = result["kv"]
    assert kv["context_tokens"] == 256 and kv["slot"]["sequences"] == 2
    assert kv["paged"]["peak_running"] == kv["paged"]["sequences"] == 8
    assert kv["paged_over_slot"] == 4.0
    assert kv["slot"]["bytes_per_sequence"] == 4 * kv["paged"]["bytes_per_sequence"]
