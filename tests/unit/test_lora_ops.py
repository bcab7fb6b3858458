"""Batched multi-LoRA: segmentation table and numerics against a per-row reference."""

from __future__ import annotations

import pytest
import torch

from services.common.types import LoRAModuleWeights
from services.worker.lora_ops import (
    NO_ADAPTER,
    LoRABatch,
    Segment,
    StackedLoRA,
    build_segments,
    lora_apply_segments,
)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([], []),
        ([-1], [Segment(0, 1, -1)]),
        ([0], [Segment(0, 1, 0)]),
        ([0, 0, 0], [Segment(0, 3, 0)]),
        ([0, 0, 1, 1, 1], [Segment(0, 2, 0), Segment(2, 5, 1)]),
        ([-1, -1, 0, 2, 2], [Segment(0, 2, -1), Segment(2, 3, 0), Segment(3, 5, 2)]),
        ([1, 0, 1], [Segment(0, 1, 1), Segment(1, 2, 0), Segment(2, 3, 1)]),
        ([0, -1, 0], [Segment(0, 1, 0), Segment(1, 2, -1), Segment(2, 3, 0)]),
    ],
)
def test_build_segments(rows: list[int], expected: list[Segment]) -> None:
    assert build_segments(rows) == expected


def test_build_segments_rejects_bad_id() -> None:
    with pytest.raises(ValueError):
        build_segments([0, -2])


def _module(
    rank: int, d_in: int, d_out: int, scale: float, gen: torch.Generator
) -> LoRAModuleWeights:
    return LoRAModuleWeights(
        lora_a=torch.randn(rank, d_in, generator=gen, dtype=torch.float64),
        lora_b=torch.randn(d_out, rank, generator=gen, dtype=torch.float64),
        scaling=scale,
    )


def _reference(
    x: torch.Tensor, rows: list[int], mods: list[LoRAModuleWeights | None]
) -> torch.Tensor:
    out = torch.zeros(x.shape[0], mods[0].lora_b.shape[0] if mods[0] else 0, dtype=x.dtype)
    for i, a in enumerate(rows):  # the naive per-row definition
        m = mods[a] if a != NO_ADAPTER else None
        if m is not None:
            out[i] = m.scaling * (m.lora_b @ (m.lora_a @ x[i]))
    return out


@pytest.mark.parametrize(
    "rows",
    [
        [0, 0, 1, 1, 1, 2, -1, -1, 3],
        [-1, 2, 2, 0, 1, -1, 0, 3, 3, 3],  # unsorted: several segments per adapter
        [-1, -1, -1],
    ],
)
def test_heterogeneous_ranks_match_per_row_reference(rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    d_in, d_out = 24, 40
    ranks = [1, 8, 64, 130]  # one rank above 128 too; no padding to the largest
    mods: list[LoRAModuleWeights | None] = [
        _module(r, d_in, d_out, 2.0 / (r**0.5), gen) for r in ranks
    ]
    x = torch.randn(len(rows), d_in, generator=gen, dtype=torch.float64)
    base = torch.randn(len(rows), d_out, generator=gen, dtype=torch.float64)
    y = base.clone()
    lora_apply_segments(y, x, build_segments(rows), mods)
    torch.testing.assert_close(y - base, _reference(x, rows, mods), rtol=1e-10, atol=1e-10)
    for i, a in enumerate(rows):
        if a == NO_ADAPTER:
            assert torch.equal(y[i], base[i])  # exactly zero delta


def test_lora_batch_targets_and_views() -> None:
    """Adapters with different target modules; deltas land in column views of a fused output."""
    gen = torch.Generator().manual_seed(1)
    d = 16
    a0 = {(0, "q_proj"): _module(4, d, d, 0.5, gen), (0, "v_proj"): _module(2, d, 8, 1.0, gen)}
    a1 = {(0, "k_proj"): _module(16, d, 8, 2.0, gen)}
    rows = [-1, 0, 0, 1]
    x = torch.randn(4, d, generator=gen, dtype=torch.float64)
    fused = torch.zeros(4, d + 8 + 8, dtype=torch.float64)  # q | k | v
    batch = LoRABatch(rows, [a0, a1])
    batch.apply(0, "q_proj", x, fused[:, :d])
    batch.apply(0, "k_proj", x, fused[:, d : d + 8])
    batch.apply(0, "v_proj", x, fused[:, d + 8 :])
    batch.apply(1, "q_proj", x, fused[:, :d])  # no weights for layer 1: nothing happens
    exp = torch.zeros_like(fused)
    for i in (1, 2):
        m = a0[(0, "q_proj")]
        exp[i, :d] = m.scaling * m.lora_b @ (m.lora_a @ x[i])
        m = a0[(0, "v_proj")]
        exp[i, d + 8 :] = m.scaling * m.lora_b @ (m.lora_a @ x[i])
    m = a1[(0, "k_proj")]
    exp[3, d : d + 8] = m.scaling * m.lora_b @ (m.lora_a @ x[3])
    torch.testing.assert_close(fused, exp, rtol=1e-10, atol=1e-10)
    assert torch.equal(fused[0], torch.zeros(d + 16, dtype=torch.float64))


def test_lora_batch_rejects_unknown_adapter_index() -> None:
    with pytest.raises(IndexError):
        LoRABatch([0, 1], [{}])


def test_lora_batch_empty_for_base_only() -> None:
    assert LoRABatch([-1, -1], []).empty


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, -1, 1], [3, 3, -1, 0], [-1, -1]])
def test_stacked_equals_segments(rows: list[int]) -> None:
    """Stacked form: same deltas, heterogeneous ranks/targets/scales, exact zero for base rows."""
    gen = torch.Generator().manual_seed(2)
    d_in, d_out = 32, 48
    adapters = [
        {
            (0, "q_proj"): _module(2, d_in, d_out, 0.5, gen),
            (1, "q_proj"): _module(8, d_in, d_out, 1.0, gen),
        },
        {(0, "q_proj"): _module(64, d_in, d_out, 0.25, gen)},
        {(1, "q_proj"): _module(130, d_in, d_out, 2.0, gen)},
        {
            (0, "q_proj"): _module(16, d_in, d_out, 3.0, gen),
            (1, "q_proj"): _module(16, d_in, d_out, 3.0, gen),
        },
    ]
    stacked = StackedLoRA("k", adapters, torch.device("cpu"), torch.float64)
    assert stacked.modules[(0, "q_proj")][0].shape == (2 + 64 + 16, d_in)  # no padding
    x = torch.randn(len(rows), d_in, generator=gen, dtype=torch.float64)
    for layer in (0, 1, 2):
        base = torch.randn(len(rows), d_out, generator=gen, dtype=torch.float64)
        y_seg, y_stk = base.clone(), base.clone()
        LoRABatch(rows, adapters).apply(layer, "q_proj", x, y_seg)
        LoRABatch(rows, adapters, stacked).apply(layer, "q_proj", x, y_stk)
        torch.testing.assert_close(y_stk, y_seg, rtol=1e-12, atol=1e-12)
        for i, a in enumerate(rows):
            if a == NO_ADAPTER or (layer, "q_proj") not in adapters[a]:
                assert torch.equal(y_stk[i], base[i])


def test_stacked_rejects_other_adapter_list() -> None:
    gen = torch.Generator().manual_seed(3)
    ad = [{(0, "q_proj"): _module(2, 4, 4, 1.0, gen)}]
    stacked = StackedLoRA("k", ad, torch.device("cpu"), torch.float64)
    with pytest.raises(ValueError):
        LoRABatch([0, 1], ad * 2, stacked)
