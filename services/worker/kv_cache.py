"""The worker's KV caches: a paged cache (fixed-size blocks through a block table per
sequence, the default) and a slot cache (one ``max_len`` slot per running sequence, kept as
the reference).

Both hold, per layer, the keys and values a step writes and attention reads, and both answer
the same per-step questions for :meth:`services.worker.model.DecoderModel.forward`:
:meth:`prepare` (take what the step's chunks need and lay out its reads), :meth:`write`,
:meth:`prefill_kv` and :meth:`decode_kv`. The engine sees :meth:`can_reserve`,
:meth:`reserve`, :meth:`free` and :meth:`move`.

Why paged: a slot reserves ``max_len`` positions per sequence whatever its length, so a 64-token
chat holds the memory of a 2,048-token one and the number of slots caps concurrency long before
compute does. The paged cache hands out ``block_size``-token blocks as a sequence grows and
takes them back when it ends, so the same memory holds as many sequences as their lengths
allow (vLLM's PagedAttention, Kwon et al., SOSP 2023, arXiv 2309.06180).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import PLoRAError
from services.common.types import ModelSpec
from services.worker.config import KV_CACHE_KINDS

__all__ = ["KV_CACHE_KINDS", "KVCache", "PagedKVCache", "SeqChunk", "SlotKVCache", "StepKV"]


class KVCacheFullError(PLoRAError):
    """A sequence needed a KV block and none is free outside other sequences' reservations
    (the engine reserves every sequence's blocks at admission, so it never meets this)."""


@dataclass
class SeqChunk:
    """The tokens one sequence contributes to a step.

    Attributes:
        slot: The sequence's index in the cache (its slot, or the key of its block table).
        row: First row of its tokens in the flat batch.
        num_tokens: Tokens in this step (1 for decode).
        start_pos: Position of its first token (= tokens already in the cache).
        seq_len: The sequence's whole length so far (prompt and generated tokens, >= the
            chunk's end); 0 means the chunk's end. LongRoPE picks its short or long factors
            from it, as transformers does from the sequence length.
    """

    slot: int
    row: int
    num_tokens: int
    start_pos: int
    seq_len: int = 0

    @property
    def end(self) -> int:
        """Cached positions of the sequence once the step has run."""
        return self.start_pos + self.num_tokens


@dataclass
class DecodeLayout:
    """Where a step's decode rows sit in the cache's decode view (:meth:`decode_kv`).

    Attributes:
        n: Rows of the view (decode rows, plus idle slots inside a slot range).
        lmax: Key positions of the view.
        heads_first: The view is ``[kv_heads, n, lmax, head_dim]`` (True) or
            ``[n, kv_heads, lmax, head_dim]``.
        q_index: ``[n]`` int64: the flat-batch row whose query fills view row ``i``.
        lengths: ``[n]`` int64: view row ``i`` attends to key positions ``[0, lengths[i])``.
        rows: ``[m]`` int64: flat-batch rows of the decode chunks.
        rel: ``[m]`` int64: their rows in the view.
        block_tables: ``[n, blocks]`` int32 block table of each view row (paged cache).
        seq_lens: ``[n]`` int32 copy of ``lengths`` (paged cache, for device kernels).
        first_slot: The slot of view row 0 (slot cache).
    """

    n: int
    lmax: int
    heads_first: bool
    q_index: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor
    rel: torch.Tensor
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    first_slot: int = 0


@dataclass
class StepKV:
    """One step's cache addressing, built by :meth:`prepare` and read by every layer.

    Attributes:
        write_a: ``[T]`` int64: slot (slot cache) or block (paged cache) of each row's write.
        write_b: ``[T]`` int64: position (slot cache) or offset in the block (paged cache).
        prefill: Per prefill chunk (by its index in ``chunks``): the block ids its attention
            reads (paged cache), else None.
        decode: The decode rows' layout, or None when the step has none.
    """

    write_a: torch.Tensor
    write_b: torch.Tensor
    prefill: dict[int, torch.Tensor | None]
    decode: DecodeLayout | None


def _bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """KV bytes one cached position takes: keys and values of every layer and KV head."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem


class SlotKVCache:
    """Preallocated per-layer key/value slots, one per running sequence.

    Attributes:
        k: per layer ``[num_slots, num_kv_heads, max_len, head_dim]``.
        v: same shape as ``k``.

    Memory is allocated with ``torch.empty``: on CPU, pages never touched are not resident,
    and :meth:`prepare` touches only the positions a step reads or writes. Decode attention
    reads a slot up to the longest sequence of the step, past the slot's own length (those
    positions get zero probability, but ``0 * NaN`` is NaN, so they must hold finite values);
    :meth:`ensure_finite` zeroes just the never-written part of that range, once. Zeroing
    whole slots instead costs ``2 * layers * kv_heads * max_len * head_dim`` elements per slot
    on first use (94 MB and ~0.1 s for SmolLM2-135M at 2,048 tokens, float32), paid on the
    engine thread exactly when a burst first fills more slots.
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
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.max_len = max_len
        self.bytes_per_token = _bytes_per_token(spec, dtype)
        # Positions [0, _finite[slot]) of a slot hold finite values: written by a sequence (a
        # sequence writes positions 0, 1, ... in order) or zeroed. Never decreases.
        self._finite = [0] * num_slots

    # ------------------------------------------------------------------ engine side
    def tokens_reserved(self, tokens: int) -> int:
        """Positions a sequence of ``tokens`` tokens holds: always ``max_len``."""
        return self.max_len

    def can_reserve(self, tokens: int) -> bool:
        """Always True: the engine's ``max_batch_size`` is the number of slots."""
        return True

    def reserve(self, slot: int, tokens: int) -> None:
        """Nothing to do: a slot is the whole reservation."""

    def free(self, slot: int) -> None:
        """Nothing to do: the slot is reused as it is."""

    def clear(self) -> None:
        """Nothing to do (no per-sequence state)."""

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src == dst or length <= 0:
            return
        for kl, vl in zip(self.k, self.v, strict=True):
            kl[dst, :, :length].copy_(kl[src, :, :length])
            vl[dst, :, :length].copy_(vl[src, :, :length])
        self._written(dst, length)

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the cache (all slots, all layers)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def capacity_tokens(self) -> int:
        """Positions the cache holds in all: ``num_slots * max_len``."""
        return self.num_slots * self.max_len

    # ------------------------------------------------------------------ forward side
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

    def _written(self, slot: int, end: int) -> None:
        if end > self._finite[slot]:
            self._finite[slot] = end

    def prepare(self, chunks: list[SeqChunk], num_rows: int) -> StepKV:
        """Lay out one step: each row writes ``[slot, :, position]``; decode rows are read as
        one strided view over the contiguous slot range they span.

        Raises:
            IndexError: a chunk ends past ``max_len``.
        """
        slots = torch.empty(num_rows, dtype=torch.long)
        pos = torch.empty(num_rows, dtype=torch.long)
        decode = [c for c in chunks if c.num_tokens == 1]
        for c in chunks:
            if c.end > self.max_len:
                raise IndexError(f"position {c.end - 1} is past the cache's {self.max_len}")
            slots[c.row : c.row + c.num_tokens] = c.slot
            pos[c.row : c.row + c.num_tokens] = torch.arange(c.start_pos, c.end)
        layout = None
        if decode:
            s_lo = min(c.slot for c in decode)
            s_hi = max(c.slot for c in decode) + 1
            n = s_hi - s_lo
            lmax = max(c.end for c in decode)
            lengths = torch.ones(n, dtype=torch.long)
            q_index = torch.zeros(n, dtype=torch.long)
            for c in decode:
                lengths[c.slot - s_lo] = c.end
                q_index[c.slot - s_lo] = c.row
            self.ensure_finite(range(s_lo, s_hi), lmax)
            dev = self.device
            layout = DecodeLayout(
                n=n,
                lmax=lmax,
                heads_first=False,
                q_index=q_index.to(dev),
                lengths=lengths,
                rows=torch.tensor([c.row for c in decode], dtype=torch.long, device=dev),
                rel=torch.tensor([c.slot - s_lo for c in decode], dtype=torch.long, device=dev),
                first_slot=s_lo,
            )
        return StepKV(slots.to(self.device), pos.to(self.device), {}, layout)

    def write(self, layer: int, step: StepKV, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys/values ``[T, kv_heads, head_dim]`` of ``layer``."""
        self.k[layer][step.write_a, :, step.write_b] = k
        self.v[layer][step.write_a, :, step.write_b] = v

    def prefill_kv(
        self, layer: int, step: StepKV, index: int, chunk: SeqChunk
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, chunk.end, head_dim]`` a prefill chunk attends to."""
        end = chunk.end
        return (
            self.k[layer][chunk.slot, :, :end].unsqueeze(0),
            self.v[layer][chunk.slot, :, :end].unsqueeze(0),
        )

    def decode_kv(self, layer: int, step: StepKV) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, kv_heads, lmax, head_dim]`` of the decode layout (strided
        views, no copy)."""
        layout = step.decode
        assert layout is not None
        lo, hi, lmax = layout.first_slot, layout.first_slot + layout.n, layout.lmax
        return self.k[layer][lo:hi, :, :lmax], self.v[layer][lo:hi, :, :lmax]

    def finish(self, chunks: list[SeqChunk]) -> None:
        """Record what the step wrote (called once every layer has written)."""
        for c in chunks:
            self._written(c.slot, c.end)


class PagedKVCache:
    """Keys and values in fixed-size blocks, addressed through a block table per sequence.

    Attributes:
        k: per layer ``[num_kv_heads, num_blocks + 2, block_size, head_dim]`` (views of one
            tensor holding every layer); block 0 is the *null block*, all zeros, never handed
            out, which pads block tables; the last block (:attr:`scratch_block`) takes the
            writes of padding rows in a fixed-size decode batch
            (:mod:`services.worker.decode_graphs`) and is never read.
        v: same shape as ``k``.

    Rules:

    - **Reservation.** The engine reserves a sequence's blocks at admission
      (:meth:`reserve`, for its prompt plus its ``max_new_tokens``, capped by the context) and
      admits a sequence only when its blocks are free outside every other reservation
      (:meth:`can_reserve`), so a running sequence never waits for, or is preempted for, a
      block. vLLM instead allocates on demand and preempts under pressure; reserving trades some
      concurrency for requests that stop long before ``max_new_tokens`` against never
      recomputing a sequence.
    - **Blocks are taken as the sequence grows** (:meth:`prepare`, before the step that first
      writes into one) from a LIFO free list (recently used memory first), zeroed when taken
      (positions past a sequence's length inside its last block are read and masked, and a
      masked ``NaN`` would still poison the sum), and all returned at :meth:`free`.
    - A table only grows; the block of position ``p`` is ``table[p // block_size]``.

    Args:
        spec: The model's shape.
        num_blocks: Blocks handed out in all (the null block comes on top).
        block_size: Tokens per block.
        max_len: Longest sequence (prompt and generated tokens).
        device: Where the cache lives.
        dtype: Its dtype (the model's).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1, or fewer blocks than one
            ``max_len`` sequence needs.
    """

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a paged KV cache needs num_blocks >= 1 and block_size >= 1, got "
                f"{num_blocks} and {block_size}"
            )
        need = -(-max_len // block_size)
        if num_blocks < need:
            raise ValueError(
                f"{num_blocks} KV blocks of {block_size} tokens hold {num_blocks * block_size} "
                f"tokens, fewer than one {max_len}-token sequence needs ({need} blocks)"
            )
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_len = max_len
        #: Where padding rows of a fixed-size decode batch write (never handed out or read).
        self.scratch_block = num_blocks + 1
        shape = (spec.num_layers, spec.num_kv_heads, num_blocks + 2, block_size, spec.head_dim)
        self._k_all = torch.empty(shape, device=device, dtype=dtype)
        self._v_all = torch.empty(shape, device=device, dtype=dtype)
        self._k_all[:, :, 0].zero_()
        self._v_all[:, :, 0].zero_()
        self.k = list(self._k_all.unbind(0))
        self.v = list(self._v_all.unbind(0))
        self.bytes_per_token = _bytes_per_token(spec, dtype)
        #: Decode attention: ``"torch"`` (gather, then matmuls) or ``"triton"`` (the paged
        #: kernel reads the blocks in place); set by the engine.
        self.decode_kernel = "torch"
        self._free_blocks = list(range(num_blocks, 0, -1))  # pop() takes block 1 first
        self._tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}  # slot -> blocks reserved (taken ones included)
        self._promised = 0  # reserved blocks not taken yet, all slots

    # ------------------------------------------------------------------ engine side
    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-tokens // self.block_size)

    def tokens_reserved(self, tokens: int) -> int:
        """Positions a sequence of ``tokens`` tokens holds: whole blocks."""
        return self.blocks_for(tokens) * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks neither taken nor promised to a reservation."""
        return len(self._free_blocks) - self._promised

    @property
    def used_blocks(self) -> int:
        """Blocks taken by sequences."""
        return self.num_blocks - len(self._free_blocks)

    def can_reserve(self, tokens: int) -> bool:
        """Whether a new sequence of up to ``tokens`` tokens fits beside every reservation."""
        return self.blocks_for(tokens) <= self.free_blocks

    def reserve(self, slot: int, tokens: int) -> None:
        """Promise ``slot`` the blocks of ``tokens`` positions (none is taken yet).

        Raises:
            KVCacheFullError: they are not free (check :meth:`can_reserve` first).
            ValueError: ``slot`` already holds a table or a reservation.
        """
        if slot in self._tables or slot in self._reserved:
            raise ValueError(f"KV slot {slot} is in use")
        need = self.blocks_for(tokens)
        if need > self.free_blocks:
            raise KVCacheFullError(f"{need} KV blocks needed, {self.free_blocks} free; retry later")
        self._reserved[slot] = need
        self._promised += need

    def free(self, slot: int) -> None:
        """Return ``slot``'s blocks and the rest of its reservation."""
        table = self._tables.pop(slot, [])
        self._promised -= max(0, self._reserved.pop(slot, 0) - len(table))
        self._free_blocks.extend(reversed(table))

    def clear(self) -> None:
        """Free every sequence."""
        for slot in list(self._tables) + list(self._reserved):
            self.free(slot)

    def move(self, src: int, dst: int, length: int) -> None:
        """Give ``src``'s table and reservation to ``dst`` (no data moves).

        Raises:
            ValueError: ``dst`` is in use.
        """
        if src == dst:
            return
        if dst in self._tables or dst in self._reserved:
            raise ValueError(f"KV slot {dst} is in use")
        if src in self._tables:
            self._tables[dst] = self._tables.pop(src)
        if src in self._reserved:
            self._reserved[dst] = self._reserved.pop(src)

    def table(self, slot: int) -> list[int]:
        """The block table of ``slot`` (a copy; empty when it holds none)."""
        return list(self._tables.get(slot, []))

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (every block, the null and scratch blocks included, all
        layers)."""
        return 2 * self._k_all.numel() * self._k_all.element_size()

    @property
    def capacity_tokens(self) -> int:
        """Positions the cache holds in all: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    # ------------------------------------------------------------------ forward side
    def _grow(self, slot: int, end: int, taken: list[int]) -> list[int]:
        table = self._tables.setdefault(slot, [])
        for _ in range(self.blocks_for(end) - len(table)):
            if len(table) < self._reserved.get(slot, 0):
                self._promised -= 1  # one of its own reservation
            elif self.free_blocks < 1:
                raise KVCacheFullError(
                    f"no free KV block for a sequence at position {end - 1}; "
                    f"{self.num_blocks} blocks are all taken or reserved"
                )
            block = self._free_blocks.pop()
            table.append(block)
            taken.append(block)
        return table

    def prepare(self, chunks: list[SeqChunk], num_rows: int) -> StepKV:
        """Take the blocks the step's chunks write into (zeroed) and lay out its reads: each
        row writes ``[:, block, offset]``; a prefill chunk reads its first
        ``ceil(end / block_size)`` blocks; decode rows are read in chunk order through a
        ``[n, blocks]`` table padded with the null block.

        Raises:
            KVCacheFullError: a chunk grows past its reservation and no block is free.
            IndexError: a chunk ends past ``max_len``.
        """
        bs, dev = self.block_size, self.device
        blocks = torch.empty(num_rows, dtype=torch.long)
        offsets = torch.empty(num_rows, dtype=torch.long)
        taken: list[int] = []
        prefill: dict[int, torch.Tensor | None] = {}
        decode: list[tuple[SeqChunk, list[int]]] = []
        for ci, c in enumerate(chunks):
            if c.end > self.max_len:
                raise IndexError(f"position {c.end - 1} is past the cache's {self.max_len}")
            table = self._grow(c.slot, c.end, taken)
            pos = torch.arange(c.start_pos, c.end)
            t = torch.tensor(table, dtype=torch.long)
            blocks[c.row : c.row + c.num_tokens] = t[pos // bs]
            offsets[c.row : c.row + c.num_tokens] = pos % bs
            if c.num_tokens == 1:
                decode.append((c, table))
            else:
                prefill[ci] = t[: self.blocks_for(c.end)].to(dev)
        if taken:
            ids = torch.tensor(taken, dtype=torch.long, device=dev)
            self._k_all.index_fill_(2, ids, 0)
            self._v_all.index_fill_(2, ids, 0)
        layout = None
        if decode:
            n = len(decode)
            lmax = max(c.end for c, _ in decode)
            width = self.blocks_for(lmax)
            tables = torch.zeros(n, width, dtype=torch.int32)
            for i, (c, table) in enumerate(decode):
                used = self.blocks_for(c.end)
                tables[i, :used] = torch.tensor(table[:used], dtype=torch.int32)
            lengths = torch.tensor([c.end for c, _ in decode], dtype=torch.long)
            rows = torch.tensor([c.row for c, _ in decode], dtype=torch.long, device=dev)
            layout = DecodeLayout(
                n=n,
                lmax=lmax,
                heads_first=True,
                q_index=rows,
                lengths=lengths,
                rows=rows,
                rel=torch.arange(n, device=dev),
                block_tables=tables.to(dev),
                seq_lens=lengths.to(device=dev, dtype=torch.int32),
            )
        return StepKV(blocks.to(dev), offsets.to(dev), prefill, layout)

    def write(self, layer: int, step: StepKV, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys/values ``[T, kv_heads, head_dim]`` of ``layer``."""
        self.k[layer][:, step.write_a, step.write_b] = k.transpose(0, 1)
        self.v[layer][:, step.write_a, step.write_b] = v.transpose(0, 1)

    def prefill_kv(
        self, layer: int, step: StepKV, index: int, chunk: SeqChunk
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[1, kv_heads, chunk.end, head_dim]`` a prefill chunk attends to
        (gathered from its blocks)."""
        ids = step.prefill[index]
        assert ids is not None
        kc, vc = self.k[layer], self.v[layer]
        heads, _, bs, hd = kc.shape
        end = chunk.end
        k = kc.index_select(1, ids).view(heads, -1, hd)[:, :end]
        v = vc.index_select(1, ids).view(heads, -1, hd)[:, :end]
        return k.unsqueeze(0), v.unsqueeze(0)

    def decode_kv(self, layer: int, step: StepKV) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[kv_heads, n, lmax, head_dim]`` of the decode rows (gathered
        through their block tables; positions past a row's length read zeros or its last
        block's unused tail, which the caller masks)."""
        layout = step.decode
        assert layout is not None and layout.block_tables is not None
        flat = layout.block_tables.reshape(-1).long()
        kc, vc = self.k[layer], self.v[layer]
        heads, _, bs, hd = kc.shape
        n, lmax = layout.n, layout.lmax
        k = kc.index_select(1, flat).view(heads, n, -1, hd)[:, :, :lmax]
        v = vc.index_select(1, flat).view(heads, n, -1, hd)[:, :, :lmax]
        return k, v

    def finish(self, chunks: list[SeqChunk]) -> None:
        """Nothing to record (blocks were taken in :meth:`prepare`)."""


#: Either cache; :meth:`DecoderModel.forward` reads both through the same methods.
KVCache = SlotKVCache | PagedKVCache
