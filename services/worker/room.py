"""Room for an adapter load in the device pool: the decision the worker's store and the
simulated worker both apply, and the pressure sampler both report.

A load whose packed tensors have byte sizes ``pieces`` needs room in the pool. The rule, one
step at a time (:meth:`RoomSearch.next`), in this order:

1. **Place** it in one free run, first fit (:meth:`~services.worker.pool.Allocator.alloc_pieces`).
   An adapter bigger than the whole pool **fails** (it can never be served).
2. When enough units are free but no run fits (``paged``):
   :func:`~services.worker.allocators.compact_or_split` decides: **compact** when pinned adapters do
   not block it and the plan moves at most ``compaction_max_ratio`` units per unit needed, else
   place it **split** over the free runs, cut only between tensors (S-LoRA's unified paging,
   arXiv 2311.03285), else compact anyway when nothing can be evicted. A compaction that did
   not make room is not repeated before the pool changes (an eviction).
3. **Evict** one adapter chosen by the eviction policy among those no lease holds, then try
   again (Predictive-LoRA, arXiv 2512.20210: a prefetch evicts only adapters with lower
   expected demand; :mod:`services.worker.eviction`).
4. Nothing to evict: a prefetch is **dropped** (it never waits); a demand load whose requests
   all ended is **cancelled**; a demand load that has waited past its deadline **fails**
   (``PoolExhaustedError``); otherwise it **waits** until a lease drops, space is freed or a
   load lands with no lease on it (a prefetch: it can be evicted).

The search holds no clock and does no I/O: the caller says whether the wait deadline has
passed, carries out each action (the live store moves tensors under its compute guard; the
simulator charges virtual time) and asks again. The pool is *under pressure* for a load that
evicted or waited; a :class:`PressureSampler` then samples utilization and fragmentation
(definitions in :class:`PressureSample`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from services.worker.allocators import compact_or_split, external_fragmentation
from services.worker.pool import (
    Allocation,
    Allocator,
    FragmentationError,
    OutOfSpaceError,
    TooLargeError,
)

#: Makes an allocation of ``pieces``: ``(pieces, split) -> Allocation`` (the allocator's
#: ``alloc_pieces``, or the device pool's, which also zeroes the memory).
AllocFn = Callable[[Sequence[int], bool], Allocation]


class RoomAction(enum.Enum):
    """What the driver does next for a load that needs room."""

    PLACE = "place"  #: the allocation is made (``RoomDecision.allocation``)
    COMPACT = "compact"  #: compact the pool for ``compact_units``, then ask again
    EVICT = "evict"  #: evict ``victim``, then ask again
    WAIT = "wait"  #: park the load until room may have appeared (module doc), then ask again
    DROP = "drop"  #: a prefetch found only more-wanted adapters: give it up
    CANCEL = "cancel"  #: a demand load nobody waits for any more: give it up
    FAIL = "fail"  #: the load fails with ``PoolExhaustedError`` (``reason``)


@dataclass(frozen=True)
class RoomDecision:
    """One step of a :class:`RoomSearch`.

    Attributes:
        action: What to do.
        allocation: ``PLACE``: the allocation made (its pieces in layout order).
        compact_units: ``COMPACT``: units the compaction must join.
        victim: ``EVICT``: the adapter id to evict.
        reason: ``FAIL``: ``"too_large"`` (bigger than the pool) or ``"timeout"`` (waited
            past its deadline).
        message: ``FAIL`` of ``"too_large"``: the allocator's explanation.
        sample_pressure: Sample the pool now (:class:`PressureSampler`): a placement after
            an eviction or a wait, or a failed wait.
    """

    action: RoomAction
    allocation: Allocation | None = None
    compact_units: int = 0
    victim: str | None = None
    reason: str = ""
    message: str = ""
    sample_pressure: bool = False


class RoomSearch:
    """One load's search for room in the pool (see the module doc for the rule).

    Args:
        pieces: Byte sizes of the packed tensors, in layout order (the points a split
            allocation may cut between).
        demanded: A request waits for it (else a prefetch).

    Attributes:
        pressure: The load evicted or waited (the pool was under pressure for it).
        compacted: The last action was a compaction that has not been followed by an
            eviction (a second compaction for the same layout would not help).
    """

    __slots__ = ("compacted", "demanded", "pieces", "pressure")

    def __init__(self, pieces: Sequence[int], *, demanded: bool) -> None:
        self.pieces = tuple(pieces)
        self.demanded = demanded
        self.pressure = False
        self.compacted = False

    def next(
        self,
        allocator: Allocator,
        *,
        alloc: AllocFn,
        pinned: Callable[[], Collection[int]],
        victim: Callable[[], str | None],
        compaction_max_ratio: float,
        has_waiters: bool = True,
        wait_expired: bool = False,
    ) -> RoomDecision:
        """The next step for this load, given the pool as it stands.

        Args:
            allocator: The pool's allocator (read, and written only by a ``PLACE``).
            alloc: Makes the allocation (:data:`AllocFn`).
            pinned: Handles that must not move (leased or loading), asked only when needed.
            victim: The eviction policy's choice among the resident adapters no lease holds
                (``None``: nothing may be evicted for this load); asked only when needed.
            compaction_max_ratio: Units a compaction may move per unit needed.
            has_waiters: A demand load still has a request waiting for it.
            wait_expired: The load has waited for room past its deadline.

        Returns:
            The decision; the driver carries it out and, for ``COMPACT``, ``EVICT`` and
            ``WAIT``, asks again later.
        """
        pieces = self.pieces
        compact = 0
        try:
            allocation = alloc(pieces, False)
            return self._placed(allocation)
        except TooLargeError as err:
            return RoomDecision(RoomAction.FAIL, reason="too_large", message=str(err))
        except FragmentationError as err:
            compact, split = compact_or_split(
                allocator,
                pinned(),
                pieces,
                err.needed_units,
                compaction_max_ratio=compaction_max_ratio,
                can_evict=lambda: victim() is not None,
                alloc_split=lambda p: alloc(p, True),
            )
            if split is not None:
                return self._placed(split)
        except OutOfSpaceError:
            pass
        if compact and not self.compacted:
            self.compacted = True
            return RoomDecision(RoomAction.COMPACT, compact_units=compact)
        chosen = victim()
        if chosen is not None:
            self.pressure = True
            self.compacted = False  # the pool changed: compaction may help again
            return RoomDecision(RoomAction.EVICT, victim=chosen)
        if not self.demanded:
            return RoomDecision(RoomAction.DROP)
        if not has_waiters:
            return RoomDecision(RoomAction.CANCEL)
        self.pressure = True
        if wait_expired:
            return RoomDecision(RoomAction.FAIL, reason="timeout", sample_pressure=True)
        self.compacted = False  # the pool changes (a lease drops) before it asks again
        return RoomDecision(RoomAction.WAIT)

    def _placed(self, allocation: Allocation) -> RoomDecision:
        return RoomDecision(RoomAction.PLACE, allocation=allocation, sample_pressure=self.pressure)


@dataclass(frozen=True)
class PressureSample:
    """The pool at one moment under pressure (all ratios in ``[0, 1]``).

    Attributes:
        utilization: Live adapter bytes / pool bytes.
        external_fragmentation: ``1 - largest allocatable extent / free bytes``
            (:func:`~services.worker.allocators.external_fragmentation`: for ``paged``, what
            compaction around pinned adapters joins or a split allocation of the coarsest
            layout seen occupies; for ``contiguous``, its largest hole); 0 with nothing free.
        free_run_fragmentation: The same with the largest free run as it stands.
        internal_waste: ``(allocated - live) / allocated`` bytes (0 with nothing allocated).
        mean_extents: Runs per allocation (1 unless allocations were split).
    """

    utilization: float
    external_fragmentation: float
    free_run_fragmentation: float
    internal_waste: float
    mean_extents: float


class PressureSampler:
    """Sums of :class:`PressureSample` taken while the pool is under pressure, and the
    coarsest tensor layout loaded so far (the reference shape of the allocatable extent)."""

    def __init__(self) -> None:
        self.samples = 0
        self.utilization = 0.0
        self.external_fragmentation = 0.0
        self.free_run_fragmentation = 0.0
        self.internal_waste = 0.0
        self.mean_extents = 0.0
        self.ref_pieces: tuple[int, ...] = ()

    def note_layout(self, pieces: Sequence[int]) -> None:
        """Remember ``pieces`` when its largest tensor is the largest seen."""
        if pieces and max(pieces) > max(self.ref_pieces, default=0):
            self.ref_pieces = tuple(pieces)

    def measure(self, allocator: Allocator, pinned: Collection[int]) -> PressureSample:
        """The pool as it stands (nothing recorded)."""
        al = allocator
        allocated = al.used_units * al.unit_bytes
        free = al.free_units
        return PressureSample(
            utilization=al.live_bytes / al.capacity_bytes,
            external_fragmentation=(
                external_fragmentation(al, pinned, self.ref_pieces) if free else 0.0
            ),
            free_run_fragmentation=1.0 - al.largest_free_run() / free if free else 0.0,
            internal_waste=(allocated - al.live_bytes) / allocated if allocated else 0.0,
            mean_extents=al.mean_extents(),
        )

    def sample(self, allocator: Allocator, pinned: Collection[int]) -> None:
        """Measure the pool and add it to the sums."""
        s = self.measure(allocator, pinned)
        self.samples += 1
        self.utilization += s.utilization
        self.external_fragmentation += s.external_fragmentation
        self.free_run_fragmentation += s.free_run_fragmentation
        self.internal_waste += s.internal_waste
        self.mean_extents += s.mean_extents

    def means(self) -> PressureSample:
        """Means over the samples (all 0 before the first)."""
        n = self.samples or 1
        return PressureSample(
            utilization=self.utilization / n,
            external_fragmentation=self.external_fragmentation / n,
            free_run_fragmentation=self.free_run_fragmentation / n,
            internal_waste=self.internal_waste / n,
            mean_extents=self.mean_extents / n,
        )
