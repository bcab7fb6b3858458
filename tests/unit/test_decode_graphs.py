"""Decode steps over static, bucketed buffers (what CUDA graphs capture) give the plain
forward pass's tokens. On the CPU the static path runs without capture; the adapters' case runs
the Triton kernels through Triton's interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.errors import ConfigError
from services.worker.decode_graphs import DecodeGraphs
from services.worker.engine import Engine, EngineConfig, EngineRequest, running_engine
from services.worker.kv_cache import PagedKVCache
from services.worker.model import DecoderModel
from services.worker.tokenizer import Tokenizer
from tests import tiny_models
from tests.helpers import engine_generate, random_lora


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, tiny_models.VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_static_decode_steps_equal_the_forward_pass(tmp_path: Path, family: str) -> None:
    """Three sequences (a bucket of 4 with one padding row), then fewer as the short ones end:
    the same greedy tokens with and without the static path, which ran the decode steps; the
    padding rows' writes never reach the null block."""
    tiny_models.save(family, tmp_path / "m")
    model = DecoderModel.from_dir(tmp_path / "m")
    tok = Tokenizer(tmp_path / "m")
    prompts = _prompts(2, (9, 14, 3))
    got = {}
    for graphs in ("off", "on"):
        cfg = EngineConfig(max_model_len=64, kv_block_size=4, cuda_graphs=graphs)
        engine = Engine(model, tok, None, cfg)
        with running_engine(engine):
            streams = [
                engine.submit(EngineRequest(f"{graphs}{i}", p, max_new_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, (12, 5, 8), strict=True))
            ]
            got[graphs] = [[t for ev in s for t in ev.token_ids] for s in streams]
        if graphs == "on":
            # 3 rows (bucket 4, one padding row) until the 5-token one ends, then 2, then 1
            assert engine.graphs is not None and engine.graphs.steps >= 11
            assert not engine.graphs.capture and engine.graphs.captured == 0  # CPU: no capture
            assert isinstance(engine.kv, PagedKVCache)
            assert torch.count_nonzero(engine.kv.k[0][:, 0]) == 0  # the null block
        else:
            assert engine.graphs is None
    assert got["on"] == got["off"]
    assert [len(t) for t in got["on"]] == [12, 5, 8]


def test_buckets_and_settings() -> None:
    model_spec_free = pytest.raises(ValueError, match="ascending positive sizes")
    with model_spec_free:
        DecodeGraphs(None, None, buckets=(4, 2))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cuda_graphs must be 'on' or 'off'"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ConfigError, match="runs over the paged KV cache"):
        EngineConfig(cuda_graphs="on", kv_cache="slot")


@pytest.mark.slow
def test_static_decode_with_adapters_through_the_triton_kernels(tmp_path: Path) -> None:
    """Adapters in the real store's pool, read by the Triton LoRA and attention kernels
    (interpreted): the static path with per-row page tables gives the eager torch engine's
    tokens, for a batch mixing two adapters (ranks 8 and 32) and a base row."""
    pytest.importorskip("triton")
    from services.worker.lora_pages import triton_interpreting
    from services.worker.store import AdapterStore
    from services.worker.store_types import StoreConfig

    if not triton_interpreting():
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1 before importing it)")
    tiny_models.save("llama", tmp_path / "m")
    model = DecoderModel.from_dir(tmp_path / "m")
    tok = Tokenizer(tmp_path / "m")
    gen = torch.Generator().manual_seed(5)
    made = {
        name: random_lora(model.spec, name, rank, targets, gen)
        for name, rank, targets in [("r8", 8, ["q_proj", "v_proj"]), ("r32", 32, tiny_models.SPLIT)]
    }
    rows: list[tuple[str | None, list[int]]] = list(
        zip(["r8", None, "r32"], _prompts(6, (5, 3, 6)), strict=True)
    )
    cfg = StoreConfig(pool_bytes=1 << 20, page_bytes=4096, host_cache_bytes=1 << 20)
    out = {}
    with AdapterStore(cfg, lambda ref: made[ref.adapter_id]) as store:
        for mode in ("eager", "static"):
            triton = mode == "static"
            cfg_e = EngineConfig(
                max_model_len=32,
                kv_block_size=4,
                lora_kernel="triton" if triton else "torch",
                attention_kernel="triton" if triton else "torch",
                cuda_graphs="on" if triton else "off",
            )
            with running_engine(Engine(model, tok, store, cfg_e)) as engine:
                events = engine_generate(engine, rows, 4, prefix=mode, ignore_eos=True)
                if triton:
                    assert engine.graphs is not None and engine.graphs.steps >= 3
                    assert engine.graphs.lora is not None  # the adapters' rows ran in it
            assert all(ev[-1].error is None for ev in events)
            out[mode] = [[t for ev in evs for t in ev.token_ids] for evs in events]
    assert out["static"] == out["eager"]
    assert len({tuple(t) for t in out["eager"]}) == 3
