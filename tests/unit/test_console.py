"""The ``plora`` console script's entry point (services/console.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO

# Ctrl-C arriving while the CLI still imports grpc: a finder sends this process SIGINT when
# the import of grpc begins, as a user's key press during the first ~0.2 s would.
INTERRUPTED_IMPORT = textwrap.dedent(
    """
    import os, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    class SigintOnGrpc:
        def find_spec(self, name, path=None, target=None):
            if name == "grpc":
                os.kill(os.getpid(), signal.SIGINT)
            return None
    sys.meta_path.insert(0, SigintOnGrpc())
    from plora.console import main
    sys.argv = ["plora", "status"]
    sys.exit(main())
    """
)


def test_ctrl_c_during_the_clis_imports_exits_130_without_a_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IMPORT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip() == "plora: interrupted", out.stderr
