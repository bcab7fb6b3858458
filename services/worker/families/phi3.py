"""Phi-3 / Phi-3.5 / Phi-4-mini: fused ``qkv_proj`` and ``gate_up_proj``, LongRoPE, partial RoPE.

The checkpoint and PEFT both name the fused projections, so an adapter's ``qkv_proj`` delta
covers the query, key and value columns at once (``[q | k | v]``, in that order) and
``gate_up_proj`` the ``[gate | up]`` columns. A config with ``sliding_window`` slides every
layer. ``partial_rotary_factor`` rotates only the leading part of each head. Rules from
transformers' ``modeling_phi3``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.worker.families import base
from services.worker.families.base import FULL, SLIDING, Architecture, Family


def describe_phi3(config: Mapping[str, Any]) -> Architecture:
    """Phi-3: Llama-style norms and SwiGLU over fused projections."""
    base.refuse_unsupported(config, "phi3")
    slide = config.get("sliding_window") is not None
    types = base.layer_types(config, lambda i: SLIDING if slide else FULL)
    r = base.rope(config)
    return Architecture(
        family="phi3",
        projections=base.FUSED_PROJECTIONS,
        fused_qkv=True,
        fused_gate_up=True,
        activation=base.activation(config, "silu"),
        attn_scale=base.scale_from_head_dim(config),
        layer_windows=base.windows(config, types),
        layer_ropes=(0,) * len(types),
        ropes=(r,),
        rotary_dim=base.rotary_dim(config, (r,)),
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
    )


PHI3 = Family(
    "phi3",
    frozenset({"phi3"}),
    frozenset({"Phi3ForCausalLM"}),
    base.FUSED_PROJECTIONS,
    describe_phi3,
)
