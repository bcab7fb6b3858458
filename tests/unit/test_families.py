"""Every served family is exact against transformers (+ PEFT) on a small random model.

For each family (Llama, Mistral, Qwen 2, Qwen 3, Gemma 2, Gemma 3, Phi-3), a model built from
transformers' own config class with the family's quirks on (GQA, biases, sliding windows
shorter than the prompts, soft-capping, fused projections, scaled RoPE: see
``tests/tiny_models.py``) is saved as an HF directory and loaded by the worker's decoder:

* the base alone: last-position logits within 1e-4 of transformers (float32) and the same
  greedy tokens;
* three PEFT adapters (ranks 4 to 64, rank and alpha patterns, rsLoRA) and base-only rows in
  ONE mixed prefill batch: each row's logits within 1e-4 of PEFT with that adapter alone;
* the engine, all rows at once, with the paged KV cache and with the slot one: greedy tokens
  equal ``PeftModel.generate`` per adapter alone (Phi-3's rows grow past LongRoPE's switch
  point while they decode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.adapters import load_lora_weights
from services.worker.adapter_api import ResidentAdapters
from services.worker.engine import Engine, EngineConfig
from services.worker.model import DecoderModel, SeqChunk, StepBatch
from services.worker.tokenizer import Tokenizer
from tests import tiny_models
from tests.helpers import engine_generate, mixed_prefill_logits, peft_reference, randomize_lora

peft = pytest.importorskip("peft")

PROMPT_LEN = (20, 14, 22, 17)
NEW_TOKENS = 10


def _adapters(family: str) -> dict[str, dict[str, Any]]:
    """Three LoRA configs over the family's projections: ranks 4 to 64, patterns, rsLoRA."""
    fused = family == "phi3"
    attn_in = ["qkv_proj"] if fused else ["q_proj", "v_proj"]
    mlp = ["gate_up_proj", "down_proj"] if fused else ["gate_proj", "up_proj", "down_proj"]
    return {
        "r4_attn": {"r": 4, "lora_alpha": 8, "target_modules": attn_in},
        "r16_all_patterns": {
            "r": 16,
            "lora_alpha": 32,
            "target_modules": tiny_models.projections(family),
            "rank_pattern": {"down_proj": 8, "model.layers.1.self_attn.o_proj": 6},
            "alpha_pattern": {"o_proj": 64},
        },
        "r64_o_mlp_rs": {
            "r": 64,
            "lora_alpha": 32,
            "use_rslora": True,
            "target_modules": ["o_proj", *mlp],
        },
    }


@pytest.fixture(scope="module", params=list(tiny_models.FAMILIES))
def family_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    family = str(request.param)
    root = tmp_path_factory.mktemp(family)
    hf = tiny_models.save(family, root / "model")
    configs = _adapters(family)
    names = list(configs)
    pm = peft.get_peft_model(hf, peft.LoraConfig(**configs[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        pm.add_adapter(n, peft.LoraConfig(**configs[n]))
    randomize_lora(pm, seed=7, b_std=0.1)
    pm.save_pretrained(str(root / "adapters"))
    model = DecoderModel.from_dir(root / "model")
    assert model.spec.family == family
    weights = {
        n: load_lora_weights(root / "adapters" / n, model.spec, adapter_id=n, version=1)
        for n in names
    }
    ranks = {m.rank for w in weights.values() for m in w.modules.values()}
    assert min(ranks) == 4 and max(ranks) == 64 and {6, 8} <= ranks
    return family, pm, model, Tokenizer(root / "model"), weights


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, tiny_models.VOCAB, (n,), generator=g).tolist() for n in PROMPT_LEN]


def _rows() -> list[tuple[str | None, list[int]]]:
    """(adapter or None, prompt): the three adapters and a base-only row between them."""
    names: list[str | None] = ["r4_attn", None, "r16_all_patterns", "r64_o_mlp_rs"]
    return list(zip(names, _prompts(), strict=True))


def test_mixed_batch_logits_and_greedy_tokens_match_transformers_peft(family_setup) -> None:  # type: ignore[no-untyped-def]
    family, pm, model, tok, weights = family_setup
    rows = _rows()
    refs = [
        peft_reference(pm, a, ids, NEW_TOKENS, eos_token_id=tiny_models.EOS, pad_token_id=0)
        for a, ids in rows
    ]
    names = list(weights)

    # One prefill step of every row in one flat batch, rows interleaved by adapter.
    logits = mixed_prefill_logits(model, rows, {n: weights[n].modules for n in names})
    for i, (ref_logits, _) in enumerate(refs):
        diff = (logits[i] - ref_logits).abs().max().item()
        assert diff < 1e-4, f"{family} row {i} ({rows[i][0]}): max |logit diff| {diff:.2e}"
    with pm.disable_adapter(), torch.no_grad():  # every adapter changes its row's logits
        for i, (a, p) in enumerate(rows):
            if a is not None:
                base = pm(input_ids=torch.tensor([p])).logits[0, -1]
                assert (refs[i][0] - base).abs().max() > 1e-3, f"{family}: {a} has no effect"

    # The engine, every row concurrently: greedy tokens equal PEFT's per adapter alone, with
    # the paged KV cache (blocks of 4 tokens, so every row crosses several) and the slot one.
    for kv_cache in ("paged", "slot"):
        engine = Engine(
            model,
            tok,
            ResidentAdapters({n: w.modules for n, w in weights.items()}),
            EngineConfig(max_batch_size=8, max_model_len=64, kv_cache=kv_cache, kv_block_size=4),
        )
        engine.start()
        try:
            got = engine_generate(engine, rows, NEW_TOKENS)
        finally:
            engine.stop()
        for i, (evs, (_, ref_tokens)) in enumerate(zip(got, refs, strict=True)):
            assert evs[-1].error is None, evs[-1].error
            tokens = [t for ev in evs for t in ev.token_ids]
            where = f"{family} {kv_cache} row {i} ({rows[i][0]})"
            assert tokens == ref_tokens, f"{where}: {tokens} != {ref_tokens}"


def test_long_rope_switch_is_crossed_while_decoding() -> None:
    """Phi-3's rows cross LongRoPE's switch point during the greedy run above."""
    omax = tiny_models.FAMILIES["phi3"][1]["original_max_position_embeddings"]
    assert min(PROMPT_LEN) <= omax < max(PROMPT_LEN) + NEW_TOKENS
    assert max(PROMPT_LEN) <= omax


def test_sliding_window_is_shorter_than_the_prompts() -> None:
    assert tiny_models.WINDOW < min(PROMPT_LEN)


def test_base_alone_matches_transformers_sharded(tmp_path: Path) -> None:
    """A sharded checkpoint loads; the base model alone is exact (Gemma 3, the most quirks)."""
    hf = tiny_models.save("gemma3", tmp_path, seed=3, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = DecoderModel.from_dir(tmp_path)
    ids = _prompts()[0]
    kv = model.new_kv_cache(1, 64)
    batch = StepBatch(
        torch.tensor(ids), torch.arange(len(ids)), [SeqChunk(0, 0, len(ids), 0)], [len(ids) - 1]
    )
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1]
    assert (model.forward(batch, kv)[0] - ref).abs().max().item() < 1e-4
