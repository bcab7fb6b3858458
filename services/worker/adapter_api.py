"""The contract between the continuous-batching engine and the adapter store.

The engine never loads files itself: for each request naming an adapter it asks an
:class:`AdapterProvider` for a lease, keeps the request waiting (while other requests keep
running) until the lease is ready, computes from the lease's weights (views into the device
pool, never a per-request copy), and releases the lease when the request finishes or is
cancelled. While a lease is held the adapter is never evicted or moved; compaction takes
``compute_guard()`` exclusively so no forward step reads memory being moved.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from services.common.types import LoRAModuleWeights


@dataclass(frozen=True)
class AdapterRef:
    """What a worker needs to load one adapter version.

    Attributes:
        adapter_id: Registry id.
        version: Registry version; a lease for version v never serves bytes of another version.
        source: Directory in PEFT layout.
        size_bytes: Bytes in the serving dtype (from the registry), for admission checks.
        sha256: :func:`~services.common.adapters.adapter_sha256` of the config and the
            weights at registration.
    """

    adapter_id: str
    version: int
    source: str
    size_bytes: int = 0
    sha256: str = ""

    @classmethod
    def of(cls, info: AdapterFields) -> AdapterRef:
        """The ref of a registry ``AdapterRecord`` or a ``plora.v1.AdapterInfo`` (both carry
        these field names)."""
        return cls(
            adapter_id=info.adapter_id,
            version=int(info.version),
            source=info.source,
            size_bytes=int(info.size_bytes),
            sha256=info.sha256,
        )


class AdapterFields(Protocol):
    """What :meth:`AdapterRef.of` reads: a registry record or a ``plora.v1.AdapterInfo``."""

    @property
    def adapter_id(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def source(self) -> str: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def sha256(self) -> str: ...


class AdapterLease(Protocol):
    """A reference-counted claim on one resident (or loading) adapter."""

    @property
    def ref(self) -> AdapterRef: ...

    def ready(self) -> bool:
        """True once the weights are resident in the device pool (or the load failed)."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ready or ``timeout`` seconds pass; returns :meth:`ready`."""
        ...

    def error(self) -> Exception | None:
        """The domain error of a failed load (then :meth:`weights` raises it)."""
        ...

    def weights(self) -> dict[tuple[int, str], LoRAModuleWeights]:
        """``(layer, projection) -> weights``; tensors are views of device-pool memory.

        Valid only while the lease is held and inside ``compute_guard()``: compaction may
        re-point them between steps, so the engine re-reads them every step.
        """
        ...

    @property
    def cold(self) -> bool:
        """True when the adapter was not resident when the lease was taken (a cold start)."""
        ...

    @property
    def wait_seconds(self) -> float:
        """Seconds from lease creation until ready (0 for a warm lease)."""
        ...

    def release(self) -> None:
        """Drop the claim (idempotent); the adapter becomes evictable when no lease is held."""
        ...


class AdapterProvider(Protocol):
    """The worker's adapter store as the engine sees it."""

    def acquire(self, ref: AdapterRef) -> AdapterLease:
        """Take a lease on ``ref``, starting a high-priority load if it is not resident.

        Never blocks on I/O. Raises the domain errors of ``services.common.errors`` for an
        adapter that can never be served (``PoolExhaustedError`` when it is bigger than the
        pool, ``InvalidAdapterError``/``IncompatibleAdapterError`` for bad files).
        """
        ...

    def compute_guard(self) -> contextlib.AbstractContextManager[None]:
        """Held by the engine around each forward step; compaction holds it exclusively."""
        ...


@contextlib.contextmanager
def no_guard() -> Iterator[None]:
    """A guard that guards nothing: for providers whose memory never moves."""
    yield


class _ResidentLease:
    """A lease on an adapter that is always resident: ready at once, never cold."""

    def __init__(self, ref: AdapterRef, modules: Mapping[tuple[int, str], LoRAModuleWeights]):
        self._ref, self._modules = ref, dict(modules)

    @property
    def ref(self) -> AdapterRef:
        return self._ref

    def ready(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def error(self) -> Exception | None:
        return None

    def weights(self) -> dict[tuple[int, str], LoRAModuleWeights]:
        return self._modules

    @property
    def cold(self) -> bool:
        return False

    @property
    def wait_seconds(self) -> float:
        return 0.0

    def release(self) -> None:
        return None


class ResidentAdapters:
    """An :class:`AdapterProvider` whose adapters are all resident in memory, never paged.

    For measuring and checking compute alone (``plora bench engine``, exactness tests): every
    lease is warm, nothing is loaded or evicted, and forward steps are serialised by one lock.

    Args:
        adapters: ``adapter_id -> ((layer, projection) -> LoRAModuleWeights)``.

    Raises:
        KeyError: from :meth:`acquire`, for an adapter id not given here.
    """

    def __init__(self, adapters: Mapping[str, Mapping[tuple[int, str], LoRAModuleWeights]]):
        self.adapters = dict(adapters)
        self._lock = threading.Lock()

    def acquire(self, ref: AdapterRef) -> AdapterLease:
        """A ready lease on ``ref`` (its version is not checked)."""
        return _ResidentLease(ref, self.adapters[ref.adapter_id])

    @contextlib.contextmanager
    def compute_guard(self) -> Iterator[None]:
        """Held around each forward step."""
        with self._lock:
            yield
