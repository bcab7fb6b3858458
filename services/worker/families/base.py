"""What a model family tells the decoder: its layers, projections and quirks, as plain data.

A :class:`Family` turns a Hugging Face ``config.json`` (old or new key layout) into an
:class:`Architecture`; :class:`services.worker.model.DecoderModel` runs every family from that
description, so the engine, the paged adapter store, the KV cache and sampling stay one
implementation. Families differ only in what they declare here:

- the LoRA projection names PEFT uses for the family (``q_proj`` ... ``down_proj``, or Phi-3's
  fused ``qkv_proj`` / ``gate_up_proj``) and whether the checkpoint stores them fused;
- the norm form (Llama's ``w * x_hat`` or Gemma's ``(1 + w) * x_hat``), the extra norms
  (Gemma 2/3's post-attention and pre/post-feed-forward norms, Qwen 3 and Gemma 3's per-head
  q/k norms), the MLP activation (SiLU or tanh-approximated GELU);
- attention: the score scale, logit soft-capping, each layer's sliding window (or none) and
  RoPE (Gemma 3's sliding layers use their own base), partial rotary dimensions;
- the embedding scale and final logit soft-capping.

The rules are transformers' (the modeling and configuration files of each family), which the
exactness tests compare against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import ConfigError
from services.common.types import PROJECTION_MODULES

#: The LoRA projections of an unfused decoder layer (Llama, Mistral, Qwen, Gemma).
SPLIT_PROJECTIONS: tuple[str, ...] = PROJECTION_MODULES
#: The LoRA projections of a layer whose checkpoint fuses q/k/v and gate/up (Phi-3).
FUSED_PROJECTIONS: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

#: RoPE types the decoder implements (transformers' ``rope_type`` names).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
#: Older spellings of ``rope_type`` in configs on the Hub.
_ROPE_TYPE_ALIASES = {"su": "longrope"}

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: type, base and the type's parameters (transformers' keys).

    Attributes:
        rope_type: One of :data:`ROPE_TYPES`.
        theta: RoPE base.
        params: The rest of the config's RoPE dict (``factor``, ``low_freq_factor``,
            ``short_factor``, ``original_max_position_embeddings``, ...).
    """

    rope_type: str
    theta: float
    params: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=True)


@dataclass(frozen=True)
class Architecture:
    """Everything the decoder needs to know about a family beyond the tensor shapes.

    Attributes:
        family: Registry name (``"llama"``, ``"qwen2"``, ``"gemma3"``, ...).
        projections: LoRA module names of a layer in PEFT's naming, in layer order.
        fused_qkv: The checkpoint stores ``self_attn.qkv_proj`` (Phi-3) instead of q/k/v.
        fused_gate_up: The checkpoint stores ``mlp.gate_up_proj`` (Phi-3).
        norm_plus_one: RMSNorms scale by ``1 + w`` computed in float32 (Gemma).
        sandwich_norms: Gemma 2/3: the attention and MLP outputs are normed before the
            residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``) and the
            MLP input by ``pre_feedforward_layernorm``.
        qk_norm: Per-head RMSNorm of queries and keys before RoPE (Qwen 3, Gemma 3).
        qkv_bias: q/k/v projections have biases (Qwen 2, ``attention_bias``).
        o_bias: The output projection has a bias (``attention_bias`` in Llama-style configs).
        mlp_bias: gate/up/down projections have biases (``mlp_bias``).
        activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
        embed_scale: Multiply embeddings by this (cast to the model dtype), or ``None``.
        attn_scale: Score scale (``head_dim ** -0.5``; Gemma ``query_pre_attn_scalar ** -0.5``).
        attn_softcap: ``cap * tanh(scores / cap)`` before the mask, or ``None``.
        final_softcap: ``cap * tanh(logits / cap)``, or ``None``.
        layer_windows: Per layer, the sliding window in tokens (a query at position ``i`` sees
            keys ``j`` with ``i - window < j <= i``), or ``None`` for global attention.
        layer_ropes: Per layer, an index into ``ropes``.
        ropes: The distinct rotary embeddings of the model.
        rotary_dim: Leading dimensions of each head that RoPE rotates (``partial_rotary_factor``).
        max_position_embeddings: The context the RoPE tables are built for.
    """

    family: str
    projections: tuple[str, ...]
    fused_qkv: bool = False
    fused_gate_up: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    embed_scale: float | None = None
    attn_scale: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    layer_ropes: tuple[int, ...] = ()
    ropes: tuple[Rope, ...] = ()
    rotary_dim: int = 0
    max_position_embeddings: int = 2048


@dataclass(frozen=True)
class Family:
    """A model family the worker serves.

    Attributes:
        name: Registry name, also ``ModelSpec.family``.
        model_types: ``config.json`` ``model_type`` values of the family.
        architectures: ``architectures`` class names of the family.
        projections: PEFT module names of a layer (what adapters for the family target).
        describe: ``config dict -> Architecture`` (raises :class:`ConfigError` on a config
            whose math the decoder does not implement).
    """

    name: str
    model_types: frozenset[str]
    architectures: frozenset[str]
    projections: tuple[str, ...]
    describe: Callable[[Mapping[str, Any]], Architecture]


# ----------------------------------------------------------------------------------------
# Config readers shared by the families (old and new transformers key layouts)


def head_dim(config: Mapping[str, Any]) -> int:
    """``head_dim`` from the config, else ``hidden_size // num_attention_heads``."""
    return int(
        config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"])
    )


def num_layers(config: Mapping[str, Any]) -> int:
    """``num_hidden_layers``."""
    return int(config["num_hidden_layers"])


def layer_types(config: Mapping[str, Any], default: Callable[[int], str]) -> tuple[str, ...]:
    """Per layer ``"sliding_attention"`` / ``"full_attention"``: the config's ``layer_types``
    when present (transformers >= 4.53 writes it), else ``default(layer_index)``.

    Raises:
        ConfigError: ``layer_types`` has the wrong length or an unknown entry.
    """
    n = num_layers(config)
    given = config.get("layer_types")
    if given is None:
        return tuple(default(i) for i in range(n))
    if not isinstance(given, Sequence) or len(given) != n:
        raise ConfigError(f"layer_types must list one entry per layer ({n}); got {given!r}")
    bad = [t for t in given if t not in (SLIDING, FULL)]
    if bad:
        raise ConfigError(
            f"layer_types entries {sorted(set(map(str, bad)))} are not supported "
            f"(only {SLIDING!r} and {FULL!r})"
        )
    return tuple(str(t) for t in given)


def windows(config: Mapping[str, Any], types: Sequence[str]) -> tuple[int | None, ...]:
    """Per layer window: ``sliding_window`` on sliding layers, ``None`` on global ones.

    Raises:
        ConfigError: a sliding layer without a positive ``sliding_window``.
    """
    w = config.get("sliding_window")
    if any(t == SLIDING for t in types) and (not isinstance(w, int) or w < 1):
        raise ConfigError(f"sliding layers need a positive sliding_window; got {w!r}")
    return tuple(int(w) if t == SLIDING else None for t in types)  # type: ignore[arg-type]


def _rope_of(d: Mapping[str, Any], config: Mapping[str, Any], default_theta: float) -> Rope:
    kind = str(d.get("rope_type") or d.get("type") or "default")
    kind = _ROPE_TYPE_ALIASES.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    theta = d.get("rope_theta")
    theta = config.get("rope_theta") if theta is None else theta
    params = {k: v for k, v in d.items() if k not in ("rope_type", "type", "rope_theta")}
    if kind in ("yarn", "longrope") and "original_max_position_embeddings" not in params:
        omax = config.get("original_max_position_embeddings")
        if omax is None:
            raise ConfigError(f"rope_type {kind!r} needs original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(omax)
    return Rope(kind, float(default_theta if theta is None else theta), params)


def rope(
    config: Mapping[str, Any],
    layer_type: str | None = None,
    default_theta: float = 10000.0,
    legacy_theta_key: str = "rope_theta",
    legacy_scaling: bool = True,
) -> Rope:
    """The RoPE a layer uses, from ``rope_parameters`` (transformers >= 5; optionally keyed
    by layer type) or the older ``rope_theta`` + ``rope_scaling`` keys.

    Args:
        config: The ``config.json`` dict.
        layer_type: For per-layer-type RoPE (Gemma 3), the layer type to read.
        default_theta: Base when the config gives none.
        legacy_theta_key: The older key holding this layer type's base (Gemma 3's sliding
            layers: ``rope_local_base_freq``).
        legacy_scaling: Whether the older ``rope_scaling`` applies to this layer type.

    Raises:
        ConfigError: an unsupported ``rope_type`` or missing parameters.
    """
    rp = config.get("rope_parameters")
    if (
        isinstance(rp, Mapping)
        and layer_type is not None
        and isinstance(rp.get(layer_type), Mapping)
    ):
        return _rope_of(rp[layer_type], {}, default_theta)
    if isinstance(rp, Mapping) and ("rope_type" in rp or "rope_theta" in rp or "type" in rp):
        return _rope_of(rp, config, default_theta)
    scaling = config.get("rope_scaling") if legacy_scaling else None
    d: dict[str, Any] = dict(scaling) if isinstance(scaling, Mapping) else {}
    theta = config.get(legacy_theta_key)
    d["rope_theta"] = default_theta if theta is None else theta
    if "partial_rotary_factor" in config and "partial_rotary_factor" not in d:
        d["partial_rotary_factor"] = config["partial_rotary_factor"]
    return _rope_of(d, config, default_theta)


def rotary_dim(config: Mapping[str, Any], ropes: Sequence[Rope]) -> int:
    """Rotated dimensions per head: ``int(head_dim * partial_rotary_factor)`` (even)."""
    factor = config.get("partial_rotary_factor")
    for r in ropes:
        factor = r.params.get("partial_rotary_factor", factor)
    dim = int(head_dim(config) * float(factor if factor is not None else 1.0))
    if dim < 2 or dim % 2:
        raise ConfigError(f"partial_rotary_factor gives {dim} rotary dimensions; need even >= 2")
    return dim


def softcap(config: Mapping[str, Any], key: str) -> float | None:
    """A soft-capping value (``None`` or absent: off)."""
    v = config.get(key)
    return None if v in (None, 0) else float(v)


def refuse_unsupported(config: Mapping[str, Any], family: str) -> None:
    """Refuse config switches that change the math and that no family here implements.

    Raises:
        ConfigError: naming the switch.
    """
    if config.get("use_bidirectional_attention"):
        raise ConfigError(f"{family}: use_bidirectional_attention is not supported")
    act = config.get("hidden_activation") or config.get("hidden_act")
    if act not in (None, "silu", "swish", "gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(
            f"{family}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)"
        )


def activation(config: Mapping[str, Any], default: str) -> str:
    """``"silu"`` or ``"gelu_tanh"`` from ``hidden_activation`` / ``hidden_act``."""
    act = config.get("hidden_activation") or config.get("hidden_act") or default
    return "gelu_tanh" if str(act).startswith("gelu") else "silu"


def scale_from_head_dim(config: Mapping[str, Any]) -> float:
    """``head_dim ** -0.5``: the attention scale of every family but Gemma."""
    return 1.0 / math.sqrt(head_dim(config))
