"""Process-wide logging configuration, called once by each service's entry point."""

from __future__ import annotations

import json
import logging
import sys
import time


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service (when named), logger, message (and exc
    when present)."""

    def __init__(self, service: str = "") -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        payload = {"ts": round(record.created, 3), "level": record.levelname}
        if self.service:  # streams of several services merged by a log collector
            payload["service"] = self.service
        payload |= {"logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload)


def configure_logging(level: str = "INFO", json_lines: bool = False, service: str = "") -> None:
    """Configure the root logger once: human-readable lines or JSON lines on stderr.

    Args:
        level: Logging level name (``DEBUG``, ``INFO``, ...).
        json_lines: Emit one JSON object per line (for log shippers).
        service: Prefix of every human-readable line and ``service`` key of every JSON one
            (e.g. ``worker-0``).
    """
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(_JsonFormatter(service))
    else:
        prefix = f"[{service}] " if service else ""
        fmt = logging.Formatter(
            f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"
        )
        fmt.converter = time.localtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # gRPC and urllib3 are chatty at INFO.
    logging.getLogger("urllib3").setLevel(logging.WARNING)
