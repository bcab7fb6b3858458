"""Open-loop gRPC replay client and cluster-status sampler (``plora bench replay``).

Open loop: request ``i`` is sent at ``t0 + arrivals[i].t`` whatever the cluster's state; a slow
cluster does not slow the arrivals down. In-flight calls are bounded by ``concurrency`` (one
thread per call); an arrival that finds ``concurrency`` calls in flight is not sent and is
recorded as failed with status :data:`~plora.replay.report.CLIENT_DROPPED`.

Prompts: the trace gives a prompt length in tokens; the client sends a deterministic raw prompt
(no chat template) of ``min(prompt_tokens, prompt_token_cap)`` words drawn from a list of
common English words that are single tokens in GPT-2-style BPE vocabularies (with their leading
space), so the prompt is about that many tokens. The words depend only on ``(seed, index)``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import numpy as np

from plora.replay.report import (
    CLIENT_DROPPED,
    OK,
    RequestRecord,
    StatusSample,
    WorkerSample,
)
from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.grpc_util import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

#: Common English words; each is one token (with its leading space) in GPT-2-style BPE.
PROMPT_WORDS: tuple[str, ...] = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "people",
    "year",
    "way",
    "day",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "work",
    "number",
    "group",
    "water",
    "city",
    "story",
    "house",
    "music",
    "light",
    "river",
    "model",
    "data",
    "system",
    "market",
    "game",
    "school",
    "night",
    "book",
    "money",
)


@dataclass(frozen=True)
class ReplayRequest:
    """One request to replay.

    Attributes:
        index: Position in the slice.
        t: Send time, seconds after the replay start.
        adapter_id: Adapter to name ("" = base model).
        trace_key: The trace key behind the adapter (for the records).
        prompt: Raw prompt text.
        max_new_tokens: Generation length bound.
    """

    index: int
    t: float
    adapter_id: str
    trace_key: str
    prompt: str
    max_new_tokens: int


@dataclass(frozen=True)
class ClientConfig:
    """Settings of the replay client.

    Attributes:
        concurrency: Most calls in flight; arrivals beyond it are dropped (``CLIENT_DROPPED``).
        request_timeout_s: gRPC deadline of each call.
        progress_interval_s: Seconds between progress callbacks.
        seed: Sampling seed sent with every request (greedy decoding ignores it).
    """

    concurrency: int = 64
    request_timeout_s: float = 180.0
    progress_interval_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_timeout_s <= 0 or self.progress_interval_s <= 0:
            raise ValueError("request_timeout_s and progress_interval_s must be > 0")


@dataclass(frozen=True)
class Progress:
    """Counts at one moment of a replay."""

    elapsed_s: float
    total: int
    sent: int
    completed: int
    failed: int
    in_flight: int


def synth_prompt(n_tokens: int, seed: int, index: int) -> str:
    """Deterministic prompt of ``max(1, n_tokens)`` words from :data:`PROMPT_WORDS`.

    Args:
        n_tokens: Target length (about one token per word).
        seed: Replay seed.
        index: Request index (different requests get different text).

    Returns:
        Words joined by single spaces, starting with a capital letter.
    """
    rng = np.random.default_rng([int(seed), int(index)])
    words = [PROMPT_WORDS[i] for i in rng.integers(0, len(PROMPT_WORDS), max(1, int(n_tokens)))]
    words[0] = words[0].capitalize()
    return " ".join(words)


def build_requests(
    times: Sequence[float],
    adapters: Sequence[str],
    trace_keys: Sequence[str],
    prompt_tokens: Sequence[int],
    *,
    max_new_tokens: int,
    prompt_token_cap: int,
    seed: int,
) -> list[ReplayRequest]:
    """Replay requests from per-arrival arrays (prompts capped at ``prompt_token_cap`` words)."""
    if prompt_token_cap < 1 or max_new_tokens < 1:
        raise ValueError("prompt_token_cap and max_new_tokens must be >= 1")
    return [
        ReplayRequest(
            index=i,
            t=float(t),
            adapter_id=a,
            trace_key=k,
            prompt=synth_prompt(min(int(p), prompt_token_cap), seed, i),
            max_new_tokens=max_new_tokens,
        )
        for i, (t, a, k, p) in enumerate(
            zip(times, adapters, trace_keys, prompt_tokens, strict=True)
        )
    ]


class ReplayClient:
    """Sends :class:`ReplayRequest` s to a gateway open-loop and records what happened."""

    def __init__(self, gateway: str, config: ClientConfig | None = None) -> None:
        self.gateway = gateway
        self.config = config or ClientConfig()
        self._channel = grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ReplayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call ---------------------------------------------------------------------------

    def _call(self, req: ReplayRequest, t0: float, id_prefix: str = "replay") -> RequestRecord:
        grpc_req = gateway_pb2.GenerateRequest(
            request_id=f"{id_prefix}-{req.index}",
            adapter_id=req.adapter_id,
            prompt=req.prompt,
            max_new_tokens=req.max_new_tokens,
            temperature=0.0,
            seed=self.config.seed,
        )
        sent = time.monotonic() - t0
        first: float | None = None
        last = None

        def record(first_s: float | None, status: str, **fields: object) -> RequestRecord:
            return RequestRecord(
                req.index,
                req.adapter_id,
                req.trace_key,
                req.t,
                sent,
                first_s,
                end,
                status,
                **fields,  # type: ignore[arg-type]
            )

        try:
            for resp in self._stub.Generate(grpc_req, timeout=self.config.request_timeout_s):
                if first is None and resp.token_ids:
                    first = time.monotonic() - t0
                last = resp
            end = time.monotonic() - t0
        except grpc.RpcError as exc:
            end = time.monotonic() - t0
            code = exc.code() if hasattr(exc, "code") else None
            return record(
                first,
                code.name if code is not None else "UNKNOWN",
                error=str(exc.details() if hasattr(exc, "details") else exc)[:300],
            )
        if last is None:
            return record(first, "EMPTY_STREAM", error="the stream ended with no message")
        return record(
            first if first is not None else end,
            OK,
            prompt_tokens=last.usage.prompt_tokens,
            completion_tokens=last.usage.completion_tokens,
            adapter_cold=last.adapter_cold,
            adapter_wait_s=last.adapter_wait_seconds,
            worker_id=last.worker_id,
            worker_ttft_s=last.worker_ttft_seconds,
        )

    # -- the uncontended TTFT ----------------------------------------------------------------

    def uncontended_ttft(self, requests: Sequence[ReplayRequest], probes: int) -> list[float]:
        """TTFT (seconds, client clock) of ``probes`` requests sent one at a time to an idle
        cluster: the prompts of requests spread evenly over ``requests`` (the slice's prompt
        lengths), each for the base model with ``max_new_tokens = 1``.

        Nothing else is in flight, so each is one prefill with no queue, no batch to share and
        no adapter load: a lower bound on what any routing, prefetch or eviction policy can
        give those prompts on this cluster (a request for an adapter adds its LoRA work). Their
        mean is the report's ``ttft_uncontended_s`` (:mod:`plora.replay.report`).

        Args:
            requests: The replay's requests (their prompts are reused, not their adapters).
            probes: How many to send; 0 sends none.

        Returns:
            One TTFT per probe, in the order sent.

        Raises:
            RuntimeError: A probe failed (an idle cluster that cannot serve the base model is
                not ready for a replay).
        """
        if probes <= 0 or not requests:
            return []
        n = len(requests)
        picks = [requests[min(n - 1, int((i + 0.5) * n / probes))] for i in range(probes)]
        ttfts = []
        for i, req in enumerate(picks):
            probe = replace(req, index=i, adapter_id="", trace_key="", max_new_tokens=1)
            rec = self._call(probe, time.monotonic(), id_prefix="uncontended")
            if not rec.ok:
                raise RuntimeError(f"uncontended-TTFT probe {i} failed: {rec.status}")
            if rec.completion_tokens < 1 or rec.ttft_s is None:
                raise RuntimeError(f"uncontended-TTFT probe {i} returned no token")
            ttfts.append(rec.ttft_s)
        return ttfts

    # -- the replay -------------------------------------------------------------------------

    def replay(
        self,
        requests: Sequence[ReplayRequest],
        *,
        t0: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> list[RequestRecord]:
        """Send every request at ``t0 + request.t`` (open loop) and wait for all to finish.

        Args:
            requests: Sorted by ``t``.
            t0: ``time.monotonic()`` of the replay start (default: now); share it with a
                :class:`StatusSampler` so both time axes agree.
            on_progress: Called every ``progress_interval_s`` and once at the end.

        Returns:
            One record per request, in ``index`` order.
        """
        cfg = self.config
        t0 = time.monotonic() if t0 is None else t0
        lock = threading.Lock()
        records: dict[int, RequestRecord] = {}
        counts = {"sent": 0, "completed": 0, "failed": 0, "in_flight": 0}
        stop_progress = threading.Event()

        def snapshot() -> Progress:
            with lock:
                return Progress(
                    time.monotonic() - t0,
                    len(requests),
                    counts["sent"],
                    counts["completed"],
                    counts["failed"],
                    counts["in_flight"],
                )

        def report_loop() -> None:
            while not stop_progress.wait(cfg.progress_interval_s):
                if on_progress is not None:
                    on_progress(snapshot())

        def done(rec: RequestRecord) -> None:
            with lock:
                records[rec.index] = rec
                counts["in_flight"] -= 1
                counts["completed" if rec.ok else "failed"] += 1

        def run_one(req: ReplayRequest) -> None:
            try:
                rec = self._call(req, t0)
            except Exception as exc:  # noqa: BLE001 - a client bug must not hang the replay
                logger.exception("replay request %d failed in the client", req.index)
                now = time.monotonic() - t0
                rec = RequestRecord(
                    req.index,
                    req.adapter_id,
                    req.trace_key,
                    req.t,
                    now,
                    None,
                    now,
                    "CLIENT_ERROR",
                    error=repr(exc)[:300],
                )
            done(rec)

        reporter = threading.Thread(target=report_loop, name="replay-progress", daemon=True)
        reporter.start()
        try:
            with ThreadPoolExecutor(
                max_workers=cfg.concurrency, thread_name_prefix="replay"
            ) as pool:
                for req in requests:
                    delay = t0 + req.t - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    with lock:
                        if counts["in_flight"] >= cfg.concurrency:
                            now = time.monotonic() - t0
                            records[req.index] = RequestRecord(
                                req.index,
                                req.adapter_id,
                                req.trace_key,
                                req.t,
                                None,
                                None,
                                None,
                                CLIENT_DROPPED,
                                error=f"{cfg.concurrency} calls in flight at t={now:.2f}s",
                            )
                            counts["failed"] += 1
                            continue
                        counts["in_flight"] += 1
                        counts["sent"] += 1
                    pool.submit(run_one, req)
        finally:
            stop_progress.set()
            reporter.join()
        if on_progress is not None:
            on_progress(snapshot())
        return [records[r.index] for r in requests]


class StatusSampler:
    """Samples ``GetClusterStatus`` every ``interval_s`` in a background thread.

    Use as a context manager around a replay; :attr:`samples` holds the
    :class:`~plora.replay.report.StatusSample` s (time relative to ``t0``). A failed call is
    logged and skipped (the sample is missing, not zero).
    """

    def __init__(self, gateway: str, t0: float, interval_s: float = 1.0) -> None:
        self.t0 = t0
        self.interval_s = interval_s
        self.samples: list[StatusSample] = []
        self.errors = 0
        self._channel = grpc.insecure_channel(gateway, options=CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="status-sampler", daemon=True)

    def sample(self) -> StatusSample | None:
        """Take one sample now (also used for the final one)."""
        try:
            resp = self._stub.GetClusterStatus(
                gateway_pb2.GetClusterStatusRequest(), timeout=max(2.0, self.interval_s * 2)
            )
        except grpc.RpcError as exc:
            self.errors += 1
            logger.warning("GetClusterStatus failed: %s", exc.code().name)
            return None
        t = time.monotonic() - self.t0
        s = StatusSample(
            t,
            tuple(
                WorkerSample(
                    worker_id=w.worker_id,
                    utilization=w.pool.utilization,
                    utilization_under_pressure=w.pool.utilization_under_pressure,
                    external_fragmentation=w.pool.external_fragmentation,
                    loads=w.pool.loads,
                    evictions=w.pool.evictions,
                    cold_starts=w.pool.cold_starts,
                    pages_used=w.pool.pages_used,
                    pages_total=w.pool.pages_total,
                    live_bytes=w.pool.live_bytes,
                    pool_bytes=w.pool.pool_bytes,
                    queue_length=w.queue_length,
                    running=w.running,
                    resident_adapters=len(w.resident_adapters),
                )
                for w in sorted(resp.workers, key=lambda w: w.worker_id)
            ),
        )
        self.samples.append(s)
        return s

    def _loop(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def __enter__(self) -> StatusSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self._channel.close()
