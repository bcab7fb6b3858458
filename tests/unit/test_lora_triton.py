"""The Triton multi-LoRA kernels (run here through Triton's CPU interpreter) against the torch
path: random mixed batches of adapters placed by the real paged pool (split over non-adjacent
pages), ranks 1 to 128, base-only rows, different target modules, three dtypes; and a whole
decoder forward pass.

``TRITON_INTERPRET=1`` is set here before anything imports Triton; the module is skipped
where Triton is not installed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from services.common.errors import ConfigError  # noqa: E402
from services.common.types import LoRAModuleWeights, LoRAWeights  # noqa: E402
from services.worker.adapter_api import AdapterRef  # noqa: E402
from services.worker.allocators import PagedAllocator  # noqa: E402
from services.worker.device_pool import DevicePool  # noqa: E402
from services.worker.engine import Engine, EngineConfig, EngineRequest, running_engine  # noqa: E402
from services.worker.lora_ops import NO_ADAPTER, LoRABatch  # noqa: E402
from services.worker.lora_pages import (  # noqa: E402
    LORA_MODULES,
    AdapterPageTable,
    PagedLoRA,
    PageTableCache,
    resolve_lora_kernel,
    triton_interpreting,
)
from services.worker.model import DecoderModel, SeqChunk, StepBatch  # noqa: E402
from services.worker.packing import module_views, pack_weights, slot_pieces  # noqa: E402
from services.worker.store import AdapterStore  # noqa: E402
from services.worker.store_types import StoreConfig  # noqa: E402
from services.worker.tokenizer import Tokenizer  # noqa: E402
from tests import tiny_models  # noqa: E402
from tests.helpers import random_lora  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_interpreting(), reason="Triton was imported before TRITON_INTERPRET=1 was set"
)

#: (in, out) per module of the kernel tests: no size is a multiple of a block.
DIMS = {
    "q_proj": (80, 80),
    "k_proj": (80, 40),
    "v_proj": (80, 40),
    "o_proj": (80, 80),
    "gate_proj": (80, 150),
    "up_proj": (80, 150),
    "down_proj": (150, 80),
}
LAYERS = 2
PAGE_BYTES = 4096


def _adapter(
    name: str, rank: int, targets: list[str], gen: torch.Generator, layers: int = LAYERS
) -> LoRAWeights:
    """Random weights of ``rank`` (``down_proj`` at half rank: ranks differ inside an adapter)."""
    modules = {}
    for layer in range(layers):
        for mod in targets:
            din, dout = DIMS[mod]
            r = max(1, rank // 2) if mod == "down_proj" else rank
            a = torch.randn(r, din, generator=gen) / din**0.5
            b = torch.randn(dout, r, generator=gen) / r**0.5
            modules[(layer, mod)] = LoRAModuleWeights(a, b, 2.0 / r)
    return LoRAWeights(name, 1, modules)


def _fragmented_pool(dtype: torch.dtype, pages: int) -> tuple[DevicePool, PagedAllocator]:
    """A paged pool whose free space is runs of 20 pages (80 KiB, the largest tensor of the
    tests) between one-page fillers, so every adapter of more than 20 pages is split over runs
    that are not adjacent."""
    al = PagedAllocator(pages, PAGE_BYTES)
    pool = DevicePool(al, dtype, "cpu")
    holes = []
    while al.free_units >= 25:
        holes.append(pool.alloc(PAGE_BYTES * 20))
        pool.alloc(PAGE_BYTES)
    for a in holes:
        pool.free(a)
    return pool, al


def _place(
    pool: DevicePool, w: LoRAWeights
) -> tuple[dict[tuple[int, str], LoRAModuleWeights], int]:
    """Place ``w`` the way the store does (pack, split allocation, copy, piece views)."""
    packed = pack_weights(w, pool.dtype)
    a = pool.alloc_pieces(slot_pieces(packed.slots, packed.flat.element_size()), split=True)
    for dst, lo, hi in pool.segments(a):
        dst.copy_(packed.flat[lo:hi])
    views = pool.view(a) if not a.is_split else pool.piece_views(a)
    return module_views(views, packed.slots), a.handle


def _rows(n_adapters: int, rng: random.Random, n: int = 45) -> list[int]:
    """Runs of random length and adapter (base-only runs included, adapters recurring)."""
    rows: list[int] = []
    while len(rows) < n:
        rows += [rng.randrange(-1, n_adapters)] * rng.choice([1, 1, 2, 5, 17])
    return rows[:n]


CASES = [
    # (seed, [(rank, targets)]): ranks 1..128, different target sets, one untargeted module
    (0, [(1, ["q_proj", "v_proj"]), (128, list(DIMS)), (8, ["o_proj", "down_proj"])]),
    (1, [(16, ["k_proj", "gate_proj", "up_proj"]), (3, list(DIMS)), (64, ["q_proj", "gate_proj"])]),
    (2, [(32, list(DIMS)), (32, list(DIMS)), (128, ["down_proj", "v_proj"]), (2, ["up_proj"])]),
]


def _setup(
    seed: int, spec: list[tuple[int, list[str]]], dtype: torch.dtype
) -> tuple[list[dict[tuple[int, str], LoRAModuleWeights]], list[AdapterPageTable], PagedAllocator]:
    gen = torch.Generator().manual_seed(seed)
    pool, al = _fragmented_pool(dtype, pages=1400 if dtype == torch.float32 else 700)
    weights, handles = [], []
    for i, (rank, targets) in enumerate(spec):
        w, h = _place(pool, _adapter(f"a{i}", rank, targets, gen))
        weights.append(w)
        handles.append(h)
    for h in handles:
        a = al.get(h)
        assert a.is_split == (a.nbytes > 20 * PAGE_BYTES)
    assert any(al.get(h).is_split for h in handles)
    tables = PageTableCache(LAYERS).tables(list(range(len(spec))), weights)
    return weights, tables, al


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "spec"), CASES)
def test_kernels_equal_torch_path_float32(seed: int, spec: list[tuple[int, list[str]]]) -> None:
    weights, tables, _ = _setup(seed, spec, torch.float32)
    rows = _rows(len(spec), random.Random(seed))
    assert NO_ADAPTER in rows
    ref = LoRABatch(rows, weights)
    tri = LoRABatch(rows, weights, paged=PagedLoRA(rows, tables, "cpu"))
    gen = torch.Generator().manual_seed(100 + seed)
    base_rows = torch.tensor([r == NO_ADAPTER for r in rows])
    for layer in range(LAYERS):
        for mod, (din, dout) in DIMS.items():
            x = torch.randn(len(rows), din, generator=gen)
            # y is a column view of a wider (fused) output, as the model passes it
            fused = torch.randn(len(rows), dout + 7, generator=gen)
            want, got = fused.clone(), fused.clone()
            ref.apply(layer, mod, x, want[:, 3 : 3 + dout])
            tri.apply(layer, mod, x, got[:, 3 : 3 + dout])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{layer} {mod}")
            assert torch.equal(got[base_rows], fused[base_rows])  # base rows untouched
            assert torch.equal(got[:, :3], fused[:, :3]) and torch.equal(got[:, -4:], fused[:, -4:])


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_kernels_16_bit_within_tolerance(dtype: torch.dtype, tol: float) -> None:
    """16-bit: the kernel accumulates in float32 and rounds once, so against the exact result
    (float64 over the same rounded inputs) its error is at most ``tol * max|y|``; the torch
    path (which rounds ``x A^T`` too) is held to the same bound."""
    seed, spec = CASES[0]
    weights, tables, _ = _setup(seed, spec, dtype)
    rows = _rows(len(spec), random.Random(seed))
    ref = LoRABatch(rows, weights)
    tri = LoRABatch(rows, weights, paged=PagedLoRA(rows, tables, "cpu"))
    gen = torch.Generator().manual_seed(7)
    for mod, (din, dout) in DIMS.items():
        x = torch.randn(len(rows), din, generator=gen).to(dtype)
        y0 = torch.randn(len(rows), dout, generator=gen).to(dtype)
        exact = y0.double()
        for i, s in enumerate(rows):
            m = weights[s].get((1, mod)) if s != NO_ADAPTER else None
            if m is not None:
                xa = x[i].double() @ m.lora_a.double().t()
                exact[i] += m.scaling * (xa @ m.lora_b.double().t())
        got, want = y0.clone(), y0.clone()
        tri.apply(1, mod, x, got)
        ref.apply(1, mod, x, want)
        bound = tol * exact.abs().max().item()
        assert (got.double() - exact).abs().max().item() <= bound, mod
        assert (want.double() - exact).abs().max().item() <= bound, mod


def test_page_table_points_into_the_adapters_pages() -> None:
    """Each entry's offsets fall in its adapter's own (non-adjacent) pages and read back the
    adapter's tensors; untargeted modules have rank 0."""
    weights, tables, al = _setup(0, CASES[0][1], torch.float32)
    page_elems = PAGE_BYTES // 4
    owners = al.page_table
    for w, t in zip(weights, tables, strict=True):
        handle = None
        pages: set[int] = set()
        for (layer, mod), m in w.items():
            a_off, b_off, rank = t.entries[layer, LORA_MODULES.index(mod)].tolist()
            assert rank == m.rank and t.scale[layer, LORA_MODULES.index(mod)] == m.scaling
            assert torch.equal(t.pool[a_off : a_off + m.lora_a.numel()].view_as(m.lora_a), m.lora_a)
            assert torch.equal(t.pool[b_off : b_off + m.lora_b.numel()].view_as(m.lora_b), m.lora_b)
            for off, n in ((a_off, m.lora_a.numel()), (b_off, m.lora_b.numel())):
                first, last = off // page_elems, (off + n - 1) // page_elems
                held = {int(owners[p]) for p in range(first, last + 1)}
                assert len(held) == 1 and -1 not in held
                handle = handle if handle is not None else held.pop()
                pages.update(range(first, last + 1))
        assert {int(owners[p]) for p in pages} == {handle}
        targeted = {(layer, LORA_MODULES.index(mod)) for layer, mod in w}
        for layer in range(LAYERS):
            for mi in range(len(LORA_MODULES)):
                if (layer, mi) not in targeted:
                    assert t.entries[layer, mi, 2] == 0


def test_page_table_rejects_tensors_outside_one_pool() -> None:
    gen = torch.Generator().manual_seed(0)
    loose = _adapter("loose", 4, ["q_proj"], gen).modules  # separate tensors, no pool
    with pytest.raises(ValueError, match="contiguous view of the pool"):
        AdapterPageTable.build(loose, LAYERS)
    placed, _, _ = _setup(1, CASES[1][1], torch.float32)
    with pytest.raises(ValueError, match="outside the page table"):
        AdapterPageTable.build(placed[0], LAYERS - 1)  # a layer beyond the model
    mixed = {**placed[0], (0, "q_proj"): loose[(0, "q_proj")]}
    with pytest.raises(ValueError, match="contiguous view of the pool"):
        AdapterPageTable.build(mixed, LAYERS)


def test_page_table_cache_rebuilds_when_views_change() -> None:
    weights, _, _ = _setup(1, CASES[1][1], torch.float32)
    cache = PageTableCache(LAYERS)
    first = cache.tables(["x"], [weights[0]])[0]
    assert cache.tables(["x"], [dict(weights[0])])[0] is first  # same views: same table
    moved = {k: LoRAModuleWeights(m.lora_a, m.lora_b, m.scaling) for k, m in weights[0].items()}
    assert cache.tables(["x"], [moved])[0] is not first  # new views (a move): rebuilt


@pytest.mark.parametrize(
    ("kernel", "device", "want"),
    [("auto", "cpu", "torch"), ("torch", "cpu", "torch"), ("triton", "cpu", "triton")],
)
def test_resolve_lora_kernel(kernel: str, device: str, want: str) -> None:
    assert resolve_lora_kernel(kernel, device) == want


def test_resolve_lora_kernel_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="not one of"):
        resolve_lora_kernel("cutlass", "cpu")
    with pytest.raises(ConfigError, match="not one of"):
        EngineConfig(lora_kernel="cutlass")
    assert EngineConfig().resolved_lora_kernel == "torch"  # auto on the CPU
    assert EngineConfig(lora_kernel="triton").resolved_lora_kernel == "triton"  # interpreted


@pytest.mark.slow
def test_decoder_forward_triton_equals_torch(tmp_path: Path) -> None:
    """A tiny Llama's mixed prefill step: logits through the kernels equal the torch path's."""
    tiny_models.save("llama", tmp_path / "model")
    model = DecoderModel.from_dir(tmp_path / "model")
    spec = model.spec
    gen = torch.Generator().manual_seed(3)
    pool, _ = _fragmented_pool(torch.float32, pages=800)
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    specs = [(4, ["q_proj", "v_proj"]), (64, all7), (16, ["o_proj", "gate_proj", "down_proj"])]
    weights = []
    for i, (rank, targets) in enumerate(specs):
        made = random_lora(spec, f"a{i}", rank, targets, gen, b_std=0.1)
        weights.append(_place(pool, made)[0])
    tables = PageTableCache(spec.num_layers).tables([0, 1, 2], weights)
    prompts = [[5, 9, 11, 30, 7], [40, 41, 42], [8, 8, 9, 10, 77, 3], [12, 13]]
    adapters = [0, NO_ADAPTER, 1, 2]
    ids: list[int] = []
    pos: list[int] = []
    rows: list[int] = []
    chunks, last = [], []
    for slot, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        chunks.append(SeqChunk(slot=slot, row=len(ids), num_tokens=len(p), start_pos=0))
        ids += p
        pos += range(len(p))
        rows += [a] * len(p)
        last.append(len(ids) - 1)

    def run(lora: LoRABatch) -> torch.Tensor:
        kv = model.new_kv_cache(len(prompts), 32)
        return model.forward(
            StepBatch(torch.tensor(ids), torch.tensor(pos), chunks, last, lora), kv
        )

    want = run(LoRABatch(rows, weights))
    got = run(LoRABatch(rows, weights, paged=PagedLoRA(rows, tables, "cpu")))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = run(LoRABatch([NO_ADAPTER] * len(rows), weights))
    for i, a in enumerate(adapters):  # every adapter changes its row; the base row is exact
        same = torch.equal(got[i], base[i])
        assert same == (a == NO_ADAPTER), i


@pytest.mark.slow
def test_engine_with_store_greedy_tokens_same_for_triton_and_torch(tmp_path: Path) -> None:
    """The engine over the real adapter store: ``lora_kernel="triton"`` (page tables over the
    store's pool) streams the same greedy tokens as ``"torch"`` for a mixed batch."""
    tiny_models.save("llama", tmp_path / "model")
    model = DecoderModel.from_dir(tmp_path / "model")
    tok = Tokenizer(tmp_path / "model")
    gen = torch.Generator().manual_seed(5)
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    made = {
        name: random_lora(model.spec, name, rank, targets, gen)
        for name, rank, targets in [("r8", 8, ["q_proj", "v_proj"]), ("r32", 32, all7)]
    }
    cfg = StoreConfig(pool_bytes=1 << 20, page_bytes=4096, host_cache_bytes=1 << 20)
    rows = [("r8", [5, 9, 11, 30, 7]), (None, [40, 41, 42]), ("r32", [8, 8, 9, 10, 77, 3])]
    out = {}
    with AdapterStore(cfg, lambda ref: made[ref.adapter_id]) as store:
        for kernel in ("torch", "triton"):
            cfg_e = EngineConfig(max_batch_size=4, max_model_len=32, lora_kernel=kernel)
            with running_engine(Engine(model, tok, store, cfg_e)) as engine:
                streams = [
                    engine.submit(
                        EngineRequest(
                            f"{kernel}{i}",
                            p,
                            max_new_tokens=4,
                            adapter=AdapterRef(a, 1, "") if a else None,
                        )
                    )
                    for i, (a, p) in enumerate(rows)
                ]
                events = [list(s) for s in streams]
                # the triton engine ran the kernels (no fall back to torch)
                assert (engine._page_tables is not None) == (kernel == "triton")
                assert not engine._paged_fallback_logged
            assert all(ev[-1].error is None for ev in events)
            out[kernel] = [[t for ev in evs for t in ev.token_ids] for evs in events]
    assert out["triton"] == out["torch"]
    assert all(len(t) == 4 for t in out["torch"])


@pytest.mark.slow
def test_kernels_compile_for_a_cuda_gpu_without_one() -> None:
    """Triton's CUDA pipeline (PTX, then ptxas) compiles both kernels for sm_90 in every dtype
    (16-bit tiles on the tensor cores), in a process without the interpreter."""
    code = (
        "import json; from services.worker.kernels.lora_triton import compile_ptx; "
        "print(json.dumps({k: 'mma.sync' in v or 'wgmma' in v for k, v in compile_ptx().items()}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensor_cores = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tensor_cores == {
        f"{k}/{d}": d != "fp32" for d in ("bf16", "fp16", "fp32") for k in ("shrink", "expand")
    }
