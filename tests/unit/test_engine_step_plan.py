"""The engine's pure step planning: which sequences run (schedule_step) and the flat batch
they make (build_step_batch), table-driven, without a model."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from services.worker.lora_ops import NO_ADAPTER
from services.worker.step_plan import build_step_batch, schedule_step


@dataclass(frozen=True)
class Seq:
    """The four fields step planning reads (a stand-in for the engine's ``_Seq``)."""

    slot: int
    tokens: tuple[int, ...]
    num_cached: int
    adapter_key: tuple[str, int] | None = None


def seqs(*specs: tuple[int, int, tuple[str, int] | None]) -> list[Seq]:
    """One sequence per ``(tokens, cached, adapter_key)``, slot = position, tokens numbered
    ``100 * slot + i`` so every token id names its sequence and index."""
    return [
        Seq(slot, tuple(100 * slot + i for i in range(n)), cached, key)
        for slot, (n, cached, key) in enumerate(specs)
    ]


# --------------------------------------------------------------------------- schedule_step
# (sequences as (tokens, cached, adapter), budget, expected [(slot, tokens)])
SCHEDULE_CASES = {
    "decode rows only": ([(10, 9, None), (4, 3, None), (7, 6, None)], 8, [(0, 1), (1, 1), (2, 1)]),
    "a prompt that fits": ([(10, 9, None), (5, 0, None)], 8, [(0, 1), (1, 5)]),
    "a prompt chunked": ([(20, 0, None)], 8, [(0, 8)]),
    "a chunk continued": ([(20, 8, None)], 8, [(0, 8)]),
    "the last chunk": ([(20, 16, None)], 8, [(0, 4)]),
    "decode first, then prefill in slot order": (
        [(6, 0, None), (3, 2, None), (6, 0, None)],
        8,
        [(1, 1), (0, 6), (2, 1)],
    ),
    "decode rows use up the budget": (
        [(3, 2, None), (3, 2, None), (5, 0, None)],
        2,
        [(0, 1), (1, 1)],
    ),
    "nothing uncached is skipped": ([(4, 4, None), (4, 3, None)], 8, [(1, 1)]),
    "adapters do not change the schedule": (
        [(5, 0, ("b", 1)), (3, 2, ("a", 1)), (4, 0, None)],
        6,
        [(1, 1), (0, 5)],
    ),
    "nothing to do": ([], 8, []),
}


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_schedule_step(case: str) -> None:
    specs, budget, expected = SCHEDULE_CASES[case]
    running = seqs(*specs)
    before = copy.deepcopy(running)
    work = schedule_step(running, budget)
    assert [(s.slot, n) for s, n in work] == expected
    assert all(s is running[s.slot] for s, _ in work)
    assert running == before


# --------------------------------------------------------------------------- build_step_batch
@dataclass(frozen=True)
class Expected:
    order: list[int]  # slots in row order
    adapter_keys: tuple[tuple[str, int], ...]
    input_ids: list[int]
    positions: list[int]
    row_adapter: list[int]
    chunks: list[tuple[int, int, int, int]]  # (slot, row, num_tokens, start_pos)
    logits_rows: list[int]
    samplers: list[int]  # slots


B = NO_ADAPTER
# (sequences as (tokens, cached, adapter), work as [(slot, tokens)], expected plan)
BUILD_CASES = {
    "one base decode row": (
        [(3, 2, None)],
        [(0, 1)],
        Expected([0], (), [2], [2], [B], [(0, 0, 1, 2)], [0], [0]),
    ),
    "base rows first, then adapters sorted, a partial chunk does not sample": (
        [(4, 3, ("b", 1)), (3, 2, None), (5, 0, ("a", 2)), (6, 1, ("b", 1)), (2, 0, None)],
        [(0, 1), (1, 1), (2, 5), (3, 3), (4, 2)],
        Expected(
            order=[1, 4, 2, 0, 3],
            adapter_keys=(("a", 2), ("b", 1)),
            input_ids=[102, 400, 401, 200, 201, 202, 203, 204, 3, 301, 302, 303],
            positions=[2, 0, 1, 0, 1, 2, 3, 4, 3, 1, 2, 3],
            row_adapter=[B, B, B, 0, 0, 0, 0, 0, 1, 1, 1, 1],
            chunks=[(1, 0, 1, 2), (4, 1, 2, 0), (2, 3, 5, 0), (0, 8, 1, 3), (3, 9, 3, 1)],
            logits_rows=[0, 2, 7, 8],
            samplers=[1, 4, 2, 0],
        ),
    ),
    "adapter keys sort as (id, version) tuples": (
        [(2, 1, ("a", 10)), (2, 1, ("a", 2)), (2, 1, ("B", 1))],
        [(0, 1), (1, 1), (2, 1)],
        Expected(
            order=[2, 1, 0],
            adapter_keys=(("B", 1), ("a", 2), ("a", 10)),
            input_ids=[201, 101, 1],
            positions=[1, 1, 1],
            row_adapter=[0, 1, 2],
            chunks=[(2, 0, 1, 1), (1, 1, 1, 1), (0, 2, 1, 1)],
            logits_rows=[0, 1, 2],
            samplers=[2, 1, 0],
        ),
    ),
    "one adapter keeps the work order": (
        [(3, 0, ("x", 1)), (2, 1, ("x", 1))],
        [(1, 1), (0, 3)],
        Expected(
            order=[1, 0],
            adapter_keys=(("x", 1),),
            input_ids=[101, 0, 1, 2],
            positions=[1, 0, 1, 2],
            row_adapter=[0, 0, 0, 0],
            chunks=[(1, 0, 1, 1), (0, 1, 3, 0)],
            logits_rows=[0, 3],
            samplers=[1, 0],
        ),
    ),
    "a first chunk of a prompt samples nothing": (
        [(20, 0, ("a", 1))],
        [(0, 8)],
        Expected(
            order=[0],
            adapter_keys=(("a", 1),),
            input_ids=list(range(8)),
            positions=list(range(8)),
            row_adapter=[0] * 8,
            chunks=[(0, 0, 8, 0)],
            logits_rows=[],
            samplers=[],
        ),
    ),
}


@pytest.mark.parametrize("case", list(BUILD_CASES))
def test_build_step_batch(case: str) -> None:
    specs, work_spec, exp = BUILD_CASES[case]
    running = seqs(*specs)
    work = [(running[slot], n) for slot, n in work_spec]
    before = copy.deepcopy(work)
    plan = build_step_batch(work)

    assert [s.slot for s, _ in plan.work] == exp.order
    assert [n for _, n in plan.work] == [dict(work_spec)[slot] for slot in exp.order]
    assert plan.adapter_keys == exp.adapter_keys
    assert plan.input_ids.dtype == torch.int64 and plan.positions.dtype == torch.int64
    assert plan.input_ids.tolist() == exp.input_ids
    assert plan.positions.tolist() == exp.positions
    assert plan.row_adapter == exp.row_adapter
    assert plan.num_rows == len(exp.input_ids) == sum(n for _, n in work_spec)
    assert [(c.slot, c.row, c.num_tokens, c.start_pos) for c in plan.chunks] == exp.chunks
    assert plan.logits_rows == exp.logits_rows
    assert [s.slot for s in plan.samplers] == exp.samplers
    # pure: the inputs are untouched and the same inputs give the same plan
    assert work == before
    again = build_step_batch(work)
    assert again.input_ids.tolist() == plan.input_ids.tolist()
    assert (again.row_adapter, again.chunks, again.logits_rows) == (
        plan.row_adapter,
        plan.chunks,
        plan.logits_rows,
    )


def test_step_batch_carries_the_plan() -> None:
    running = seqs((5, 0, None), (3, 2, ("a", 1)))
    plan = build_step_batch(schedule_step(running, 8))
    batch = plan.step_batch(None)
    assert batch.lora is None
    assert batch.input_ids is plan.input_ids and batch.positions is plan.positions
    assert batch.chunks == plan.chunks and batch.logits_rows == plan.logits_rows


def test_schedule_then_build_prefills_a_long_prompt_over_steps() -> None:
    """A 20-token prompt under an 8-token budget: chunks of 8, 8, 4; only the last samples."""
    tokens = tuple(range(20))
    cached = 0
    seen: list[tuple[list[int], list[int]]] = []
    while cached < len(tokens):
        plan = build_step_batch(schedule_step([Seq(0, tokens, cached)], 8))
        seen.append((plan.positions.tolist(), plan.logits_rows))
        cached += plan.num_rows
    assert seen == [
        (list(range(0, 8)), []),
        (list(range(8, 16)), []),
        (list(range(16, 20)), [3]),
    ]
