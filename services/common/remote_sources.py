"""Adapter sources in object storage: ``s3://bucket/prefix/`` and ``hf://org/repo@revision``.

A remote source names a *directory* of objects holding ``adapter_config.json`` and
``adapter_model.safetensors`` (PEFT's layout), read through the store's own client library:

- ``s3://BUCKET/PREFIX/``: any S3-compatible store through boto3, with boto3's standard
  credential chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, a profile, a web
  identity token, an instance role) and ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for a
  store other than AWS (MinIO, Ceph, R2, ``rclone serve s3``). Object names are the prefix plus
  the file name.
- ``hf://ORG/REPO[@REVISION][/SUBFOLDER]``: a model repository on the Hugging Face Hub through
  huggingface_hub, which honours ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HOME`` /
  ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``. Online, reads are ranged HTTP reads
  (``HfFileSystem``); offline (``HF_HUB_OFFLINE=1``), the files are read from the local Hub
  cache, where ``huggingface-cli download`` (or any earlier download) put them. The revision
  is a branch, a tag or a commit (no ``/``); none = ``main``.

Which remote sources a server reads is the operator's choice (:class:`SourceAllowList`,
``--adapter-source-allow``): none by default. A source outside the list, malformed, or whose
objects are missing or unreadable is refused with one message, :data:`REMOTE_SOURCE_REFUSED`,
whatever the cause, so a client cannot probe which buckets or objects exist.

At registration the gateway reads only what it needs (:func:`inspect_remote_adapter`); a
worker downloads an adapter whole and verifies it (:func:`download_adapter`), into its
node-local cache (:mod:`services.worker.adapter_cache`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from services.common.errors import ConfigError, PLoRAError, quoted
from services.common.peft_config import CONFIG_NAME, InspectionLimits
from services.common.sources import SourceRefusedError

if TYPE_CHECKING:
    import torch

    from services.common.adapters import AdapterManifest
    from services.common.types import ModelSpec

#: The weights file of a PEFT adapter (as :data:`services.common.adapters.WEIGHTS_NAME`).
WEIGHTS_NAME = "adapter_model.safetensors"

#: Environment variable of the allowed remote source prefixes, comma-separated.
ADAPTER_SOURCE_ALLOW_ENV = "PLORA_ADAPTER_SOURCE_ALLOW"

S3_SCHEME = "s3"
HF_SCHEME = "hf"
SCHEMES = (S3_SCHEME, HF_SCHEME)

#: The one message of every refused remote source: the same whether the bucket, the
#: repository or the objects exist or not, and never naming what was asked for.
REMOTE_SOURCE_REFUSED = (
    "source is not an adapter location this server may read: register s3://BUCKET/PREFIX/ "
    "or hf://ORG/REPO[@REVISION][/SUBFOLDER] under a prefix the operator allows "
    "(--adapter-source-allow), holding adapter_config.json and adapter_model.safetensors"
)

#: Bytes read at a time when an object is streamed (hashed, downloaded).
CHUNK_BYTES = 1 << 20

# One path segment of a key prefix or subfolder: no empty, "." or ".." segment (a store
# backed by a filesystem could resolve it), no backslash, no control character.
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_.=+,@~-]+$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_HF_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class RemoteSourceRefusedError(SourceRefusedError):
    """A remote source this server may not read: outside ``--adapter-source-allow``,
    malformed, or its objects missing or unreadable (INVALID_ARGUMENT). Its message is always
    :data:`REMOTE_SOURCE_REFUSED`."""

    def __init__(self) -> None:
        PLoRAError.__init__(self, REMOTE_SOURCE_REFUSED)


class ObjectStoreError(PLoRAError):
    """The object store could not be reached or answered with an error other than a missing
    or forbidden object (UNAVAILABLE: try again later).

    Attributes:
        reason: A short label for metrics (``unreachable``, ``error``).
    """

    status_code_name = "UNAVAILABLE"

    def __init__(self, message: str, reason: str = "unreachable") -> None:
        super().__init__(message)
        self.reason = reason


class ObjectMissingError(Exception):
    """An object of a remote source is missing, or the credentials may not read it (kept
    internal: the gateway answers :class:`RemoteSourceRefusedError`, a worker a
    FAILED_PRECONDITION naming the adapter)."""


def is_remote(source: str) -> bool:
    """Whether ``source`` names a remote source (``s3://`` or ``hf://``) rather than a local
    directory."""
    return any(source.startswith(f"{scheme}://") for scheme in SCHEMES)


@dataclass(frozen=True)
class RemoteSource:
    """A parsed remote adapter source.

    Attributes:
        scheme: ``s3`` or ``hf``.
        location: The bucket (``s3``) or the repository id ``org/repo`` (``hf``).
        prefix: The key prefix (``s3``) or the subfolder (``hf``), ``/``-terminated, or empty.
        revision: The repository revision (``hf``; None = ``main``).
    """

    scheme: str
    location: str
    prefix: str = ""
    revision: str | None = None

    @property
    def url(self) -> str:
        """The canonical form registration records (``s3://b/p/``, ``hf://o/r@rev/sub/``)."""
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.scheme}://{self.location}{rev}/{self.prefix}"

    @property
    def path(self) -> str:
        """What the allow-list matches: the URL without the revision, ``/``-terminated."""
        return f"{self.scheme}://{self.location}/{self.prefix}"

    def key(self, name: str) -> str:
        """The object name of the adapter file ``name`` (a key, or a path in the repo)."""
        return f"{self.prefix}{name}"


def _segments_ok(text: str) -> bool:
    """Every ``/``-separated segment of ``text`` (no leading or doubled ``/``) is safe."""
    return all(_SEGMENT_RE.match(part) and part not in (".", "..") for part in text.split("/"))


def parse_remote(source: str) -> RemoteSource:
    """Parse an ``s3://`` or ``hf://`` source.

    Args:
        source: ``s3://BUCKET/PREFIX/`` (the prefix may be empty; a trailing ``/`` is added),
            or ``hf://ORG/REPO[@REVISION][/SUBFOLDER]``.

    Returns:
        The parsed source.

    Raises:
        RemoteSourceRefusedError: not one of those forms, or a name with an empty, ``.`` or
            ``..`` segment or a character outside letters, digits and ``_.=+,@~-``.
    """
    scheme, sep, rest = source.partition("://")
    if not sep or scheme not in SCHEMES or len(source) > 1024:
        raise RemoteSourceRefusedError()
    rest = rest.rstrip("/")
    if scheme == S3_SCHEME:
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET_RE.match(bucket) or (prefix and not _segments_ok(prefix)):
            raise RemoteSourceRefusedError()
        return RemoteSource(S3_SCHEME, bucket, f"{prefix}/" if prefix else "")
    parts = rest.split("/")
    if len(parts) < 2:
        raise RemoteSourceRefusedError()
    org, repo, sub = parts[0], parts[1], "/".join(parts[2:])
    repo, at, revision = repo.partition("@")
    if (
        not _HF_NAME_RE.match(org)
        or not _HF_NAME_RE.match(repo)
        or (at and not _REVISION_RE.match(revision))
        or (sub and not _segments_ok(sub))
    ):
        raise RemoteSourceRefusedError()
    return RemoteSource(HF_SCHEME, f"{org}/{repo}", f"{sub}/" if sub else "", revision or None)


def _allow_entry(text: str) -> str:
    """An allow-list entry as the prefix of :attr:`RemoteSource.path` it admits.

    Raises:
        ConfigError: not ``s3://BUCKET[/PREFIX]`` or ``hf://ORG[/REPO[/SUBFOLDER]]``.
    """
    entry = text.strip()
    scheme, sep, rest = entry.partition("://")
    rest = rest.strip("/")
    first = rest.split("/")[0]
    ok = (
        sep
        and scheme in SCHEMES
        and "@" not in rest
        and _segments_ok(rest)
        and (_BUCKET_RE.match(first) if scheme == S3_SCHEME else _HF_NAME_RE.match(first))
    )
    if not ok:
        raise ConfigError(
            f"--adapter-source-allow / {ADAPTER_SOURCE_ALLOW_ENV}: entry {quoted(entry)} is not "
            "s3://BUCKET[/PREFIX/] or hf://ORG[/REPO/]"
        )
    return f"{scheme}://{rest}/"


@dataclass(frozen=True)
class SourceAllowList:
    """The remote sources a server may read: prefixes of :attr:`RemoteSource.path`, each
    ending at a ``/`` (``s3://models`` admits ``s3://models/a/`` but not
    ``s3://models-private/``). Empty = every remote source refused.

    Attributes:
        prefixes: Normalized entries (``scheme://.../``).
    """

    prefixes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: Sequence[str]) -> SourceAllowList:
        """The list from flag or environment values, each possibly comma-separated.

        Raises:
            ConfigError: a malformed entry (naming it).
        """
        out: list[str] = []
        for value in entries:
            for part in value.split(","):
                if part.strip():
                    entry = _allow_entry(part)
                    if entry not in out:
                        out.append(entry)
        return cls(tuple(out))

    def check(self, source: str, tenant: str | None = None) -> RemoteSource:
        """The parsed ``source`` when an entry admits it (with ``tenant``: an entry followed
        by ``<tenant>/``, as a tenant's local sources lie under ``ROOT/<tenant>/``).

        Raises:
            RemoteSourceRefusedError: malformed, or no entry admits it (one message).
        """
        remote = parse_remote(source)
        if tenant is not None and (not tenant or not _segments_ok(tenant) or "/" in tenant):
            raise RemoteSourceRefusedError()
        for prefix in self.prefixes:
            if remote.path.startswith(prefix if tenant is None else f"{prefix}{tenant}/"):
                return remote
        raise RemoteSourceRefusedError()


# ----------------------------------------------------------------------------------------
# Readers


class ObjectReader(Protocol):
    """Reads the objects of one remote source by file name (``adapter_config.json``...)."""

    def size(self, name: str) -> int:
        """Bytes of the object.

        Raises:
            ObjectMissingError: missing or forbidden.
            ObjectStoreError: the store failed.
        """

    def read(self, name: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (one ranged read; fewer at the end).

        Raises:
            ObjectMissingError / ObjectStoreError: as :meth:`size`.
        """

    def chunks(self, name: str) -> Iterator[bytes]:
        """The whole object, streamed in pieces of at most :data:`CHUNK_BYTES`.

        Raises:
            ObjectMissingError / ObjectStoreError: as :meth:`size` (also mid-stream).
        """


_S3_MISSING = {"404", "403", "NoSuchKey", "NoSuchBucket", "AccessDenied", "NotFound"}


class S3Reader:
    """An :class:`ObjectReader` over an S3-compatible store (boto3; its standard credential
    chain and ``AWS_ENDPOINT_URL``).

    Args:
        remote: An ``s3://`` source.
        client: A boto3 S3 client; None = a new session's (credentials and endpoint read
            from the environment now).
    """

    def __init__(self, remote: RemoteSource, client: Any = None) -> None:
        import boto3  # noqa: PLC0415 - only servers with remote sources need it
        from botocore.config import Config  # noqa: PLC0415

        self.remote = remote
        # A session of its own: boto3's default session caches the credentials it found
        # first, and a session is not thread-safe.
        self.client = client or boto3.session.Session().client(
            "s3",
            config=Config(
                connect_timeout=10,
                read_timeout=60,
                retries={"max_attempts": 3, "mode": "standard"},
                # A store may send the whole object's CRC with a ranged GET, which botocore
                # would check against the range; the sha256 is what verifies the bytes.
                response_checksum_validation="when_required",
                request_checksum_calculation="when_required",
                s3={"addressing_style": os.environ.get("PLORA_S3_ADDRESSING_STYLE", "auto")},
            ),
        )

    def _call(self, fn: Callable[..., Any], name: str, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        try:
            return fn(Bucket=self.remote.location, Key=self.remote.key(name), **kw)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _S3_MISSING:
                raise ObjectMissingError(code) from None
            if code == "InvalidRange":
                return None
            raise ObjectStoreError(
                f"the object store answered {code or 'an error'}; check its health and the "
                "credentials (AWS_* variables, the plora-s3 Secret)",
                reason="error",
            ) from None
        except BotoCoreError as exc:
            raise ObjectStoreError(
                f"the object store could not be reached ({type(exc).__name__}); check "
                "AWS_ENDPOINT_URL and the network"
            ) from None

    def size(self, name: str) -> int:
        """See :meth:`ObjectReader.size`."""
        return int(self._call(self.client.head_object, name)["ContentLength"])

    def read(self, name: str, start: int, length: int) -> bytes:
        """See :meth:`ObjectReader.read` (one ``Range: bytes=start-end`` GET)."""
        if length <= 0:
            return b""
        resp = self._call(self.client.get_object, name, Range=f"bytes={start}-{start + length - 1}")
        if resp is None:
            return b""
        return bytes(self._body(resp["Body"].read))

    def chunks(self, name: str) -> Iterator[bytes]:
        """See :meth:`ObjectReader.chunks`."""
        resp = self._call(self.client.get_object, name)
        body = resp["Body"]
        try:
            while block := self._body(lambda: body.read(CHUNK_BYTES)):
                yield block
        finally:
            body.close()

    @staticmethod
    def _body(read: Callable[[], bytes]) -> bytes:
        from botocore.exceptions import BotoCoreError  # noqa: PLC0415

        try:
            return read()
        except (BotoCoreError, OSError) as exc:
            raise ObjectStoreError(
                f"the object store connection broke mid-read ({type(exc).__name__})"
            ) from None


class HubReader:
    """An :class:`ObjectReader` over a Hugging Face Hub repository (huggingface_hub:
    ``HF_ENDPOINT``, ``HF_TOKEN``, the cache and ``HF_HUB_OFFLINE`` honoured).

    Online, sizes come from the Hub's file metadata and reads are ranged (``HfFileSystem``);
    offline, the files are read from the local Hub cache (``try_to_load_from_cache``), and
    one not there is missing.
    """

    def __init__(self, remote: RemoteSource) -> None:
        from huggingface_hub import constants  # noqa: PLC0415

        self.remote = remote
        self.offline = bool(constants.HF_HUB_OFFLINE)
        self._fs: Any = None

    def _cached(self, name: str) -> str:
        from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415

        try:
            path = try_to_load_from_cache(
                self.remote.location, self.remote.key(name), revision=self.remote.revision
            )
        except (ValueError, OSError):
            path = None
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ObjectMissingError(name)
        return path

    def _hub_path(self, name: str) -> str:
        rev = f"@{self.remote.revision}" if self.remote.revision else ""
        return f"{self.remote.location}{rev}/{self.remote.key(name)}"

    def _open(self, name: str) -> BinaryIO:
        if self.offline:
            return open(self._cached(name), "rb")  # noqa: SIM115 - the caller closes it
        if self._fs is None:
            from huggingface_hub import HfFileSystem  # noqa: PLC0415

            self._fs = HfFileSystem()
        with _hub_errors(name):
            return self._fs.open(self._hub_path(name), "rb")

    def size(self, name: str) -> int:
        """See :meth:`ObjectReader.size`."""
        with _hub_errors(name), self._open(name) as f:
            return int(f.seek(0, os.SEEK_END))

    def read(self, name: str, start: int, length: int) -> bytes:
        """See :meth:`ObjectReader.read`."""
        with _hub_errors(name), self._open(name) as f:
            f.seek(start)
            return f.read(max(0, length))

    def chunks(self, name: str) -> Iterator[bytes]:
        """See :meth:`ObjectReader.chunks`."""
        with _hub_errors(name), self._open(name) as f:
            while block := f.read(CHUNK_BYTES):
                yield block


@contextlib.contextmanager
def _hub_errors(name: str) -> Iterator[None]:
    """huggingface_hub's errors as :class:`ObjectMissingError` (no such repository, revision
    or file; gated or forbidden) or :class:`ObjectStoreError` (anything else)."""
    from huggingface_hub import errors  # noqa: PLC0415

    try:
        yield
    except (ObjectMissingError, ObjectStoreError):
        raise
    except (
        FileNotFoundError,
        errors.RepositoryNotFoundError,
        errors.RevisionNotFoundError,
        errors.EntryNotFoundError,
        errors.GatedRepoError,
        errors.DisabledRepoError,
    ):
        raise ObjectMissingError(name) from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403, 404):
            raise ObjectMissingError(name) from None
        raise ObjectStoreError(
            f"the Hugging Face Hub answered {status or 'an error'}; check HF_ENDPOINT and HF_TOKEN",
            reason="error",
        ) from None
    except OSError as exc:
        raise ObjectStoreError(
            f"the Hugging Face Hub could not be read ({type(exc).__name__}); check "
            "HF_ENDPOINT and the network"
        ) from None


def open_reader(remote: RemoteSource) -> ObjectReader:
    """The reader of ``remote``'s store (:class:`S3Reader` or :class:`HubReader`)."""
    return S3Reader(remote) if remote.scheme == S3_SCHEME else HubReader(remote)


# ----------------------------------------------------------------------------------------
# Registration and download


def _config_bytes(reader: ObjectReader, limits: InspectionLimits) -> bytes:
    """``adapter_config.json``, its size checked before it is read."""
    from services.common.errors import InvalidAdapterError  # noqa: PLC0415

    size = reader.size(CONFIG_NAME)
    if size > limits.max_config_bytes:
        raise InvalidAdapterError(
            f"{CONFIG_NAME} is {size} bytes; at most {limits.max_config_bytes} are accepted "
            "(--max-adapter-config-bytes / PLORA_MAX_ADAPTER_CONFIG_BYTES; PEFT writes about "
            "1 KiB)"
        )
    return reader.read(CONFIG_NAME, 0, size)


def _copy(reader: ObjectReader, name: str, size: int, out: BinaryIO) -> str:
    """Stream object ``name`` into ``out``; its hex sha256.

    Raises:
        ObjectStoreError: the object is not ``size`` bytes (changed or cut off mid-read).
    """
    h = hashlib.sha256()
    got = 0
    for block in reader.chunks(name):
        got += len(block)
        if got > size:
            break
        h.update(block)
        out.write(block)
    if got != size:
        raise ObjectStoreError(
            f"{name} arrived with {got} bytes where the store announced {size} (it changed or "
            "the transfer was cut off)",
            reason="truncated",
        )
    return h.hexdigest()


def inspect_remote_adapter(
    remote: RemoteSource,
    spec: ModelSpec,
    dtype: torch.dtype | None = None,
    *,
    limits: InspectionLimits,
    max_bytes: int | None = None,
    reader: ObjectReader | None = None,
    scratch_dir: str | None = None,
) -> AdapterManifest:
    """Validate a remote adapter as :func:`~services.common.adapters.inspect_adapter` does a
    directory, reading only what each step needs.

    In order: the config's size (HEAD), the config (bounded, rank-capped), the weights'
    size, their first 8 bytes (one ranged GET: the header length, bounded), the header (one
    ranged GET), the module plan and the pool fit (``max_bytes``). Only then is the weights
    object streamed once, hashed (ETag is not a checksum: a multipart ETag is no digest of the
    bytes, and a store may compute it any way it likes) and written to a temporary file in
    ``scratch_dir`` whose tensors are scanned for NaN/Inf and overflow, then deleted. Cost:
    one full transfer of the weights and as much scratch disk, per registration.

    Args:
        remote: The source (already admitted by the allow-list).
        spec: Served base model.
        dtype: Serving dtype (None = float32).
        limits: Bounds on the config, the header and the rank.
        max_bytes: Largest ``size_bytes`` any pool could hold; None = no check.
        reader: The store's reader; None = :func:`open_reader`.
        scratch_dir: Where the temporary copy goes (None = the system's temporary directory).

    Returns:
        The manifest (``sha256`` as :func:`~services.common.adapters.adapter_sha256`).

    Raises:
        RemoteSourceRefusedError: an object is missing or forbidden (one message).
        ObjectStoreError: the store failed (UNAVAILABLE).
        InvalidAdapterError / IncompatibleAdapterError / PoolExhaustedError: as
            :func:`~services.common.adapters.inspect_adapter`.
    """
    import torch  # noqa: PLC0415 - the allow-list alone (configs) needs no torch

    from services.common.adapters import (  # noqa: PLC0415
        adapter_sha256,
        check_pool_fit,
        header_length,
        manifest_of,
        parse_config_bytes,
        parse_safetensors_header,
        plan_modules,
        scan_weights,
    )

    dtype = dtype or torch.float32
    reader = reader or open_reader(remote)
    where = remote.url + WEIGHTS_NAME
    try:
        config = _config_bytes(reader, limits)
        cfg = parse_config_bytes(config, limits)
        size = reader.size(WEIGHTS_NAME)
        head = reader.read(WEIGHTS_NAME, 0, 8)
        n = header_length(head, size, where, limits)
        header = parse_safetensors_header(
            head + reader.read(WEIGHTS_NAME, 8, n), size, where, limits
        )
        plans = plan_modules(cfg, header, spec, remote.url)
        check_pool_fit(plans, dtype, max_bytes)
        with tempfile.NamedTemporaryFile(dir=scratch_dir, suffix=".safetensors") as tmp:
            weights_sha = _copy(reader, WEIGHTS_NAME, size, tmp)  # type: ignore[arg-type]
            tmp.flush()
            scan_weights(tmp.name, plans, dtype, remote.url)
    except ObjectMissingError:
        raise RemoteSourceRefusedError() from None
    sha = adapter_sha256(hashlib.sha256(config).hexdigest(), weights_sha)
    return manifest_of(cfg, plans, sha, dtype, spec.projections)


def remote_size(reader: ObjectReader) -> int:
    """Bytes of both adapter files of a remote source (two HEADs).

    Raises:
        ObjectMissingError / ObjectStoreError: as :meth:`ObjectReader.size`.
    """
    return reader.size(CONFIG_NAME) + reader.size(WEIGHTS_NAME)


def download_adapter(
    reader: ObjectReader,
    dest: Path,
    expected_sha256: str,
    limits: InspectionLimits,
    on_bytes: Callable[[int], None] | None = None,
) -> int:
    """Download both adapter files into the directory ``dest`` and verify them against the
    registered digest; bounds are checked before the big transfer (the config's size, the
    header length on the first 8 bytes).

    Args:
        reader: The source's reader.
        dest: An empty directory (the caller's temporary name; it renames it when this
            returns, and deletes it when this raises).
        expected_sha256: :func:`~services.common.adapters.adapter_sha256` recorded at
            registration.
        limits: Bounds on the config and the header.
        on_bytes: Called with the size of each piece written (metrics).

    Returns:
        Bytes written.

    Raises:
        ObjectMissingError: an object is gone.
        ObjectStoreError: the store failed, or an object arrived short (``reason``
            ``truncated``).
        InvalidAdapterError: beyond ``limits``.
        ChecksumMismatchError: the bytes are not the registered ones.
    """
    from services.common.adapters import adapter_sha256, header_length  # noqa: PLC0415

    config = _config_bytes(reader, limits)
    (dest / CONFIG_NAME).write_bytes(config)
    size = reader.size(WEIGHTS_NAME)
    header_length(reader.read(WEIGHTS_NAME, 0, 8), size, WEIGHTS_NAME, limits)

    class _Counting:
        def __init__(self, f: BinaryIO) -> None:
            self.f = f

        def write(self, block: bytes) -> int:
            if on_bytes is not None:
                on_bytes(len(block))
            return self.f.write(block)

    with open(dest / WEIGHTS_NAME, "wb") as f:
        weights_sha = _copy(reader, WEIGHTS_NAME, size, _Counting(f))  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    if on_bytes is not None:
        on_bytes(len(config))
    sha = adapter_sha256(hashlib.sha256(config).hexdigest(), weights_sha)
    if sha != expected_sha256:
        raise ChecksumMismatchError(
            f"the objects' sha256 {sha[:12]}... is not the registered {expected_sha256[:12]}... "
            "(they changed since registration)"
        )
    return len(config) + size


class ChecksumMismatchError(Exception):
    """Downloaded adapter bytes differ from the registered digest."""
