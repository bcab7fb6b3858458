"""Llama, Mistral and Qwen 2 / 2.5 / 3: pre-norm decoders with SwiGLU MLPs.

They differ in attention only: Mistral's sliding window (every layer, when the config sets
one), Qwen 2's q/k/v biases and optional sliding layers above ``max_window_layers``, Qwen 3's
per-head q/k RMSNorm. Rules from transformers' ``modeling_llama``, ``modeling_mistral``,
``modeling_qwen2`` and ``modeling_qwen3``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.worker.families import base
from services.worker.families.base import FULL, SLIDING, Architecture, Family


def _common(config: Mapping[str, Any], family: str, types: tuple[str, ...]) -> dict[str, Any]:
    base.refuse_unsupported(config, family)
    r = base.rope(config)
    return {
        "family": family,
        "projections": base.SPLIT_PROJECTIONS,
        "activation": base.activation(config, "silu"),
        "attn_scale": base.scale_from_head_dim(config),
        "layer_windows": base.windows(config, types),
        "layer_ropes": (0,) * len(types),
        "ropes": (r,),
        "rotary_dim": base.rotary_dim(config, (r,)),
        "max_position_embeddings": int(config.get("max_position_embeddings") or 2048),
        "o_bias": bool(config.get("attention_bias")),
        "qkv_bias": bool(config.get("attention_bias")),
        "mlp_bias": bool(config.get("mlp_bias")),
    }


def describe_llama(config: Mapping[str, Any]) -> Architecture:
    """Llama 2/3 (and SmolLM2): global attention everywhere."""
    return Architecture(**_common(config, "llama", base.layer_types(config, lambda i: FULL)))


def describe_mistral(config: Mapping[str, Any]) -> Architecture:
    """Mistral: every layer slides over ``sliding_window`` tokens when the config sets it."""
    slide = config.get("sliding_window") is not None
    types = base.layer_types(config, lambda i: SLIDING if slide else FULL)
    return Architecture(**_common(config, "mistral", types))


def _qwen_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    # Sliding layers are those at or above max_window_layers, and only with use_sliding_window.
    slide = bool(config.get("use_sliding_window")) and config.get("sliding_window") is not None
    top = int(config.get("max_window_layers") or 0)
    return base.layer_types(config, lambda i: SLIDING if slide and i >= top else FULL)


def describe_qwen2(config: Mapping[str, Any]) -> Architecture:
    """Qwen 2 / 2.5: q/k/v always carry biases, the output projection never does."""
    fields = _common(config, "qwen2", _qwen_types(config))
    fields.update(qkv_bias=True, o_bias=False)
    return Architecture(**fields)


def describe_qwen3(config: Mapping[str, Any]) -> Architecture:
    """Qwen 3: RMSNorm over each query and key head before RoPE; biases per ``attention_bias``."""
    fields = _common(config, "qwen3", _qwen_types(config))
    fields.update(qk_norm=True)
    return Architecture(**fields)


LLAMA = Family(
    "llama",
    frozenset({"llama", "smollm2", "smollm3_llama"}),
    frozenset({"LlamaForCausalLM"}),
    base.SPLIT_PROJECTIONS,
    describe_llama,
)
MISTRAL = Family(
    "mistral",
    frozenset({"mistral"}),
    frozenset({"MistralForCausalLM"}),
    base.SPLIT_PROJECTIONS,
    describe_mistral,
)
QWEN2 = Family(
    "qwen2",
    frozenset({"qwen2"}),
    frozenset({"Qwen2ForCausalLM"}),
    base.SPLIT_PROJECTIONS,
    describe_qwen2,
)
QWEN3 = Family(
    "qwen3",
    frozenset({"qwen3"}),
    frozenset({"Qwen3ForCausalLM"}),
    base.SPLIT_PROJECTIONS,
    describe_qwen3,
)
