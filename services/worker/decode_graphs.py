"""Decode steps over static, bucketed buffers, captured as CUDA graphs on CUDA.

A decode step launches hundreds of small kernels (every projection, norm, rotation, attention
and LoRA launch of every layer); at small batch a GPU spends more time waiting for the host to
launch them than running them. A CUDA graph records the launch sequence once and replays it
with one call. It replays the same kernels on the same addresses, so everything a step reads
that varies (token ids, positions, KV write slots, block tables, sequence lengths, each row's
adapter table) lives in buffers allocated once and refilled before each replay, and the batch
is padded to a *bucket* (1, 2, 4, 8, 16, 32, ... rows; vLLM and SGLang do the same). Padding
rows have sequence length 0 (attention reads nothing), no adapter (the LoRA kernels return at
once) and write their keys/values to the cache's scratch block.

Eligible steps: every row decodes one token, there are at most ``max(buckets)`` rows, the cache
is paged, and the step's adapters (if any) are in the Triton kernels' pool with ranks up to
``max_rank``. Others run :meth:`~services.worker.model.DecoderModel.forward` as before.

On the CPU the same static path runs eagerly (no capture): the tests check it against
:meth:`~services.worker.model.DecoderModel.forward` there, through Triton's interpreter.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from services.worker.kv_cache import DecodeLayout, PagedKVCache, SeqChunk, StepKV
from services.worker.lora_pages import AdapterPageTable, StaticPagedLoRA
from services.worker.model import DecoderModel

logger = logging.getLogger(__name__)

#: Default batch buckets (rows a captured step holds).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class DecodeGraphs:
    """Bucketed static decode steps of one model over one paged KV cache.

    Args:
        model: The decoder.
        kv: Its paged KV cache.
        buckets: Batch sizes, ascending; a step of ``n`` rows runs in the smallest
            bucket ``>= n``.
        max_rank: Largest adapter rank a captured step serves (the adapter pool is the one the
            first step with adapters reads; a step whose adapters live elsewhere is refused).
        capture: Capture CUDA graphs (True only on CUDA); False runs the static path eagerly.

    Raises:
        ValueError: empty or non-ascending ``buckets``.
    """

    def __init__(
        self,
        model: DecoderModel,
        kv: PagedKVCache,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_rank: int = 256,
        capture: bool = False,
    ) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be ascending positive sizes, got {list(buckets)}")
        self.model, self.kv = model, kv
        self.buckets = tuple(buckets)
        self.capture = capture
        dev = model.device
        rows = self.buckets[-1]
        width = kv.blocks_for(kv.max_len)
        self._ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self._pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self._blk = torch.full((rows,), kv.scratch_block, dtype=torch.long, device=dev)
        self._off = torch.zeros(rows, dtype=torch.long, device=dev)
        self._tables = torch.zeros((rows, width), dtype=torch.int32, device=dev)
        self._lens = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.max_rank = max_rank
        self.lora: StaticPagedLoRA | None = None  # made for the first step with adapters
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outs: dict[tuple[int, bool], torch.Tensor] = {}
        self._mempool: Any = None
        #: Steps run through the static path (replayed or eager), and graphs captured.
        self.steps = 0
        self.captured = 0

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows`` rows, or None when none does."""
        return next((b for b in self.buckets if b >= rows), None)

    def run(
        self,
        input_ids: torch.Tensor,
        chunks: Sequence[SeqChunk],
        row_adapter: Sequence[int],
        tables: Sequence[AdapterPageTable] | None,
    ) -> torch.Tensor | None:
        """Run one decode step of ``len(chunks)`` rows (``chunks[i].row == i``, one token
        each) through the static path; None when the step is not eligible (nothing run).

        Args:
            input_ids: ``[n]`` int64 token ids (host or device).
            chunks: One decode chunk per row, rows 0..n-1 in order.
            row_adapter: ``[n]`` index into ``tables`` per row, ``NO_ADAPTER`` for base rows.
            tables: The step's adapters' page tables (None or empty: base only).

        Returns:
            ``[n, vocab]`` float32 logits of the rows, in row order.
        """
        n = len(chunks)
        b = self.bucket(n)
        if b is None or any(c.num_tokens != 1 or c.row != i for i, c in enumerate(chunks)):
            return None
        with_lora = bool(tables)
        if tables:
            if self.lora is None:
                self.lora = StaticPagedLoRA(
                    self.buckets[-1],
                    self.model.spec.num_layers,
                    tables[0].pool,
                    self.max_rank,
                    self.model.device,
                )
            if not self.lora.fill(row_adapter, tables):
                return None
        kv = self.kv
        step = kv.prepare(list(chunks), n)  # takes the blocks the rows write into
        dec = step.decode
        assert dec is not None and dec.block_tables is not None and dec.seq_lens is not None
        self._ids[:n].copy_(input_ids)
        self._ids[n:b].zero_()
        self._pos[:n].copy_(torch.tensor([c.start_pos for c in chunks], dtype=torch.long))
        self._pos[n:b].zero_()
        self._blk[:n].copy_(step.write_a)
        self._blk[n:b].fill_(kv.scratch_block)
        self._off[:n].copy_(step.write_b)
        self._off[n:b].zero_()
        self._tables[:b].zero_()
        self._tables[:n, : dec.block_tables.shape[1]].copy_(dec.block_tables)
        self._lens[:n].copy_(dec.seq_lens)
        self._lens[n:b].zero_()
        key = (b, with_lora)
        if self.capture:
            if key not in self._graphs:
                self._capture(key)
            self._graphs[key].replay()
            out = self._outs[key]
        else:
            out = self._forward(b, with_lora)
        kv.finish(list(chunks))
        self.steps += 1
        return out[:n]

    def _forward(self, b: int, with_lora: bool) -> torch.Tensor:
        """The static step of bucket ``b`` over the buffers' first ``b`` rows."""
        dev = self.model.device
        rows = torch.arange(b, device=dev)
        layout = DecodeLayout(
            n=b,
            lmax=0,
            heads_first=True,
            q_index=rows,
            lengths=self._lens[:b],
            rows=rows,
            rel=rows,
            block_tables=self._tables[:b],
            seq_lens=self._lens[:b],
        )
        step = StepKV(self._blk[:b], self._off[:b], {}, layout)
        lora = self.lora.head(b) if with_lora and self.lora is not None else None
        return self.model.forward_decode(self._ids[:b], self._pos[:b], self.kv, step, lora)

    def _capture(self, key: tuple[int, bool]) -> None:
        """Warm the bucket up (Triton compiles on first launch) and capture its graph."""
        b, with_lora = key
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b, with_lora)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = self._forward(b, with_lora)
        self._graphs[key], self._outs[key] = graph, out
        self.captured += 1
        logger.info("captured the decode step of %d rows (adapters: %s)", b, with_lora)
