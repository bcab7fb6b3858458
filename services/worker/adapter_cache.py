"""The worker's node-local disk cache of adapters downloaded from object storage.

Below the host and device tiers of the store: a remote adapter
(:mod:`services.common.remote_sources`) is downloaded here once, verified against the
sha256 recorded at registration, and the store's loader reads it from here as it reads a local
directory.

- An entry is a directory named by the adapter's registered sha256 (content-addressed: two
  ids or versions with the same bytes share it), holding ``adapter_config.json`` and
  ``adapter_model.safetensors``.
- A download goes to a temporary directory (``.tmp-*``), is verified, and only then renamed
  to its entry: a failed, partial or tampered download never becomes an entry, and leftovers
  of a crash are removed at start.
- The cache is bounded in bytes (``--adapter-cache-bytes``); least recently used entries
  leave first, never one a load is reading (pinned).
- Concurrent demand for one entry shares one download: the first caller downloads, the others
  wait for it and get its entry or its error.
- The directory is locked (``flock``) by its worker: two workers never share one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from services.common.adapters import CONFIG_NAME, WEIGHTS_NAME, InspectionLimits
from services.common.errors import AdapterSourceError, ConfigError, InvalidAdapterError
from services.common.remote_sources import (
    ChecksumMismatchError,
    ObjectMissingError,
    ObjectReader,
    ObjectStoreError,
    RemoteSource,
    download_adapter,
    open_reader,
    remote_size,
)

logger = logging.getLogger(__name__)

_ENTRY_RE = re.compile(r"^[0-9a-f]{64}$")
_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".lock"


class DownloadError(AdapterSourceError):
    """A remote adapter could not be made a verified cache entry (FAILED_PRECONDITION); the
    message says why, without naming the adapter (the caller does)."""


class CacheMetrics:
    """What the cache reports, as callbacks (the worker wires them to Prometheus).

    Attributes:
        on_hit: An entry was on disk.
        on_miss: An entry was not (the caller downloads it or waits for a download).
        on_bytes: Bytes written by a download.
        on_download: A download finished and was verified (its seconds).
        on_failure: A download failed (its reason: ``missing``, ``checksum``, ``too_large``,
            ``invalid``, ``unreachable``, ``truncated``, ``error``).
        on_size: The bytes the cache holds now.
        on_evict: An entry was removed to make room.
    """

    def __init__(self) -> None:
        noop = lambda *_: None  # noqa: E731
        self.on_hit: Callable[[], None] = noop
        self.on_miss: Callable[[], None] = noop
        self.on_bytes: Callable[[int], None] = noop
        self.on_download: Callable[[float], None] = noop
        self.on_failure: Callable[[str], None] = noop
        self.on_size: Callable[[int], None] = noop
        self.on_evict: Callable[[], None] = noop


@dataclass
class _Entry:
    path: Path
    size: int
    pins: int = 0


@dataclass
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class AdapterCache:
    """A bounded, least-recently-used disk cache of verified remote adapters.

    Args:
        directory: The cache directory (created; locked for this process).
        max_bytes: Most bytes of entries kept (both files of each).
        limits: Bounds a download checks before the big transfer (config size, header
            length).
        metrics: Callbacks; None = none.
        reader_factory: Makes the reader of a source (tests may pass one with a different
            client); None = :func:`~services.common.remote_sources.open_reader`.

    Raises:
        ConfigError: ``max_bytes`` below 1, the directory cannot be created, or another
            process holds it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        limits: InspectionLimits,
        metrics: CacheMetrics | None = None,
        reader_factory: Callable[[RemoteSource], ObjectReader] | None = None,
    ) -> None:
        if max_bytes < 1:
            raise ConfigError(f"--adapter-cache-bytes must be >= 1, got {max_bytes}")
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        self.limits = limits
        self.metrics = metrics or CacheMetrics()
        self._reader = reader_factory or open_reader
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._flights: dict[str, _Flight] = {}
        self._bytes = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.directory / _LOCK_NAME, "a")  # noqa: SIM115
        except OSError as exc:
            raise ConfigError(
                f"--adapter-cache-dir / PLORA_ADAPTER_CACHE_DIR {str(self.directory)!r} cannot "
                f"be used: {exc.strerror}"
            ) from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ConfigError(
                f"--adapter-cache-dir / PLORA_ADAPTER_CACHE_DIR {str(self.directory)!r} is in "
                "use by another worker; give each worker its own directory"
            ) from None
        self._scan()

    def close(self) -> None:
        """Release the directory's lock (the entries stay for the next start)."""
        with contextlib.suppress(OSError, ValueError):
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def _scan(self) -> None:
        """Adopt the complete entries on disk (oldest use first) and delete the leftovers of
        interrupted downloads; anything else in the directory is left alone."""
        found: list[tuple[float, str, _Entry]] = []
        for child in self.directory.iterdir():
            name = child.name
            if name.startswith(_TMP_PREFIX):  # a download cut short by a crash
                _remove(child)
                continue
            if not _ENTRY_RE.match(name) or child.is_symlink():
                continue  # not the cache's: left alone
            files = [child / CONFIG_NAME, child / WEIGHTS_NAME]
            if child.is_dir() and all(f.is_file() and not f.is_symlink() for f in files):
                size = sum(f.stat().st_size for f in files)
                found.append((child.stat().st_mtime, name, _Entry(child, size)))
            else:  # an entry's name but not an entry's content
                _remove(child)
        for _, name, entry in sorted(found, key=lambda t: t[0]):
            self._entries[name] = entry
            self._bytes += entry.size
        self._trim()
        self.metrics.on_size(self._bytes)

    @property
    def size_bytes(self) -> int:
        """Bytes of the entries held now."""
        with self._lock:
            return self._bytes

    def entries(self) -> list[str]:
        """The digests of the entries, least recently used first."""
        with self._lock:
            return list(self._entries)

    @contextlib.contextmanager
    def pinned(self, remote: RemoteSource, sha256: str) -> Iterator[Path]:
        """The verified entry of ``remote`` (downloaded first when absent), kept on disk until
        the ``with`` ends.

        Args:
            remote: The registered source.
            sha256: Its registered digest (names the entry; the download must match it).

        Yields:
            The entry's directory.

        Raises:
            DownloadError: the objects are gone, changed since registration (the
                registered sha256 does not match), beyond the bounds, larger than the whole
                cache, or the store failed (FAILED_PRECONDITION for the request; the reason
                is counted). Nothing is cached then.
        """
        if not _ENTRY_RE.match(sha256):
            raise DownloadError(
                "the registered record has no sha256 to verify a download against; register "
                "the adapter again"
            )
        entry = self._acquire(remote, sha256)
        try:
            yield entry.path
        finally:
            with self._lock:
                entry.pins -= 1
                self._trim()

    def _acquire(self, remote: RemoteSource, sha256: str) -> _Entry:
        """Pin the entry, downloading it (or waiting for the download in flight)."""
        counted = False
        while True:
            with self._lock:
                entry = self._entries.get(sha256)
                if entry is not None:
                    entry.pins += 1
                    self._entries.move_to_end(sha256)
                    with contextlib.suppress(OSError):
                        os.utime(entry.path)  # the order of use survives a restart
                    if not counted:
                        self.metrics.on_hit()
                    return entry
                if not counted:
                    self.metrics.on_miss()
                    counted = True
                flight = self._flights.get(sha256)
                leader = flight is None
                if flight is None:
                    flight = self._flights[sha256] = _Flight()
            if not leader:
                flight.done.wait()
                if flight.error is not None:
                    raise DownloadError(str(flight.error)) from flight.error
                continue  # the entry is there now (or was evicted at once: download again)
            try:
                entry = self._download(remote, sha256)
            except BaseException as exc:
                flight.error = exc
                raise
            finally:
                with self._lock:
                    del self._flights[sha256]
                flight.done.set()
            return entry

    def _download(self, remote: RemoteSource, sha256: str) -> _Entry:
        """Download, verify and rename into place; the new entry is returned pinned.

        Raises:
            AdapterSourceError: as :meth:`pinned` (the temporary directory is removed).
        """
        tmp = self.directory / f"{_TMP_PREFIX}{sha256[:16]}-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        reason = "error"
        try:
            tmp.mkdir()
            reader = self._reader(remote)
            total = remote_size(reader)
            if total > self.max_bytes:
                reason = "too_large"
                raise DownloadError(
                    f"its objects hold {total} bytes, more than this worker's whole adapter "
                    f"cache ({self.max_bytes} bytes, --adapter-cache-bytes); raise it"
                )
            size = download_adapter(reader, tmp, sha256, self.limits, self.metrics.on_bytes)
        except DownloadError:
            _remove(tmp)
            self.metrics.on_failure(reason)
            raise
        except ObjectMissingError:
            _remove(tmp)
            self.metrics.on_failure("missing")
            raise DownloadError(
                "its objects are gone from the store or no longer readable with this worker's "
                "credentials; restore them or register it again"
            ) from None
        except ChecksumMismatchError as exc:
            _remove(tmp)
            self.metrics.on_failure("checksum")
            raise DownloadError(
                f"{exc}; the download was discarded: restore the objects or register the "
                "adapter again"
            ) from None
        except ObjectStoreError as exc:
            _remove(tmp)
            self.metrics.on_failure(exc.reason)
            raise DownloadError(f"its download failed: {exc}") from None
        except InvalidAdapterError as exc:
            _remove(tmp)
            self.metrics.on_failure("invalid")
            raise DownloadError(f"its objects are no longer valid: {exc}") from None
        except BaseException:
            _remove(tmp)
            self.metrics.on_failure("error")
            raise
        final = self.directory / sha256
        with self._lock:
            _remove(final)  # no entry of that name is known: a leftover
            os.rename(tmp, final)
            entry = _Entry(final, size, pins=1)
            self._entries[sha256] = entry
            self._bytes += size
            self._trim()
            self.metrics.on_size(self._bytes)
        self.metrics.on_download(time.monotonic() - started)
        logger.info(
            "downloaded %s (%d bytes) into the adapter cache in %.2f s",
            remote.url,
            size,
            time.monotonic() - started,
        )
        return entry

    def _trim(self) -> None:
        """Remove least recently used unpinned entries while over the bound (lock held)."""
        if self._bytes <= self.max_bytes:
            return
        for name in list(self._entries):
            if self._bytes <= self.max_bytes:
                break
            entry = self._entries[name]
            if entry.pins:
                continue
            del self._entries[name]
            self._bytes -= entry.size
            _remove(entry.path)
            self.metrics.on_evict()
        self.metrics.on_size(self._bytes)


def _remove(path: Path) -> None:
    """Delete a file or a directory tree, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
