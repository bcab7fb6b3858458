"""The predictor's forecasts of one trace, computed once by the production forecaster and shared.

The predictor service's forecaster sees only the request stream: every tick it is given the
arrivals of the last second (``observe_counts``), asked for a forecast (``tick``) and trained
(``train``), in that order (:meth:`services.predictor.server.PredictorCore.tick`). None of that
depends on what the workers do, so for a given trace, key -> adapter map and forecaster the
sequence of forecasts is the same under every policy and every worker count. The simulator
therefore runs the production forecaster (:func:`services.predictor.forecast.make_forecaster`)
once per trace, here, and every simulation of that trace reads the stored forecasts; placement,
prefetch choice and eviction (which do depend on the workers) still run per simulation, per
tick.

:class:`DemandFeed` produces the forecasts either in this process, tick by tick as the
simulation asks for them, or in a child process that runs ahead of the simulation and streams
them in chunks (``process=True``: the forecaster then costs wall time only where it is slower
than the simulation itself, on a second core). Both produce the same numbers bit for bit: the
forecaster is deterministic from its seed and runs single-threaded in both.

Tick schedule (as the simulator's event loop has it): ticks at ``tick_s, 2 tick_s, ...`` (each
the previous one plus ``tick_s``), the tick at ``t`` observing the arrivals in ``(t - tick_s,
t]``, and a next tick scheduled while some arrival is at or after ``t``.
"""

from __future__ import annotations

import bisect
import logging
import multiprocessing as mp
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from services.predictor.forecast import make_forecaster

logger = logging.getLogger(__name__)

#: Ticks per chunk a child process sends at once.
CHUNK_TICKS = 64


@dataclass(frozen=True)
class FeedSettings:
    """What the forecasts depend on besides the arrivals (see :class:`SimConfig`).

    Attributes:
        forecaster: Name for :func:`make_forecaster`.
        horizon_s: Forecast horizon, seconds.
        seed: Forecaster seed.
        tick_s: Tick period, seconds.
        train_every: Train every this many ticks.
        train_budget_s: Budget of one ``train`` call, seconds (the LSTM runs one step anyway).
    """

    forecaster: str
    horizon_s: float
    seed: int
    tick_s: float
    train_every: int
    train_budget_s: float


def tick_times(arrivals: np.ndarray, tick_s: float) -> np.ndarray:
    """``float64 [T]`` the predictor's tick times for arrivals ``arrivals`` (sorted seconds).

    ``[]`` for no arrivals; else ``tick_s, 2 tick_s, ...`` accumulated by addition (as the event
    loop schedules them) up to and including the first tick after the last arrival.
    """
    if len(arrivals) == 0:
        return np.zeros(0, dtype=np.float64)
    last = float(arrivals[-1])
    out = []
    t = tick_s
    while True:
        out.append(t)
        if t > last:
            break
        t = t + tick_s
    return np.asarray(out, dtype=np.float64)


def _chunks(
    arrivals: np.ndarray,
    req_adapter: np.ndarray,
    names: Sequence[str],
    settings: FeedSettings,
    chunk_ticks: int,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, float, float]]:
    """Run the production forecaster over the trace; yield ``(counts [c], adapters [m],
    expected [m], wall_s)`` per chunk of ``c`` ticks (``counts`` = scored adapters per tick,
    ``adapters`` int32 adapter indices in forecast order, ``expected`` float64 > 0); ``wall_s``
    covers the chunk, and its process CPU seconds are added as a fifth item."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny LSTM steps: one thread is far faster than contended ones
    try:
        f = make_forecaster(settings.forecaster, horizon_s=settings.horizon_s, seed=settings.seed)
        index = {n: i for i, n in enumerate(names)}
        ticks = tick_times(arrivals, settings.tick_s)
        his = np.searchsorted(arrivals, ticks, side="right")
        k_total = len(names)
        lo = 0
        counts: list[int] = []
        ads: list[np.ndarray] = []
        exps: list[np.ndarray] = []
        t0, c0 = time.perf_counter(), time.process_time()
        for k, (t, hi) in enumerate(zip(ticks.tolist(), his.tolist(), strict=True)):
            if hi > lo:
                c = np.bincount(req_adapter[lo:hi], minlength=k_total)
                nz = np.flatnonzero(c)
                f.observe_counts({names[a]: float(c[a]) for a in nz.tolist()}, t)
            lo = hi
            fc = f.tick(t)
            if (k + 1) % settings.train_every == 0:
                f.train(settings.train_budget_s)
            e = fc.expected_count
            keep = e > 0
            ids = fc.adapter_ids
            a = np.fromiter((index[ids[j]] for j in np.flatnonzero(keep).tolist()), dtype=np.int32)
            counts.append(len(a))
            ads.append(a)
            exps.append(np.asarray(e[keep], dtype=np.float64))
            if len(counts) == chunk_ticks or k == len(ticks) - 1:
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                yield (
                    np.asarray(counts, dtype=np.int64),
                    np.concatenate(ads) if ads else np.zeros(0, np.int32),
                    np.concatenate(exps) if exps else np.zeros(0, np.float64),
                    wall,
                    cpu,
                )
                counts, ads, exps = [], [], []
                t0, c0 = time.perf_counter(), time.process_time()
    finally:
        torch.set_num_threads(threads)


def _child(conn, arrivals, req_adapter, names, settings, chunk_ticks) -> None:  # noqa: ANN001
    """Child-process entry: stream the chunks to ``conn`` (an error as ``("error", text)``).

    The parent knows how many ticks to expect and closes its end once it has them all, or
    early when it stops; either way the child then just ends.
    """
    try:
        for chunk in _chunks(arrivals, req_adapter, names, settings, chunk_ticks):
            conn.send(chunk)
    except (BrokenPipeError, EOFError):
        pass
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except (BrokenPipeError, EOFError):
            pass
    finally:
        conn.close()


class DemandFeed:
    """The forecaster's output for every tick of one trace (see the module doc).

    Args:
        arrivals: ``float64 [n]`` sorted arrival times, seconds.
        req_adapter: ``int64 [n]`` adapter index of each arrival.
        names: Adapter ids, indexed like ``req_adapter``.
        settings: Forecaster and tick settings.
        process: Compute in a child process that runs ahead (``spawn``), else in this
            process on demand.

    Attributes:
        ticks: ``float64 [T]`` tick times.
        child_process: The forecasts come from a child process.
        compute_s: Seconds the forecaster took (observe + tick + train), summed over the
            ticks produced so far (in the child when ``process``).
        compute_cpu_s: CPU seconds of the process that ran the forecaster, over the same.
        wait_s: Seconds :meth:`get` spent waiting for (or computing) forecasts in this process.
    """

    def __init__(
        self,
        arrivals: np.ndarray,
        req_adapter: np.ndarray,
        names: Sequence[str],
        settings: FeedSettings,
        process: bool = False,
    ) -> None:
        self.settings = settings
        self.trace_key: tuple = ()  # set by the maker: what trace this is for
        self.ticks = tick_times(arrivals, settings.tick_s)
        self.compute_s = 0.0
        self.compute_cpu_s = 0.0
        self.wait_s = 0.0
        # received chunks: first tick of each, and (offsets [c+1], adapters, expected)
        self._starts: list[int] = []
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._received = 0  # ticks received
        self._proc = None
        self._conn = None
        self._gen: Iterator | None = None
        args = (
            np.ascontiguousarray(arrivals, dtype=np.float64),
            np.ascontiguousarray(req_adapter, dtype=np.int64),
            list(names),
            settings,
            CHUNK_TICKS,
        )
        self.child_process = bool(process and len(self.ticks))
        if self.child_process:
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(target=_child, args=(child, *args), daemon=True)
            self._proc.start()
            child.close()
            self._conn = parent
        else:
            self._gen = _chunks(*args[:4], chunk_ticks=1)

    def __len__(self) -> int:
        return len(self.ticks)

    @property
    def done(self) -> bool:
        """Every tick's forecast is here."""
        return self._received == len(self.ticks)

    def _pull(self) -> None:
        if self._gen is not None:
            chunk = next(self._gen)
        else:
            assert self._conn is not None
            try:
                chunk = self._conn.recv()
            except EOFError:
                chunk = ("error", "the process ended early")
            if isinstance(chunk[0], str):
                self.close()
                raise RuntimeError(f"forecast process failed: {chunk[1]}")
        counts, ads, exps, wall, cpu = chunk
        self.compute_s += wall
        self.compute_cpu_s += cpu
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        self._starts.append(self._received)
        self._chunks.append((offsets, ads, exps))
        self._received += len(counts)
        if self.done:
            self.close()

    def get(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Tick ``k``'s forecast: ``(adapters int32 [m], expected float64 [m])``, the adapters
        with a positive expected count over the horizon, in the forecaster's order.

        Raises:
            IndexError: ``k`` is not a tick of this trace.
            RuntimeError: The child process failed.
        """
        if not 0 <= k < len(self.ticks):
            raise IndexError(f"tick {k} out of range [0, {len(self.ticks)})")
        if k >= self._received:
            t0 = time.perf_counter()
            while k >= self._received:
                self._pull()
            self.wait_s += time.perf_counter() - t0
        c = bisect.bisect_right(self._starts, k) - 1
        offsets, ads, exps = self._chunks[c]
        j = k - self._starts[c]
        lo, hi = offsets[j], offsets[j + 1]
        return ads[lo:hi], exps[lo:hi]

    def close(self) -> None:
        """Stop the child process (if any); the forecasts received so far stay readable."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join()
            self._proc = None
        self._gen = None

    def __del__(self) -> None:  # pragma: no cover - interpreter teardown
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
