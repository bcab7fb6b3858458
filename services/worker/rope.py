"""Rotary position embeddings: inverse frequencies for every RoPE type the families use.

Types and formulas are transformers' (``modeling_rope_utils``): ``default``, ``linear``
(positions divided by ``factor``), ``llama3`` (Llama 3.1's banded interpolation), ``yarn``
(NTK-by-parts with the ``mscale`` attention factor; Qwen 2.5 long-context configs) and
``longrope`` (Phi-3's per-dimension short and long factors; the long factors apply to a
sequence once it is longer than ``original_max_position_embeddings``). ``tests/unit/
test_model_rope.py`` compares each against transformers' own functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from services.common.errors import ConfigError
from services.worker.families.base import Rope


@dataclass(frozen=True)
class RopeFrequencies:
    """The frequencies of one rotary embedding.

    Attributes:
        inv_freq: ``[rotary_dim // 2]`` float32 inverse frequencies.
        attention_factor: cos/sin are multiplied by this (YaRN's mscale, LongRoPE's factor).
        long_inv_freq: LongRoPE only: the frequencies for sequences longer than
            ``long_after`` tokens.
        long_after: LongRoPE's ``original_max_position_embeddings``; ``None`` otherwise.
    """

    inv_freq: torch.Tensor
    attention_factor: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    long_after: int | None = None


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low = float(p.get("low_freq_factor", 1.0))
    high = float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    inv_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_llama)


def _yarn(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> RopeFrequencies:
    omax = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    factor = float(factor) if factor is not None else max_pos / omax

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = (
            mscale(factor, float(m)) / mscale(factor, float(m_all))
            if m and m_all
            else mscale(factor)
        )
    beta_fast = float(p.get("beta_fast") or 32)
    beta_slow = float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(omax / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return RopeFrequencies(inv, float(attn))


def _longrope(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> RopeFrequencies:
    omax = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    factor = float(factor) if factor is not None else max_pos / omax
    attn = p.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omax))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def inv(key: str) -> torch.Tensor:
        ext = torch.tensor(p[key], dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ConfigError(f"longrope {key} has {ext.numel()} entries; need {dim // 2}")
        return 1.0 / (ext * theta**shape)

    return RopeFrequencies(inv("short_factor"), float(attn), inv("long_factor"), omax)


def rope_frequencies(rope: Rope, rotary_dim: int, max_position_embeddings: int) -> RopeFrequencies:
    """Inverse frequencies and attention factor of ``rope`` over ``rotary_dim`` dimensions.

    Args:
        rope: The layer's RoPE (type, base, parameters) from the family description.
        rotary_dim: Rotated dimensions per head (even).
        max_position_embeddings: The config's context; YaRN and LongRoPE derive ``factor``
            from it when the config gives none.

    Raises:
        ConfigError: an unsupported type or a parameter missing.
    """
    p = dict(rope.params)
    inv = _base_inv_freq(rope.theta, rotary_dim)
    try:
        if rope.rope_type == "default":
            return RopeFrequencies(inv)
        if rope.rope_type == "linear":
            return RopeFrequencies(inv / float(p["factor"]))
        if rope.rope_type == "llama3":
            return RopeFrequencies(_llama3(inv, p))
        if rope.rope_type == "yarn":
            return _yarn(rope.theta, rotary_dim, p, max_position_embeddings)
        if rope.rope_type == "longrope":
            return _longrope(rope.theta, rotary_dim, p, max_position_embeddings)
    except KeyError as e:
        raise ConfigError(
            f"rope_type {rope.rope_type!r} needs {e.args[0]!r} in its parameters"
        ) from None
    raise ConfigError(f"rope_type {rope.rope_type!r} is not supported")


class RopeTable:
    """cos/sin tables of one rotary embedding, grown on demand, in the model dtype.

    ``cos``/``sin`` are ``[L, rotary_dim]`` (the two halves repeat, as transformers'
    ``rotate_half`` convention wants), already multiplied by the attention factor. For LongRoPE
    the rows ``[L, 2L)`` hold the long-factor table, so a row's index is ``pos + L`` when its
    sequence is longer than ``long_after``.
    """

    def __init__(self, freqs: RopeFrequencies, device: torch.device, dtype: torch.dtype) -> None:
        self.freqs = freqs
        self.device = device
        self.dtype = dtype
        self.length = 0
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)

    def ensure(self, length: int) -> None:
        """Make the table cover positions ``[0, length)``."""
        if length <= self.length:
            return
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        invs = [self.freqs.inv_freq]
        if self.freqs.long_inv_freq is not None:
            invs.append(self.freqs.long_inv_freq)
        cos, sin = [], []
        for inv in invs:
            freqs = torch.outer(pos, inv.to(self.device).float())
            emb = torch.cat([freqs, freqs], dim=-1)
            cos.append(emb.cos() * self.freqs.attention_factor)
            sin.append(emb.sin() * self.freqs.attention_factor)
        self.cos = torch.cat(cos).to(self.dtype)
        self.sin = torch.cat(sin).to(self.dtype)
        self.length = length

    def rows(
        self, pos: torch.Tensor, seq_end: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, rotary_dim]`` cos and sin for positions ``pos`` (``[T]`` int64).

        ``seq_end`` (``[T]``, the length of each row's sequence after this step) selects
        LongRoPE's long table where it exceeds ``long_after``; ignored for other types.
        """
        idx = pos
        if self.freqs.long_after is not None and seq_end is not None:
            idx = pos + (seq_end > self.freqs.long_after).to(pos.dtype) * self.length
        return self.cos[idx].unsqueeze(1), self.sin[idx].unsqueeze(1)
