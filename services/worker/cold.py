"""Why a request started cold: one taxonomy for the live store and the simulated worker.

A request is *cold* when its adapter is not resident in the device pool as the worker takes it
(then it waits for the load). Its cause is decided at that moment, from what this worker did
with the adapter before, in this order:

``prefetch_late``
    A prefetch of it is queued or loading: the forecast named it, but too late.
``first_use``
    This worker never held it (nothing to keep; a prefetch could have brought it).
``evicted_recency``
    It was evicted for a demand load by recency (LRU order, or the forecast agreed with it).
``evicted_forecast``
    It was evicted for a demand load because the forecast ranked it lowest where recency
    would have kept it.
``evicted_for_prefetch``
    It was evicted to make room for a prefetch.
``unloaded``
    It left for another reason (a newer version, an unload, a failed load).

The bounded label set is also the ``cause`` label of ``plora_worker_cold_starts_total``.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Every cause, in the order of the module doc (report and metric label values).
COLD_CAUSES: tuple[str, ...] = (
    "prefetch_late",
    "first_use",
    "evicted_recency",
    "evicted_forecast",
    "evicted_for_prefetch",
    "unloaded",
)

#: Index of each cause (the simulator stores ``index + 1`` per request; 0 = warm).
CAUSE_INDEX: Mapping[str, int] = {c: i for i, c in enumerate(COLD_CAUSES)}


def eviction_cause(*, for_demand: bool, by_forecast: bool) -> str:
    """The cause a later cold start of an evicted adapter gets.

    Args:
        for_demand: The eviction made room for a demand load (else a prefetch).
        by_forecast: The eviction policy's forecast chose this victim where recency would have
            chosen another (:attr:`services.worker.eviction.EvictionPolicy.last_by_forecast`).
    """
    if not for_demand:
        return "evicted_for_prefetch"
    return "evicted_forecast" if by_forecast else "evicted_recency"


def cold_cause(*, prefetch_in_flight: bool, ever_held: bool, last_eviction: str | None) -> str:
    """The cause of one cold start (see the module doc).

    Args:
        prefetch_in_flight: A prefetch of the adapter is queued or loading here.
        ever_held: This worker held the adapter (any version) before.
        last_eviction: :func:`eviction_cause` of its last eviction here, if it was evicted.
    """
    if prefetch_in_flight:
        return "prefetch_late"
    if not ever_held:
        return "first_use"
    return last_eviction or "unloaded"
