"""The gateway's event stream to the predictor never blocks the request path."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from plora.v1 import predictor_pb2, predictor_pb2_grpc
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


@pytest.mark.slow
def test_a_predictor_that_comes_back_is_reconnected_to_within_2_s() -> None:
    """README: peers reconnect within 2 s of a restarted service's return. The stream's
    backoff grew to 5 s while the predictor was down, so a predictor back after ~12 s waited
    3.5 s for its events."""
    from services.common.grpc_util import create_server

    class Sink(predictor_pb2_grpc.PredictorServicer):
        def StreamRequestEvents(self, request_iterator, context):  # noqa: N802, ANN001, ANN201
            for _ in request_iterator:
                pass
            return predictor_pb2.StreamRequestEventsResponse()

    address = _dead_address()
    streamer = EventStreamer(address, queue_size=10, on_dropped=lambda n: None)
    streamer.start()
    server = None
    try:
        time.sleep(12.0)  # down long enough for any backoff to reach its cap
        assert not streamer.connected

        def register(s: grpc.Server) -> list[str]:
            predictor_pb2_grpc.add_PredictorServicer_to_server(Sink(), s)
            return ["plora.v1.Predictor"]

        server, _, _ = create_server(register, port=int(address.rsplit(":", 1)[1]))
        server.start()
        back = time.monotonic()
        while not streamer.connected:
            assert time.monotonic() - back < 2.5, "not reconnected within 2 s of its return"
            time.sleep(0.05)
    finally:
        streamer.stop()
        if server is not None:
            server.stop(0)
