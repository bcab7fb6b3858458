"""Batched multi-LoRA for one projection: many adapters of different ranks in one batch.

The flat token batch of a step is cut into *segments*: maximal runs of consecutive rows that
use the same adapter (LoRAX ``find_segments`` / Punica SGMV). For every segment ``s`` with
adapter ``a`` and every projection the adapter targets::

    y[start_s:end_s] += scale_a * (x[start_s:end_s] @ A_a.T) @ B_a.T

so row ``i`` with adapter ``a`` gets ``scale_a * B_a (A_a x_i)`` and a row with no adapter (or
whose adapter does not target this projection) gets exactly zero delta. Each adapter keeps its
own rank (no padding to the batch's largest rank), the base weights are never merged or
touched, and the work is one pair of matmuls per *segment*, never a Python loop over rows.
The engine sorts the rows of a step by adapter, so each adapter is one segment. The mapping
is rebuilt every step from the leases' current weights (views into the device pool).

This is the pure-torch path; it runs on any device (a CUDA build can swap in a grouped-GEMM
kernel behind :meth:`LoRABatch.apply` without changing callers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from services.common.types import LoRAModuleWeights

#: Row adapter id meaning "base model only".
NO_ADAPTER = -1


@dataclass(frozen=True)
class Segment:
    """A run of consecutive batch rows that share one adapter.

    Attributes:
        start: First row (inclusive).
        end: Last row + 1 (exclusive).
        adapter: Index into the step's adapter list, or :data:`NO_ADAPTER`.
    """

    start: int
    end: int
    adapter: int


def build_segments(row_adapter_ids: Sequence[int]) -> list[Segment]:
    """Cut a row -> adapter map into maximal runs of equal adapter ids.

    Args:
        row_adapter_ids: For each row of the flat batch, the index of its adapter in the
            step's adapter list, or :data:`NO_ADAPTER` (-1) for base-only rows.

    Returns:
        Segments in row order covering every row exactly once (base-only runs included, with
        ``adapter == NO_ADAPTER``). Empty input gives ``[]``.

    Raises:
        ValueError: an id is below -1.
    """
    segments: list[Segment] = []
    start = 0
    n = len(row_adapter_ids)
    for i in range(1, n + 1):
        if i == n or row_adapter_ids[i] != row_adapter_ids[start]:
            aid = int(row_adapter_ids[start])
            if aid < NO_ADAPTER:
                raise ValueError(f"adapter id {aid} < -1 at row {start}")
            segments.append(Segment(start, i, aid))
            start = i
    return segments


def lora_apply_segments(
    y: torch.Tensor,
    x: torch.Tensor,
    segments: Sequence[Segment],
    modules: Sequence[LoRAModuleWeights | None],
) -> None:
    """Add the LoRA deltas of one projection to ``y`` in place, segment by segment.

    Computes, for each segment ``s`` whose adapter ``a`` has weights here,
    ``y[s.start:s.end] += scale_a * (x[s.start:s.end] @ A_a.T) @ B_a.T``.

    Args:
        y: ``[T, out_features]`` projection output (may be a column view of a fused output).
        x: ``[T, in_features]`` projection input.
        segments: From :func:`build_segments`; rows of ``NO_ADAPTER`` are skipped.
        modules: ``modules[a]`` is adapter ``a``'s weights for this (layer, projection), or
            ``None`` when the adapter does not target it. ``lora_a`` is ``[r_a, in]``,
            ``lora_b`` is ``[out, r_a]``; ranks may differ between adapters.

    Raises:
        IndexError: a segment names an adapter index outside ``modules``.
    """
    for seg in segments:
        if seg.adapter == NO_ADAPTER:
            continue
        m = modules[seg.adapter]
        if m is None:
            continue
        a, b = m.lora_a, m.lora_b
        if a.dtype != x.dtype or a.device != x.device:
            a = a.to(device=x.device, dtype=x.dtype)
            b = b.to(device=x.device, dtype=x.dtype)
        xs = x[seg.start : seg.end]
        ys = y[seg.start : seg.end]
        ys.addmm_(xs @ a.t(), b.t(), alpha=m.scaling)


class LoRABatch:
    """The LoRA mapping of one engine step: segments plus each adapter's current weights.

    Args:
        row_adapter_ids: ``[T]`` adapter index per flat-batch row (``NO_ADAPTER`` = base).
        adapter_weights: ``adapter_weights[a]`` maps ``(layer, projection)`` to that adapter's
            :class:`LoRAModuleWeights` (read from the lease this step).
    """

    def __init__(
        self,
        row_adapter_ids: Sequence[int],
        adapter_weights: Sequence[Mapping[tuple[int, str], LoRAModuleWeights]],
    ) -> None:
        self.segments = [s for s in build_segments(row_adapter_ids) if s.adapter != NO_ADAPTER]
        self.adapter_weights = list(adapter_weights)
        for s in self.segments:
            if s.adapter >= len(self.adapter_weights):
                raise IndexError(
                    f"segment names adapter {s.adapter}, only {len(self.adapter_weights)} given"
                )

    @property
    def empty(self) -> bool:
        """True when no row of the step uses an adapter."""
        return not self.segments

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += LoRA(x)`` for ``(layer, module)`` over every segment (see module doc)."""
        if not self.segments:
            return
        for seg in self.segments:
            m = self.adapter_weights[seg.adapter].get((layer, module))
            if m is None:
                continue
            a, b = m.lora_a, m.lora_b
            if a.dtype != x.dtype or a.device != x.device:
                a = a.to(device=x.device, dtype=x.dtype)
                b = b.to(device=x.device, dtype=x.dtype)
            y[seg.start : seg.end].addmm_(x[seg.start : seg.end] @ a.t(), b.t(), alpha=m.scaling)
