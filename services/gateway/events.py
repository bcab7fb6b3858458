"""Request events from the gateway to the predictor: bounded, lossy, never on the request path.

The request path calls :meth:`EventStreamer.offer`, which never blocks: when the predictor is
slow or down the bounded queue fills and further events are dropped and counted (issue 5,
"Ingest"). A background thread holds one client-streaming ``StreamRequestEvents`` call open and
reconnects with capped exponential backoff.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from plora.v1 import predictor_pb2, predictor_pb2_grpc
from services.common.grpc_util import CHANNEL_OPTIONS
from services.common.internal_auth import internal_channel

#: Longest pause (seconds) between two connection attempts while the predictor is down. Each
#: attempt also waits up to 2 s for the channel (whose own reconnect backoff is capped at 2 s,
#: ``CHANNEL_OPTIONS``), so a predictor that comes back is reconnected to within ~2 s
#: (docs/architecture.md, failures); a refused local connection every ~3 s costs nothing.
RECONNECT_BACKOFF_MAX_S = 1.0

logger = logging.getLogger(__name__)


class EventStreamer:
    """Streams ``RequestEvent`` messages to the predictor in a background thread.

    Args:
        address: ``host:port`` of the predictor; empty disables streaming (events are dropped
            silently, as the baseline policy has no predictor).
        queue_size: Bound of the event queue.
        on_sent / on_dropped / on_connected: Metric hooks (``on_connected(bool)``).
        internal_token: Sent with the stream (:mod:`services.common.internal_auth`); ``""``
            when internal authentication is off.
    """

    def __init__(
        self,
        address: str,
        queue_size: int,
        on_sent: Callable[[int], None] = lambda n: None,
        on_dropped: Callable[[int], None] = lambda n: None,
        on_connected: Callable[[bool], None] = lambda c: None,
        internal_token: str = "",
    ) -> None:
        self.address = address
        self._internal_token = internal_token
        self._queue: queue.Queue[predictor_pb2.RequestEvent] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._on_sent, self._on_dropped, self._on_connected = on_sent, on_dropped, on_connected
        self.connected = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the background sender (no-op without a predictor address)."""
        if self.address:
            self._thread = threading.Thread(target=self._run, name="predictor-events", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the sender; queued events are discarded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def offer(self, event: predictor_pb2.RequestEvent) -> bool:
        """Queue one event without blocking; returns False (and counts it) when dropped."""
        if not self.address:
            return False
        try:
            self._queue.put_nowait(event)
            return True
        except queue.Full:
            self._on_dropped(1)
            return False

    def _events(self) -> Iterator[predictor_pb2.RequestEvent]:
        while not self._stop.is_set():
            try:
                event = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            self._on_sent(1)
            yield event

    def _set_connected(self, value: bool) -> None:
        if value != self.connected:
            self.connected = value
            self._on_connected(value)
            logger.info(
                "predictor event stream %s (%s)",
                "connected" if value else "disconnected",
                self.address,
            )

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            channel = internal_channel(self.address, self._internal_token, options=CHANNEL_OPTIONS)
            with channel:
                try:
                    grpc.channel_ready_future(channel).result(timeout=2.0)
                    self._set_connected(True)
                    backoff = 0.5
                    stub = predictor_pb2_grpc.PredictorStub(channel)
                    stub.StreamRequestEvents(self._events())
                except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
                    logger.debug("predictor stream ended: %s", exc)
            self._set_connected(False)
            # While disconnected, events keep arriving; the bounded queue drops the excess.
            self._stop.wait(backoff)
            backoff = min(backoff * 2, RECONNECT_BACKOFF_MAX_S)
