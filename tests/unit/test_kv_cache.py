"""The paged KV cache: block accounting, and the same keys, values and greedy tokens as the slot
cache on small random models of three families (GQA, sliding windows, soft-capping)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.common.errors import ConfigError
from services.worker.engine import Engine, EngineConfig, EngineRequest
from services.worker.kv_cache import KVCacheFullError, PagedKVCache, SeqChunk
from services.worker.model import DecoderModel, KVCache, StepBatch
from services.worker.tokenizer import Tokenizer
from tests import tiny_models
from tests.helpers import engine_generate


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[DecoderModel, Path]]:
    root = tmp_path_factory.mktemp("kv")
    out = {}
    for family in ("llama", "mistral", "gemma2"):
        tiny_models.save(family, root / family)
        out[family] = (DecoderModel.from_dir(root / family), root / family)
    return out


def _paged(model: DecoderModel, blocks: int, block_size: int = 4, max_len: int = 16):
    return PagedKVCache(model.spec, blocks, block_size, max_len, "cpu", torch.float32)


def _chunk_step(kv: PagedKVCache, slot: int, start: int, n: int) -> None:
    """Take the blocks positions ``[start, start + n)`` of ``slot`` need."""
    kv.prepare([SeqChunk(slot=slot, row=0, num_tokens=n, start_pos=start)], n)


def test_blocks_are_reserved_taken_as_sequences_grow_and_returned(models) -> None:  # type: ignore[no-untyped-def]
    model, _ = models["llama"]
    kv = _paged(model, blocks=10)
    assert kv.capacity_tokens == 40 and kv.free_blocks == 10
    assert kv.tokens_reserved(5) == 8
    kv.reserve(0, 16)  # 4 blocks promised, none taken
    assert kv.free_blocks == 6 and kv.used_blocks == 0
    kv.reserve(1, 21)  # 6 blocks
    assert kv.free_blocks == 0 and not kv.can_reserve(1)
    with pytest.raises(KVCacheFullError, match="retry later"):
        kv.reserve(2, 1)
    with pytest.raises(ValueError, match="in use"):
        kv.reserve(1, 1)

    _chunk_step(kv, 0, 0, 6)  # 2 of slot 0's own blocks
    assert kv.used_blocks == 2 and kv.free_blocks == 0
    assert kv.table(0) == [1, 2]
    _chunk_step(kv, 1, 0, 3)
    assert kv.table(1) == [3]
    _chunk_step(kv, 0, 6, 10)  # grows to its 4 reserved blocks
    assert kv.table(0) == [1, 2, 4, 5]

    kv.free(0)  # all 4 back, LIFO: the last returned is taken first
    assert kv.used_blocks == 1 and kv.free_blocks == 4
    kv.move(1, 0, 3)
    assert kv.table(0) == [3] and kv.table(1) == []
    _chunk_step(kv, 0, 3, 2)
    assert kv.table(0) == [3, 1]
    with pytest.raises(ValueError, match="in use"):
        kv.move(5, 0, 0)

    # A sequence without a reservation takes only blocks nobody was promised.
    _chunk_step(kv, 7, 0, 16)
    assert kv.free_blocks == 0
    with pytest.raises(KVCacheFullError, match="no free KV block"):
        _chunk_step(kv, 8, 0, 1)
    kv.clear()
    assert kv.used_blocks == 0 and kv.free_blocks == 10

    with pytest.raises(ValueError, match="fewer than one 16-token sequence"):
        _paged(model, blocks=3)
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        _paged(model, blocks=0)


def _run_script(model: DecoderModel, kv: KVCache, script, prompts):  # type: ignore[no-untyped-def]
    """Run ``script`` (per step: ``(slot, n)`` chunks; n tokens of that sequence) greedily and
    return every step's logits. A chunk of one token after the prompt decodes the last
    sampled token."""
    tokens = {s: list(p) for s, p in prompts.items()}
    cached = dict.fromkeys(prompts, 0)
    out = []
    for step in script:
        ids: list[int] = []
        pos: list[int] = []
        chunks, last = [], []
        for slot, n in step:
            start = cached[slot]
            chunks.append(SeqChunk(slot=slot, row=len(ids), num_tokens=n, start_pos=start))
            ids += tokens[slot][start : start + n]
            pos += range(start, start + n)
            last.append(len(ids) - 1)
        batch = StepBatch(torch.tensor(ids), torch.tensor(pos), chunks, last)
        logits = model.forward(batch, kv)
        out.append(logits)
        for (slot, n), row in zip(step, logits, strict=True):
            cached[slot] += n
            if cached[slot] == len(tokens[slot]):
                tokens[slot].append(int(row.argmax()))
    return out, tokens


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_paged_forward_equals_slot_forward(models, family: str) -> None:  # type: ignore[no-untyped-def]
    """Chunked prefill, decode rows of different lengths crossing block boundaries, and tables
    of shuffled, non-contiguous blocks give the slot cache's logits (within float32 rounding
    of a different batching of the same products) and its greedy tokens."""
    model, _ = models[family]
    g = torch.Generator().manual_seed(3)
    prompts = {
        s: torch.randint(4, tiny_models.VOCAB, (n,), generator=g).tolist()
        for s, n in enumerate((11, 17, 5))
    }
    script = [[(0, 11), (1, 9)], [(0, 1), (1, 8), (2, 5)]]
    script += [[(0, 1), (1, 1), (2, 1)] for _ in range(14)]
    slot = model.new_kv_cache(3, 40, kind="slot")
    paged = model.new_kv_cache(3, 40, kind="paged", num_tokens=120, block_size=4)
    assert isinstance(paged, PagedKVCache)
    # Shuffle the free list so every table is a scatter of blocks.
    random.Random(5).shuffle(paged._free_blocks)  # noqa: SLF001 - the layout is the point
    want, want_tokens = _run_script(model, slot, script, prompts)
    got, got_tokens = _run_script(model, paged, script, prompts)
    assert got_tokens == want_tokens
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        diff = (a - b).abs().max().item()
        assert diff < 1e-5, f"{family} step {i}: max |logit diff| {diff:.2e}"
    tables = [paged.table(s) for s in range(3)]
    assert all(len(t) == -(-len(want_tokens[s]) // 4) for s, t in enumerate(tables))
    assert any(b - a != 1 for t in tables for a, b in zip(t, t[1:], strict=False))


def _engine_tokens(model: DecoderModel, tok: Tokenizer, cfg: EngineConfig, prompts):  # type: ignore[no-untyped-def]
    engine = Engine(model, tok, None, cfg)
    streams = [
        engine.submit(EngineRequest(f"q{i}", p, max_new_tokens=6, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    engine.start()
    try:
        out = []
        for s in streams:
            evs = list(s)
            assert evs[-1].error is None, evs[-1].error
            out.append([t for ev in evs for t in ev.token_ids])
    finally:
        engine.stop()
    return out, engine


def test_paged_engine_admits_by_blocks_and_matches_the_slot_engine(models) -> None:  # type: ignore[no-untyped-def]
    """In the memory of 2 slots of 128 tokens, 16-token chats: the slot engine runs 2 at a
    time, the paged one 16 (one 16-token block each), with the same greedy tokens; the rest
    queue until blocks come back, and every block is returned."""
    model, path = models["mistral"]
    tok = Tokenizer(path)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, tiny_models.VOCAB, (10,), generator=g).tolist() for _ in range(20)]
    slot_cfg = EngineConfig(max_batch_size=2, max_model_len=128, kv_cache="slot")
    want, slot_engine = _engine_tokens(model, tok, slot_cfg, prompts)
    paged_cfg = EngineConfig(
        max_batch_size=64, max_model_len=128, kv_cache_tokens=2 * 128, kv_block_size=16
    )
    got, paged_engine = _engine_tokens(model, tok, paged_cfg, prompts)
    assert got == want
    assert slot_engine.peak_running == 2
    assert paged_engine.peak_running == 16
    assert isinstance(paged_engine.kv, PagedKVCache)
    assert paged_engine.kv.nbytes <= slot_engine.kv.nbytes * 18 // 16  # + null, scratch
    assert paged_engine.kv.used_blocks == 0 and paged_engine.kv.free_blocks == 16
    assert paged_engine.kv_tokens == (256, 0) and slot_engine.kv_tokens == (256, 0)


def test_kv_cache_settings_are_checked(models) -> None:  # type: ignore[no-untyped-def]
    model, path = models["llama"]
    tok = Tokenizer(path)
    with pytest.raises(ConfigError, match="kv_cache 'ring' is not one of"):
        EngineConfig(kv_cache="ring")
    with pytest.raises(ConfigError, match="sizes the paged KV cache"):
        EngineConfig(kv_cache="slot", kv_cache_tokens=4096)
    with pytest.raises(ConfigError, match="kv_block_size must be >= 1"):
        EngineConfig(kv_block_size=0)
    with pytest.raises(ConfigError, match="cannot hold one 128-token sequence"):
        Engine(model, tok, None, EngineConfig(max_model_len=128, kv_cache_tokens=100))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_triton_decode_attention_engine_matches_torch(models, family: str) -> None:  # type: ignore[no-untyped-def]
    """The engine with the Triton paged-attention kernel (through Triton's interpreter here)
    gives the torch path's greedy tokens: GQA, sliding windows shorter than the sequences,
    soft-capping, blocks of 4 tokens."""
    pytest.importorskip("triton")
    from services.worker.lora_pages import triton_interpreting

    if not triton_interpreting():
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1 before importing it)")
    model, path = models[family]
    tok = Tokenizer(path)
    g = torch.Generator().manual_seed(4)
    rows: list[tuple[str | None, list[int]]] = [
        (None, torch.randint(4, tiny_models.VOCAB, (n,), generator=g).tolist()) for n in (9, 14, 3)
    ]
    got = {}
    for kernel in ("torch", "triton"):
        cfg = EngineConfig(max_model_len=64, kv_block_size=4, attention_kernel=kernel)
        engine = Engine(model, tok, None, cfg)
        assert isinstance(engine.kv, PagedKVCache) and engine.kv.decode_kernel == kernel
        engine.start()
        try:
            evs = engine_generate(engine, rows, 8, ignore_eos=True)
        finally:
            engine.stop()
        got[kernel] = [[t for ev in row for t in ev.token_ids] for row in evs]
    assert got["triton"] == got["torch"]
    with pytest.raises(ConfigError, match="reads the paged KV cache"):
        EngineConfig(kv_cache="slot", attention_kernel="triton")
