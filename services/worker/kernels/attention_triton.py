"""Paged-attention decode: one query token per sequence against its keys in a paged KV cache.

Semantics (both :func:`paged_decode_attention`, the Triton kernel, and
:func:`paged_decode_attention_torch`, the pure-torch path): sequence ``i`` has ``L = seq_lens[i]``
keys at positions ``0 .. L-1``, key position ``p`` stored in slot ``p % block_size`` of physical
block ``block_tables[i, p // block_size]``; its query is at position ``L - 1``. Query head ``h``
reads KV head ``h // group`` (``group = num_heads // num_kv_heads``, grouped-query attention) and::

    s_p     = scale * q[i, h] . k[h // group, p]                 # float32
    s_p     = softcap * tanh(s_p / softcap)                      # only with softcap (Gemma 2)
    valid p : p < L and (window is None or p > L - 1 - window)   # sliding window of `window` keys
    out[i, h] = sum_p softmax(s)_p v[h // group, p]               # over valid p; cast to q's dtype

A sequence with ``L == 0`` (a padding row) reads nothing and gets zeros. Table entries past a
sequence's last block are never read, so they may point anywhere (block 0 by convention), and
slots of its last block past ``L`` are never read either.

Design: vLLM's PagedAttention (Kwon et al., arXiv 2309.06180) — the KV cache is allocated in
fixed-size blocks reached through a per-sequence block table — with a flash-decoding style
single pass per program: one program per ``(sequence, KV head)`` serves all ``group`` query heads
of that KV head (each K/V tile is read once for the group) and walks the sequence's keys in tiles
of ``TILE`` positions with an online softmax (running max and sum, float32). Tiles wholly before
a sliding window are skipped. The sequence is not split across programs (no flash-decoding
reduction step): decode parallelism comes from ``batch x num_kv_heads`` programs.

Dtypes: float32, bfloat16, float16 (``q`` and both caches the same). Float32 products are exact
IEEE (no TF32), so the kernel agrees with the torch path to float32 rounding. On CUDA, 16-bit
tiles go to the tensor cores with float32 accumulation (the softmax weights are rounded to the
cache's dtype for the ``p @ V`` product, as in FlashAttention); through Triton's CPU interpreter
every tile is float32.

This module imports Triton; import it only where Triton is installed
(:func:`services.worker.lora_pages.triton_available`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Key positions per step of the kernel's loop (a power of two, >= 16 for 16-bit ``tl.dot``).
TILE = 32

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _tanh(x):
    """float32 tanh: a Taylor series near 0 (no cancellation), ``(1 - e) / (1 + e)`` elsewhere."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    far = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    near = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(ax < 0.0625, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [n, H, D]
    k_ptr,  # [KVH, NB, BS, D]
    v_ptr,  # [KVH, NB, BS, D]
    table_ptr,  # int32 [n, max_blocks]
    lens_ptr,  # int32 [n]
    out_ptr,  # [n, H, D]
    scale,
    softcap,
    window,
    max_blocks,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kh,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vh,
    stride_vb,
    stride_vs,
    stride_vd,
    stride_tn,
    stride_tb,
    stride_on,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    i = tl.program_id(0)
    kh = tl.program_id(1).to(tl.int64)
    # A length past the table is clipped to it, so no read leaves the table's row.
    seq_len = tl.minimum(tl.load(lens_ptr + i), max_blocks * BLOCK_SIZE)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kh * GROUP + g
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + i * stride_qn + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((GROUP_P,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_P,), dtype=tl.float32)
    acc = tl.zeros((GROUP_P, HEAD_DIM_P), dtype=tl.float32)
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    k_head = k_ptr + kh * stride_kh
    v_head = v_ptr + kh * stride_vh
    row = table_ptr + i * stride_tn
    # Every tile visited holds at least one valid key, so the running max stays finite.
    for t0 in range((lo // TILE) * TILE, seq_len, TILE):
        pos = t0 + tl.arange(0, TILE)
        p_ok = (pos < seq_len) & (pos >= lo)
        blk = tl.load(row + (pos // BLOCK_SIZE) * stride_tb, mask=p_ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        kt = tl.load(
            k_head + blk[None, :] * stride_kb + slot[None, :] * stride_ks + d[:, None] * stride_kd,
            mask=d_ok[:, None] & p_ok[None, :],
            other=0.0,
        )  # K^T tile [D, TILE]
        if UPCAST:
            s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(
            v_head + blk[:, None] * stride_vb + slot[:, None] * stride_vs + d[None, :] * stride_vd,
            mask=p_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # V tile [TILE, D]
        if UPCAST:
            pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / tl.maximum(l_i, 1e-30)[:, None]  # a row of no keys: 0 / tiny = 0
    tl.store(
        out_ptr + i * stride_on + heads[:, None] * stride_oh + d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    softcap: float | None,
    out: torch.Tensor | None,
) -> int:
    """Validate the arguments of both paths; return ``group``. Raises ValueError."""
    if q.dim() != 3:
        raise ValueError(f"q must be [n, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_kv_heads, num_blocks, block_size, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    n, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} differs from the cache's {cache_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads {num_heads} is not a multiple of the cache's num_kv_heads {num_kv_heads}"
        )
    if block_size == 0 or head_dim == 0 or num_blocks == 0:
        raise ValueError(f"empty KV cache of shape {tuple(k_cache.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported (float32, bfloat16, float16)")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != n or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [n={n}, max_blocks], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (n,) or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"seq_lens must be int32 [n={n}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    tensors = {"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    tensors["seq_lens"] = seq_lens
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}"
            )
        tensors["out"] = out
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all on one device")
    if q.device.type == "cpu" and n:
        # Checking values on a GPU would wait for it every step; on the CPU it is free.
        max_blocks = block_tables.shape[1]
        if int(seq_lens.min()) < 0 or int(seq_lens.max()) > max_blocks * block_size:
            raise ValueError(
                f"seq_lens must lie in [0, max_blocks * block_size = {max_blocks * block_size}]"
            )
        if block_tables.numel() and (
            int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks
        ):
            raise ValueError(f"block_tables entries must lie in [0, num_blocks = {num_blocks})")
    return num_heads // num_kv_heads


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention through the block tables, one Triton launch (semantics: module docstring).

    Args:
        q: ``[n, num_heads, head_dim]`` one query token per sequence, same dtype as the cache.
        k_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]`` keys of one layer.
        v_cache: Values, same shape and dtype as ``k_cache``.
        block_tables: ``int32 [n, max_blocks]``; ``block_tables[i, j]`` is the physical block of
            sequence ``i``'s logical block ``j``.
        seq_lens: ``int32 [n]`` keys per sequence (the query is at position ``seq_lens[i] - 1``);
            0 for a padding row (its output is zeros).
        scale: Multiplies ``q . k`` (usually ``head_dim ** -0.5``).
        window: Sliding window: only the last ``window`` keys are attended; None for all.
        softcap: ``scores -> softcap * tanh(scores / softcap)`` after scaling; None for none.
        out: ``[n, num_heads, head_dim]`` of q's dtype to write into (may be a strided view).

    Any strides are accepted for every tensor. On a CPU the values of ``seq_lens`` and
    ``block_tables`` are checked too; on a GPU they are not (that would wait for the device):
    a length above ``max_blocks * block_size`` is clipped to it there, and a block number
    outside ``[0, num_blocks)`` reads out of bounds.

    Returns:
        ``[n, num_heads, head_dim]`` in q's dtype (``out`` when given).

    Raises:
        ValueError: a shape, dtype or device disagrees with the above, ``window < 1``,
            ``softcap <= 0``, or (CPU) a length or block number out of range.
    """
    group = _check(q, k_cache, v_cache, block_tables, seq_lens, window, softcap, out)
    if out is None:
        out = torch.empty_like(q)
    n, _, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    if n == 0:
        return out
    _paged_decode_kernel[(n, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(window) if window is not None else 0,
        block_tables.shape[1],
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE=TILE,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        UPCAST=q.dtype == torch.float32 or q.device.type != "cuda",
    )
    return out


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same as :func:`paged_decode_attention` in plain torch (gather blocks, mask, softmax).

    The reference of the kernel's tests and a path for devices without Triton. It gathers the
    batch's blocks up to its longest sequence (``seq_lens.max()`` is read, a device sync on a
    GPU). Arguments, result and errors as for :func:`paged_decode_attention`.
    """
    group = _check(q, k_cache, v_cache, block_tables, seq_lens, window, softcap, out)
    n, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    longest = int(seq_lens.max()) if n else 0
    nb = min(-(-longest // block_size), block_tables.shape[1])
    length = nb * block_size
    flat = block_tables[:, :nb].reshape(-1).long()
    # [kvh, n * nb, bs, d] -> [kvh, n, nb * bs, d], contiguous (index_select copies)
    k = k_cache.index_select(1, flat).view(num_kv_heads, n, length, head_dim).float()
    v = v_cache.index_select(1, flat).view(num_kv_heads, n, length, head_dim).float()
    pos = torch.arange(length, device=q.device)
    lens = seq_lens.long()[:, None]
    valid = pos[None, :] < lens
    if window is not None:
        valid &= pos[None, :] >= lens - window
    # Unread slots may hold anything, NaN included (and NaN * 0 is NaN): v is a copy, zero them.
    unread = (~valid).reshape(-1).nonzero().squeeze(1)
    v.view(num_kv_heads, n * length, head_dim).index_fill_(1, unread, 0.0)
    qg = q.float().reshape(n, num_kv_heads, group, head_dim).transpose(0, 1)  # [kvh, n, g, d]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [kvh, n, g, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of no keys -> zeros
    res = torch.matmul(probs, v).transpose(0, 1).reshape(n, num_heads, head_dim).to(q.dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


def compile_ptx(arch: int = 90) -> dict[str, str]:
    """Compile the kernel ahead of time for a CUDA ``sm_<arch>`` GPU, without one.

    For every dtype (``bf16``, ``fp16``, ``fp32``), plain and with window and softcap (head_dim
    128, block_size 16, group 4), Triton's full CUDA pipeline runs (TTIR, TTGIR, LLVM IR, PTX,
    ``ptxas``). Run it in a process where ``TRITON_INTERPRET`` is unset.

    Returns:
        ``"decode/<dtype>[/window_softcap]" -> PTX text``.

    Raises:
        triton.compiler.CompilationError: the kernel does not compile.
        RuntimeError: Triton runs in interpreter mode (kernels are not compilable then).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(_paged_decode_kernel, JITFunction):
        raise RuntimeError("Triton is in interpreter mode (TRITON_INTERPRET=1): nothing to compile")
    target = GPUTarget("cuda", arch, 32)
    strides = [
        f"stride_{t}{a}"
        for t, axes in (("q", "nhd"), ("k", "hbsd"), ("v", "hbsd"), ("t", "nb"), ("o", "nhd"))
        for a in axes
    ]
    out: dict[str, str] = {}
    for dt in ("bf16", "fp16", "fp32"):
        for extras in (False, True):
            sig = {
                "q_ptr": f"*{dt}",
                "k_ptr": f"*{dt}",
                "v_ptr": f"*{dt}",
                "table_ptr": "*i32",
                "lens_ptr": "*i32",
                "out_ptr": f"*{dt}",
                "scale": "fp32",
                "softcap": "fp32",
                "window": "i32",
                "max_blocks": "i32",
            } | dict.fromkeys(strides, "i32")
            const = {
                "GROUP": 4,
                "GROUP_P": 4,
                "HEAD_DIM": 128,
                "HEAD_DIM_P": 128,
                "BLOCK_SIZE": 16,
                "TILE": TILE,
                "USE_WINDOW": extras,
                "USE_SOFTCAP": extras,
                "UPCAST": dt == "fp32",
            }
            sig |= dict.fromkeys(const, "constexpr")
            src = ASTSource(_paged_decode_kernel, sig, constexprs=const)
            key = f"decode/{dt}" + ("/window_softcap" if extras else "")
            out[key] = triton.compile(src, target=target).asm["ptx"]
    return out
