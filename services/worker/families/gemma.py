"""Gemma 2 and Gemma 3 (text): sandwich norms, ``(1 + w)`` RMSNorm, GeGLU, scaled embeddings.

Gemma 2 alternates sliding and global layers (even layers slide) and soft-caps attention and
final logits. Gemma 3 slides on all but every ``sliding_window_pattern``-th layer (6), gives
its sliding layers their own RoPE base (``rope_local_base_freq``, 10,000; global layers
1,000,000 with the config's RoPE scaling) and norms each query and key head. The attention
scale is ``query_pre_attn_scalar ** -0.5`` and embeddings are multiplied by
``sqrt(hidden_size)`` in the model dtype. Rules from transformers' ``modeling_gemma2`` and
``modeling_gemma3`` (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from services.worker.families import base
from services.worker.families.base import FULL, SLIDING, Architecture, Family


def _gemma(config: Mapping[str, Any], family: str, types: tuple[str, ...]) -> dict[str, Any]:
    base.refuse_unsupported(config, family)
    scalar = config.get("query_pre_attn_scalar") or base.head_dim(config)
    return {
        "family": family,
        "projections": base.SPLIT_PROJECTIONS,
        "norm_plus_one": True,
        "sandwich_norms": True,
        "activation": base.activation(config, "gelu_pytorch_tanh"),
        "embed_scale": math.sqrt(int(config["hidden_size"])),
        "attn_scale": float(scalar) ** -0.5,
        "attn_softcap": base.softcap(config, "attn_logit_softcapping"),
        "final_softcap": base.softcap(config, "final_logit_softcapping"),
        "layer_windows": base.windows(config, types),
        "max_position_embeddings": int(config.get("max_position_embeddings") or 8192),
        "qkv_bias": bool(config.get("attention_bias")),
        "o_bias": bool(config.get("attention_bias")),
    }


def describe_gemma2(config: Mapping[str, Any]) -> Architecture:
    """Gemma 2: one RoPE, even layers sliding, attention and final soft-capping."""
    types = base.layer_types(config, lambda i: SLIDING if (i + 1) % 2 else FULL)
    r = base.rope(config)
    return Architecture(
        **_gemma(config, "gemma2", types),
        layer_ropes=(0,) * len(types),
        ropes=(r,),
        rotary_dim=base.rotary_dim(config, (r,)),
    )


def describe_gemma3(config: Mapping[str, Any]) -> Architecture:
    """Gemma 3 (text): local RoPE base on sliding layers, q/k norms."""
    pattern = int(config.get("sliding_window_pattern") or 6)
    types = base.layer_types(config, lambda i: SLIDING if (i + 1) % pattern else FULL)
    full = base.rope(config, FULL, default_theta=1_000_000.0)
    local = base.rope(
        config,
        SLIDING,
        default_theta=10_000.0,
        legacy_theta_key="rope_local_base_freq",
        legacy_scaling=False,
    )
    return Architecture(
        **_gemma(config, "gemma3", types),
        qk_norm=True,
        layer_ropes=tuple(1 if t == SLIDING else 0 for t in types),
        ropes=(full, local),
        rotary_dim=base.rotary_dim(config, (full,)),
    )


GEMMA2 = Family(
    "gemma2",
    frozenset({"gemma2"}),
    frozenset({"Gemma2ForCausalLM"}),
    base.SPLIT_PROJECTIONS,
    describe_gemma2,
)
GEMMA3 = Family(
    "gemma3",
    frozenset({"gemma3_text"}),
    frozenset({"Gemma3ForCausalLM"}),
    base.SPLIT_PROJECTIONS,
    describe_gemma3,
)
