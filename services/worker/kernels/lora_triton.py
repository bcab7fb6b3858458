"""Triton multi-LoRA kernels that read adapters straight from the paged device pool.

Semantics (the same as the pure-torch path, :mod:`services.worker.lora_ops`): for one
``(layer, module)`` and every row ``i`` of the flat batch whose adapter ``s`` targets it::

    y[i] += scale_s * B_s (A_s x[i])        # A_s [r_s, in], B_s [out, r_s]

and a base-only row, or a row whose adapter does not target the module, gets no delta. The
work is split SGMV-style (Punica, arXiv 2310.18547) into two launches per projection:

``shrink``  ``t[i, :r_s] = x[i] @ A_s.T``, float32 ``t`` (``[T, R]``, ``R`` the largest rank of
            the module in the step: a scratch width only, no adapter is padded);
``expand``  ``y[i] += scale_s * t[i, :r_s] @ B_s.T``, accumulated in float32 and rounded once
            to ``y``'s dtype.

Each program takes one tile of one *segment* (consecutive rows sharing an adapter) and finds its
adapter's A or B through the page table (:mod:`services.worker.lora_pages`): an element offset
into the pool tensor plus the rank, so adapters are read in place, wherever their pages lie,
with each adapter's own rank; tiles past a segment's rows or an adapter's rank exit at once.

Dtypes: float32, bfloat16, float16 (``x``, the pool and ``y`` may differ; tiles are converted on
load). Float32 products are exact IEEE (no TF32), so the kernels agree with the torch path to
float32 rounding. On CUDA, 16-bit tiles go to the tensor cores with float32 accumulation; on the
CPU the kernels run through Triton's interpreter (every tile in float32 there).

This module imports Triton; import it only where :func:`triton_available` is true.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rows of a segment per program.
BLOCK_M = 16
#: Rank columns per shrink program and rank chunk of the expand loop.
BLOCK_R = 16
#: Input features per step of the shrink loop.
BLOCK_K = 64
#: Output features per expand program.
BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K] projection input
    pool_ptr,  # [P] pool elements
    t_ptr,  # [T, R] float32 scratch
    table_ptr,  # int64 [S, E, 3]: (A offset, B offset, rank)
    seg_start_ptr,  # int32 [G]
    seg_len_ptr,  # int32 [G]
    seg_adapter_ptr,  # int32 [G]
    entry,  # l * num_modules + m
    num_entries,  # E = layers * modules
    K,
    stride_xm,
    stride_xk,
    stride_tm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    g = tl.program_id(2)
    s = tl.load(seg_adapter_ptr + g).to(tl.int64)
    row = table_ptr + (s * num_entries + entry) * 3
    a_off = tl.load(row)
    rank = tl.load(row + 2)
    seg_len = tl.load(seg_len_ptr + g)
    r0 = pid_r * BLOCK_R
    m0 = pid_m * BLOCK_M
    if r0 >= rank:
        return
    if m0 >= seg_len:
        return
    start = tl.load(seg_start_ptr + g).to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = r0 + tl.arange(0, BLOCK_R)
    row_ok = rows < seg_len
    col_ok = cols < rank
    x_rows = x_ptr + (start + rows)[:, None] * stride_xm
    a_cols = pool_ptr + a_off + cols[None, :].to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :])
        at = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :])  # A^T tile
        if UPCAST:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at.to(xt.dtype))
    t_out = t_ptr + (start + rows)[:, None] * stride_tm + cols[None, :]
    tl.store(t_out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _expand_kernel(
    t_ptr,  # [T, R] float32 from the shrink
    pool_ptr,  # [P] pool elements
    y_ptr,  # [T, N] projection output (any strides)
    table_ptr,  # int64 [S, E, 3]
    scale_ptr,  # float32 [S, E]
    seg_start_ptr,
    seg_len_ptr,
    seg_adapter_ptr,
    entry,
    num_entries,
    N,
    stride_tm,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    s = tl.load(seg_adapter_ptr + g).to(tl.int64)
    row = table_ptr + (s * num_entries + entry) * 3
    b_off = tl.load(row + 1)
    rank = tl.load(row + 2)
    seg_len = tl.load(seg_len_ptr + g)
    m0 = pid_m * BLOCK_M
    if rank == 0:
        return
    if m0 >= seg_len:
        return
    scale = tl.load(scale_ptr + s * num_entries + entry)
    start = tl.load(seg_start_ptr + g).to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    outs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < seg_len
    out_ok = outs < N
    t_rows = t_ptr + (start + rows)[:, None] * stride_tm
    b_rows = pool_ptr + b_off + outs[None, :].to(tl.int64) * rank
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        tt = tl.load(t_rows + rs[None, :], mask=row_ok[:, None] & r_ok[None, :])
        bt = tl.load(b_rows + rs[:, None], mask=r_ok[:, None] & out_ok[None, :])  # B^T tile
        if UPCAST:
            acc += tl.dot(tt, bt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(tt.to(y_ptr.dtype.element_ty), bt.to(y_ptr.dtype.element_ty))
    y_tile = y_ptr + (start + rows)[:, None] * stride_ym + outs[None, :] * stride_yn
    mask = row_ok[:, None] & out_ok[None, :]
    y = tl.load(y_tile, mask=mask).to(tl.float32)
    tl.store(y_tile, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


def _upcast(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.float32 or device.type != "cuda"


def lora_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    entry: int,
    max_rank: int,
    max_rows: int,
) -> torch.Tensor:
    """``t[i, :r_s] = x[i] @ A_s.T`` for every segment row (one launch).

    Args:
        x: ``[T, in]`` projection input (any strides).
        pool: ``[P]`` the pool's elements (A and B are read from it through ``table``).
        table: ``int64 [S, E, 3]`` page table (:class:`services.worker.lora_pages.PagedLoRA`).
        segments: ``int32 [G]`` start row, row count and adapter index of each segment.
        entry: ``layer * num_modules + module`` index into the table's second axis.
        max_rank: Largest rank of the module among the step's adapters (> 0).
        max_rows: Longest segment, rows.

    Returns:
        ``float32 [T, max_rank]``; row ``i`` holds its adapter's ``r_s`` columns (the others,
        and the rows of other segments' untargeted adapters, are left unwritten).
    """
    t = torch.empty((x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(max_rows, BLOCK_M), triton.cdiv(max_rank, BLOCK_R), segments[0].numel())
    _shrink_kernel[grid](
        x,
        pool,
        t,
        table,
        *segments,
        entry,
        table.shape[1],
        x.shape[1],
        x.stride(0),
        x.stride(1),
        t.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_R=BLOCK_R,
        BLOCK_K=BLOCK_K,
        UPCAST=_upcast(x.dtype, x.device),
    )
    return t


def lora_expand(
    t: torch.Tensor,
    pool: torch.Tensor,
    y: torch.Tensor,
    table: torch.Tensor,
    scale: torch.Tensor,
    segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    entry: int,
    max_rows: int,
) -> None:
    """``y[i] += scale_s * t[i, :r_s] @ B_s.T`` in place for every segment row (one launch).

    Args:
        t: ``float32 [T, R]`` from :func:`lora_shrink`.
        pool: ``[P]`` the pool's elements.
        y: ``[T, out]`` projection output; a column view of a fused output is fine.
        table: ``int64 [S, E, 3]`` page table.
        scale: ``float32 [S, E]`` each adapter's scaling per entry.
        segments: As for :func:`lora_shrink`.
        entry: ``layer * num_modules + module``.
        max_rows: Longest segment, rows.
    """
    n = y.shape[1]
    grid = (triton.cdiv(max_rows, BLOCK_M), triton.cdiv(n, BLOCK_N), segments[0].numel())
    _expand_kernel[grid](
        t,
        pool,
        y,
        table,
        scale,
        *segments,
        entry,
        table.shape[1],
        n,
        t.stride(0),
        y.stride(0),
        y.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_R=BLOCK_R,
        UPCAST=_upcast(y.dtype, y.device),
    )


def compile_ptx(arch: int = 90) -> dict[str, str]:
    """Compile both kernels ahead of time for a CUDA ``sm_<arch>`` GPU, without one.

    For every dtype (``bf16``, ``fp16``, ``fp32``) and kernel, Triton's full CUDA pipeline
    runs (TTIR, TTGIR, LLVM IR, PTX, and ``ptxas`` to a cubin); a kernel that would not compile
    on a GPU fails here. Run it in a process where ``TRITON_INTERPRET`` is unset.

    Returns:
        ``"<kernel>/<dtype>" -> PTX text``.

    Raises:
        triton.compiler.CompilationError: a kernel does not compile.
        RuntimeError: Triton runs in interpreter mode (kernels are not compilable then).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(_shrink_kernel, JITFunction):
        raise RuntimeError("Triton is in interpreter mode (TRITON_INTERPRET=1): nothing to compile")
    target = GPUTarget("cuda", arch, 32)
    ints = ("entry", "num_entries")
    out: dict[str, str] = {}
    for dt in ("bf16", "fp16", "fp32"):
        up = dt == "fp32"
        segs = {"seg_start_ptr": "*i32", "seg_len_ptr": "*i32", "seg_adapter_ptr": "*i32"}
        shrink = {"x_ptr": f"*{dt}", "pool_ptr": f"*{dt}", "t_ptr": "*fp32", "table_ptr": "*i64"}
        shrink |= segs | dict.fromkeys((*ints, "K", "stride_xm", "stride_xk", "stride_tm"), "i32")
        shrink_const = {"BLOCK_M": BLOCK_M, "BLOCK_R": BLOCK_R, "BLOCK_K": BLOCK_K, "UPCAST": up}
        expand = {"t_ptr": "*fp32", "pool_ptr": f"*{dt}", "y_ptr": f"*{dt}", "table_ptr": "*i64"}
        expand |= {"scale_ptr": "*fp32"} | segs
        expand |= dict.fromkeys((*ints, "N", "stride_tm", "stride_ym", "stride_yn"), "i32")
        expand_const = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_R": BLOCK_R, "UPCAST": up}
        for name, fn, sig, const in (
            ("shrink", _shrink_kernel, shrink, shrink_const),
            ("expand", _expand_kernel, expand, expand_const),
        ):
            sig = sig | dict.fromkeys(const, "constexpr")
            compiled = triton.compile(ASTSource(fn, sig, constexprs=const), target=target)
            out[f"{name}/{dt}"] = compiled.asm["ptx"]
    return out
