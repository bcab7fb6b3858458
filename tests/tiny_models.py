"""Small random-weight models of every served family, built from transformers' own config
classes with each family's quirks switched on (GQA, biases, sliding windows shorter than the
test prompts, soft-capping, fused projections, scaled RoPE), saved as HF directories.

Every parameter is drawn at random (norm weights too, so Gemma's ``1 + w`` and Qwen 3's q/k
norms matter), and a word-level ``tokenizer.json`` over the model's vocabulary is written
beside the weights so the directory also serves through ``plora up --model DIR``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

#: Vocabulary of the tiny models (word-level tokens ``w0`` .. ``w{VOCAB-1}``).
VOCAB = 256
#: Window shorter than the test prompts, so sliding layers differ from global ones.
WINDOW = 6
#: EOS token id of the tiny models and their tokenizer (``w2``).
EOS = 2

#: Shared shape: 4 layers, 4 query heads over 2 KV heads (GQA), head_dim 16.
_SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": EOS,
    "pad_token_id": 0,
}
#: family -> (transformers config class, extra config kwargs with the family's quirks on).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "mistral": ("MistralConfig", {"head_dim": 16, "sliding_window": WINDOW}),
    "qwen2": (
        "Qwen2Config",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "qwen3": (
        "Qwen3Config",
        {
            "head_dim": 16,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW,
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            "final_logit_softcapping": 8.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "phi3": (
        "Phi3Config",
        {
            "sliding_window": WINDOW,
            "original_max_position_embeddings": 24,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.05 * i for i in range(6)],
                "long_factor": [2.0 + 0.5 * i for i in range(6)],
                "original_max_position_embeddings": 24,
            },
        },
    ),
}

#: PEFT target modules per family: split projections, or Phi-3's fused ones.
SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def projections(family: str) -> list[str]:
    """The LoRA projections PEFT finds in ``family``'s layers."""
    return FUSED if family == "phi3" else SPLIT


def hf_config(family: str, quirks: bool = True):  # type: ignore[no-untyped-def]
    """transformers' config object of the tiny ``family`` model (its quirks off with
    ``quirks=False``: the config class's defaults on the shared shape)."""
    import transformers

    cls_name, extra = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**_SHAPE, **(extra if quirks else {})})


def build(family: str, seed: int = 0, quirks: bool = True):  # type: ignore[no-untyped-def]
    """A random-weight ``*ForCausalLM`` of ``family`` in float32, eval mode.

    Every floating parameter is redrawn: matrices ``N(0, 1/fan_in)``-ish, norm weights and
    biases ``N(0, 0.3)`` around their neutral value.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, quirks), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "norm" in name and not family.startswith("gemma"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:  # Gemma norm weights (used as 1 + w) and biases
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.eval()
    return model


def write_tokenizer(out: Path, vocab: int = VOCAB) -> None:
    """A word-level ``tokenizer.json`` (``w0`` .. ``w{vocab-1}``) with ``w2`` as EOS, matching
    the tiny models' ``eos_token_id`` (:func:`plora.bench.gpu.write_word_tokenizer`)."""
    from plora.bench.gpu import write_word_tokenizer

    write_word_tokenizer(out, vocab)


def save(family: str, out: Path, seed: int = 0, max_shard_size: str | None = None):  # type: ignore[no-untyped-def]
    """Build the tiny ``family`` model, save it as an HF directory with a tokenizer at ``out``
    (sharded when ``max_shard_size`` is given) and return the transformers model."""
    model = build(family, seed)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    write_tokenizer(out)
    return model


def put_in_hub_cache(src: Path, cache: Path, repo_id: str, commit: str = "0" * 40) -> Path:
    """Lay the model directory ``src`` out in a Hugging Face Hub cache at ``cache`` as
    ``hf download repo_id`` would (``models--org--name/blobs/<sha256>``,
    ``snapshots/<commit>/<file>`` linking to its blob, ``refs/main`` holding ``commit``) and
    return the snapshot directory."""
    import hashlib
    import os

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


#: Families :func:`save_gguf` writes, by llama.cpp's architecture name.
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2"}


def save_gguf(family: str, path: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """Write the tiny ``family`` model (quirks off: a GGUF states no sliding window or RoPE
    scaling that transformers' reader takes in) as an all-float32 GGUF file at ``path``, the way
    llama.cpp's converter lays it out: its tensor names, Llama's q/k rows permuted, the
    architecture's metadata keys and a byte-level BPE vocabulary ``w0`` .. ``w{VOCAB-1}``.
    Returns the transformers model it holds."""
    import gguf
    import numpy as np

    model = build(family, seed, quirks=False)
    cfg = model.config
    arch = GGUF_ARCH[family]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if family == "llama":
        writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"w{i}" for i in range(cfg.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's q/k row order
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if family == "llama" and name.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif family == "llama" and name.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
