"""What a worker publishes about its own service for routing: exponentially weighted means of a
prefill's share of its step, of a cold start's wait for its adapter and of a load from the
source tier (the inputs of rank-aware routing's cost estimate)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServiceEstimates:
    """Recent per-request service figures of one worker, published with its heartbeat for
    expected-delay routing (:func:`services.predictor.placement.route_rank_aware`).

    Exponentially weighted means over requests (weight ``alpha`` on the newest; the first
    observation sets the mean), seconds, 0.0 until observed:

    Attributes:
        prefill_s: Step time attributed to one request's prompt (each step's wall time split
            over its rows by tokens, summed until the request's first token): the delay one
            more pending request adds before a new request's first token.
        cold_wait_s: Time a cold request waited for its adapter to become resident.
        source_load_s: Time of a load that read the adapter from its source (not from the
            host cache): the read, finding room and the copy into the pool. What a request
            sent to this worker for an adapter it holds in neither tier pays at least.
        decode_row_s: Marginal step time of one more decoding sequence, seconds: the slope of
            decode-only steps' wall time against their rows (exponentially weighted least
            squares, weight ``decode_decay`` kept per step), so what each running sequence
            adds to every step a new request waits through. It stays 0.0 until the steps
            seen span at least two batch sizes; clipped to ``[0, mean step time per row]``.
            Exported for operators
            (``plora_worker_service_estimate_seconds{figure="decode_row"}``); it is not in the
            heartbeat, and routing does not weigh it.
        alpha: Weight of the newest observation, in (0, 1].
        decode_decay: Weight a decode step's observation keeps at each later one, in (0, 1).
    """

    prefill_s: float = 0.0
    cold_wait_s: float = 0.0
    source_load_s: float = 0.0
    decode_row_s: float = 0.0
    alpha: float = 0.1
    decode_decay: float = 0.99
    # exponentially weighted sums over decode-only steps: weight, rows, rows^2, s, rows*s
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5, init=False, repr=False)

    def observe_prefill(self, seconds: float) -> None:
        """Fold in one request's prefill share (seconds)."""
        self.prefill_s = _ewma(self.prefill_s, seconds, self.alpha)

    def observe_cold_wait(self, seconds: float) -> None:
        """Fold in one cold request's adapter wait (seconds)."""
        self.cold_wait_s = _ewma(self.cold_wait_s, seconds, self.alpha)

    def observe_source_load(self, seconds: float) -> None:
        """Fold in one load from the source tier (seconds)."""
        self.source_load_s = _ewma(self.source_load_s, seconds, self.alpha)

    def observe_decode_step(self, rows: int, seconds: float) -> None:
        """Fold in one decode-only step: ``rows`` sequences (one token each) in ``seconds``
        of wall time, and refit :attr:`decode_row_s`."""
        if rows <= 0:
            return
        d = self.decode_decay
        s = self._sums
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            s[i] = s[i] * d + v
        w, x, xx, y, xy = s
        spread = w * xx - x * x  # w^2 times the weighted variance of rows
        if spread <= 0.05 * w * w:  # (about) one batch size seen: slope unknown
            return
        slope = (w * xy - x * y) / spread
        self.decode_row_s = min(max(0.0, slope), y / x)


def _ewma(mean: float, x: float, alpha: float) -> float:
    return x if mean <= 0.0 else mean + alpha * (x - mean)
