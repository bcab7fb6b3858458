"""Process lifecycle helpers shared by the service entry points."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path


def write_ready_file(path: str, grpc_port: int, metrics_port: int) -> None:
    """Atomically write ``{"grpc_port", "metrics_port"}`` so the launcher learns bound ports."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps({"grpc_port": grpc_port, "metrics_port": metrics_port}))
    tmp.replace(target)


def serve_until_signalled(stop: Callable[[], None]) -> None:
    """Block the main thread until SIGINT or SIGTERM, then call ``stop``."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    stop()
