"""The adapter store's background work: the loader threads (source or host read, room in the
pool by :class:`~services.worker.room.RoomSearch`, copy in), the host-staging thread, and the
bookkeeping of failed source reads. :class:`StoreLoading` is a part of
:class:`~services.worker.store.AdapterStore`; its methods run on the store's own state, under
its lock where they say so."""

from __future__ import annotations

import contextlib
import heapq
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from services.common.errors import (
    AdapterNotFoundError,
    InvalidAdapterError,
    PLoRAError,
    PoolExhaustedError,
    RequestCancelledError,
)
from services.common.lifecycle import lower_thread_priority
from services.common.sources import redact
from services.worker.adapter_api import AdapterRef
from services.worker.packing import PackedAdapter, pack_weights, slot_pieces
from services.worker.pool import Allocation
from services.worker.room import RoomAction, RoomSearch
from services.worker.store_types import (
    _NO_WAITER,
    SOURCE_RETRY_S,
    StoreEvent,
    _Detached,
    _Entry,
    _NoRoom,
    _PrefetchIgnored,
    _State,
    demand_queued,
)

if TYPE_CHECKING:
    from services.worker.store import AdapterStore

logger = logging.getLogger("services.worker.store")


class StoreLoading:
    """The loader threads, host staging and source-failure bookkeeping of the adapter store
    (see :mod:`services.worker.store` for the rules they keep)."""

    def _demand_queued(self: AdapterStore) -> bool:
        """Whether a demand load waits for a loader thread (lock held; :func:`demand_queued`)."""
        return demand_queued(self._jobs)

    def _stage_needed(self: AdapterStore, ref: AdapterRef, room: int) -> bool:
        """Whether a staging read of ``ref`` is wanted and fits ``room`` host bytes: not
        cached (this version), not resident or loading on the device (that load reads it
        itself), and of known size (lock held)."""
        return (
            ref.adapter_id not in self._entries
            and not self._host.holds(ref.adapter_id, ref.version)
            and 0 < ref.size_bytes <= room
        )

    def _stage_one(self: AdapterStore, ref: AdapterRef) -> None:
        """One staging read (the staging thread, no lock held): source -> host cache."""
        try:
            with self._lock:
                skip = (
                    self._closed
                    or self._latest.get(ref.adapter_id) != ref.version  # unloaded, superseded
                    # cached, or on the device, or the space went to loads since it was queued
                    or not self._stage_needed(ref, self._host.free_bytes)
                )
            if skip:
                return
            t0 = time.monotonic()
            packed, tier, _ = self._host_copy(ref)
            if tier == "source":
                seconds = time.monotonic() - t0
                with self._lock:
                    self._c.stages += 1
                    self._c.stage_seconds += seconds
                    self._emit(
                        StoreEvent(
                            "host_stage",
                            ref.adapter_id,
                            ref.version,
                            seconds=seconds,
                            nbytes=packed.nbytes,
                        )
                    )
        except Exception as err:  # noqa: BLE001 - the demand load reports it to the request
            with self._lock:
                self._source_failed(ref, err, "host staging")
                self._emit(StoreEvent("host_stage_failed", ref.adapter_id, ref.version))
        finally:
            with self._cv:
                self._staging_current = None
                self._cv.notify_all()

    def _source_broken(self: AdapterStore, ref: AdapterRef, now: float) -> bool:
        """Whether background reads (staging, prefetch) skip ``ref``: its source read failed
        less than :data:`SOURCE_RETRY_S` ago (lock held)."""
        failed = self._failed_source.get(ref.adapter_id)
        return failed is not None and failed[0] == ref.version and now < failed[1]

    def _source_failed(self: AdapterStore, ref: AdapterRef, err: BaseException, what: str) -> None:
        """Note a failed source read of ``ref`` (lock held): background reads skip it for
        :data:`SOURCE_RETRY_S`; logged as a warning the first time for this version, at DEBUG
        after, so a broken adapter does not fill the log every pass and every prefetch tick)."""
        again = self._failed_source.get(ref.adapter_id, (0, 0.0))[0] == ref.version
        self._failed_source[ref.adapter_id] = (ref.version, time.monotonic() + SOURCE_RETRY_S)
        log = logger.debug if again else logger.warning
        if isinstance(err, PLoRAError):
            log(
                "%s of %s v%d failed (not read in the background again for %.0f s): %s",
                what, ref.adapter_id, ref.version, SOURCE_RETRY_S, err,
            )  # fmt: skip
        else:
            log("%s of %s v%d failed", what, ref.adapter_id, ref.version, exc_info=err)

    def _stager(self: AdapterStore) -> None:
        """The host-staging thread: one read at a time, only while no demand load is queued
        for a loader thread (:meth:`_demand_queued`; a queued prefetch does not hold it back:
        both are speculative, and a staging read is what makes an adapter's first request a
        host copy). Its own thread, so a staging read (as slow as any source read: seconds
        from remote storage) never holds a loader thread.
        Staging is speculative, so the thread runs at background priority: on a CPU host it
        must not take cores from the decode steps (demand loads read the source themselves)."""
        torch.set_num_threads(1)
        lower_thread_priority()
        while True:
            with self._cv:
                while not self._closed and (self._demand_queued() or not self._staging):
                    self._cv.wait()
                if self._closed:
                    return
                ref = self._staging_current = self._staging.popleft()
            self._stage_one(ref)

    def _worker(self: AdapterStore) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Background loads must not take the cores from the decode step: on CPU each loader
        # thread runs its tensor work on one intra-op thread (the setting is per thread).
        torch.set_num_threads(1)
        while True:
            with self._cv:
                while True:
                    timeout = self._expire_parked()
                    if self._closed or self._jobs:
                        break
                    self._cv.wait(timeout)
                if self._closed:
                    return
                _, _, _, e = heapq.heappop(self._jobs)
                if self._staging and not self._demand_queued():
                    self._cv.notify_all()  # the stager waits while a demand load is queued
                if e.detached or e.state is not _State.LOADING or e.job_started:
                    continue
                e.job_started = True
                self._loads_running += 1
            try:
                self._load(e, stream)
            except (_PrefetchIgnored, _Detached, _NoRoom):
                pass
            except PLoRAError as err:
                with self._lock:
                    if isinstance(err, PoolExhaustedError):
                        logger.warning(
                            "load of %s v%d failed: %s", e.ref.adapter_id, e.ref.version, err
                        )
                    else:  # the source: its files, their values, their shapes
                        self._source_failed(e.ref, err, "load")
                    self._fail(e, err)
            except Exception as err:
                with self._lock:
                    self._source_failed(e.ref, err, "load")
                    reason = redact(str(err), e.ref.source)
                    self._fail(
                        e, PLoRAError(f"loading adapter {e.ref.adapter_id!r} failed: {reason}")
                    )
            finally:
                with self._cv:
                    self._loads_running -= 1
                    self._cv.notify_all()

    def _host_copy(self: AdapterStore, ref: AdapterRef) -> tuple[PackedAdapter, str, float]:
        with self._lock:
            cached = self._host.get(ref.adapter_id, ref.version)
        if cached is not None:
            return cached, "host", 0.0
        t0 = time.monotonic()
        try:
            weights = self._loader(ref)
        except PLoRAError:
            raise
        except FileNotFoundError as err:
            logger.warning("adapter %s source %r: %s", ref.adapter_id, ref.source, err)
            raise AdapterNotFoundError(  # no server path to the client: the log has it
                f"adapter {ref.adapter_id!r} v{ref.version}: its source files are missing; "
                "restore them or register it again"
            ) from err
        if ref.sha256 and weights.sha256 and ref.sha256 != weights.sha256:
            raise InvalidAdapterError(
                f"adapter {ref.adapter_id!r} version {ref.version}: files changed since "
                f"registration (sha256 {weights.sha256[:12]} != {ref.sha256[:12]}); re-register it"
            )
        packed = pack_weights(weights, self.config.torch_dtype, self._host_device, self._pin)
        packed = PackedAdapter(
            ref.adapter_id, ref.version, packed.flat, packed.slots, packed.sha256
        )
        with self._lock:
            if self._latest.get(ref.adapter_id) == ref.version:
                self._host.put(packed)
        return packed, "source", time.monotonic() - t0

    def _load(self: AdapterStore, e: _Entry, stream: torch.cuda.Stream | None) -> None:
        ref = e.ref
        if e.packed is None:
            packed, tier, read_s = self._host_copy(ref)
        else:  # a parked load retried: its bytes are already in host memory
            packed, tier, read_s = e.packed, e.tier, e.read_s
        with self._lock:
            if e.yielding and not e.demanded:  # a demand load wants this thread
                self._drop_prefetch(e)
                self._c.prefetch_cancelled += 1
                raise _PrefetchIgnored()
        if packed.nbytes > self._pool.capacity_bytes:
            raise PoolExhaustedError(
                f"adapter {ref.adapter_id!r} holds {packed.nbytes} bytes but the device pool "
                f"holds {self._pool.capacity_bytes}; use a smaller rank or a bigger pool"
            )
        t0 = time.monotonic()
        e.packed, e.tier, e.read_s = packed, tier, read_s  # kept if it is parked (_NoRoom)
        a = self._allocate(e, slot_pieces(packed.slots, packed.flat.element_size()))
        e.packed = None
        self._copy_in(self._pool.segments(a), packed.flat, stream)
        t1 = time.monotonic()
        with self._lock:
            if e.detached:
                self._free_alloc(e)
                return
            e.slots = packed.slots
            e.views = None  # built on the first weights() call
            e.state = _State.RESIDENT
            self._ever_held.add(ref.adapter_id)
            e.ready_at = t1
            e.event.set()
            seconds = read_s + (t1 - t0)
            self._c.loads_by_tier[tier] += 1
            self._c.load_seconds_by_tier[tier] += seconds
            self._emit(
                StoreEvent(
                    "load",
                    ref.adapter_id,
                    ref.version,
                    tier=tier,
                    seconds=seconds,
                    nbytes=packed.nbytes,
                )
            )
            for created in e.cold_created:
                w = max(0.0, t1 - created)
                self._c.cold_wait_total += w
                self._c.cold_wait_max = max(self._c.cold_wait_max, w)
                self._emit(StoreEvent("cold_start", ref.adapter_id, ref.version, seconds=w))
            e.cold_created = []
            if e.refcount == 0:
                self._unpark()  # it landed unleased (a prefetch): a parked demand load may evict it
            self._cv.notify_all()

    def _drop_prefetch(self: AdapterStore, e: _Entry) -> None:
        """Give up a prefetch that holds no pool memory (lock held); its host copy stays."""
        if self._entries.get(e.ref.adapter_id) is e:
            del self._entries[e.ref.adapter_id]
        e.detached = True
        e.state = _State.FAILED
        e.event.set()

    def _preempt_prefetch(self: AdapterStore) -> None:
        """Demand before prefetch (lock held): when every loader thread is busy, the running
        prefetch with the least expected demand that has not yet taken pool room yields its
        thread once its read returns (its bytes stay in the host cache). The simulator's
        worker does the same (``SimWorker._preempt_prefetch``), where a read is cancelled at
        once."""
        if self._loads_running < self.config.loader_threads:
            return
        running = [
            x
            for x in self._entries.values()
            if x.state is _State.LOADING
            and x.job_started
            and not x.demanded
            and x.alloc is None
            and not x.yielding
        ]
        if running:
            min(running, key=lambda x: x.expected).yielding = True

    def _copy_in(
        self: AdapterStore,
        segments: Sequence[tuple[torch.Tensor, int, int]],
        src: torch.Tensor,
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Copy the packed ``src`` into the pool (:meth:`DevicePool.segments`: one copy per
        run of tensors that lie together; one for an adapter in one run)."""
        parts = [(d, src[lo:hi]) for d, lo, hi in segments]
        if stream is None:
            for d, s in parts:
                d.copy_(s)
            return
        # the destination was zeroed on the default stream: order the copy after it
        stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(stream):
            for d, s in parts:
                d.copy_(s, non_blocking=True)
        stream.synchronize()

    def _allocate(self: AdapterStore, e: _Entry, pieces: Sequence[int]) -> Allocation:
        """Find room for ``e``, whose packed tensors have byte sizes ``pieces`` (layout order),
        by the rule of :class:`~services.worker.room.RoomSearch` (place, compact, split, evict,
        drop, wait); returns its allocation. A demand load with no room is parked (its loader
        thread takes other loads) and queued again whenever room may appear (:meth:`_unpark`),
        until ``load_wait_timeout_s``.

        Raises:
            PoolExhaustedError: bigger than the pool, or no room before the wait timeout.
            _PrefetchIgnored: a prefetch found only more-wanted adapters to evict.
            _Detached: the entry was unloaded or superseded meanwhile, or nobody waits for it.
            _NoRoom: the load is parked.
        """
        nbytes = sum(pieces)
        search = e.room
        if search is None or search.pieces != tuple(pieces):
            search = e.room = RoomSearch(pieces, demanded=e.demanded)
        search.demanded = e.demanded
        with self._lock:
            self._pressure.note_layout(pieces)
        while True:
            with self._cv:
                if e.detached:
                    raise _Detached()
                now = time.monotonic()
                d = search.next(
                    self._pool.allocator,
                    alloc=lambda p, split: self._pool.alloc_pieces(p, split=split),
                    pinned=self._pinned,
                    victim=lambda: self._pick_victim(e),
                    compaction_max_ratio=self.config.compaction_max_ratio,
                    has_waiters=e.refcount > 0,
                    wait_expired=e.room_deadline is not None and now >= e.room_deadline,
                )
                if self._on_decision is not None:
                    self._on_decision(e.ref.adapter_id, d)
                if d.sample_pressure:
                    self._pressure.sample(self._pool.allocator, self._pinned())
                a = d.allocation
                if d.action is RoomAction.PLACE and a is not None:
                    e.alloc = a
                    e.room = None
                    self._holders[a.handle] = e
                    if a.is_split:
                        self._c.splits += 1
                        self._emit(
                            StoreEvent("split", e.ref.adapter_id, e.ref.version, nbytes=nbytes)
                        )
                    return a
                if d.action is RoomAction.EVICT:
                    assert d.victim is not None
                    self._evict(self._entries[d.victim], "demand" if e.demanded else "prefetch")
                    continue
                if d.action is RoomAction.DROP:
                    self._drop_prefetch(e)
                    self._c.prefetch_ignored += 1
                    self._emit(StoreEvent("prefetch_ignored", e.ref.adapter_id, e.ref.version))
                    raise _PrefetchIgnored()
                if d.action is RoomAction.CANCEL:  # its requests ended while it was queued
                    self._fail(e, RequestCancelledError(_NO_WAITER), count=False)
                    raise _Detached()
                if d.action is RoomAction.FAIL:
                    if d.reason == "too_large":
                        raise PoolExhaustedError(d.message)
                    raise PoolExhaustedError(
                        f"no room in the device pool for adapter {e.ref.adapter_id!r} "
                        f"({nbytes} bytes): every resident adapter stayed in use for "
                        f"{self.config.load_wait_timeout_s:g} s; retry later"
                    )
                if d.action is RoomAction.WAIT:
                    if e.room_deadline is None:
                        e.room_deadline = now + self.config.load_wait_timeout_s
                    # Park it and free this loader thread for loads that fit (no head-of-line
                    # blocking); it is queued again whenever room may appear (_unpark).
                    e.job_started = False
                    self._parked.append(e)
                    raise _NoRoom()
            self._compact(d.compact_units)

    def _compact(self: AdapterStore, need_units: int) -> None:
        """Compact the pool with the compute guard held exclusively (no step running)."""
        with self._guard.write(), self._lock:
            ctx = (
                torch.cuda.stream(torch.cuda.default_stream(self.device))
                if self.device.type == "cuda"
                else contextlib.nullcontext()
            )
            with ctx:
                res = self._pool.compact(self._pinned(), need_units)
            if self.device.type == "cuda":
                torch.cuda.default_stream(self.device).synchronize()
            for m in res.moves:
                holder = self._holders[m.handle]
                holder.alloc = self._pool.allocator.get(m.handle)
                holder.views = None  # re-pointed: rebuilt from the new run on next use
            self._c.compactions += 1
            self._c.bytes_moved += res.bytes_moved
            self._emit(StoreEvent("compact", nbytes=res.bytes_moved))
