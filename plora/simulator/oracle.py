"""The ``oracle`` policy of the simulator: eviction and prefetch that know the future arrivals.

It is the bound the forecast is measured against (``predictor_gap_closed`` in the report), not
a policy a cluster can run:

* **Eviction** (Belady's MIN, per worker): among the resident adapters no request holds, evict
  the one whose next request in the trace comes last (never again first). A prefetch may evict
  only adapters whose next request comes after the prefetched one's, by the production rule
  of :meth:`services.worker.eviction.EvictionPolicy.choose_victim` fed with exact counts.
* **Prefetch**: every predictor tick, the exact number of requests of each adapter in the next
  :data:`LOOKAHEAD_S` seconds is the "forecast", for the adapters requested at least once
  before the tick. An adapter's first request is cold under every policy (nothing that
  precedes it says it is coming), so the oracle does not prefetch it either: the bound is
  what a perfect forecast of the trace's *repeat* requests gains. ``oracle-clairvoyant``
  prefetches first requests too, to show how much of the cold-start time no forecast can
  reach. Placement, the prefetch choice and the
  workers' loads then run the production code (:func:`plan_placement`,
  :class:`PrefetchSelector`, the simulated store), so prefetches go through the same loader
  threads, pool and routing as ``plora``'s.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from services.worker.eviction import Candidate, EvictionPolicy

#: Seconds ahead the oracle's prefetch looks: about twice a remote adapter load (median 4.4 s,
#: p90 6.1 s on Alibaba's measurements), so a prefetch can finish before the request.
LOOKAHEAD_S = 12.0


class FutureArrivals:
    """Per-adapter arrival times of a trace, for next-use and window-count queries.

    Args:
        times: ``float64 [n]`` arrival times (sorted).
        adapter: ``int64 [n]`` adapter index of each arrival.
        num_adapters: K.
    """

    def __init__(self, times: np.ndarray, adapter: np.ndarray, num_adapters: int) -> None:
        order = np.argsort(adapter, kind="stable")
        bounds = np.searchsorted(adapter[order], np.arange(num_adapters + 1))
        sorted_times = times[order]
        self._per_adapter: list[list[float]] = [
            sorted_times[bounds[a] : bounds[a + 1]].tolist() for a in range(num_adapters)
        ]
        self._times = times
        self._adapter = adapter
        #: First arrival of each adapter (``inf`` for an adapter never requested).
        self._first = np.array(
            [arr[0] if arr else np.inf for arr in self._per_adapter], dtype=np.float64
        )

    def next_use(self, a: int, t: float) -> float:
        """The first arrival of adapter ``a`` after ``t`` (``inf`` when none)."""
        arr = self._per_adapter[a]
        i = bisect.bisect_right(arr, t)
        return arr[i] if i < len(arr) else float("inf")

    def counts(
        self, t0: float, t1: float, seen_only: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(adapters, counts)``: arrivals per adapter in ``(t0, t1]``, adapters ascending;
        with ``seen_only``, only of adapters whose first arrival is at or before ``t0``."""
        lo = int(np.searchsorted(self._times, t0, side="right"))
        hi = int(np.searchsorted(self._times, t1, side="right"))
        if hi <= lo:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        ads, counts = np.unique(self._adapter[lo:hi], return_counts=True)
        if seen_only:
            keep = self._first[ads] <= t0
            ads, counts = ads[keep], counts[keep]
        return ads.astype(np.int64), counts.astype(np.float64)


class BeladyPolicy(EvictionPolicy):
    """Evicts the candidate whose next request comes last (Belady's MIN).

    Args:
        future: The trace's arrivals.
        index: ``adapter_id -> adapter index``.
        now: The simulation's clock (called at each choice).
    """

    name = "belady"

    def __init__(
        self, future: FutureArrivals, index: Mapping[str, int], now: Callable[[], float]
    ) -> None:
        super().__init__()
        self._future = future
        self._index = index
        self._now = now

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        t = self._now()
        nxt = self._future.next_use
        idx = self._index
        return sorted(candidates, key=lambda c: (-nxt(idx[c.adapter_id], t), c.adapter_id))
