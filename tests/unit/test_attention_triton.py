"""The Triton paged-attention decode kernel (run here through Triton's CPU interpreter) and its
pure-torch path, both against dense attention over the unpaged keys and values: shuffled,
non-contiguous block tables, lengths of one key, exactly a block, a partial last block and many
blocks, GQA groups 1, 3 and 4, sliding windows, softcap, three dtypes; unused slots and blocks
(block 0 included) hold NaN, so a read of one shows.

``TRITON_INTERPRET=1`` is set here before anything imports Triton; the module is skipped
where Triton is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from services.worker.kernels.attention_triton import (  # noqa: E402
    _tanh,
    paged_decode_attention,
    paged_decode_attention_torch,
)
from services.worker.lora_pages import triton_interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_interpreting(), reason="Triton was imported before TRITON_INTERPRET=1 was set"
)

PATHS = {"triton": paged_decode_attention, "torch": paged_decode_attention_torch}


@dataclass
class Case:
    """A batch in a paged cache, and the same keys and values unpaged."""

    q: torch.Tensor  # [n, H, D]
    k_cache: torch.Tensor  # [KVH, NB, BS, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [n, max_blocks], padded with block 0
    seq_lens: torch.Tensor  # int32 [n]
    keys: list[torch.Tensor]  # per sequence [KVH, L, D]
    values: list[torch.Tensor]
    used: int  # physical blocks in use (block 0 excluded)


def _case(
    lens: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 0,
) -> Case:
    """Random keys and values scattered over a shuffled set of physical blocks, the longest
    sequence's table row full unless ``spare_blocks``. Every slot no sequence owns is NaN, even
    block 0 (all zeros when serving), which the tables' padding points at."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    used = sum(need)
    max_blocks = max(need) + spare_blocks
    num_blocks = 1 + used + 3  # block 0, the batch's blocks, 3 nobody owns
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for i, n in enumerate(lens):
        k = torch.randn(kv_heads, n, head_dim, generator=gen).to(dtype)
        v = torch.randn(kv_heads, n, head_dim, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        for j in range(need[i]):
            b = physical.pop()
            table[i, j] = b
            piece = slice(j * block_size, min(n, (j + 1) * block_size))
            width = piece.stop - piece.start
            k_cache[:, b, :width] = k[:, piece]
            v_cache[:, b, :width] = v[:, piece]
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return Case(q, k_cache, v_cache, table, seq_lens, keys, values, used)


def _dense(
    case: Case, scale: float, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Plain attention per sequence and head over the unpaged keys, float64."""
    n, num_heads, head_dim = case.q.shape
    group = num_heads // case.keys[0].shape[0] if n else 1
    out = torch.zeros(n, num_heads, head_dim, dtype=torch.float64)
    for i in range(n):
        length = case.keys[i].shape[1]
        if length == 0:
            continue
        first = 0 if window is None else max(0, length - window)
        for h in range(num_heads):
            k = case.keys[i][h // group, first:].double()
            v = case.values[i][h // group, first:].double()
            s = scale * (k @ case.q[i, h].double())
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[i, h] = torch.softmax(s, 0) @ v
    return out


def _run(path: str, case: Case, scale: float, **kw: object) -> torch.Tensor:
    fn = PATHS[path]
    return fn(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("block_size,head_dim", [(8, 16), (16, 64), (32, 128)])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 30.0), (19, 20.0)])
def test_float32_equals_dense_attention(
    path: str,
    block_size: int,
    head_dim: int,
    group: int,
    window: int | None,
    softcap: float | None,
) -> None:
    """One key, exactly one block, a partial last block, and a long sequence (several kernel
    tiles) agree with dense attention within 1e-5."""
    lens = [1, block_size, block_size + 3, 4 * block_size + 5]
    case = _case(lens, block_size, kv_heads=2, group=group, head_dim=head_dim, seed=group)
    scale = head_dim**-0.5
    got = _run(path, case, scale, window=window, softcap=softcap)
    assert got.dtype == torch.float32 and got.shape == case.q.shape
    assert not got.isnan().any()
    want = _dense(case, scale, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_kernel_equals_torch_path_with_large_scores() -> None:
    """Peaked softmaxes (scale 1 over head_dim 64) and a softcap near the scores' size: the
    kernel's online softmax and float32 tanh agree with the torch path within 1e-5."""
    case = _case([3, 40, 77, 16], 16, kv_heads=3, group=2, head_dim=64, seed=7)
    for softcap in (None, 5.0):
        got = _run("triton", case, 1.0, softcap=softcap)
        want = _run("torch", case, 1.0, softcap=softcap)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        dense = _dense(case, 1.0, None, softcap)
        torch.testing.assert_close(got.double(), dense, atol=1e-5, rtol=0)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, _tanh(tl.load(x_ptr + offs)))


def test_kernel_tanh_keeps_relative_precision() -> None:
    """The kernel's float32 tanh (Triton has no portable one) is within 1e-6 relative of
    torch's from 1e-6 to 20 in size, both signs: no cancellation near 0."""
    mags = torch.logspace(-6, 1.3, 512, dtype=torch.float64)
    x = torch.cat([mags, -mags]).float()
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, N=x.numel())
    want = torch.tanh(x.double())
    assert ((y.double() - want).abs() / want.abs()).max() < 1e-6


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("window", [1, 16, 17, 1000])
def test_window_edges(path: str, window: int) -> None:
    """A window of one key (the query's own), exactly a block, one past it, and longer than
    every sequence (the same as none)."""
    case = _case([1, 16, 33, 70], 16, kv_heads=1, group=4, head_dim=32, seed=window)
    got = _run(path, case, 0.3, window=window)
    torch.testing.assert_close(got.double(), _dense(case, 0.3, window), atol=1e-5, rtol=1e-5)
    if window == 1:  # softmax over one key: its value, for every head of the group
        for i, n in enumerate([1, 16, 33, 70]):
            torch.testing.assert_close(got[i], case.values[i][0, n - 1].expand(4, -1))
    if window == 1000:
        torch.testing.assert_close(got, _run(path, case, 0.3))


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(
    "dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)], ids=["bf16", "fp16"]
)
def test_16_bit_within_tolerance(path: str, dtype: torch.dtype, tol: float) -> None:
    """bf16 within 2e-2 and fp16 within 4e-3 (absolute and relative) of float64 attention over
    the same 16-bit keys and values; the result keeps q's dtype."""
    case = _case([1, 8, 13, 45], 8, kv_heads=2, group=3, head_dim=64, dtype=dtype, seed=3)
    for window, softcap in ((None, None), (10, 25.0)):
        got = _run(path, case, 0.125, window=window, softcap=softcap)
        assert got.dtype == dtype
        want = _dense(case, 0.125, window, softcap)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_padding_entries_never_change_the_result(path: str) -> None:
    """Table entries past a sequence's last block are never read: pointing them at block 0, at
    blocks of other sequences or at NaN blocks, or widening the table, gives the same bytes."""
    case = _case([5, 16, 21, 40], 8, kv_heads=2, group=4, head_dim=32, seed=11, spare_blocks=3)
    base = _run(path, case, 0.2, window=12, softcap=10.0)
    gen = torch.Generator().manual_seed(1)
    need = [-(-int(n) // 8) for n in case.seq_lens]
    num_blocks = case.k_cache.shape[1]
    table = case.block_tables.clone()
    for i, n in enumerate(need):
        table[i, n:] = torch.randint(0, num_blocks, (table.shape[1] - n,), generator=gen)
    wide = torch.cat([table, torch.randint(0, num_blocks, (4, 5), generator=gen)], 1).int()
    for t in (table, wide):
        got = PATHS[path](case.q, case.k_cache, case.v_cache, t, case.seq_lens, 0.2, 12, 10.0)
        assert torch.equal(got, base)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_strided_inputs_and_out(path: str) -> None:
    """q as a view of a fused QKV output, the cache and table as strided views, and ``out`` a
    strided view written in place and returned."""
    case = _case([9, 30], 8, kv_heads=2, group=2, head_dim=16, seed=5)
    n, num_heads, head_dim = case.q.shape
    fused = torch.randn(n, 3 * num_heads * head_dim)
    fused[:, : num_heads * head_dim] = case.q.reshape(n, -1)
    q = fused[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    k_cache = torch.stack([case.k_cache, case.k_cache.neg()], 1)[:, 0]  # head stride doubled
    table = torch.stack([case.block_tables, case.block_tables], 2)[:, :, 0]  # stride 2 on blocks
    assert not (q.is_contiguous() or k_cache.is_contiguous() or table.is_contiguous())
    big = torch.zeros(n, num_heads, 2 * head_dim)
    out = big[:, :, head_dim:]
    got = PATHS[path](q, k_cache, case.v_cache, table, case.seq_lens, 0.25, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(big[:, :, head_dim:].double(), _dense(case, 0.25), atol=1e-5, rtol=0)
    assert not big[:, :, :head_dim].any()


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_zero_length_rows_get_zeros(path: str) -> None:
    """A padding row (``seq_len`` 0, a table of block 0) reads nothing and gets zeros; an empty
    batch returns an empty result."""
    case = _case([0, 12, 0], 8, kv_heads=1, group=2, head_dim=16, seed=2)
    got = _run(path, case, 0.3)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    torch.testing.assert_close(got.double(), _dense(case, 0.3), atol=1e-5, rtol=0)
    empty = PATHS[path](
        case.q[:0],
        case.k_cache,
        case.v_cache,
        case.block_tables[:0],
        case.seq_lens[:0],
        0.3,
    )
    assert empty.shape == (0, 2, 16)


def _bad_inputs() -> tuple[dict[str, object], dict[str, tuple[dict[str, object], str]]]:
    """Valid arguments, and per error a change to them and the message it must raise."""
    c = _case([5, 9], 8, kv_heads=2, group=2, head_dim=16)
    q, k, v, t, s = c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens
    good = {"q": q, "k_cache": k, "v_cache": v, "block_tables": t, "seq_lens": s, "scale": 0.25}
    return good, {
        "q 2-D": ({"q": q[0]}, "q must be"),
        "cache 3-D": ({"k_cache": k[0], "v_cache": v[0]}, "k_cache must be"),
        "v shape": ({"v_cache": v[:, :3]}, "v_cache shape"),
        "head_dim": ({"q": torch.randn(2, 4, 32)}, "head_dim"),
        "heads": ({"q": torch.randn(2, 3, 16)}, "not a multiple"),
        "float64": (
            {"q": q.double(), "k_cache": k.double(), "v_cache": v.double()},
            "not supported",
        ),
        "mixed dtypes": ({"q": q.half()}, "one dtype"),
        "int64 table": ({"block_tables": t.long()}, "block_tables must be int32"),
        "table rows": ({"block_tables": t[:1]}, "block_tables must be int32"),
        "int64 lens": ({"seq_lens": s.long()}, "seq_lens must be int32"),
        "lens shape": ({"seq_lens": s[:1]}, "seq_lens must be int32"),
        "window 0": ({"window": 0}, "window"),
        "softcap 0": ({"softcap": 0.0}, "softcap"),
        "out shape": ({"out": torch.empty(2, 4, 8)}, "out must be"),
        "out dtype": ({"out": torch.empty(2, 4, 16, dtype=torch.half)}, "out must be"),
        "device": ({"k_cache": k.to("meta")}, "one device"),
        "length past table": ({"seq_lens": torch.tensor([5, 9999], dtype=torch.int32)}, "seq_lens"),
        "negative length": ({"seq_lens": torch.tensor([-1, 9], dtype=torch.int32)}, "seq_lens"),
        "block past cache": ({"block_tables": t + 1000}, "num_blocks"),
    }


GOOD, BAD = _bad_inputs()


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise_value_error(path: str, name: str) -> None:
    change, message = BAD[name]
    args = {**GOOD, **change}
    with pytest.raises(ValueError, match=message):
        PATHS[path](**args)  # type: ignore[arg-type]


@pytest.mark.slow
def test_kernel_compiles_for_a_cuda_gpu_without_one() -> None:
    """Triton's CUDA pipeline (PTX, then ptxas) compiles the kernel for sm_90 in every dtype,
    plain and with window and softcap (16-bit tiles on the tensor cores), in a process without
    the interpreter."""
    code = (
        "import json; from services.worker.kernels.attention_triton import compile_ptx; "
        "print(json.dumps({k: 'mma.sync' in v or 'wgmma' in v for k, v in compile_ptx().items()}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensor_cores = json.loads(proc.stdout.strip().splitlines()[-1])
    variants = ("", "/window_softcap")
    assert tensor_cores == {
        f"decode/{d}{x}": d != "fp32" for d in ("bf16", "fp16", "fp32") for x in variants
    }
