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

This is the pure-torch path, the reference; it runs on any device. :class:`LoRABatch` can
instead carry a :class:`~services.worker.lora_pages.PagedLoRA`, the Triton kernels that read the
adapters straight from the paged pool, behind the same :meth:`LoRABatch.apply`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from services.common.types import LoRAModuleWeights

if TYPE_CHECKING:
    from services.worker.lora_pages import PagedLoRA

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


class StackedLoRA:
    """A fixed list of adapters with each projection's A and B concatenated along the rank.

    For decode-sized steps the per-segment loop costs two small matmuls per adapter per
    projection; with ``K`` distinct adapters that is ``14 K`` kernel calls per layer, dominated
    by dispatch overhead. Stacked, one projection is three calls whatever ``K``::

        t = x @ A_cat.T            # [T, R], R = sum of the adapters' ranks (no padding)
        t *= M                     # M[i, c] = scale_a if column c belongs to row i's adapter a
        y += t @ B_cat             # B_cat = [B_1.T; ...; B_K.T], [R, out]

    Row ``i`` therefore gets exactly ``scale_a * B_a (A_a x_i)`` (the other adapters' columns
    are multiplied by an exact zero) and a base-only row gets an exact zero delta. Ranks are
    concatenated, never padded. The wasted work is ``T x R`` multiply-adds per projection, so
    the engine uses it only for small ``T`` (decode steps).

    It holds a *copy* of the adapters' tensors, valid because an ``(adapter_id, version)`` is
    immutable; the engine builds one only for an adapter set that stays the same over
    consecutive steps and drops it when the set changes.

    Args:
        key: Identity of the adapter list (the engine uses ``((id, version), ...)``).
        adapter_weights: Per adapter ``(layer, projection) -> LoRAModuleWeights``.
        device: Device of the stacked tensors.
        dtype: Dtype of the stacked tensors.
    """

    def __init__(
        self,
        key: object,
        adapter_weights: Sequence[Mapping[tuple[int, str], LoRAModuleWeights]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.key = key
        self.num_adapters = len(adapter_weights)
        names = sorted({k for w in adapter_weights for k in w})
        layout_ids: dict[tuple[tuple[int, int, float], ...], int] = {}
        self.layouts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (owner [R], scale [R])
        self.modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.nbytes = 0
        for name in names:
            parts = [(a, w[name]) for a, w in enumerate(adapter_weights) if name in w]
            sig = tuple((a, m.rank, float(m.scaling)) for a, m in parts)
            if sig not in layout_ids:
                layout_ids[sig] = len(self.layouts)
                owner = torch.cat([torch.full((m.rank,), a, dtype=torch.long) for a, m in parts])
                scale = torch.cat(
                    [torch.full((m.rank,), float(m.scaling), dtype=torch.float32) for _, m in parts]
                )
                self.layouts.append((owner.to(device), scale.to(device=device, dtype=dtype)))
            a_cat = torch.cat([m.lora_a.to(device=device, dtype=dtype) for _, m in parts])
            b_cat = torch.cat([m.lora_b.to(device=device, dtype=dtype).t() for _, m in parts])
            self.modules[name] = (a_cat.contiguous(), b_cat.contiguous(), layout_ids[sig])
            self.nbytes += (a_cat.numel() + b_cat.numel()) * a_cat.element_size()

    def row_masks(self, row_adapter_ids: torch.Tensor) -> list[torch.Tensor]:
        """Per layout, ``[T, R]`` masks: ``scale`` where the column is the row's adapter."""
        rows = row_adapter_ids.unsqueeze(1)
        return [
            (rows == owner.unsqueeze(0)).to(scale.dtype) * scale for owner, scale in self.layouts
        ]


class LoRAApplier(Protocol):
    """What the forward pass calls per projection: ``y += LoRA(x)`` for ``(layer, module)``
    (:class:`LoRABatch`, :class:`~services.worker.lora_pages.StaticPagedLoRA`)."""

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the rows' LoRA deltas of ``(layer, module)`` into ``y`` ``[T, out]``."""
        ...


class LoRABatch:
    """The LoRA mapping of one engine step: segments plus each adapter's current weights.

    Args:
        row_adapter_ids: ``[T]`` adapter index per flat-batch row (``NO_ADAPTER`` = base).
        adapter_weights: ``adapter_weights[a]`` maps ``(layer, projection)`` to that adapter's
            :class:`LoRAModuleWeights` (read from the lease this step).
        stacked: Optional :class:`StackedLoRA` of the same adapter list; when given, every
            projection uses the stacked three-call form instead of the segment loop.
        paged: Optional :class:`~services.worker.lora_pages.PagedLoRA` of the same rows and
            adapter list; when given, every projection runs the Triton kernels over the pool
            (it takes precedence over ``stacked``).
    """

    def __init__(
        self,
        row_adapter_ids: Sequence[int],
        adapter_weights: Sequence[Mapping[tuple[int, str], LoRAModuleWeights]],
        stacked: StackedLoRA | None = None,
        paged: PagedLoRA | None = None,
    ) -> None:
        self.paged = paged
        self.segments = [s for s in build_segments(row_adapter_ids) if s.adapter != NO_ADAPTER]
        self.adapter_weights = list(adapter_weights)
        for s in self.segments:
            if s.adapter >= len(self.adapter_weights):
                raise IndexError(
                    f"segment names adapter {s.adapter}, only {len(self.adapter_weights)} given"
                )
        self.stacked = stacked
        self._masks: list[torch.Tensor] = []
        if stacked is not None and self.segments:
            if stacked.num_adapters != len(self.adapter_weights):
                raise ValueError("the stacked adapters are not this step's adapter list")
            ids = torch.tensor(list(row_adapter_ids), dtype=torch.long)
            if stacked.layouts:
                ids = ids.to(stacked.layouts[0][0].device)
            self._masks = stacked.row_masks(ids)

    @property
    def empty(self) -> bool:
        """True when no row of the step uses an adapter."""
        return not self.segments

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += LoRA(x)`` for ``(layer, module)`` over every segment (see module doc)."""
        if not self.segments:
            return
        if self.paged is not None:
            self.paged.apply(layer, module, x, y)
            return
        if self.stacked is not None:
            entry = self.stacked.modules.get((layer, module))
            if entry is not None:
                a_cat, b_cat, layout = entry
                t = torch.nn.functional.linear(x, a_cat)
                t.mul_(self._masks[layout])
                y.addmm_(t, b_cat)
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
