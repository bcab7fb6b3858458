"""Adapter sources confined to adapter roots: which directories a gateway registers adapters
from and a worker loads them from.

With adapter roots configured (``--adapter-root`` / ``PLORA_ADAPTER_ROOTS``), a source must
resolve, after following every symlink of the directory *and* of each file read inside it
(``adapter_config.json``, ``adapter_model.safetensors``), to a path under one of the roots;
with a tenant it must lie under ``ROOT/<tenant>/`` of some root. A file is opened by walking
from its root one component at a time with ``O_NOFOLLOW`` (``openat``), so a symlink swapped in
after the check cannot lead the read out of the root, and a FIFO or a device in place of a file
is refused without blocking.

Every refusal says the same :data:`SOURCE_REFUSED` whatever the cause (missing, not a
directory, a file missing, outside the roots, no permission, a symlink out): a caller cannot
use registration to learn anything about the server's filesystem. The rule follows vLLM's
``--allowed-local-media-path`` (a server reads local files only under directories its operator
names).

No roots configured: :func:`confine` is not called and sources are read as given.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from services.common.errors import ConfigError, InvalidAdapterError, quoted

#: Environment variable of the adapter roots, ``os.pathsep``-separated.
ADAPTER_ROOTS_ENV = "PLORA_ADAPTER_ROOTS"

#: Files of a PEFT adapter directory that are read (both must pass the check).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

#: The one message of every refused source: the same for a path that exists and one that
#: does not, and never the path itself.
SOURCE_REFUSED = (
    "source is not an adapter directory this server may read: register a directory holding "
    "adapter_config.json and adapter_model.safetensors under one of its adapter roots "
    "(ROOT/<tenant>/ for a tenant)"
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in place of a file must not wait for a writer.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class SourceRefusedError(InvalidAdapterError):
    """An adapter source outside the adapter roots, or not readable as an adapter directory
    (INVALID_ARGUMENT at registration; a worker reports it as the registered adapter's
    failure). Its message is always :data:`SOURCE_REFUSED`."""

    def __init__(self) -> None:
        super().__init__(SOURCE_REFUSED)


def resolve_roots(roots: Iterable[str], flag: str = "--adapter-root") -> tuple[str, ...]:
    """The adapter roots as absolute, symlink-free paths (``~`` expanded), duplicates dropped,
    in order: what :func:`confine` compares sources with.

    Args:
        roots: Directories as configured.
        flag: How the message names the setting.

    Raises:
        ConfigError: a root is empty or is not an existing directory.
    """
    out: list[str] = []
    for root in roots:
        if not root:
            raise ConfigError(f"{flag} / {ADAPTER_ROOTS_ENV}: an adapter root is empty")
        path = os.path.realpath(os.path.expanduser(root))
        if not os.path.isdir(path):
            raise ConfigError(
                f"{flag} / {ADAPTER_ROOTS_ENV}: adapter root {quoted(root, 256)} is not an "
                "existing directory; create it or name another"
            )
        if path not in out:
            out.append(path)
    return tuple(out)


def split_roots(text: str) -> tuple[str, ...]:
    """``PLORA_ADAPTER_ROOTS``'s value as a list of roots (``os.pathsep``-separated, empty
    items skipped)."""
    return tuple(part for part in text.split(os.pathsep) if part)


def _bases(roots: Sequence[str], tenant: str | None) -> list[str]:
    """The directories a source may lie under: the roots, or ``ROOT/<tenant>`` of each."""
    if tenant is None:
        return list(roots)
    if not tenant or tenant in (".", "..") or "/" in tenant or "\0" in tenant:
        return []  # no directory of its own: nothing is under it
    return [os.path.join(root, tenant) for root in roots]


def _base_of(real: str, bases: Sequence[str]) -> str | None:
    """The first of ``bases`` that ``real`` (symlink-free, absolute) lies strictly under."""
    for base in bases:
        if real.startswith(base.rstrip(os.sep) + os.sep):
            return base
    return None


def _open_under(path: str, roots: Sequence[str], tenant: str | None, directory: bool) -> int:
    """The descriptor of ``path``'s real file (a regular file, or a directory with
    ``directory``), opened race-free under a root (``ROOT/<tenant>`` with a tenant).

    Raises:
        SourceRefusedError: every failure, whatever its cause.
    """
    try:
        real = os.path.realpath(path, strict=True)
    except (OSError, ValueError, RuntimeError):
        raise SourceRefusedError() from None
    bases = _bases(roots, tenant)
    base = _base_of(real, bases)
    if base is None:
        raise SourceRefusedError()
    root = base if tenant is None else os.path.dirname(base)
    try:
        fd = _walk_from(root, real, _DIR_FLAGS if directory else _FILE_FLAGS)
    except (OSError, ValueError):
        raise SourceRefusedError() from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise SourceRefusedError() from None
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        os.close(fd)
        raise SourceRefusedError()
    if not directory:
        os.set_blocking(fd, True)
    return fd


def _walk_from(root: str, real: str, final_flags: int) -> int:
    """Open ``real`` (under ``root``) walking down from ``root`` one component at a time,
    never following a symlink; returns the descriptor opened with ``final_flags``.

    Raises:
        OSError: a component is missing, is a symlink (``ELOOP``), is not a directory, or may
            not be opened.
    """
    parts = Path(os.path.relpath(real, root)).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], final_flags, dir_fd=fd)
    finally:
        os.close(fd)


def open_confined(
    path: str | os.PathLike[str], roots: Sequence[str], tenant: str | None = None
) -> BinaryIO:
    """Open the file ``path`` for reading (binary) when its real path, every symlink followed,
    lies under one of ``roots`` (``ROOT/<tenant>/`` with ``tenant``); the open walks down from
    the root without following any symlink, so what is read is the file that was checked.

    Args:
        path: A file inside an adapter directory (it may itself be a symlink within the roots,
            as in a Hugging Face cache).
        roots: Resolved adapter roots (:func:`resolve_roots`).
        tenant: When given, the file must lie under ``ROOT/<tenant>/``.

    Raises:
        SourceRefusedError: outside the roots, missing, not a regular file, or unreadable.
    """
    fd = _open_under(os.fspath(path), roots, tenant, directory=False)
    return os.fdopen(fd, "rb")


def confine(
    source: str | os.PathLike[str], roots: Sequence[str], tenant: str | None = None
) -> Path:
    """The adapter directory ``source`` names, checked against the adapter roots.

    ``~`` is expanded and every symlink followed; the directory and each of
    :data:`ADAPTER_FILES` inside it must resolve under one root (``ROOT/<tenant>/`` when
    ``tenant`` is given), be a directory / regular files, and open for reading.

    Args:
        source: The directory as the caller gave it.
        roots: Resolved adapter roots (:func:`resolve_roots`); must not be empty.
        tenant: When given, the source and its files must lie under ``ROOT/<tenant>/`` (a
            tenant registers only from its own directory; an empty tenant has none).

    Returns:
        The directory's real path (absolute, no symlinks).

    Raises:
        SourceRefusedError: any check failed (always the same message).
    """
    try:
        text = os.fspath(source)
        real = os.path.realpath(os.path.expanduser(text), strict=True) if text else ""
    except (OSError, ValueError, RuntimeError, TypeError):
        raise SourceRefusedError() from None
    if not real:
        raise SourceRefusedError()
    os.close(_open_under(real, roots, tenant, directory=True))
    for name in ADAPTER_FILES:
        os.close(_open_under(os.path.join(real, name), roots, tenant, directory=False))
    return Path(real)


@dataclass(frozen=True)
class Confinement:
    """Where adapter files may be read from: the adapter roots and, for a tenant's
    registration, that tenant's directory under them. What
    :func:`~services.common.adapters.inspect_adapter` and
    :func:`~services.common.adapters.load_lora_weights` take (None there: no roots, read as
    given).

    Attributes:
        roots: Resolved adapter roots (:func:`resolve_roots`); empty with a tenant = nothing
            may be read.
        tenant: When set, sources and their files must lie under ``ROOT/<tenant>/``.
    """

    roots: tuple[str, ...]
    tenant: str | None = None

    def directory(self, source: str | os.PathLike[str]) -> Path:
        """:func:`confine` of ``source`` under this confinement.

        Raises:
            SourceRefusedError: as :func:`confine`.
        """
        return confine(source, self.roots, self.tenant)

    def open(self, path: str | os.PathLike[str]) -> BinaryIO:
        """:func:`open_confined` of ``path`` under this confinement.

        Raises:
            SourceRefusedError: as :func:`open_confined`.
        """
        return open_confined(path, self.roots, self.tenant)


def redact(message: str, *paths: str | os.PathLike[str]) -> str:
    """``message`` with each of ``paths`` (as given, and their real paths) replaced by
    ``<source>``: an error a worker returns to a client names no server path.

    Args:
        message: An error's text.
        paths: The source as registered, and any other path the message may hold.
    """
    forms: set[str] = set()
    for p in paths:
        text = os.fspath(p)
        if not text:
            continue
        forms.add(text.rstrip(os.sep))
        try:
            forms.add(os.path.realpath(os.path.expanduser(text)))
        except (OSError, ValueError):
            pass
    for form in sorted(
        (f for f in forms if len(f) > 1), key=len, reverse=True
    ):  # longest first: no partial leftovers
        message = message.replace(form, "<source>")
    return message
