"""Process lifecycle helpers shared by the service entry points."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.common.errors import PLoRAError
from services.common.logging_setup import configure_logging
from services.common.registry import RegistryUnavailableError

logger = logging.getLogger(__name__)


class _Config(Protocol):
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Any: ...


def write_json_atomic(
    path: Path, obj: object, indent: int | None = None, mode: int | None = None
) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file beside it, so a reader (the
    launcher polling a ready file, a client or Prometheus reading the cluster's files) never
    sees half a file.

    Args:
        path: The file.
        obj: JSON-serialisable value.
        indent: ``json.dumps`` indentation.
        mode: Permission bits of the new file (``0o600``: its owner only), set before anything
            is written to it; None: the umask's default.

    Raises:
        OSError: the file cannot be written.
    """
    tmp = path.with_suffix(".tmp")
    if mode is None:
        tmp.write_text(json.dumps(obj, indent=indent))
    else:
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)  # the umask may have cleared bits of ``mode``
            f.write(json.dumps(obj, indent=indent))
    tmp.replace(path)


def write_ready_file(path: str, grpc_port: int, metrics_port: int, **ports: int) -> None:
    """Atomically write ``{"grpc_port", "metrics_port", ...}`` (plus any other named
    ``ports``, e.g. ``http_port``) so the launcher learns bound ports."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(target, {"grpc_port": grpc_port, "metrics_port": metrics_port, **ports})


#: Run as ``python -c _STOP_WITH_PARENT <parent pid> <command...>``: ask Linux to send SIGTERM
#: when the parent dies (prctl(PR_SET_PDEATHSIG), which survives execve), stop at once if the
#: parent is already gone, then exec the command. Standard library only, so it starts fast.
_STOP_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def stop_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that Linux sends it SIGTERM when this process dies, even by SIGKILL,
    so a killed ``plora up`` leaves no services or Redis behind holding ports; the services
    stop gracefully on SIGTERM.

    The child sets ``prctl(PR_SET_PDEATHSIG)`` itself in a short Python trampoline that then
    execs ``cmd`` (not in a ``preexec_fn``: Python code between fork and exec in a process
    with gRPC's threads can abort the child, and did in the test suite). Linux tracks the
    *thread* that started the child: call ``Popen`` from a thread that lives as long as the
    child (the launcher's main thread does).

    Returns:
        The command to run; ``cmd`` unchanged off Linux.
    """
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _STOP_WITH_PARENT, str(os.getpid()), *cmd]


#: ``nice`` of speculative background threads (host staging, the predictor's tick): the CFS
#: weight of nice 10 is ~1/9 of nice 0, so on a host whose cores the decode steps keep busy
#: they take mostly idle time instead of stretching steps and queues.
BACKGROUND_NICE = 10


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Raise the calling thread's ``nice`` to at least ``nice`` (Linux: a thread's priority
    is its own; ``setpriority(PRIO_PROCESS, tid)`` changes only that thread and the threads
    it starts later).

    For speculative work that nothing waits on: raising nice needs no privilege, but a
    thread can't lower it back without CAP_SYS_NICE, so never call this from a thread that
    also does work a request waits for.

    Returns:
        Whether it was applied (False off Linux or when refused).
    """
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        # never below the nice the process was started with (that would need privilege)
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class FrozenHeap:
    """What :func:`freeze_startup_heap` did.

    Attributes:
        objects: Objects moved out of the collector's reach (the permanent generation).
        full_collection_ms: Milliseconds one full collection took over the heap as start-up
            left it, which is what every later full collection would have scanned.
        full_collection_after_ms: Milliseconds a full collection takes once the start-up
            heap is frozen (the least of three).
    """

    objects: int
    full_collection_ms: float
    full_collection_after_ms: float


def freeze_startup_heap() -> FrozenHeap:
    """Take every object alive after start-up (imported modules, the model, gRPC and HTTP
    servers, caches) out of the cyclic garbage collector's scans, so that a full
    (generation-2) collection while serving scans only what was allocated since.

    Without it a full collection stops every thread of the process while it walks the whole
    start-up heap: under ``plora up`` on a 2-core x86 machine that takes about 90 ms in the
    gateway and in each worker (default model) and 150 ms in the predictor, at moments the
    interpreter chooses, which lands on the refusal, token and health-check latencies being
    served at the time. vLLM freezes its start-up heap the same way once its engine is warmed
    up (``freeze_gc_heap``); SGLang offers it as ``freeze_gc``.

    A full collection runs first, so only live objects are frozen. Frozen objects are still
    freed by reference counting when their last reference goes; one left in a reference
    cycle is not, which is why this is called once, when the process starts serving, and not
    where services are built and stopped many times in one process (tests).

    Returns:
        The number of objects frozen and a full collection's time before and after.
    """
    began = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - began) * 1e3
    gc.freeze()
    after_ms = []
    for _ in range(3):  # the least of three: other threads' turns on the GIL are not its cost
        began = time.perf_counter()
        gc.collect()
        after_ms.append((time.perf_counter() - began) * 1e3)
    return FrozenHeap(gc.get_freeze_count(), full_ms, min(after_ms))


def serve_until_signalled(stop: Callable[[], None]) -> None:
    """Block the main thread until SIGINT or SIGTERM, then call ``stop``."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    stop()


def service_parser(
    name: str, config_cls: type[_Config], exit_on_error: bool = True
) -> argparse.ArgumentParser:
    """The flags of ``plora serve <name>``: the config's own, then ``--log-level`` and
    ``--log-json`` (the same parser checks ``plora up``'s flags before start-up)."""
    parser = argparse.ArgumentParser(prog=f"plora serve {name}", exit_on_error=exit_on_error)
    config_cls.add_arguments(parser)
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR (no env variable; default INFO)",
    )
    parser.add_argument(
        "--log-json",
        action="store_true",
        help="one JSON object per log line, for log collectors (default: plain text)",
    )
    return parser


#: A service's exit status when it cannot start because Redis is unreachable: a temporary
#: failure (``EX_TEMPFAIL`` of sysexits.h), which ``plora up`` retries instead of stopping.
EXIT_REGISTRY_UNAVAILABLE = 75


def run_service(
    name: str,
    config_cls: type[_Config],
    service_factory: Callable[[Any], Any],
    argv: list[str] | None,
    log_name: Callable[[Any], str] | None = None,
) -> int:
    """Entry point shared by ``plora serve {gateway,worker,predictor}``.

    Parses the service's flags, configures logging once, builds the service, freezes the
    start-up heap (:func:`freeze_startup_heap`), starts it, then serves until SIGINT/SIGTERM
    and stops it gracefully.

    Args:
        name: Service name (``gateway``).
        config_cls: The service's config dataclass (``add_arguments`` / ``from_args``).
        service_factory: ``config -> service`` with ``start() -> service`` and ``stop()``.
        argv: Command-line arguments (None = ``sys.argv[1:]``).
        log_name: Prefix of log lines from the config (default: ``name``).

    Returns:
        0 after a clean stop; :data:`EXIT_REGISTRY_UNAVAILABLE` when it cannot start because
        Redis is unreachable (worth trying again later); 2 when it cannot start for another
        reason (bad config, model missing, a port taken) - with a one-line reason in the log,
        not a stack trace.
    """
    args = service_parser(name, config_cls).parse_args(argv)
    try:
        config = config_cls.from_args(args)
    except PLoRAError as exc:
        configure_logging(args.log_level, args.log_json, service=name)
        logger.error("%s", exc)
        return 2
    configure_logging(args.log_level, args.log_json, service=log_name(config) if log_name else name)
    try:
        service = service_factory(config)
        # before start(): the first requests, health checks and the ready file come after it
        heap = freeze_startup_heap()
        logger.info(
            "froze %d start-up objects out of the garbage collector's scans: a full "
            "collection took %.0f ms, now %.1f ms",
            heap.objects,
            heap.full_collection_ms,
            heap.full_collection_after_ms,
        )
        service.start()
    except RegistryUnavailableError as exc:
        logger.error("%s", exc)
        return EXIT_REGISTRY_UNAVAILABLE
    except (PLoRAError, OSError) as exc:  # OSError: a port it cannot bind, a file it cannot read
        logger.error("%s", exc)
        return 2
    serve_until_signalled(service.stop)
    return 0
