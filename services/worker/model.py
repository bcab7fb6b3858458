"""Our own Llama-family forward pass with a slot KV cache and batched multi-LoRA.

Serving never runs transformers' modeling code: this module implements the decoder
(RMSNorm, RoPE with default / linear / llama3 scaling, grouped-query attention, SwiGLU MLP,
tied or untied embeddings) over weights read from an HF directory's safetensors files.

One forward call runs one engine *step* over a flat token batch ``[T]`` that mixes prefill
chunks of new sequences (many tokens each) with single-token decode rows of running ones.
Every one of the seven projections adds the batch's LoRA deltas through
:class:`services.worker.lora_ops.LoRABatch`. The base model uses fused ``qkv`` and
``gate_up`` matrices (one matmul each); LoRA deltas are added to column views of the fused
outputs, so per-module semantics are exactly PEFT's.

The KV cache is a preallocated pool of *slots* (one per running sequence) per layer:
``k[layer]`` is ``[num_slots, num_kv_heads, max_len, head_dim]``. New keys/values are written
in place (no concatenation); decode attention reads a strided view over a contiguous range of
slots, which the engine keeps compact (:meth:`KVCache.move`).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from services.common.errors import ConfigError
from services.common.types import ModelSpec
from services.worker.lora_ops import LoRABatch
from services.worker.model_loader import spec_from_dir

logger = logging.getLogger(__name__)


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` (float32) and the attention scaling.

    Supports ``rope_type`` ``default``, ``linear`` and ``llama3`` (transformers'
    ``_compute_llama3_parameters``), read from ``spec.rope_scaling``.

    Raises:
        ConfigError: an unsupported ``rope_type``.
    """
    dim = spec.head_dim
    base = spec.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = getattr(spec, "rope_scaling", None) or {}
    rope_type = str(scaling.get("rope_type") or scaling.get("type") or "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        inv_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, inv_llama), 1.0
    raise ConfigError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")


class KVCache:
    """Preallocated per-layer key/value slots.

    Attributes:
        k: per layer ``[num_slots, num_kv_heads, max_len, head_dim]``.
        v: same shape as ``k``.

    Memory is allocated with ``torch.empty``: on CPU, pages never touched are not resident,
    and :meth:`LlamaModel.forward` touches only the positions a step reads or writes. Decode
    attention reads a slot up to the longest sequence of the step, past the slot's own length
    (those positions get zero probability, but ``0 * NaN`` is NaN, so they must hold finite
    values); :meth:`ensure_finite` zeroes just the never-written part of that range, once.
    Zeroing whole slots instead costs ``2 * layers * kv_heads * max_len * head_dim`` elements
    per slot on first use (94 MB and ~0.1 s for SmolLM2-135M at 2,048 tokens, float32), paid
    on the engine thread exactly when a burst first fills more slots.
    """

    #: Positions zeroed at a time by :meth:`ensure_finite` (rounded up to a multiple).
    ZERO_AHEAD = 64

    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_slots, spec.num_kv_heads, max_len, spec.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        # Positions [0, _finite[slot]) of a slot hold finite values: written by a sequence (a
        # sequence writes positions 0, 1, ... in order) or zeroed. Never decreases.
        self._finite = [0] * num_slots

    def ensure_finite(self, slots: range, length: int) -> None:
        """Make positions ``[0, length)`` of every slot in ``slots`` finite (zero the part
        never written or zeroed before).

        Raises:
            IndexError: ``length`` exceeds ``max_len`` or a slot is out of range.
        """
        if length > self.max_len:
            raise IndexError(f"length {length} > the cache's {self.max_len} positions")
        # Zero up to the next multiple of ZERO_AHEAD positions: the longest sequence grows by
        # one position a step, and 2 x layers small kernel calls per lagging slot every step
        # would cost more than the zeroing itself.
        end = min(self.max_len, -(-length // self.ZERO_AHEAD) * self.ZERO_AHEAD)
        for slot in slots:
            lo = self._finite[slot]
            if lo < length:
                for kl, vl in zip(self.k, self.v, strict=True):
                    kl[slot, :, lo:end].zero_()
                    vl[slot, :, lo:end].zero_()
                self._finite[slot] = end

    def written(self, slot: int, end: int) -> None:
        """Record that positions ``[0, end)`` of ``slot`` now hold a sequence's keys/values."""
        if end > self._finite[slot]:
            self._finite[slot] = end

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the cache (all slots, all layers)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src == dst or length <= 0:
            return
        for kl, vl in zip(self.k, self.v, strict=True):
            kl[dst, :, :length].copy_(kl[src, :, :length])
            vl[dst, :, :length].copy_(vl[src, :, :length])
        self.written(dst, length)


@dataclass
class SeqChunk:
    """The tokens one sequence contributes to a step.

    Attributes:
        slot: KV-cache slot of the sequence.
        row: First row of its tokens in the flat batch.
        num_tokens: Tokens in this step (1 for decode).
        start_pos: Position of its first token (= tokens already in the cache).
    """

    slot: int
    row: int
    num_tokens: int
    start_pos: int


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
    ln1: torch.Tensor  # [d]
    ln2: torch.Tensor  # [d]


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


class LlamaModel:
    """A Llama-family decoder for batched multi-LoRA serving.

    Args:
        spec: The model's shape.
        state: HF-named weights (``model.layers.{i}.self_attn.q_proj.weight``, ...).
        device: Where weights and activations live (``"cpu"``, ``"cuda"``, ...).
        dtype: Weight/activation dtype (float32 on CPU; bfloat16/float16 on CUDA).

    Raises:
        KeyError: a weight is missing from ``state``.
    """

    def __init__(
        self,
        spec: ModelSpec,
        state: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")  # [vocab, d]
        if spec.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")  # [vocab, d]
        self.norm = w("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    wqkv=torch.cat(
                        [
                            w(p + "self_attn.q_proj.weight"),
                            w(p + "self_attn.k_proj.weight"),
                            w(p + "self_attn.v_proj.weight"),
                        ]
                    ).contiguous(),
                    wo=w(p + "self_attn.o_proj.weight"),
                    w_gate_up=torch.cat(
                        [w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]
                    ).contiguous(),
                    w_down=w(p + "mlp.down_proj.weight"),
                    ln1=w(p + "input_layernorm.weight"),
                    ln2=w(p + "post_attention_layernorm.weight"),
                )
            )
        inv_freq, self._attn_scaling = rope_inv_freq(spec)
        self._inv_freq = inv_freq.to(self.device)
        self._rope_len = 0
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._ensure_rope(min(spec.max_position_embeddings, 4096))

    @classmethod
    def from_dir(
        cls,
        model_dir: Path | str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        name: str = "",
    ) -> LlamaModel:
        """Load from an HF model directory (``config.json`` + safetensors)."""
        model_dir = Path(model_dir)
        spec = spec_from_dir(model_dir, name)
        logger.info("loading %s weights (%s, %s)", spec.name, device, dtype)
        state = _load_state(model_dir)
        return cls(spec, state, device=device, dtype=dtype)

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer's projections and norms, the
        final norm and the LM head (the embedding rows a step gathers are negligible; tied
        embeddings count once, as the LM head)."""
        tensors = [self.lm_head, self.norm]
        for layer in self.layers:
            tensors += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down, layer.ln1, layer.ln2]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _ensure_rope(self, length: int) -> None:
        if length <= self._rope_len:
            return
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self._inv_freq.float())  # [L, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [L, hd]
        self._cos = (emb.cos() * self._attn_scaling).to(self.dtype)
        self._sin = (emb.sin() * self._attn_scaling).to(self.dtype)
        self._rope_len = length

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A KV cache for ``num_slots`` sequences of up to ``max_len`` tokens."""
        self._ensure_rope(max_len)
        return KVCache(self.spec, num_slots, max_len, self.device, self.dtype)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return weight * (xf * torch.rsqrt(var + self.spec.rms_norm_eps)).to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, hd]; cos/sin: [T, 1, hd]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Run one step; write the step's keys/values into ``kv``.

        Args:
            batch: The flat token batch (see :class:`StepBatch`).
            kv: The slot cache the chunks' ``slot`` fields index.

        Returns:
            ``[len(batch.logits_rows), vocab]`` float32 next-token logits, in the order of
            ``batch.logits_rows``; all NaN for a row whose final hidden state overflowed.
        """
        spec = self.spec
        nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qdim, kvdim = nh * hd, nkv * hd
        m = spec.intermediate_size
        group = nh // nkv
        scale = 1.0 / math.sqrt(hd)
        dev = self.device
        lora = batch.lora if batch.lora is not None and not batch.lora.empty else None

        ids = batch.input_ids.to(dev)
        pos = batch.positions.to(dev)
        T = ids.shape[0]
        cos = self._cos[pos].unsqueeze(1)  # [T, 1, hd]
        sin = self._sin[pos].unsqueeze(1)

        # Row -> slot map for the KV writes.
        slot_rows = torch.empty(T, dtype=torch.long)
        decode: list[SeqChunk] = []
        prefill: list[SeqChunk] = []
        for c in batch.chunks:
            slot_rows[c.row : c.row + c.num_tokens] = c.slot
            (decode if c.num_tokens == 1 else prefill).append(c)
        slot_rows = slot_rows.to(dev)

        # Decode attention over a contiguous slot range [s_lo, s_hi): one strided view.
        dec_meta = None
        if decode:
            s_lo = min(c.slot for c in decode)
            s_hi = max(c.slot for c in decode) + 1
            n = s_hi - s_lo
            lmax = max(c.start_pos + 1 for c in decode)
            lengths = torch.ones(n, dtype=torch.long)
            q_index = torch.zeros(n, dtype=torch.long)
            used = torch.zeros(n, dtype=torch.bool)
            for c in decode:
                lengths[c.slot - s_lo] = c.start_pos + 1
                q_index[c.slot - s_lo] = c.row
                used[c.slot - s_lo] = True
            mask = torch.arange(lmax).unsqueeze(0) >= lengths.unsqueeze(1)  # [n, lmax]
            dec_rows = torch.tensor([c.row for c in decode], dtype=torch.long, device=dev)
            dec_slots_rel = torch.tensor(
                [c.slot - s_lo for c in decode], dtype=torch.long, device=dev
            )
            kv.ensure_finite(range(s_lo, s_hi), lmax)
            dec_meta = (
                s_lo,
                s_hi,
                lmax,
                mask.to(dev)[:, None, None, :],
                q_index.to(dev),
                dec_rows,
                dec_slots_rel,
            )

        h = F.embedding(ids, self.embed)  # [T, d]
        for li, L in enumerate(self.layers):
            x = self._rms(h, L.ln1)
            qkv = F.linear(x, L.wqkv)  # [T, q + 2kv]
            if lora is not None:
                lora.apply(li, "q_proj", x, qkv[:, :qdim])
                lora.apply(li, "k_proj", x, qkv[:, qdim : qdim + kvdim])
                lora.apply(li, "v_proj", x, qkv[:, qdim + kvdim :])
            q = qkv[:, :qdim].view(T, nh, hd)
            k = qkv[:, qdim : qdim + kvdim].view(T, nkv, hd)
            v = qkv[:, qdim + kvdim :].view(T, nkv, hd)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            kc, vc = kv.k[li], kv.v[li]
            kc[slot_rows, :, pos] = k
            vc[slot_rows, :, pos] = v

            attn = torch.empty(T, nh, hd, device=dev, dtype=self.dtype)
            for c in prefill:
                end = c.start_pos + c.num_tokens
                qp = q[c.row : c.row + c.num_tokens].transpose(0, 1).unsqueeze(0)  # [1,H,n,hd]
                kp = kc[c.slot, :, :end].unsqueeze(0)  # [1, nkv, end, hd]
                vp = vc[c.slot, :, :end].unsqueeze(0)
                if c.start_pos == 0:
                    o = F.scaled_dot_product_attention(
                        qp, kp, vp, is_causal=True, enable_gqa=group > 1
                    )
                else:
                    allow = torch.ones(c.num_tokens, end, dtype=torch.bool, device=dev).tril(
                        c.start_pos
                    )
                    o = F.scaled_dot_product_attention(
                        qp, kp, vp, attn_mask=allow, enable_gqa=group > 1
                    )
                attn[c.row : c.row + c.num_tokens] = o[0].transpose(0, 1)
            if dec_meta is not None:
                s_lo, s_hi, lmax, dmask, q_index, dec_rows, dec_rel = dec_meta
                n = s_hi - s_lo
                qd = q.index_select(0, q_index).view(n, nkv, group, hd)
                kd = kc[s_lo:s_hi, :, :lmax]  # [n, nkv, lmax, hd] strided view
                vd = vc[s_lo:s_hi, :, :lmax]
                scores = torch.matmul(qd, kd.transpose(-1, -2)).mul_(scale)  # [n,nkv,g,lmax]
                scores.masked_fill_(dmask, float("-inf"))
                probs = torch.softmax(scores, dim=-1)
                od = torch.matmul(probs, vd).view(n, nh, hd)
                attn[dec_rows] = od.index_select(0, dec_rel)

            a2 = attn.view(T, qdim)
            o = F.linear(a2, L.wo)
            if lora is not None:
                lora.apply(li, "o_proj", a2, o)
            h = h + o

            x = self._rms(h, L.ln2)
            gu = F.linear(x, L.w_gate_up)  # [T, 2m]
            if lora is not None:
                lora.apply(li, "gate_proj", x, gu[:, :m])
                lora.apply(li, "up_proj", x, gu[:, m:])
            inter = F.silu(gu[:, :m]) * gu[:, m:]
            dn = F.linear(inter, L.w_down)
            if lora is not None:
                lora.apply(li, "down_proj", inter, dn)
            h = h + dn

        for c in batch.chunks:  # recorded only once every layer has written them
            kv.written(c.slot, c.start_pos + c.num_tokens)
        rows = torch.tensor(batch.logits_rows, dtype=torch.long, device=dev)
        hs = h.index_select(0, rows)
        hl = self._rms(hs, self.norm)
        # ``lm_head @ hl.T`` rather than ``F.linear(hl, lm_head)``: the same float32 products,
        # but with few rows and a vocabulary-wide output (49,152 x 576 for SmolLM2) oneDNN/MKL
        # run the linear form on one thread at a fraction of memory bandwidth; measured on
        # this 2-core AVX2 machine, 1 thread: 41.6 -> 19.6 ms at 4 rows, 192 -> 148 ms at 128;
        # 2 threads: 33.9 -> 10.3 ms at 4 rows (the linear form did not parallelise).
        logits = torch.mm(self.lm_head, hl.t()).t().float().contiguous()
        # A row whose hidden state overflowed (NaN/Inf, or a mean square past float32's range,
        # which the norm turns into zeros: all-equal logits, argmax token 0) gets NaN logits,
        # so the engine fails its request instead of streaming that as an answer.
        overflowed = ~torch.isfinite(hs.float().pow(2).sum(-1))
        if bool(overflowed.any()):
            logits[overflowed] = float("nan")
        return logits
