"""One engine step, planned as pure functions: :func:`schedule_step` decides which running
sequences compute how many tokens this step (chunked prefill under a token budget, decode
rows), and :func:`build_step_batch` turns that schedule into the flat batch the model runs
(token ids, positions, KV chunks, the rows whose logits are sampled, and the LoRA segments).
Neither touches engine state or a clock, so both are table-tested."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from services.worker.lora_ops import NO_ADAPTER, LoRABatch
from services.worker.model import SeqChunk, StepBatch


class StepSeq(Protocol):
    """What step planning reads of a running sequence (:class:`_Seq` has it)."""

    @property
    def tokens(self) -> Sequence[int]:
        """Prompt and generated tokens so far."""
        ...

    @property
    def num_cached(self) -> int:
        """Leading tokens whose keys/values are in the KV cache."""
        ...

    @property
    def slot(self) -> int:
        """KV-cache slot (index in the running list)."""
        ...

    @property
    def adapter_key(self) -> tuple[str, int] | None:
        """``(adapter_id, version)``, or None for the base model."""
        ...


S = TypeVar("S", bound=StepSeq)


def schedule_step(running: Sequence[S], max_num_batched_tokens: int) -> list[tuple[S, int]]:
    """Which running sequences compute how many tokens this step (pure).

    Rule: every decoding sequence (exactly one token not in the KV cache, the last one sampled)
    gets one row, in slot order; the rest of the ``max_num_batched_tokens`` budget then goes to
    prefilling sequences (more than one uncached token) in slot order, each taking
    ``min(uncached tokens, budget left)`` (chunked prefill: a prompt longer than the budget
    continues on the next steps) until the budget is spent. Sequences with nothing uncached
    are skipped.

    Args:
        running: The running sequences, index = KV slot.
        max_num_batched_tokens: The step's token budget (>= the number of running sequences,
            which :class:`EngineConfig` guarantees, so every decode row fits).

    Returns:
        ``(sequence, tokens)`` pairs, decode rows first; empty when nothing is to compute.
    """
    decode = [s for s in running if s.num_cached == len(s.tokens) - 1]
    budget = max_num_batched_tokens - len(decode)
    work: list[tuple[S, int]] = [(s, 1) for s in decode]
    for s in running:
        if budget <= 0:
            break
        pending = len(s.tokens) - s.num_cached
        if pending > 1:
            n = min(pending, budget)
            work.append((s, n))
            budget -= n
    return work


@dataclass(frozen=True)
class StepPlan(Generic[S]):
    """One step's flat token batch, before the LoRA weights are attached (see
    :func:`build_step_batch`; ``T`` = the step's tokens).

    Attributes:
        work: ``(sequence, tokens)`` in row order.
        adapter_keys: The step's distinct adapters in canonical (sorted) order; LoRA segment
            ``i`` of the step is ``adapter_keys[i]``.
        input_ids: ``int64 [T]`` (CPU) token ids, rows grouped by sequence.
        positions: ``int64 [T]`` (CPU) absolute position of each token in its sequence.
        row_adapter: ``T`` ints: index into ``adapter_keys`` per row, ``NO_ADAPTER`` (-1) for
            the base model.
        chunks: One :class:`~services.worker.model.SeqChunk` per ``work`` entry.
        logits_rows: Rows whose next-token logits are wanted: the last row of every sequence
            whose uncached tokens are all in the step.
        samplers: The sequences of ``logits_rows``, aligned with them.
    """

    work: list[tuple[S, int]]
    adapter_keys: tuple[tuple[str, int], ...]
    input_ids: torch.Tensor
    positions: torch.Tensor
    row_adapter: list[int]
    chunks: list[SeqChunk]
    logits_rows: list[int]
    samplers: list[S]

    @property
    def num_rows(self) -> int:
        """``T``, the tokens (rows) of the step."""
        return len(self.row_adapter)

    def step_batch(self, lora: LoRABatch | None) -> StepBatch:
        """The model's input for this step with ``lora`` (None: base model only)."""
        return StepBatch(
            input_ids=self.input_ids,
            positions=self.positions,
            chunks=self.chunks,
            logits_rows=self.logits_rows,
            lora=lora,
        )


def build_step_batch(work: Sequence[tuple[S, int]]) -> StepPlan[S]:
    """Lay out the scheduled ``work`` as one flat token batch (pure: reads its inputs only).

    Rule: rows are grouped by adapter so each adapter is one contiguous LoRA segment: base-model
    sequences first, then the adapters in sorted ``(adapter_id, version)`` order, each group in
    ``work`` order (a stable sort). A sequence ``s`` scheduled for ``n`` tokens contributes
    ``s.tokens[s.num_cached : s.num_cached + n]`` at positions ``num_cached .. num_cached + n
    - 1`` into its slot, and its last row is a logits row (it samples) when that reaches the end
    of its tokens.

    Args:
        work: ``(sequence, tokens)`` pairs from :func:`schedule_step` (non-empty tokens).

    Returns:
        The plan; ``work`` and the sequences are not modified.
    """
    present = {s.adapter_key for s, _ in work if s.adapter_key is not None}
    keys = {k: i for i, k in enumerate(sorted(present))}  # canonical adapter order
    ordered = sorted(work, key=lambda w: -1 if w[0].adapter_key is None else keys[w[0].adapter_key])
    ids: list[int] = []
    positions: list[int] = []
    row_adapter: list[int] = []
    chunks: list[SeqChunk] = []
    logits_rows: list[int] = []
    samplers: list[S] = []
    for s, n in ordered:
        row = len(ids)
        start = s.num_cached
        ids.extend(s.tokens[start : start + n])
        positions.extend(range(start, start + n))
        aid = NO_ADAPTER if s.adapter_key is None else keys[s.adapter_key]
        row_adapter.extend([aid] * n)
        chunks.append(
            SeqChunk(slot=s.slot, row=row, num_tokens=n, start_pos=start, seq_len=len(s.tokens))
        )
        if start + n == len(s.tokens):
            logits_rows.append(row + n - 1)
            samplers.append(s)
    return StepPlan(
        work=ordered,
        adapter_keys=tuple(keys),
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        row_adapter=row_adapter,
        chunks=chunks,
        logits_rows=logits_rows,
        samplers=samplers,
    )
