"""``python -m services.common.healthcheck HOST:PORT``: exit 0 when the gRPC server is SERVING.

Used by the Docker health checks (no grpcurl needed in the image).
"""

from __future__ import annotations

import sys

from services.common.grpc_util import wait_healthy


def main(argv: list[str]) -> int:
    """Check one address; ``argv = [address, timeout_seconds?]``."""
    if not argv:
        print("usage: python -m services.common.healthcheck HOST:PORT [TIMEOUT_S]", file=sys.stderr)
        return 2
    timeout = float(argv[1]) if len(argv) > 1 else 3.0
    try:
        wait_healthy(argv[0], timeout)
    except TimeoutError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
