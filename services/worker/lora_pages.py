"""Page tables of the paged adapter pool, and the Triton multi-LoRA path that reads them.

How the store lays an adapter out (:mod:`services.worker.packing`, :mod:`services.worker.pool`):
the adapter is packed as every ``(layer, module)``'s A ``[r, in]`` then B ``[out, r]``, row-major,
in sorted key order; the pool holds it in fixed-size pages, in one run of pages or, when the
pool is fragmented, in several runs (extents) cut only between tensors. Every A and every B is
therefore one contiguous, row-major run of elements somewhere in the pool tensor, and its
position is fully given by one *element offset*: ``page * page_elements + offset in page``.
The pages of one adapter need not be adjacent, nor in layout order.

The page-table format the kernels read (:mod:`services.worker.kernels.lora_triton`), for a step
with ``S`` adapters over a model of ``L`` layers and the ``M = len(LORA_MODULES)`` module names:

``entries``  ``int64 [S, L * M, 3]``: row ``s * L * M + l * M + m`` is
             ``(A element offset, B element offset, rank)`` of adapter ``s`` at layer ``l``,
             module ``LORA_MODULES[m]``; ``A_s = pool[a : a + r * in].view(r, in)``,
             ``B_s = pool[b : b + out * r].view(out, r)``; rank 0: the adapter does not target
             the module (its rows get no delta there).
``scale``    ``float32 [S, L * M]``: the module's scaling (``alpha / r`` or rsLoRA's).
``pool``     ``[P]``: the pool's whole buffer (one tensor; the offsets index it).
``segments`` ``int32 [G]`` x 3: start row, row count and adapter index ``s`` of each run of
             consecutive rows sharing an adapter; base-only rows are in no segment.

A table is built once per adapter placement (:class:`AdapterPageTable`, from the lease's
weights, which are views of the pool) and stacked per step: no adapter byte is copied.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from services.common.types import ATTN_MODULES, FUSED_MODULES, MLP_MODULES, LoRAModuleWeights
from services.worker.config import LORA_KERNELS
from services.worker.lora_ops import NO_ADAPTER, build_segments

logger = logging.getLogger(__name__)

#: Module names a page table indexes, in table order.
LORA_MODULES: tuple[str, ...] = ATTN_MODULES + MLP_MODULES + FUSED_MODULES
_MODULE_INDEX = {name: i for i, name in enumerate(LORA_MODULES)}


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported here."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # an import blocked in sys.modules
        return False


def triton_interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1`` set
    before Triton was first imported). False where Triton is absent."""
    if not triton_available():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def resolve_lora_kernel(kernel: str, device: torch.device | str, what: str = "lora") -> str:
    """The implementation ``kernel`` means on ``device``: ``"torch"`` or ``"triton"`` (for the
    multi-LoRA kernels, or ``what="attention"`` for the paged decode attention kernel).

    ``auto`` is ``triton`` on CUDA where Triton is installed, else ``torch``.

    Raises:
        ValueError: ``kernel`` is not one of :data:`LORA_KERNELS`; ``triton`` without the
            package; ``triton`` on a CPU device without Triton's interpreter.
    """
    if kernel not in LORA_KERNELS:
        raise ValueError(f"{what} kernel {kernel!r} is not one of {list(LORA_KERNELS)}")
    on_cuda = torch.device(device).type == "cuda"
    if kernel == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if kernel == "triton":
        if not triton_available():
            raise ValueError(
                f"the triton {what} kernel needs the triton package (pip install 'plora[gpu]')"
            )
        if not on_cuda and not triton_interpreting():
            raise ValueError(
                f"the triton {what} kernel runs on CUDA, or on the CPU only through Triton's "
                "interpreter (set TRITON_INTERPRET=1); use the torch kernel on the CPU"
            )
    return kernel


def pool_tensor(t: torch.Tensor) -> torch.Tensor:
    """``dtype [P]``: the whole storage ``t`` views (the pool buffer, for a lease's tensor)."""
    st = t.untyped_storage()
    n = st.nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(st, 0, (n,), (1,))


@dataclass(frozen=True, eq=False)
class AdapterPageTable:
    """Where one adapter's A and B tensors lie in the pool (host tensors, built once per
    placement of the adapter).

    Attributes:
        entries: ``int64 [L, M, 3]``: ``(A offset, B offset, rank)`` per (layer, module); the
            offsets are elements of the pool tensor, rank 0 = not targeted.
        scale: ``float32 [L, M]`` the modules' scalings.
        pool: ``[P]`` the pool tensor the offsets index.
        source: The weights the table was built from (identity marks a still-valid table).
    """

    entries: torch.Tensor
    scale: torch.Tensor
    pool: torch.Tensor
    source: tuple[LoRAModuleWeights, ...]

    @classmethod
    def build(
        cls, weights: Mapping[tuple[int, str], LoRAModuleWeights], num_layers: int
    ) -> AdapterPageTable:
        """The page table of an adapter whose tensors are views of one pool.

        Args:
            weights: ``(layer, module) -> weights`` from a store lease (views of the pool).
            num_layers: Layers of the model (the table's ``L``).

        Raises:
            ValueError: no modules; a layer outside the model or an unknown module name; a
                tensor that is not a contiguous row-major view of the same storage and dtype
                as the others (weights that do not live in one pool).
        """
        if not weights:
            raise ValueError("an adapter page table needs at least one module")
        first = next(iter(weights.values())).lora_a
        base = first.untyped_storage().data_ptr()
        entries = torch.zeros((num_layers, len(LORA_MODULES), 3), dtype=torch.int64)
        scale = torch.zeros((num_layers, len(LORA_MODULES)), dtype=torch.float32)
        for (layer, module), m in weights.items():
            mi = _MODULE_INDEX.get(module)
            if mi is None or not 0 <= layer < num_layers:
                raise ValueError(f"module {(layer, module)} is outside the page table")
            for t in (m.lora_a, m.lora_b):
                if (
                    t.untyped_storage().data_ptr() != base
                    or t.dtype != first.dtype
                    or t.device != first.device
                    or not t.is_contiguous()
                ):
                    raise ValueError(
                        f"module {(layer, module)} is not a contiguous view of the pool"
                    )
            entries[layer, mi, 0] = int(m.lora_a.storage_offset())
            entries[layer, mi, 1] = int(m.lora_b.storage_offset())
            entries[layer, mi, 2] = m.rank
            scale[layer, mi] = m.scaling
        return cls(entries, scale, pool_tensor(first), tuple(weights.values()))

    def matches(self, weights: Mapping[tuple[int, str], LoRAModuleWeights]) -> bool:
        """Whether ``weights`` are the very views this table was built from (the store makes
        new views whenever it moves an adapter, so a moved adapter never matches)."""
        vals = tuple(weights.values())
        return len(vals) == len(self.source) and all(
            a is b for a, b in zip(vals, self.source, strict=True)
        )


class PageTableCache:
    """Page tables of the adapters of recent steps, rebuilt when an adapter's views change.

    Args:
        num_layers: Layers of the model.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._tables: dict[object, AdapterPageTable] = {}

    def tables(
        self,
        keys: Sequence[object],
        weights: Sequence[Mapping[tuple[int, str], LoRAModuleWeights]],
    ) -> list[AdapterPageTable]:
        """The tables of one step's adapters (``keys[i]`` names ``weights[i]``); only these
        stay cached.

        Raises:
            ValueError: see :meth:`AdapterPageTable.build`.
        """
        out: dict[object, AdapterPageTable] = {}
        for key, w in zip(keys, weights, strict=True):
            t = self._tables.get(key)
            if t is None or not t.matches(w):
                t = AdapterPageTable.build(w, self.num_layers)
            out[key] = t
        self._tables = out
        return list(out.values())


class PagedLoRA:
    """One step's multi-LoRA through the Triton kernels, reading the adapters in the pool.

    For row ``i`` with adapter ``s`` and every (layer, module) ``s`` targets:
    ``y_i += scale_s * B_s (A_s x_i)``; other rows are untouched (see
    :mod:`services.worker.kernels.lora_triton`). Two launches per projection; the per-step
    work on the host is stacking ``S`` small tables and one copy of them to the device.

    Args:
        row_adapter_ids: ``[T]`` adapter index per row (``NO_ADAPTER`` = base only).
        tables: ``tables[s]``: adapter ``s``'s page table (all in the same pool).
        device: Where the step runs (the pool's device).

    Raises:
        ValueError: tables over different pools or layer counts; a row naming a missing
            adapter.
    """

    def __init__(
        self,
        row_adapter_ids: Sequence[int],
        tables: Sequence[AdapterPageTable],
        device: torch.device | str,
    ) -> None:
        from services.worker.kernels import lora_triton

        self._k = lora_triton
        segs = [s for s in build_segments(row_adapter_ids) if s.adapter != NO_ADAPTER]
        if any(s.adapter >= len(tables) for s in segs):
            raise ValueError(f"a row names an adapter beyond the {len(tables)} given")
        self.empty = not segs
        self.num_layers = tables[0].entries.shape[0] if tables else 0
        if self.empty:
            return
        pools = {t.pool.untyped_storage().data_ptr() for t in tables}
        if len(pools) != 1 or any(t.entries.shape[0] != self.num_layers for t in tables):
            raise ValueError("the adapters of a step must live in one pool of one model")
        self.pool = tables[0].pool
        entries = torch.stack([t.entries for t in tables])  # [S, L, M, 3]
        # per (layer, module): the largest rank in the step (grid size; 0 = nobody targets it)
        self._max_rank: list[list[int]] = entries[..., 2].amax(0).tolist()
        s = len(tables)
        self.entries = entries.view(s, -1, 3).to(device, non_blocking=True)
        self.scale = torch.stack([t.scale for t in tables]).view(s, -1).to(device)
        seg = torch.tensor(
            [[x.start for x in segs], [x.end - x.start for x in segs], [x.adapter for x in segs]],
            dtype=torch.int32,
        ).to(device, non_blocking=True)
        self.segments = (seg[0], seg[1], seg[2])
        self.max_rows = max(x.end - x.start for x in segs)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += LoRA(x)`` for ``(layer, module)``: ``x [T, in]``, ``y [T, out]`` (a column
        view of a fused output is fine)."""
        mi = _MODULE_INDEX.get(module)
        if self.empty or mi is None or layer >= self.num_layers:
            return
        r = self._max_rank[layer][mi]
        if r == 0:
            return
        entry = layer * len(LORA_MODULES) + mi
        t = self._k.lora_shrink(x, self.pool, self.entries, self.segments, entry, r, self.max_rows)
        self._k.lora_expand(
            t, self.pool, y, self.entries, self.scale, self.segments, entry, self.max_rows
        )


class StaticPagedLoRA:
    """Multi-LoRA of a fixed-size decode batch through the Triton kernels, from buffers whose
    addresses never change (what a CUDA graph captures): row ``i`` is its own one-row
    segment and reads its own copy of its adapter's page table.

    Same semantics as :class:`PagedLoRA` (``y_i += scale_s * B_s (A_s x_i)``; base-only and
    padding rows untouched). Every projection launches its two kernels whatever the rows'
    adapters (a graph replays a fixed launch sequence): the shrink's grid covers ranks up to
    ``max_rank``, and programs past a row's own rank, or of a row without an adapter, return
    at once. :meth:`fill` refuses a step whose adapters it cannot serve.

    Args:
        rows: Rows of the batch (the largest bucket; :meth:`head` gives smaller ones).
        num_layers: Layers of the model.
        pool: ``[P]`` the pool tensor every adapter lives in.
        max_rank: Largest rank served (the shrink's grid and scratch width).
        device: The pool's device.
    """

    def __init__(
        self,
        rows: int,
        num_layers: int,
        pool: torch.Tensor,
        max_rank: int,
        device: torch.device | str,
    ) -> None:
        from services.worker.kernels import lora_triton

        self._k = lora_triton
        n_entries = num_layers * len(LORA_MODULES)
        self.num_layers = num_layers
        self.pool = pool
        self.max_rank = max_rank
        self.entries = torch.zeros((rows, n_entries, 3), dtype=torch.int64, device=device)
        self.scale = torch.zeros((rows, n_entries), dtype=torch.float32, device=device)
        self.seg_start = torch.arange(rows, dtype=torch.int32, device=device)
        self.seg_len = torch.zeros(rows, dtype=torch.int32, device=device)
        self.seg_adapter = torch.arange(rows, dtype=torch.int32, device=device)

    def head(self, rows: int) -> StaticPagedLoRA:
        """The same buffers' first ``rows`` rows (views: the addresses stay)."""
        view = object.__new__(StaticPagedLoRA)
        view.__dict__.update(self.__dict__)
        view.entries, view.scale = self.entries[:rows], self.scale[:rows]
        view.seg_start, view.seg_len = self.seg_start[:rows], self.seg_len[:rows]
        view.seg_adapter = self.seg_adapter[:rows]
        return view

    def fill(self, row_adapter_ids: Sequence[int], tables: Sequence[AdapterPageTable]) -> bool:
        """Write the rows' tables into the buffers (rows past ``row_adapter_ids`` are padding:
        no adapter). Returns False, writing nothing, when an adapter lives in another pool or
        has a rank above ``max_rank`` (the caller runs the step another way)."""
        ptr = self.pool.untyped_storage().data_ptr()
        if any(t.pool.untyped_storage().data_ptr() != ptr for t in tables):
            return False
        if any(int(t.entries[..., 2].max()) > self.max_rank for t in tables):
            return False
        n, rows = len(row_adapter_ids), self.entries.shape[0]
        entries = torch.zeros(self.entries.shape, dtype=torch.int64)
        scale = torch.zeros(self.scale.shape, dtype=torch.float32)
        lens = torch.zeros(rows, dtype=torch.int32)
        for i, a in enumerate(row_adapter_ids):
            if a != NO_ADAPTER:
                entries[i] = tables[a].entries.view(-1, 3)
                scale[i] = tables[a].scale.view(-1)
                lens[i] = 1
        assert n <= rows
        self.entries.copy_(entries)
        self.scale.copy_(scale)
        self.seg_len.copy_(lens)
        return True

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += LoRA(x)`` for ``(layer, module)``: ``x [B, in]``, ``y [B, out]``."""
        mi = _MODULE_INDEX.get(module)
        if mi is None or layer >= self.num_layers:
            return
        entry = layer * len(LORA_MODULES) + mi
        segments = (self.seg_start, self.seg_len, self.seg_adapter)
        t = self._k.lora_shrink(x, self.pool, self.entries, segments, entry, self.max_rank, 1)
        self._k.lora_expand(t, self.pool, y, self.entries, self.scale, segments, entry, 1)
