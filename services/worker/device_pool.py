"""The device pool: one preallocated tensor carved by an allocator (:mod:`services.worker.pool`),
with zeroed reuse, views of allocations and compaction that moves the bytes."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from services.worker.pool import Allocation, Allocator, Move

logger = logging.getLogger("services.worker.pool")


@dataclass(frozen=True)
class CompactionResult:
    """What one compaction did: the moves applied and the bytes copied."""

    moves: tuple[Move, ...]
    bytes_moved: int


class DevicePool:
    """A preallocated flat tensor on a device, carved up by an :class:`Allocator`.

    Invariant: every byte outside a live allocation's run is zero (freed runs are zeroed at
    free time, compaction zeroes what it vacates), so a new adapter never sees old bytes.

    Args:
        allocator: Decides placement; its ``unit_bytes`` must be a multiple of the dtype size.
        dtype: Element type of the pool (the serving dtype of adapter weights).
        device: Where the buffer lives (``"cpu"``, ``"cuda:0"``, or ``"meta"`` for
            byte-accounting runs without storage).

    Attributes:
        buffer: ``dtype [capacity_bytes // element_size]`` on ``device``, zero-initialised.

    Raises:
        ValueError: unit size not a multiple of the element size.
    """

    def __init__(self, allocator: Allocator, dtype: torch.dtype, device: torch.device | str):
        self.allocator = allocator
        self.dtype = dtype
        self.device = torch.device(device)
        self.element_size = torch.empty((), dtype=dtype).element_size()
        if allocator.unit_bytes % self.element_size:
            raise ValueError(
                f"unit of {allocator.unit_bytes} bytes is not a multiple of the "
                f"{self.element_size}-byte {dtype}"
            )
        self.buffer = torch.zeros(
            allocator.capacity_bytes // self.element_size, dtype=dtype, device=self.device
        )  # [capacity elements]
        self._unit_elems = allocator.unit_bytes // self.element_size

    @property
    def capacity_bytes(self) -> int:
        """Pool bytes."""
        return self.allocator.capacity_bytes

    def _run(self, start: int, units: int) -> torch.Tensor:
        u = self._unit_elems
        return self.buffer[start * u : (start + units) * u]

    def alloc(self, nbytes: int) -> Allocation:
        """Allocate one run (see :meth:`Allocator.alloc`; same errors). It reads as zeros."""
        return self.allocator.alloc(nbytes)

    def alloc_pieces(self, pieces: Sequence[int], *, split: bool = False) -> Allocation:
        """Allocate room for ``pieces`` (see :meth:`Allocator.alloc_pieces`; same errors).

        Every extent reads as zeros. Pieces must be whole elements, so each extent's views
        (:meth:`extent_views`) are whole elements too.

        Raises:
            ValueError: a piece that is not a multiple of the element size.
        """
        if any(p % self.element_size for p in pieces):
            raise ValueError(f"pieces must be multiples of the {self.element_size}-byte dtype")
        return self.allocator.alloc_pieces(pieces, split=split)

    def free(self, allocation: Allocation) -> None:
        """Zero every extent, then return the allocation to the allocator.

        Raises:
            KeyError: double free.
        """
        a = self.allocator.get(allocation.handle)
        for e in a.extents:
            self._run(e.start, e.length).zero_()
        self.allocator.free(a)

    def view(self, allocation: Allocation) -> torch.Tensor:
        """``dtype [nbytes // element_size]`` view of an allocation's live bytes (no copy).

        Raises:
            ValueError: the allocation is split (use :meth:`extent_views`).
        """
        a = self.allocator.get(allocation.handle)
        if a.is_split:
            raise ValueError(f"allocation {a.handle} is split over {len(a.extents)} extents")
        return self.extent_views(a)[0]

    def extent_views(self, allocation: Allocation) -> list[torch.Tensor]:
        """Views (no copies) of each extent's live bytes: view ``i`` is
        ``dtype [extent_bytes[i] // element_size]``."""
        a = self.allocator.get(allocation.handle)
        u = self._unit_elems
        return [
            self.buffer[e.start * u : e.start * u + b // self.element_size]
            for e, b in zip(a.extents, a.extent_bytes, strict=True)
        ]

    def piece_views(self, allocation: Allocation) -> list[torch.Tensor]:
        """Views (no copies) of each piece, in the caller's order: view ``i`` is
        ``dtype [pieces[i] // element_size]``."""
        return [dst for dst, _, _ in self.segments(allocation, merge=False)]

    def segments(
        self, allocation: Allocation, merge: bool = True
    ) -> list[tuple[torch.Tensor, int, int]]:
        """``(pool view, first element, end element)``: where elements ``[first, end)`` of the
        caller's layout (its pieces end to end) live in the pool, in layout order.

        With ``merge``, consecutive pieces that are also adjacent in the pool form one
        segment (one copy to load them; a single run is one segment).
        """
        a = self.allocator.get(allocation.handle)
        u, es = self._unit_elems, self.element_size
        out: list[tuple[int, int, int]] = []  # (pool element, layout element, elements)
        src = 0
        for p, (i, off) in zip(a.pieces, a.piece_offsets, strict=True):
            dst, n = a.extents[i].start * u + off // es, p // es
            if merge and out and out[-1][0] + out[-1][2] == dst:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((dst, src, n))
            src += n
        return [(self.buffer[d : d + n], s, s + n) for d, s, n in out]

    def compact(
        self, pinned: Iterable[int] = (), need_units: int | None = None
    ) -> CompactionResult:
        """Plan and apply a compaction, moving bytes with it; zeroes what is vacated.

        The caller must guarantee that nothing reads the pool meanwhile (the store holds the
        engine's compute guard exclusively) and pass every allocation in use or being written
        as ``pinned``. ``need_units``: see :meth:`Allocator.plan_compaction`.
        """
        moves = self.allocator.plan_compaction(pinned, need_units)
        moved = 0
        for m in moves:
            self._move_bytes(m)
            moved += m.units * self.allocator.unit_bytes
        self.allocator.apply_moves(moves)
        if moves:
            logger.debug("compacted: %d moves, %d bytes", len(moves), moved)
        return CompactionResult(tuple(moves), moved)

    def _move_bytes(self, m: Move) -> None:
        u = self._unit_elems
        src, dst, n = m.src * u, m.dst * u, m.units * u
        shift = src - dst
        buf = self.buffer
        if abs(shift) >= n:  # disjoint: one copy, then the whole source is vacated
            buf[dst : dst + n].copy_(buf[src : src + n])
            buf[src : src + n].zero_()
            return
        if shift <= 0:
            raise ValueError(f"an overlapping move must go to a lower address, got {m}")
        if n // shift <= 16:
            # overlapping slide to lower addresses: copy front to back in chunks <= shift
            for i in range(0, n, shift):
                c = min(shift, n - i)
                buf[dst + i : dst + i + c].copy_(buf[src + i : src + i + c])
        else:
            buf[dst : dst + n].copy_(buf[src : src + n].clone())
        # zero the part of the source that the destination does not cover
        lo = max(src, dst + n)
        if lo < src + n:
            buf[lo : src + n].zero_()
