"""Types shared by the worker's layers: the base model's shape and host-side LoRA weights.

The layering follows vLLM's ``lora/`` package: ``ModelSpec`` describes
the served base; ``LoRAWeights`` holds one adapter's tensors as PEFT defines them; the store
(``store.py``) places them in the paged device pool; the engine applies them in batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: Projection names of an unfused decoder layer (Llama, Mistral, Qwen, Gemma), PEFT naming.
ATTN_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
PROJECTION_MODULES: tuple[str, ...] = ATTN_MODULES + MLP_MODULES
#: Fused projections some families' checkpoints and PEFT adapters name (Phi-3).
FUSED_MODULES: tuple[str, ...] = ("qkv_proj", "gate_up_proj")
#: Every projection name an adapter may target on some served family.
ALL_PROJECTION_MODULES: tuple[str, ...] = PROJECTION_MODULES + FUSED_MODULES


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a served base model, as read from its config.

    Attributes:
        name: Display name of the model (e.g. ``"SmolLM2-135M-Instruct"``).
        num_layers: Decoder layers (``num_hidden_layers``).
        hidden_size: Model width d.
        intermediate_size: MLP width.
        num_heads: Attention (query) heads.
        num_kv_heads: Key/value heads (grouped-query attention when < num_heads).
        head_dim: Per-head width (hidden_size // num_heads unless the config says otherwise).
        vocab_size: Embedding rows.
        max_position_embeddings: Context window in tokens.
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: Whether lm_head shares the embedding matrix.
        rope_scaling: RoPE scaling parameters (``{"rope_type": "llama3", "factor": ...}``)
            from ``rope_scaling`` or a non-default ``rope_parameters``; ``None`` for plain RoPE.
        family: The model family (``services.worker.families``): ``"llama"``, ``"qwen2"``,
            ``"gemma3"``, ``"phi3"``, ...
        projections: The projection names of a decoder layer that adapters may target, in
            PEFT's naming and layer order (Phi-3: ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
            ``down_proj``).
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    family: str = "llama"
    projections: tuple[str, ...] = PROJECTION_MODULES

    def module_shape(self, module: str) -> tuple[int, int]:
        """Return ``(in_features, out_features)`` of one projection of a decoder layer.

        Raises:
            KeyError: ``module`` is not one of :data:`ALL_PROJECTION_MODULES`.
        """
        d, q, kv, m = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        shapes = {
            "q_proj": (d, q),
            "k_proj": (d, kv),
            "v_proj": (d, kv),
            "o_proj": (q, d),
            "gate_proj": (d, m),
            "up_proj": (d, m),
            "down_proj": (m, d),
            "qkv_proj": (d, q + 2 * kv),
            "gate_up_proj": (d, 2 * m),
        }
        return shapes[module]

    @classmethod
    def from_hf_config(
        cls,
        config: dict[str, Any],
        name: str = "",
        family: str = "llama",
        projections: tuple[str, ...] = PROJECTION_MODULES,
    ) -> ModelSpec:
        """Build from a Hugging Face ``config.json`` dict of a decoder-only model.

        ``family`` and ``projections`` come from the worker's family registry
        (``services.worker.model_loader.spec_from_config`` fills them in).

        Reads ``rope_theta`` at the top level or inside ``rope_parameters`` (transformers >= 5).

        Raises:
            KeyError: a required field (``hidden_size``, ``num_hidden_layers``, ...) is missing.
        """
        c = config
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        rope = c.get("rope_parameters") or {}
        theta = c.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None)
        scaling = c.get("rope_scaling")
        if not isinstance(scaling, dict) and isinstance(rope, dict):
            scaling = rope
        if isinstance(scaling, dict):
            kind = scaling.get("rope_type") or scaling.get("type") or "default"
            scaling = None if kind == "default" else dict(scaling)
        else:
            scaling = None
        return cls(
            name=name or str(c.get("_name_or_path") or c.get("model_type") or "llama"),
            num_layers=int(c["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(c["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            vocab_size=int(c["vocab_size"]),
            max_position_embeddings=int(c.get("max_position_embeddings") or 2048),
            rope_theta=float(theta or 10000.0),
            rms_norm_eps=float(c.get("rms_norm_eps") or 1e-6),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            family=family,
            projections=tuple(projections),
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict (published in Redis so the gateway can validate adapters)."""
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelSpec:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = cls.__dataclass_fields__.keys()
        fields = {k: v for k, v in data.items() if k in names}
        if isinstance(fields.get("projections"), list):
            fields["projections"] = tuple(fields["projections"])  # type: ignore[arg-type]
        return cls(**fields)  # type: ignore[arg-type]


@dataclass
class LoRAModuleWeights:
    """LoRA weights of one (layer, projection) module, PEFT convention.

    The module's output becomes ``y = W x + scaling * B (A x)``.

    Attributes:
        lora_a: ``[r, in_features]`` (PEFT ``lora_A.weight``).
        lora_b: ``[out_features, r]`` (PEFT ``lora_B.weight``).
        scaling: ``alpha / r`` or, with rsLoRA, ``alpha / sqrt(r)``, with ``r`` and ``alpha``
            resolved per module through ``rank_pattern`` / ``alpha_pattern``.
    """

    lora_a: torch.Tensor  # [r, in_features]
    lora_b: torch.Tensor  # [out_features, r]
    scaling: float

    @property
    def rank(self) -> int:
        """LoRA rank r of this module (from the tensor shapes)."""
        return int(self.lora_a.shape[0])


@dataclass
class LoRAWeights:
    """All LoRA weights of one adapter version, on the host, in the serving dtype.

    Attributes:
        adapter_id: Registry id.
        version: Registry version (bumps on re-registration; stale versions must never serve).
        modules: ``(layer_index, projection_name) -> LoRAModuleWeights``.
        alpha: ``lora_alpha`` of the config (informational; scaling is per module).
        use_rslora: Whether scaling is ``alpha / sqrt(r)``.
        sha256: sha256 of the safetensors file the weights came from.
    """

    adapter_id: str
    version: int
    modules: dict[tuple[int, str], LoRAModuleWeights]
    alpha: float = 0.0
    use_rslora: bool = False
    sha256: str = ""
    target_modules: tuple[str, ...] = field(default_factory=tuple)

    @property
    def rank(self) -> int:
        """Largest rank over the adapter's modules."""
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of every A and B tensor together (the device pool's live bytes)."""
        return sum(
            m.lora_a.numel() * m.lora_a.element_size() + m.lora_b.numel() * m.lora_b.element_size()
            for m in self.modules.values()
        )


#: Shape of the default base model, SmolLM2-135M-Instruct (its ``config.json``: 30 layers,
#: hidden 576, MLP 1536, 9 heads, 3 KV heads, vocab 49,152). Serving reads the real config;
#: benchmarks and the simulator size adapters with this constant.
SMOLLM2_135M = ModelSpec(
    name="SmolLM2-135M-Instruct",
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
