"""Our own decoder forward pass for every served family, with a paged (or slot) KV cache and
batched multi-LoRA.

Serving never runs transformers' modeling code: this module implements the decoder (RMSNorm,
RoPE, grouped-query attention with optional sliding windows and soft-capping, gated MLP, tied
or untied embeddings) over weights read from an HF directory's safetensors files. What differs
between Llama, Mistral, Qwen 2/3, Gemma 2/3 and Phi-3 is declared by the family
(:mod:`services.worker.families`) and read here as data; there is one forward pass.

One forward call runs one engine *step* over a flat token batch ``[T]`` that mixes prefill
chunks of new sequences (many tokens each) with single-token decode rows of running ones.
Every projection adds the batch's LoRA deltas through
:class:`services.worker.lora_ops.LoRABatch`. The base model uses fused ``qkv`` and
``gate_up`` matrices (one matmul each); LoRA deltas are added to column views of the fused
outputs, so per-module semantics are exactly PEFT's.

Keys and values live in a :mod:`services.worker.kv_cache` cache: paged (fixed-size blocks
through a block table per sequence) or slots (one ``max_len`` slot per sequence). New
keys/values are written in place; attention reads them through the cache's layout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from services.common.errors import ConfigError
from services.common.types import ModelSpec
from services.worker.families import Architecture, describe
from services.worker.kv_cache import (
    DecodeLayout,
    KVCache,
    PagedKVCache,
    SeqChunk,
    SlotKVCache,
    StepKV,
)
from services.worker.lora_ops import LoRAApplier, LoRABatch
from services.worker.model_loader import read_config, spec_from_config
from services.worker.rope import RopeTable, rope_frequencies

__all__ = ["DecoderModel", "KVCache", "PagedKVCache", "SeqChunk", "SlotKVCache", "StepBatch"]

logger = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """One forward step's inputs (built by the engine every step).

    Attributes:
        input_ids: ``[T]`` int64 token ids, rows grouped by sequence.
        positions: ``[T]`` int64 absolute positions.
        chunks: One :class:`SeqChunk` per sequence in the step.
        logits_rows: Rows whose next-token logits are wanted (last token of a sequence).
        lora: The step's LoRA mapping, or ``None`` for base-only.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    chunks: list[SeqChunk]
    logits_rows: list[int]
    lora: LoRABatch | None = None
    _cache: dict[str, object] = field(default_factory=dict)


@dataclass
class _Layer:
    wqkv: torch.Tensor  # [q + 2 kv, d]
    wo: torch.Tensor  # [d, q]
    w_gate_up: torch.Tensor  # [2 m, d]
    w_down: torch.Tensor  # [d, m]
    ln1: torch.Tensor  # [d] input norm
    ln2: torch.Tensor  # [d] MLP input norm
    bqkv: torch.Tensor | None = None  # [q + 2 kv]
    bo: torch.Tensor | None = None  # [d]
    b_gate_up: torch.Tensor | None = None  # [2 m]
    b_down: torch.Tensor | None = None  # [d]
    post_attn: torch.Tensor | None = None  # [d] Gemma's norm of the attention output
    post_ffn: torch.Tensor | None = None  # [d] Gemma's norm of the MLP output
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]


def _load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text("utf-8"))["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_file(str(model_dir / name)))
        return state
    return load_file(str(model_dir / "model.safetensors"))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class DecoderModel:
    """A decoder-only transformer of any registered family, for batched multi-LoRA serving.

    One implementation for every family: the family's :class:`Architecture` says which norms,
    biases, activation, attention windows, RoPE tables and soft-caps a layer has (see
    :mod:`services.worker.families`). LoRA deltas are added per projection name the family
    declares (``q_proj`` ... ``down_proj``, or Phi-3's fused ``qkv_proj`` / ``gate_up_proj``)
    onto column views of the fused base outputs, so each adapter's math is exactly PEFT's.

    Args:
        spec: The model's shape.
        arch: The family's description of the layers.
        state: HF-named weights (``model.layers.{i}.self_attn.q_proj.weight``, ...).
        device: Where weights and activations live (``"cpu"``, ``"cuda"``, ...).
        dtype: Weight/activation dtype (float32 on CPU; bfloat16/float16 on CUDA).

    Raises:
        ConfigError: a weight the architecture needs is missing from ``state``.
    """

    def __init__(
        self,
        spec: ModelSpec,
        arch: Architecture,
        state: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec = spec
        self.arch = arch
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            if name not in state:
                raise ConfigError(
                    f"the checkpoint has no {name!r}, which a {arch.family} model needs"
                )
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:
            # Gemma scales by (1 + w) in float32; folding the 1 in at load is the same sum.
            if arch.norm_plus_one:
                return (1.0 + state[name].float()).to(self.device) if name in state else w(name)
            return w(name)

        def cat(names: list[str]) -> torch.Tensor:
            return torch.cat([w(n) for n in names]).contiguous()

        self.embed = w("model.embed_tokens.weight")  # [vocab, d]
        if spec.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")  # [vocab, d]
        self.norm = norm("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(spec.num_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = ["qkv_proj"] if arch.fused_qkv else ["q_proj", "k_proj", "v_proj"]
            gate_up = ["gate_up_proj"] if arch.fused_gate_up else ["gate_proj", "up_proj"]
            p = f"model.layers.{i}."
            layer = _Layer(
                wqkv=cat([a + n + ".weight" for n in qkv]),
                wo=w(a + "o_proj.weight"),
                w_gate_up=cat([m + n + ".weight" for n in gate_up]),
                w_down=w(m + "down_proj.weight"),
                ln1=norm(p + "input_layernorm.weight"),
                ln2=norm(
                    p
                    + (
                        "pre_feedforward_layernorm"
                        if arch.sandwich_norms
                        else "post_attention_layernorm"
                    )
                    + ".weight"
                ),
            )
            if arch.qkv_bias:
                layer.bqkv = cat([a + n + ".bias" for n in qkv])
            if arch.o_bias:
                layer.bo = w(a + "o_proj.bias")
            if arch.mlp_bias:
                layer.b_gate_up = cat([m + n + ".bias" for n in gate_up])
                layer.b_down = w(m + "down_proj.bias")
            if arch.sandwich_norms:
                layer.post_attn = norm(p + "post_attention_layernorm.weight")
                layer.post_ffn = norm(p + "post_feedforward_layernorm.weight")
            if arch.qk_norm:
                layer.q_norm = norm(a + "q_norm.weight")
                layer.k_norm = norm(a + "k_norm.weight")
            self.layers.append(layer)
        qdim = spec.num_heads * spec.head_dim
        kvdim = spec.num_kv_heads * spec.head_dim
        mlp = spec.intermediate_size
        # (LoRA module name, column range of the fused output) for q/k/v and gate/up.
        if arch.fused_qkv:
            self._qkv_views = [("qkv_proj", 0, qdim + 2 * kvdim)]
        else:
            self._qkv_views = [
                ("q_proj", 0, qdim),
                ("k_proj", qdim, qdim + kvdim),
                ("v_proj", qdim + kvdim, qdim + 2 * kvdim),
            ]
        if arch.fused_gate_up:
            self._gate_up_views = [("gate_up_proj", 0, 2 * mlp)]
        else:
            self._gate_up_views = [("gate_proj", 0, mlp), ("up_proj", mlp, 2 * mlp)]
        self._act = _gelu_tanh if arch.activation == "gelu_tanh" else F.silu
        self._ropes = [
            RopeTable(
                rope_frequencies(r, arch.rotary_dim, arch.max_position_embeddings),
                self.device,
                dtype,
            )
            for r in arch.ropes
        ]
        self._long_rope = any(t.freqs.long_after is not None for t in self._ropes)
        self._ensure_rope(min(spec.max_position_embeddings, 4096))

    @classmethod
    def from_dir(
        cls,
        model_dir: Path | str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        name: str = "",
    ) -> DecoderModel:
        """Load from an HF model directory (``config.json`` + safetensors, sharded or not).

        Raises:
            ConfigError: an unsupported family or config, or a missing weight.
        """
        model_dir = Path(model_dir)
        config = read_config(model_dir)
        spec = spec_from_config(config, name or model_dir.name)
        arch = describe(config, model_dir)
        logger.info("loading %s (%s) weights (%s, %s)", spec.name, arch.family, device, dtype)
        state = _load_state(model_dir)
        return cls(spec, arch, state, device=device, dtype=dtype)

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's switch point (``original_max_position_embeddings``), else ``None``.

        A sequence longer than this uses the long factors at every position; one that grows
        past it during decode must have its cached keys and values computed again (the engine
        re-prefills it once, as transformers' Phi-3 ``generate`` drops its cache there).
        """
        points = [t.freqs.long_after for t in self._ropes if t.freqs.long_after is not None]
        return min(points) if points else None

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer's projections, biases and
        norms, the final norm and the LM head (the embedding rows a step gathers are
        negligible; tied embeddings count once, as the LM head)."""
        tensors = [self.lm_head, self.norm]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _ensure_rope(self, length: int) -> None:
        for table in self._ropes:
            table.ensure(length)

    def new_kv_cache(
        self,
        num_slots: int,
        max_len: int,
        kind: str = "slot",
        num_tokens: int | None = None,
        block_size: int = 16,
        decode_kernel: str = "torch",
    ) -> KVCache:
        """A KV cache for sequences of up to ``max_len`` tokens.

        Args:
            num_slots: ``slot``: sequences it holds.
            max_len: Longest sequence.
            kind: ``"slot"`` or ``"paged"``.
            num_tokens: ``paged``: positions it holds in all (rounded up to whole blocks);
                ``None`` = ``num_slots * max_len``, the slot cache's memory.
            block_size: ``paged``: tokens per block.
            decode_kernel: ``paged``: ``"torch"`` or ``"triton"`` decode attention.

        Raises:
            ValueError: an unknown ``kind``, or a paged cache smaller than one sequence.
        """
        self._ensure_rope(max_len)
        if kind == "slot":
            return SlotKVCache(self.spec, num_slots, max_len, self.device, self.dtype)
        if kind == "paged":
            tokens = num_slots * max_len if num_tokens is None else num_tokens
            blocks = -(-tokens // block_size)
            cache = PagedKVCache(self.spec, blocks, block_size, max_len, self.device, self.dtype)
            cache.decode_kernel = decode_kernel
            return cache
        raise ValueError(f"KV cache kind {kind!r} is not 'slot' or 'paged'")

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        if self.arch.norm_plus_one:  # Gemma: (x_hat * (1 + w)) in float32, then the dtype
            return (normed * weight).to(x.dtype)
        return weight * normed.to(x.dtype)  # Llama: w * x_hat.to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, hd]; cos/sin: [T, 1, rotary_dim]; only the leading rotary_dim rotate.
        rd = cos.shape[-1]
        xr = x[..., :rd]
        half = rd // 2
        rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
        out = xr * cos + rot * sin
        return out if rd == x.shape[-1] else torch.cat([out, x[..., rd:]], dim=-1)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allow: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """Attention of ``q`` ``[1, H, n, hd]`` over ``k``/``v`` ``[1, KV, L, hd]``.

        ``allow`` is a boolean ``[n, L]`` mask (True = may attend); ``causal`` asks for the
        plain causal mask instead. Soft-capped families take the explicit path (SDPA has no
        soft-capping).
        """
        arch = self.arch
        group = q.shape[1] // k.shape[1]
        if arch.attn_softcap is None:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allow,
                is_causal=causal and allow is None,
                scale=arch.attn_scale,
                enable_gqa=group > 1,
            )
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scores = _softcap(torch.matmul(q, k.transpose(-1, -2)) * arch.attn_scale, arch.attn_softcap)
        if allow is None:
            n, length = q.shape[2], k.shape[2]
            allow = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
        scores = scores.masked_fill(~allow, float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)

    def _decode_attend(
        self,
        q: torch.Tensor,
        kv: KVCache,
        layer: int,
        step: StepKV,
        dec: DecodeLayout,
        hide: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of the step's decode rows over their cached keys/values.

        Args:
            q: ``[T, heads, head_dim]`` the step's rotated queries.
            hide: Boolean mask broadcastable to the scores (True = masked).

        Returns:
            ``[m, heads, head_dim]`` in the order of ``dec.rows``.
        """
        arch, nh, hd = self.arch, self.spec.num_heads, self.spec.head_dim
        if isinstance(kv, PagedKVCache) and kv.decode_kernel == "triton":
            from services.worker.kernels.attention_triton import paged_decode_attention

            assert dec.block_tables is not None and dec.seq_lens is not None
            return paged_decode_attention(
                q.index_select(0, dec.rows),
                kv.k[layer],
                kv.v[layer],
                dec.block_tables,
                dec.seq_lens,
                arch.attn_scale,
                window=arch.layer_windows[layer],
                softcap=arch.attn_softcap,
            )
        nkv = self.spec.num_kv_heads
        group = nh // nkv
        n = dec.n
        qd = q.index_select(0, dec.q_index).view(n, nkv, group, hd)
        kd, vd = kv.decode_kv(layer, step)  # [n, nkv, lmax, hd] or [nkv, n, lmax, hd]
        if dec.heads_first:
            qd = qd.transpose(0, 1)
        scores = torch.matmul(qd, kd.transpose(-1, -2)).mul_(arch.attn_scale)
        if arch.attn_softcap is not None:
            scores = _softcap(scores, arch.attn_softcap)
        scores.masked_fill_(hide, float("-inf"))
        od = torch.matmul(torch.softmax(scores, dim=-1), vd)
        if dec.heads_first:
            od = od.transpose(0, 1)
        return od.reshape(n, nh, hd).index_select(0, dec.rel)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Run one step; write the step's keys/values into ``kv``.

        Args:
            batch: The flat token batch (see :class:`StepBatch`).
            kv: The KV cache the chunks' ``slot`` fields index.

        Returns:
            ``[len(batch.logits_rows), vocab]`` float32 next-token logits, in the order of
            ``batch.logits_rows``; all NaN for a row whose final hidden state overflowed.
        """
        arch = self.arch
        nh, hd = self.spec.num_heads, self.spec.head_dim
        dev = self.device
        lora = batch.lora if batch.lora is not None and not batch.lora.empty else None

        ids = batch.input_ids.to(dev)
        pos = batch.positions.to(dev)
        T = ids.shape[0]

        # Row -> sequence length after the step (LongRoPE).
        seq_end = torch.empty(T, dtype=torch.long) if self._long_rope else None
        prefill: list[tuple[int, SeqChunk]] = []
        for ci, c in enumerate(batch.chunks):
            if seq_end is not None:
                seq_end[c.row : c.row + c.num_tokens] = max(c.seq_len, c.end)
            if c.num_tokens > 1:
                prefill.append((ci, c))
        rope_rows = [t.rows(pos, None if seq_end is None else seq_end.to(dev)) for t in self._ropes]
        step = kv.prepare(batch.chunks, T)

        # Prefill masks per window (None = global), built once per step.
        prefill_masks: dict[tuple[int, int | None], torch.Tensor | None] = {}

        def prefill_mask(ci: int, c: SeqChunk, window: int | None) -> torch.Tensor | None:
            key = (ci, window)
            if key not in prefill_masks:
                end = c.end
                if c.start_pos == 0 and (window is None or window >= end):
                    prefill_masks[key] = None  # plain causal
                else:
                    qpos = torch.arange(c.start_pos, end, device=dev).unsqueeze(1)
                    kpos = torch.arange(end, device=dev).unsqueeze(0)
                    allow = kpos <= qpos
                    if window is not None:
                        allow &= kpos > qpos - window
                    prefill_masks[key] = allow
            return prefill_masks[key]

        # Decode masks per window over the cache's decode view.
        dec = step.decode
        dec_masks: dict[int | None, torch.Tensor] = {}
        if dec is not None:
            kpos = torch.arange(dec.lmax).unsqueeze(0)
            lengths = dec.lengths.unsqueeze(1)
            for window in set(arch.layer_windows):
                hide = kpos >= lengths  # [n, lmax]
                if window is not None:
                    hide |= kpos <= lengths - 1 - window
                hide = hide.to(dev)
                dec_masks[window] = (
                    hide[None, :, None, :] if dec.heads_first else hide[:, None, None, :]
                )

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            window = arch.layer_windows[li]
            attn = torch.empty(T, nh, hd, device=dev, dtype=self.dtype)
            for ci, c in prefill:
                qp = q[c.row : c.row + c.num_tokens].transpose(0, 1).unsqueeze(0)  # [1,H,n,hd]
                kp, vp = kv.prefill_kv(li, step, ci, c)  # [1, nkv, end, hd]
                o = self._attend(qp, kp, vp, prefill_mask(ci, c, window), causal=True)
                attn[c.row : c.row + c.num_tokens] = o[0].transpose(0, 1)
            if dec is not None:
                attn[dec.rows] = self._decode_attend(q, kv, li, step, dec, dec_masks[window])
            return attn

        h = self._layers(ids, rope_rows, lora, kv, step, attend)
        kv.finish(batch.chunks)  # recorded only once every layer has written them
        rows = torch.tensor(batch.logits_rows, dtype=torch.long, device=dev)
        return self._logits(h.index_select(0, rows))

    @torch.inference_mode()
    def forward_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKVCache,
        step: StepKV,
        lora: LoRAApplier | None,
    ) -> torch.Tensor:
        """One decode step over static buffers: every row is one sequence's next token.

        Nothing here depends on the rows' values on the host (no Python branch on them, no
        device-to-host read, no shape that varies with them), so a CUDA graph can capture it
        and replay it with new contents in the same buffers
        (:class:`services.worker.decode_graphs.DecodeGraphs`).

        Args:
            input_ids: ``[B]`` int64 token ids.
            positions: ``[B]`` int64 positions (= keys cached before the token).
            kv: The paged cache (its ``decode_kernel`` picks the attention).
            step: ``write_a``/``write_b`` ``[B]`` (block and offset of each row's write; padding
                rows write a scratch block) and ``decode`` with ``block_tables`` ``[B, W]``
                int32 and ``seq_lens`` ``[B]`` int32 (0 for padding rows).
            lora: The rows' LoRA (a static :class:`~services.worker.lora_pages.PagedLoRA`),
                or None.

        Returns:
            ``[B, vocab]`` float32 next-token logits (NaN for an overflowed row).
        """
        from services.worker.kernels.attention_triton import (
            paged_decode_attention,
            paged_decode_attention_torch,
        )

        arch = self.arch
        dec = step.decode
        assert dec is not None and dec.block_tables is not None and dec.seq_lens is not None
        tables, lens = dec.block_tables, dec.seq_lens
        attention = (
            paged_decode_attention if kv.decode_kernel == "triton" else paged_decode_attention_torch
        )
        rope_rows = [t.rows(positions, None) for t in self._ropes]

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            return attention(
                q,
                kv.k[li],
                kv.v[li],
                tables,
                lens,
                arch.attn_scale,
                window=arch.layer_windows[li],
                softcap=arch.attn_softcap,
            )

        h = self._layers(input_ids, rope_rows, lora, kv, step, attend)
        return self._logits(h)

    def _layers(
        self,
        ids: torch.Tensor,
        rope_rows: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoRAApplier | None,
        kv: KVCache,
        step: StepKV,
        attend: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Embed ``ids`` ``[T]`` and run every layer; ``attend(layer, q)`` turns the rotated
        queries ``[T, heads, head_dim]`` into attention outputs of the same shape once the
        step's keys/values are in ``kv``. Returns the hidden states ``[T, d]``."""
        spec, arch = self.spec, self.arch
        nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qdim, kvdim = nh * hd, nkv * hd
        m = spec.intermediate_size
        T = ids.shape[0]
        h = F.embedding(ids, self.embed)  # [T, d]
        if arch.embed_scale is not None:
            h = h * torch.tensor(arch.embed_scale, dtype=h.dtype)
        for li, L in enumerate(self.layers):
            cos, sin = rope_rows[arch.layer_ropes[li]]
            x = self._rms(h, L.ln1)
            qkv = F.linear(x, L.wqkv, L.bqkv)  # [T, q + 2kv]
            if lora is not None:
                for name, lo, hi in self._qkv_views:
                    lora.apply(li, name, x, qkv[:, lo:hi])
            q = qkv[:, :qdim].view(T, nh, hd)
            k = qkv[:, qdim : qdim + kvdim].view(T, nkv, hd)
            v = qkv[:, qdim + kvdim :].view(T, nkv, hd)
            if L.q_norm is not None and L.k_norm is not None:
                q = self._rms(q, L.q_norm)
                k = self._rms(k, L.k_norm)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            kv.write(li, step, k, v)

            a2 = attend(li, q).view(T, qdim)
            o = F.linear(a2, L.wo, L.bo)
            if lora is not None:
                lora.apply(li, "o_proj", a2, o)
            if L.post_attn is not None:
                o = self._rms(o, L.post_attn)
            h = h + o

            x = self._rms(h, L.ln2)
            gu = F.linear(x, L.w_gate_up, L.b_gate_up)  # [T, 2m]
            if lora is not None:
                for name, lo, hi in self._gate_up_views:
                    lora.apply(li, name, x, gu[:, lo:hi])
            inter = self._act(gu[:, :m]) * gu[:, m:]
            dn = F.linear(inter, L.w_down, L.b_down)
            if lora is not None:
                lora.apply(li, "down_proj", inter, dn)
            if L.post_ffn is not None:
                dn = self._rms(dn, L.post_ffn)
            h = h + dn
        return h

    def _logits(self, hs: torch.Tensor) -> torch.Tensor:
        """``[R, vocab]`` float32 logits of the hidden states ``hs`` ``[R, d]``; NaN rows for
        states that overflowed."""
        arch = self.arch
        hl = self._rms(hs, self.norm)
        # ``lm_head @ hl.T`` rather than ``F.linear(hl, lm_head)``: the same float32 products,
        # but with few rows and a vocabulary-wide output (49,152 x 576 for SmolLM2) oneDNN/MKL
        # run the linear form on one thread at a fraction of memory bandwidth; measured on
        # this 2-core AVX2 machine, 1 thread: 41.6 -> 19.6 ms at 4 rows, 192 -> 148 ms at 128;
        # 2 threads: 33.9 -> 10.3 ms at 4 rows (the linear form did not parallelise).
        logits = torch.mm(self.lm_head, hl.t()).t()
        if arch.final_softcap is not None:
            logits = _softcap(logits, arch.final_softcap)
        logits = logits.float().contiguous()
        # A row whose hidden state overflowed (NaN/Inf, or a mean square past float32's range,
        # which the norm turns into zeros: all-equal logits, argmax token 0) gets NaN logits,
        # so the engine fails its request instead of streaming that as an answer.
        # (A masked fill, not ``if overflowed.any()``: no device sync on the step's path.)
        overflowed = ~torch.isfinite(hs.float().pow(2).sum(-1, keepdim=True))
        return logits.masked_fill_(overflowed, float("nan"))
