"""Eviction policies of the device pool, behind one interface.

``lru`` (:class:`LRUPolicy`)
    The S-LoRA-style baseline (arXiv 2311.03285): evict the adapter whose
    last use is oldest.
``predictive`` (:class:`PredictivePolicy`)
    Predictive-LoRA (arXiv 2512.20210, demand-aware eviction) where the forecast earns it: two
    experts, *recency* (LRU) and *forecast* (lowest forecast demand per byte,
    ``expected_count / nbytes``, from the latest :meth:`EvictionPolicy.set_forecast`; ties by
    LRU), weighted as LeCaR does (Vietri et al., "Driving Cache Replacement with ML-based
    LeCaR", HotStorage 2018). Each eviction follows the expert of larger weight; recency leads
    until the forecast has shown it does better. When the experts disagree, both choices are
    remembered (for the last :data:`REGRET_HISTORY` disagreements) and the next request for
    either settles it: a miss on the adapter the followed expert evicted, or a hit on the one
    the other expert would have evicted, multiplies the wrong expert's weight by
    ``exp(-LEARNING_RATE)``. Weights stay within ``[MIN_WEIGHT, 1 - MIN_WEIGHT]`` so the mix
    can always turn back when the workload changes.

Policies only *order* candidates; the store decides which adapters are candidates (resident,
not in use, not being written) and how many to evict. The ordering functions are pure and
table-tested.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Policy names understood by :func:`make_policy`.
EVICTION_KINDS: tuple[str, ...] = ("lru", "predictive")


@dataclass(frozen=True)
class Candidate:
    """An adapter that may be evicted.

    Attributes:
        adapter_id: Registry id.
        nbytes: Pool bytes it holds (allocated bytes).
        last_used: Monotonic seconds of its last lease (or load).
    """

    adapter_id: str
    nbytes: int
    last_used: float


def _recency_key(c: Candidate) -> tuple[float, str]:
    return (c.last_used, c.adapter_id)


def lru_order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates in eviction order: least recently used first (ties by id)."""
    return sorted(candidates, key=_recency_key)


def _demand_per_byte_key(
    forecast: Mapping[str, float],
) -> Callable[[Candidate], tuple[float, float, str]]:
    """Sort key of the forecast expert: ``forecast[id] / nbytes``, then LRU, then id."""

    def key(c: Candidate) -> tuple[float, float, str]:
        demand = max(0.0, float(forecast.get(c.adapter_id, 0.0)))
        return (demand / max(1, c.nbytes), c.last_used, c.adapter_id)

    return key


def predictive_order(
    candidates: Sequence[Candidate], forecast: Mapping[str, float]
) -> list[Candidate]:
    """Candidates in eviction order: lowest ``forecast[id] / nbytes`` first, then LRU.

    Args:
        candidates: Evictable adapters.
        forecast: ``adapter_id -> expected requests`` in the forecast horizon (missing = 0).
    """
    return sorted(candidates, key=_demand_per_byte_key(forecast))


def prefetch_victim_limit(incoming_expected: float, min_gain: float) -> float:
    """The forecast demand below which a resident, unleased adapter may be evicted to make
    room for a prefetch expecting ``incoming_expected`` requests (both expected counts over the
    forecast horizon): evict a victim with demand ``v`` only if ``v < limit``.

    Under Poisson arrivals an adapter with expected count ``x`` is requested at least once in
    the horizon with probability ``p(x) = 1 - exp(-x)``, so swapping the victim for the
    incoming adapter avoids ``p(incoming) - p(v)`` expected cold starts in the horizon (and
    causes the victim's). The swap is made only when that gain is more than ``min_gain``
    (``v < -ln(min_gain + exp(-incoming))``, and always ``v < incoming``): a load is not free
    (loader and copy time, and a wasted prefetch may evict the next request's adapter), and
    forecasts a hair apart must not trade adapters back and forth (hysteresis). ``min_gain``
    0 is the plain rule "never evict an adapter wanted at least as much" (Predictive-LoRA,
    demand-aware prefetch). Computed once per prefetch item; the per-victim test is one
    comparison.

    Args:
        incoming_expected: Forecast expected count of the adapter to prefetch (>= 0).
        min_gain: Least gain in probability of use within the horizon, in [0, 1).

    Returns:
        The limit (0.0 when no victim qualifies).
    """
    x = max(0.0, incoming_expected)
    floor = min_gain + math.exp(-x)
    if floor >= 1.0:
        return 0.0
    return min(x, -math.log(floor))


class EvictionPolicy(ABC):
    """Orders eviction candidates; holds the latest demand forecast."""

    name: str = ""

    def __init__(self) -> None:
        self._forecast: dict[str, float] | None = None
        #: Whether the last :meth:`choose_victim` picked another adapter than recency would
        #: have (the forecast decided it); False for LRU.
        self.last_by_forecast = False

    def set_forecast(self, forecast: Mapping[str, float]) -> None:
        """Replace the demand forecast (``adapter_id -> expected requests``)."""
        self._forecast = {str(k): float(v) for k, v in forecast.items()}

    def update_forecast(self, items: Mapping[str, float]) -> None:
        """Merge fresher per-adapter figures (e.g. from a prefetch request) into the forecast."""
        if self._forecast is None:
            self._forecast = {}
        self._forecast.update({str(k): float(v) for k, v in items.items()})

    @property
    def has_forecast(self) -> bool:
        """Whether a forecast was ever given."""
        return self._forecast is not None

    def note_miss(self, adapter_id: str) -> None:  # noqa: B027 - a hook, no-op by default
        """A request found ``adapter_id`` not resident (learning policies use it)."""

    def note_hit(self, adapter_id: str) -> None:  # noqa: B027 - a hook, no-op by default
        """A request found ``adapter_id`` resident (learning policies use it)."""

    def demand(self, adapter_id: str) -> float:
        """Forecast demand of one adapter (0 when unknown)."""
        return (self._forecast or {}).get(adapter_id, 0.0)

    @abstractmethod
    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Candidates in eviction order (first = evict first)."""

    def choose_victim(
        self,
        evictable: Iterable[Candidate],
        *,
        demanded: bool,
        incoming_expected: float,
        min_gain: float,
    ) -> str | None:
        """The adapter to evict for a load, or ``None`` when none may go.

        A demand load (a request waits for it) may evict any of ``evictable``; a prefetch
        only those whose forecast demand is below :func:`prefetch_victim_limit` of its own.
        The store and the simulator both call this, each listing its resident adapters that
        no lease holds.

        Args:
            evictable: Resident adapters no request holds (the load's own entry excluded).
            demanded: The load is for a waiting request (not a prefetch).
            incoming_expected: The prefetch's forecast expected count (ignored when demanded).
            min_gain: ``prefetch_min_gain`` of the store.
        """
        cands = self._candidates(evictable, demanded, incoming_expected, min_gain)
        if not cands:
            self.last_by_forecast = False
            return None
        victim = self.order(cands)[0]
        self.last_by_forecast = victim is not min(cands, key=_recency_key)
        return victim.adapter_id

    def _candidates(
        self, evictable: Iterable[Candidate], demanded: bool, incoming: float, min_gain: float
    ) -> list[Candidate]:
        """Those of ``evictable`` a load may evict (:meth:`choose_victim`'s rule)."""
        if demanded:
            return list(evictable)
        limit = prefetch_victim_limit(incoming, min_gain)
        return [c for c in evictable if self.demand(c.adapter_id) < limit]

    def prefetch_fits(
        self,
        need_bytes: int,
        free_bytes: int,
        evictable: Iterable[tuple[str, int]],
        *,
        incoming_expected: float,
        min_gain: float,
    ) -> bool:
        """Whether a prefetch of ``need_bytes`` can have room: the free bytes plus those of the
        evictable adapters it may displace (:meth:`choose_victim`'s prefetch rule) cover it.
        Checked before a prefetch is queued, so one that could only wait is not queued.

        Args:
            need_bytes: Pool bytes the adapter takes (rounded to the allocator's unit).
            free_bytes: Free pool bytes now.
            evictable: ``(adapter_id, nbytes)`` of resident adapters no request holds.
            incoming_expected: The prefetch's forecast expected count.
            min_gain: ``prefetch_min_gain`` of the store.
        """
        room = free_bytes
        if room >= need_bytes:
            return True
        limit = prefetch_victim_limit(incoming_expected, min_gain)
        for adapter_id, nbytes in evictable:
            if self.demand(adapter_id) < limit:
                room += nbytes
                if room >= need_bytes:
                    return True
        return False


class LRUPolicy(EvictionPolicy):
    """Least recently used first (the baseline)."""

    name = "lru"

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        return lru_order(candidates)


#: Disagreements of the two experts remembered until a request settles them.
REGRET_HISTORY = 256
#: Multiplicative penalty ``exp(-LEARNING_RATE)`` of the expert a request proved wrong.
LEARNING_RATE = 0.2
#: Least weight of either expert (neither is ever written off).
MIN_WEIGHT = 0.02
#: Starting weights: recency leads until the forecast is proved better twice more often than
#: not (``ln(0.6 / 0.4) / LEARNING_RATE`` = 2.03 net regrets of recency).
INITIAL_WEIGHTS = {"recency": 0.6, "forecast": 0.4}


class PredictivePolicy(EvictionPolicy):
    """Forecast demand per byte or recency, whichever has been proved wrong less (see the
    module doc); LRU without a forecast.

    Attributes:
        weights: ``{"recency": w, "forecast": w}``, summing to 1.
    """

    name = "predictive"

    def __init__(self) -> None:
        super().__init__()
        self.weights = dict(INITIAL_WEIGHTS)
        # adapter -> expert proved wrong if it is asked for next: the followed expert for its
        # victim (a miss), the overruled expert for the adapter it would have evicted (a hit)
        self._evicted: OrderedDict[str, str] = OrderedDict()
        self._spared: OrderedDict[str, str] = OrderedDict()

    @property
    def leader(self) -> str:
        """The expert evictions follow now (``"recency"`` or ``"forecast"``)."""
        return "forecast" if self.weights["forecast"] > self.weights["recency"] else "recency"

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        if self._forecast is None or self.leader == "recency":
            return lru_order(candidates)
        return predictive_order(candidates, self._forecast)

    def choose_victim(
        self,
        evictable: Iterable[Candidate],
        *,
        demanded: bool,
        incoming_expected: float,
        min_gain: float,
    ) -> str | None:
        cands = self._candidates(evictable, demanded, incoming_expected, min_gain)
        self.last_by_forecast = False
        if not cands:
            return None
        by_recency = min(cands, key=_recency_key)
        if self._forecast is None:
            victim = by_recency
        else:
            by_forecast = min(cands, key=_demand_per_byte_key(self._forecast))
            follow = self.leader
            victim, spared = (
                (by_forecast, by_recency) if follow == "forecast" else (by_recency, by_forecast)
            )
            self.last_by_forecast = victim is not by_recency
            if spared is not victim:  # the experts disagree: the next request for either tells
                other = "recency" if follow == "forecast" else "forecast"
                self._remember(self._evicted, victim.adapter_id, follow)
                self._remember(self._spared, spared.adapter_id, other)
        # an evicted adapter is no longer one an expert spared
        self._spared.pop(victim.adapter_id, None)
        return victim.adapter_id

    @staticmethod
    def _remember(book: OrderedDict[str, str], adapter_id: str, expert: str) -> None:
        book.pop(adapter_id, None)
        book[adapter_id] = expert
        while len(book) > REGRET_HISTORY:
            book.popitem(last=False)

    def note_miss(self, adapter_id: str) -> None:
        """A request found ``adapter_id`` not resident: if it was evicted where the experts
        disagreed, the expert followed was wrong."""
        self._spared.pop(adapter_id, None)
        expert = self._evicted.pop(adapter_id, None)
        if expert is not None:
            self._penalize(expert)

    def note_hit(self, adapter_id: str) -> None:
        """A request found ``adapter_id`` resident: if the overruled expert would have evicted
        it, that expert was wrong."""
        expert = self._spared.pop(adapter_id, None)
        if expert is not None:
            self._penalize(expert)

    def _penalize(self, expert: str) -> None:
        w = self.weights
        w[expert] *= math.exp(-LEARNING_RATE)
        total = w["forecast"] + w["recency"]
        hi = 1.0 - MIN_WEIGHT
        w["forecast"] = min(hi, max(MIN_WEIGHT, w["forecast"] / total))
        w["recency"] = 1.0 - w["forecast"]


def make_policy(kind: str) -> EvictionPolicy:
    """Build a policy by name (``"lru"`` or ``"predictive"``).

    Raises:
        ValueError: unknown kind.
    """
    if kind == "lru":
        return LRUPolicy()
    if kind == "predictive":
        return PredictivePolicy()
    raise ValueError(f"unknown eviction policy {kind!r}; expected one of {EVICTION_KINDS}")
