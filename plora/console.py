"""The ``plora`` console script's entry point: :func:`plora.cli.main`, with Ctrl-C at any
moment - even while the CLI's own imports (grpc, ~0.2 s; torch for some verbs) are still
running - ending in one line and exit status 130 instead of a traceback."""

from __future__ import annotations

import sys


def main() -> int:
    """Run ``plora``; 130 (128 + SIGINT) when interrupted before a verb handles it."""
    try:
        from plora.cli import main as cli_main  # noqa: PLC0415 - the interruptible part

        return cli_main()
    except KeyboardInterrupt:
        print("\nplora: interrupted", file=sys.stderr)
        return 130
