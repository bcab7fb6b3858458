"""The serving policies a cluster runs and the simulator models: one table for both.

``plora`` and ``baseline`` are the Predictive-LoRA policy (arXiv 2512.20210) and the
S-LoRA-style baseline (arXiv 2311.03285); every other entry is an ablation that removes one
piece of ``plora``.
``plora up --policy``, ``plora bench replay --policies`` (:mod:`plora.launcher`, which turns a
spec into each service's flags) and ``plora simulate --policies``
(:mod:`plora.simulator.engine`) all read :data:`POLICIES`, so a policy means the same pieces
live and simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.config import ROUTING_POLICIES
from services.worker.config import ALLOCATORS, EVICTIONS


@dataclass(frozen=True)
class PolicySpec:
    """One serving policy, as the pieces it combines.

    Attributes:
        name: Report name.
        allocator: ``"paged"`` or ``"contiguous"``
            (:func:`services.worker.allocators.make_allocator`; the worker's ``--allocator``).
        eviction: ``"lru"`` or ``"predictive"`` (:func:`services.worker.eviction.make_policy`;
            the worker's ``--eviction``).
        routing: ``"rank_aware"`` or ``"round_robin"`` (:mod:`services.predictor.placement`;
            the gateway's ``--routing``).
        predictor: Run the predictor: forecasts every tick (placement, predictive eviction's
            forecast), and prefetch when ``prefetch`` is set.
        prefetch: The predictor sends its prefetch choice to the workers (the predictor's
            ``--prefetch``; needs ``predictor``).
        host_staging: Workers read the registered adapters into free host-cache space ahead
            of demand (``AdapterStore.stage``; the worker's ``--host-staging``).
        oracle: Simulator only: eviction and prefetch know the future arrivals
            (:mod:`plora.simulator.oracle`), the bound the forecast is measured against.
        clairvoyant: Simulator only, with ``oracle``: also prefetch adapters before their
            first request, which nothing observable announces (a reference, out of any
            forecast's reach).

    Raises:
        ValueError: an unknown allocator, eviction or routing name, or prefetch without the
            predictor.
    """

    name: str
    allocator: str
    eviction: str
    routing: str
    predictor: bool
    prefetch: bool
    host_staging: bool = False
    oracle: bool = False
    clairvoyant: bool = False

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if self.prefetch and not (self.predictor or self.oracle):
            raise ValueError("prefetch needs the predictor")


#: Every policy by name, ``plora`` first.
POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec("plora", "paged", "predictive", "rank_aware", True, True, True),
        PolicySpec("baseline", "contiguous", "lru", "round_robin", False, False, False),
        PolicySpec("plora-no-predictor", "paged", "lru", "rank_aware", False, False, True),
        PolicySpec("plora-no-prefetch", "paged", "predictive", "rank_aware", True, False, True),
        PolicySpec("plora-no-staging", "paged", "predictive", "rank_aware", True, True, False),
        PolicySpec("plora-contiguous", "contiguous", "predictive", "rank_aware", True, True, True),
        PolicySpec("plora-round-robin", "paged", "predictive", "round_robin", True, True, True),
        PolicySpec("plora-lru", "paged", "lru", "rank_aware", True, True, True),
    )
}


#: Policies only the simulator runs: ``oracle`` knows the future (Belady eviction per worker and
#: prefetch of the next requests of adapters already seen, through the same loader threads, pool
#: and routing as ``plora``), the bound of what any forecast could win; ``oracle-clairvoyant``
#: also prefetches first requests.
SIM_POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec("oracle", "paged", "lru", "rank_aware", False, True, True, oracle=True),
        PolicySpec(
            "oracle-clairvoyant",
            "paged",
            "lru",
            "rank_aware",
            False,
            True,
            True,
            oracle=True,
            clairvoyant=True,
        ),
    )
}


def get_policy(name: str, *, simulated: bool = False) -> PolicySpec:
    """The policy called ``name``; with ``simulated``, the simulator-only ones too.

    Raises:
        ValueError: Unknown name (the message lists the known ones).
    """
    known = {**POLICIES, **SIM_POLICIES} if simulated else POLICIES
    try:
        return known[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {tuple(known)}") from None
