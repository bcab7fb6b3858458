"""The gateway's event stream to the predictor never blocks the request path."""

from __future__ import annotations

import socket
import time

from plora.v1 import predictor_pb2
from services.gateway.events import EventStreamer


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def test_offer_never_blocks_and_counts_drops_when_the_predictor_is_down() -> None:
    dropped: list[int] = []
    streamer = EventStreamer(_dead_address(), queue_size=10, on_dropped=dropped.append)
    streamer.start()
    try:
        start = time.perf_counter()
        accepted = [
            streamer.offer(predictor_pb2.RequestEvent(adapter_id=f"a{i}")) for i in range(1000)
        ]
        elapsed = time.perf_counter() - start
    finally:
        streamer.stop()
    assert elapsed < 0.5, f"offering 1000 events took {elapsed:.3f}s"
    assert sum(accepted) == 10 and len(dropped) == 990
    assert not streamer.connected


def test_without_a_predictor_events_are_discarded_silently() -> None:
    dropped: list[int] = []
    streamer = EventStreamer("", queue_size=1, on_dropped=dropped.append)
    streamer.start()
    assert not streamer.offer(predictor_pb2.RequestEvent(adapter_id="a"))
    assert dropped == []
    streamer.stop()
