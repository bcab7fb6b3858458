"""Adapters as the store holds them: packed into one flat tensor in the device layout, and
the byte-bounded host cache of packed adapters (the host tier).

A packed adapter is every ``(layer, projection)`` A ``[r, in]`` then B ``[out, r]`` tensor, in
sorted key order, back to back in one flat tensor of the pool dtype; its slots say where each
tensor lies. The same layout is copied into a device-pool run, so the engine reads views of it.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.errors import InvalidAdapterError
from services.common.types import LoRAModuleWeights, LoRAWeights


@dataclass(frozen=True)
class ModuleSlot:
    """Where one module's A and B live inside an adapter's flat buffer (element offsets)."""

    key: tuple[int, str]
    a_offset: int
    a_shape: tuple[int, int]  # [r, in_features]
    b_offset: int
    b_shape: tuple[int, int]  # [out_features, r]
    scaling: float


@dataclass(frozen=True, eq=False)
class PackedAdapter:
    """One adapter version packed into one flat host tensor in the device layout.

    Attributes:
        adapter_id: Registry id.
        version: Registry version.
        flat: ``dtype [numel]`` on the host (pinned on CUDA): every A then B, module by module.
        slots: Offsets of each module's tensors in ``flat`` (sorted by layer, projection).
        sha256: From the loaded weights.
    """

    adapter_id: str
    version: int
    flat: torch.Tensor
    slots: tuple[ModuleSlot, ...]
    sha256: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer (= live bytes in the pool)."""
        return self.flat.numel() * self.flat.element_size()


def pack_weights(
    weights: LoRAWeights, dtype: torch.dtype, device: torch.device | str = "cpu", pin: bool = False
) -> PackedAdapter:
    """Pack every module's A (``[r, in]``) and B (``[out, r]``) into one flat tensor.

    Args:
        weights: Host weights from the loader.
        dtype: Serving dtype (weights are converted).
        device: Host device (``"cpu"``; ``"meta"`` for byte accounting).
        pin: Allocate page-locked memory (for async copies to CUDA).

    Raises:
        InvalidAdapterError: no modules, or a tensor that is not 2-D.
    """
    if not weights.modules:
        raise InvalidAdapterError(f"adapter {weights.adapter_id!r} has no LoRA modules")
    slots: list[ModuleSlot] = []
    off = 0
    for key in sorted(weights.modules):
        m = weights.modules[key]
        if m.lora_a.dim() != 2 or m.lora_b.dim() != 2:
            raise InvalidAdapterError(
                f"adapter {weights.adapter_id!r} module {key}: LoRA A and B must be 2-D"
            )
        a_shape = (int(m.lora_a.shape[0]), int(m.lora_a.shape[1]))
        b_shape = (int(m.lora_b.shape[0]), int(m.lora_b.shape[1]))
        a_off = off
        b_off = a_off + a_shape[0] * a_shape[1]
        off = b_off + b_shape[0] * b_shape[1]
        slots.append(ModuleSlot(key, a_off, a_shape, b_off, b_shape, float(m.scaling)))
    flat = torch.empty(off, dtype=dtype, device=device, pin_memory=pin)  # [numel]
    if flat.is_meta:  # byte accounting: no storage to fill
        return PackedAdapter(
            weights.adapter_id, weights.version, flat, tuple(slots), weights.sha256
        )
    for s in slots:
        m = weights.modules[s.key]
        flat[s.a_offset : s.b_offset].view(s.a_shape).copy_(m.lora_a)
        flat[s.b_offset : s.b_offset + s.b_shape[0] * s.b_shape[1]].view(s.b_shape).copy_(m.lora_b)
    return PackedAdapter(weights.adapter_id, weights.version, flat, tuple(slots), weights.sha256)


def slot_pieces(slots: Sequence[ModuleSlot], element_size: int) -> list[int]:
    """Byte sizes of the packed tensors in layout order (A then B of each module): the pieces
    a split allocation may be cut between (:meth:`services.worker.pool.Allocator.alloc_pieces`).
    """
    out: list[int] = []
    for s in slots:
        out.append(s.a_shape[0] * s.a_shape[1] * element_size)
        out.append(s.b_shape[0] * s.b_shape[1] * element_size)
    return out


def module_views(
    flat: torch.Tensor | Sequence[torch.Tensor], slots: Sequence[ModuleSlot]
) -> dict[tuple[int, str], LoRAModuleWeights]:
    """``(layer, projection) -> LoRAModuleWeights`` whose tensors are views of ``flat``.

    Args:
        flat: The packed buffer (``dtype [numel]``), or its consecutive parts (the extents
            of a split allocation, :meth:`DevicePool.extent_views`): part ``i`` holds
            elements ``[sum(numel of parts before i), ... + its numel)`` of the layout.
        slots: Element offsets of each module's A and B in the layout.

    Raises:
        ValueError: a tensor crosses a boundary between parts (the split was not made at
            tensor boundaries).
    """
    parts = [flat] if isinstance(flat, torch.Tensor) else list(flat)
    bounds = list(itertools.accumulate((p.numel() for p in parts), initial=0))

    def piece(offset: int, shape: tuple[int, int]) -> torch.Tensor:
        n = shape[0] * shape[1]
        i = bisect.bisect_right(bounds, offset) - 1
        local = offset - bounds[i]
        if i >= len(parts) or local + n > parts[i].numel():
            raise ValueError(f"tensor at element {offset} ({n} elements) crosses a part boundary")
        return parts[i][local : local + n].view(shape)

    out: dict[tuple[int, str], LoRAModuleWeights] = {}
    for s in slots:
        a = piece(s.a_offset, s.a_shape)
        b = piece(s.b_offset, s.b_shape)
        out[s.key] = LoRAModuleWeights(lora_a=a, lora_b=b, scaling=s.scaling)
    return out


class HostCache:
    """Byte-bounded LRU of packed adapters, one version per adapter id.

    Args:
        capacity_bytes: Bound on the bytes of the cached flat tensors.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, PackedAdapter] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def ids(self) -> list[str]:
        """The cached adapter ids, least recently used first."""
        return list(self._items)

    def get(self, adapter_id: str, version: int) -> PackedAdapter | None:
        """The cached copy of exactly this version (marked recently used), else None."""
        p = self._items.get(adapter_id)
        if p is None or p.version != version:
            return None
        self._items.move_to_end(adapter_id)
        return p

    def holds(self, adapter_id: str, version: int) -> bool:
        """Whether exactly this version is cached (its recency is left as it is)."""
        p = self._items.get(adapter_id)
        return p is not None and p.version == version

    @property
    def free_bytes(self) -> int:
        """Bytes the cache can take without evicting."""
        return self.capacity_bytes - self.used_bytes

    def put(self, packed: PackedAdapter) -> None:
        """Cache ``packed`` (replacing any other version), evicting LRU entries to fit.

        An adapter bigger than the whole cache is not cached.
        """
        self.drop(packed.adapter_id)
        if packed.nbytes > self.capacity_bytes:
            return
        while self.used_bytes + packed.nbytes > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self.used_bytes -= old.nbytes
        self._items[packed.adapter_id] = packed
        self.used_bytes += packed.nbytes

    def drop(self, adapter_id: str) -> bool:
        """Remove any version of ``adapter_id``; returns whether one was cached."""
        p = self._items.pop(adapter_id, None)
        if p is None:
            return False
        self.used_bytes -= p.nbytes
        return True


def flat_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (for integrity checks in tests and tools)."""
    data = t.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
