"""RoPE frequencies of every supported type equal transformers' for the same config."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import ConfigError
from services.common.types import ModelSpec
from services.worker.families import describe
from services.worker.rope import rope_frequencies

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}


def _config(rope: dict[str, object], model_type: str = "llama") -> dict[str, object]:
    return {
        "model_type": model_type,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 1000,
        "max_position_embeddings": 131072,
        "rope_parameters": rope,
    }


def _phi3_longrope(partial: float) -> dict[str, object]:
    dim = int(64 * partial)
    return {
        "model_type": "phi3",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": partial,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.01 * i for i in range(dim // 2)],
            "long_factor": [1.5 + 0.1 * i for i in range(dim // 2)],
        },
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        LLAMA3,
        YARN,
    ],
    ids=["default", "linear", "llama3", "yarn"],
)
def test_inv_freq_matches_transformers(rope: dict[str, object]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _config(rope)
    arch = describe(cfg)
    ours = rope_frequencies(arch.ropes[0], arch.rotary_dim, arch.max_position_embeddings)
    hf_cfg = LlamaConfig(**cfg)
    if rope["rope_type"] == "default":
        dim = arch.rotary_dim
        theirs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        theirs_scale = 1.0
    else:
        theirs, theirs_scale = ROPE_INIT_FUNCTIONS[str(rope["rope_type"])](hf_cfg, "cpu")
    torch.testing.assert_close(ours.inv_freq, theirs.float(), rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(theirs_scale, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_and_long_match_transformers(partial: float) -> None:
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _phi3_longrope(partial)
    arch = describe(cfg)
    assert arch.rotary_dim == int(64 * partial)
    ours = rope_frequencies(arch.ropes[0], arch.rotary_dim, arch.max_position_embeddings)
    hf = Phi3Config(**cfg)
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=100)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=5000)
    torch.testing.assert_close(ours.inv_freq, short.float(), rtol=1e-6, atol=0)
    assert ours.long_inv_freq is not None
    torch.testing.assert_close(ours.long_inv_freq, long.float(), rtol=1e-6, atol=0)
    assert ours.long_after == 4096
    assert ours.attention_factor == pytest.approx(scale, rel=1e-12)


def test_spec_reads_rope_scaling_forms() -> None:
    assert ModelSpec.from_hf_config(_config({"rope_type": "default"})).rope_scaling is None
    assert ModelSpec.from_hf_config(_config(LLAMA3)).rope_scaling["factor"] == 32.0  # type: ignore[index]
    legacy = _config({})
    legacy["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ModelSpec.from_hf_config(legacy).rope_scaling == {"type": "linear", "factor": 2.0}


def test_legacy_rope_keys_are_read() -> None:
    legacy = _config({})
    del legacy["rope_parameters"]
    legacy["rope_theta"] = 500000.0
    legacy["rope_scaling"] = {"type": "linear", "factor": 2.0}
    rope = describe(legacy).ropes[0]
    assert (rope.rope_type, rope.theta, dict(rope.params)) == ("linear", 500000.0, {"factor": 2.0})


@pytest.mark.parametrize("kind", ["dynamic", "mrope", "nonsense"])
def test_unknown_rope_type_is_refused(kind: str) -> None:
    with pytest.raises(ConfigError, match=f"rope_type '{kind}' is not supported"):
        describe(_config({"rope_type": kind, "factor": 2.0}))


def test_rope_missing_parameter_is_named() -> None:
    arch = describe(_config({"rope_type": "linear", "rope_theta": 1e4}))
    with pytest.raises(ConfigError, match="'factor'"):
        rope_frequencies(arch.ropes[0], arch.rotary_dim, arch.max_position_embeddings)
