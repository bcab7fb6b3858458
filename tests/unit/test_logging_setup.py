"""``--log-json``: one JSON object per line, naming the service that wrote it."""

from __future__ import annotations

import json
import logging

import pytest

from services.common.logging_setup import configure_logging


def test_json_lines_name_their_service(capsys: pytest.CaptureFixture[str]) -> None:
    """A new operator merging the services' JSON logs could not tell worker-0's lines from
    worker-1's: the plain format prefixed ``[worker-0]``, the JSON one had no such key."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("INFO", json_lines=True, service="worker-1")
        logging.getLogger("services.worker.server").warning("heartbeat failed: %s", "boom")
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert line["service"] == "worker-1" and line["level"] == "WARNING"
    assert (
        line["logger"] == "services.worker.server" and line["message"] == "heartbeat failed: boom"
    )
