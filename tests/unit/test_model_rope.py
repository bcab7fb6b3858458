"""RoPE frequencies (default, linear, llama3) equal transformers' for the same config."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.errors import ConfigError
from services.common.types import ModelSpec
from services.worker.model import rope_inv_freq

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def _config(rope: dict[str, object]) -> dict[str, object]:
    return {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 1000,
        "max_position_embeddings": 131072,
        "rope_parameters": rope,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        LLAMA3,
    ],
)
def test_inv_freq_matches_transformers(rope: dict[str, object]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _config(rope)
    spec = ModelSpec.from_hf_config(cfg)
    ours, scaling = rope_inv_freq(spec)
    hf_cfg = LlamaConfig(**cfg)
    if rope["rope_type"] == "default":
        dim = spec.head_dim
        theirs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        theirs_scale = 1.0
    else:
        theirs, theirs_scale = ROPE_INIT_FUNCTIONS[str(rope["rope_type"])](hf_cfg, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert scaling == theirs_scale


def test_spec_reads_rope_scaling_forms() -> None:
    assert ModelSpec.from_hf_config(_config({"rope_type": "default"})).rope_scaling is None
    assert ModelSpec.from_hf_config(_config(LLAMA3)).rope_scaling["factor"] == 32.0  # type: ignore[index]
    legacy = _config({})
    legacy["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ModelSpec.from_hf_config(legacy).rope_scaling == {"type": "linear", "factor": 2.0}


def test_unknown_rope_type_is_refused() -> None:
    spec = dataclasses.replace(
        ModelSpec.from_hf_config(_config({})), rope_scaling={"rope_type": "yarn", "factor": 2.0}
    )
    with pytest.raises(ConfigError, match="yarn"):
        rope_inv_freq(spec)
