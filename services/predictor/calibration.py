"""Online calibration of the demand forecast for prefetch decisions.

A forecaster's expected count is a score, not a probability: whether an adapter forecast at
``x`` expected requests in the next horizon is actually requested depends on the trace and on
the forecaster's bias. :class:`ForecastCalibrator` learns the map from what arrived: every
tick, each adapter forecast at or above ``min_expected`` is a prediction in the bucket of its
expected count; once the horizon has passed, it is a hit when the adapter was requested in
``(t, t + horizon]``. The calibrated probability of a bucket is its hit rate with a Beta prior
centred on the Poisson reading of the score, ``1 - exp(-x)`` (reliability-diagram binning with
a prior: Niculescu-Mizil and Caruana, "Predicting good probabilities with supervised
learning", ICML 2005), so an unseen bucket starts where a calibrated forecaster would be.

A prefetch pays when the adapter is requested before it is evicted: its benefit is a cold
start saved (with probability ``p``), its cost a load that takes loader bandwidth and evicts
another adapter (with probability ``1 - p`` for nothing). :class:`PrefetchSelector
<services.predictor.placement.PrefetchSelector>` prefetches only adapters whose calibrated
``p`` reaches ``prefetch_min_probability``, so the volume of prefetch follows its measured
precision on the traffic at hand.

Pure bookkeeping, no clock: times are given by the caller (the predictor's tick, or the
simulator's virtual clock).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping

#: Upper edges of the expected-count buckets (the last bucket is open).
DEFAULT_EDGES: tuple[float, ...] = (0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0)


class ForecastCalibrator:
    """Per-bucket hit rates of forecast expected counts (see the module doc).

    Args:
        horizon_s: The forecast horizon, seconds (a prediction is resolved after it).
        min_expected: Forecasts below this are not tracked (they are never prefetched).
        edges: Upper edges of the buckets, ascending.
        prior_weight: Pseudo-observations of the Poisson prior per bucket.

    Raises:
        ValueError: ``horizon_s`` not positive, or ``edges`` not ascending.
    """

    def __init__(
        self,
        horizon_s: float,
        *,
        min_expected: float = 0.05,
        edges: tuple[float, ...] = DEFAULT_EDGES,
        prior_weight: float = 4.0,
    ) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        if list(edges) != sorted(edges):
            raise ValueError("edges must be ascending")
        self.horizon_s = horizon_s
        self.min_expected = min_expected
        self.edges = edges
        self.prior_weight = prior_weight
        n = len(edges) + 1
        self.hits = [0] * n
        self.count = [0] * n
        self._pending: deque[tuple[float, list[tuple[str, int]]]] = deque()
        self._arrivals: dict[str, deque[float]] = {}

    def bucket(self, expected: float) -> int:
        """Index of the bucket of ``expected``."""
        return bisect.bisect_left(self.edges, expected)

    def observe(self, t: float, forecast: Mapping[str, float], arrived: Iterable[str]) -> None:
        """One tick at time ``t``: the requests that arrived since the last tick (adapter ids,
        one per request), then this tick's forecast (``adapter_id -> expected count``).
        Predictions whose horizon has passed are resolved first."""
        for a in arrived:
            self._arrivals.setdefault(a, deque()).append(t)
        self._resolve(t)
        batch = [(a, self.bucket(x)) for a, x in forecast.items() if x >= self.min_expected]
        self._pending.append((t, batch))

    def _resolve(self, t: float) -> None:
        h = self.horizon_s
        while self._pending and self._pending[0][0] + h <= t:
            t0, batch = self._pending.popleft()
            for a, b in batch:
                times = self._arrivals.get(a)
                hit = times is not None and _any_in(times, t0, t0 + h)
                self.count[b] += 1
                self.hits[b] += int(hit)
        oldest = self._pending[0][0] if self._pending else t
        for a in list(self._arrivals):
            times = self._arrivals[a]
            while times and times[0] <= oldest:
                times.popleft()
            if not times:
                del self._arrivals[a]

    def probability(self, expected: float) -> float:
        """Calibrated probability that an adapter forecast at ``expected`` is requested within
        the horizon (0 below ``min_expected``)."""
        if expected < self.min_expected:
            return 0.0
        b = self.bucket(expected)
        n = self.count[b]
        prior = 1.0 - math.exp(-expected)
        w = self.prior_weight
        return (self.hits[b] + w * prior) / (n + w)

    def table(self) -> list[dict[str, float]]:
        """The reliability table: per bucket its upper edge, predictions resolved and hit
        rate (NaN before the first)."""
        out = []
        for b, edge in enumerate((*self.edges, math.inf)):
            n = self.count[b]
            out.append(
                {
                    "upper_expected": edge,
                    "predictions": n,
                    "hit_rate": self.hits[b] / n if n else math.nan,
                }
            )
        return out


def _any_in(times: deque[float], lo: float, hi: float) -> bool:
    """Whether some time in ascending ``times`` lies in ``(lo, hi]``."""
    for x in times:
        if x > hi:
            return False
        if x > lo:
            return True
    return False
