"""Request-trace loaders: real public traces as sorted arrival arrays keyed by adapter.

Every loader returns a :class:`Trace`: arrivals sorted by time (seconds from the trace start),
each with an adapter key, a prompt length and an output length in tokens. The same trace feeds
the forecaster evaluation (``plora eval predictor``), the simulator and the replay benchmark, so
everything here is deterministic from a seed and does no I/O beyond reading the file.

Formats (``fmt`` of :func:`load_trace`; where to download each: docs/benchmarks.md):

``"alibaba"``
    Alibaba cluster-trace-v2026-GenAI ``lora_request_trace.csv``: one row per request.
    ``groupId`` (tenant) is the adapter key, ``gmt_create`` (1 s resolution wall clock, read as
    UTC) is the arrival time, ``prompt_length`` the prompt tokens (missing -> the default).
    The service generates images, so there is no output length: ``default_output_tokens``.
    Requests sharing a second keep the file order and the same time stamp.
``"azure2019"``
    Azure Functions 2019 ``invocations_per_function_md.anon.dNN.csv`` (or a sample of it):
    ``HashOwner, HashApp, HashFunction, Trigger`` then one column per minute of the day holding
    that minute's invocation count. ``HashFunction`` is the adapter key. Sub-minute times are
    not in the data; we expand each minute deterministically and evenly: the ``n``
    invocations of minute column ``m`` arrive at ``(m - m0) * 60 + (i + 0.5) * 60 / n``
    seconds, ``i = 0 .. n-1``, where ``m0`` is the first minute column of the file (so the
    sample file starting at minute 480 and the full-day files, minutes 1..1440, both start at
    t = 0). No token lengths: the defaults.
``"azure2021"``
    Azure Functions 2021 ``AzureFunctionsInvocationTraceForTwoWeeksJan2021.csv``: one row per
    invocation, ``app, func, end_timestamp, duration`` (seconds since trace start), not sorted.
    The adapter key is ``"<app>/<func>"``, the arrival is ``end_timestamp - duration``; an
    invocation that began before the trace window (a negative start) is counted at t = 0.
    Read as a stream (``csv.reader``), so the full ~2 M-row file loads in seconds.
``"azure_llm2023"``
    Azure LLM inference trace 2023 (``AzureLLMInferenceTrace_{code,conv}.csv``):
    ``TIMESTAMP`` (wall clock, 100 ns digits), ``ContextTokens``, ``GeneratedTokens``. It has
    no adapter ids, so keys are drawn from a stated popularity model: Zipf with exponent
    ``zipf_exponent`` over ``num_keys`` keys ``"k0000" .. "k{K-1}"`` (``P(key k) ∝
    (k + 1) ** -zipf_exponent``), i.i.d. per request from ``numpy.random.default_rng(seed)``.

Post-processing, in this order (all in :func:`load_trace`):

1. ``drop_top=N`` removes every arrival of the N busiest keys of the whole file (ties broken by
   key string), e.g. the one event-triggered function that carries 63 % of the Azure 2019 sample.
2. ``time_scale=X`` compresses time: ``t' = t / X`` (X = 60 replays an hour in a minute).
3. ``start``/``duration`` keep the arrivals with ``start <= t' < start + duration`` (seconds
   of the scaled clock) and rebase them so the slice starts at t = 0.
"""

from __future__ import annotations

import csv
import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

#: Trace formats understood by :func:`load_trace`.
TRACE_FORMATS: tuple[str, ...] = ("alibaba", "azure2019", "azure2021", "azure_llm2023")

#: Prompt/output lengths used for formats whose rows carry none (Azure Functions, Alibaba output).
DEFAULT_PROMPT_TOKENS = 128
DEFAULT_OUTPUT_TOKENS = 64


@dataclass(frozen=True)
class Arrival:
    """One request of a trace.

    Attributes:
        t: Arrival time, seconds from the trace start (after scaling and slicing).
        adapter_key: The trace's key for the adapter (tenant, function, ...).
        prompt_tokens: Prompt length in tokens (>= 1).
        output_tokens: Output length in tokens (>= 1).
    """

    t: float
    adapter_key: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, eq=False)
class Trace:
    """Arrivals sorted by time, as parallel numpy arrays.

    Attributes:
        times: ``float64 [n]`` arrival times in seconds from the trace start, non-decreasing.
        key_index: ``int32 [n]`` index of each arrival's key into ``keys``.
        keys: Key vocabulary (every key has at least one arrival), in order of first row in the
            file.
        prompt_tokens: ``int32 [n]`` prompt lengths in tokens.
        output_tokens: ``int32 [n]`` output lengths in tokens.
        fmt: The format the trace was loaded from (one of :data:`TRACE_FORMATS`, or "synthetic").
        source: Where it came from (a path), for reports.
    """

    times: np.ndarray
    key_index: np.ndarray
    keys: tuple[str, ...]
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    fmt: str = "synthetic"
    source: str = ""

    def __post_init__(self) -> None:
        n = len(self.times)
        for name in ("key_index", "prompt_tokens", "output_tokens"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trace.{name} has {len(getattr(self, name))} rows, times {n}")
        if n > 1 and bool(np.any(np.diff(self.times) < 0)):
            raise ValueError("Trace.times must be sorted; build traces with Trace.from_arrays")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(
        cls,
        times: np.ndarray | Sequence[float],
        adapter_keys: Sequence[str] | np.ndarray,
        prompt_tokens: np.ndarray | Sequence[int] | int = DEFAULT_PROMPT_TOKENS,
        output_tokens: np.ndarray | Sequence[int] | int = DEFAULT_OUTPUT_TOKENS,
        *,
        fmt: str = "synthetic",
        source: str = "",
    ) -> Trace:
        """Build a trace from unsorted per-arrival values (stable sort by time).

        Args:
            times: ``[n]`` arrival seconds.
            adapter_keys: ``[n]`` key per arrival.
            prompt_tokens: ``[n]`` or one value for all.
            output_tokens: ``[n]`` or one value for all.
        """
        t = np.asarray(times, dtype=np.float64)
        n = len(t)
        vocab: dict[str, int] = {}
        idx = np.fromiter(
            (vocab.setdefault(str(k), len(vocab)) for k in adapter_keys), dtype=np.int32, count=n
        )
        return cls._build(t, idx, tuple(vocab), prompt_tokens, output_tokens, fmt, source)

    @classmethod
    def _build(
        cls,
        t: np.ndarray,
        idx: np.ndarray,
        keys: tuple[str, ...],
        prompt_tokens: np.ndarray | Sequence[int] | int,
        output_tokens: np.ndarray | Sequence[int] | int,
        fmt: str,
        source: str,
    ) -> Trace:
        n = len(t)
        p = _as_tokens(prompt_tokens, n)
        o = _as_tokens(output_tokens, n)
        order = np.argsort(t, kind="stable")
        idx = idx.astype(np.int32)
        used = np.unique(idx)
        if len(used) < len(keys):  # drop keys without arrivals, keep file order
            remap = np.full(len(keys), -1, dtype=np.int32)
            remap[used] = np.arange(len(used), dtype=np.int32)
            idx = remap[idx]
            keys = tuple(keys[k] for k in used.tolist())
        return cls(t[order], idx[order], keys, p[order], o[order], fmt, source)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.times)

    def __iter__(self) -> Iterator[Arrival]:
        keys = self.keys
        for t, k, p, o in zip(
            self.times.tolist(),
            self.key_index.tolist(),
            self.prompt_tokens.tolist(),
            self.output_tokens.tolist(),
            strict=True,
        ):
            yield Arrival(t, keys[k], p, o)

    def arrivals(self) -> list[Arrival]:
        """All arrivals as :class:`Arrival` objects.

        O(n) memory: prefer the arrays for big traces.
        """
        return list(self)

    @property
    def adapter_keys(self) -> np.ndarray:
        """``object [n]`` key string per arrival."""
        return np.asarray(self.keys, dtype=object)[self.key_index]

    @property
    def duration(self) -> float:
        """Seconds from t = 0 to the last arrival (0 for an empty trace)."""
        return float(self.times[-1]) if len(self.times) else 0.0

    def key_counts(self) -> dict[str, int]:
        """Arrivals per key."""
        counts = np.bincount(self.key_index, minlength=len(self.keys))
        return {k: int(c) for k, c in zip(self.keys, counts, strict=True)}

    def keys_by_popularity(self) -> list[str]:
        """Keys sorted by arrival count, descending; ties by key string (deterministic)."""
        counts = self.key_counts()
        return sorted(counts, key=lambda k: (-counts[k], k))

    # ------------------------------------------------------------------ transforms
    def _select(self, mask: np.ndarray, shift: float = 0.0, scale: float = 1.0) -> Trace:
        idx = self.key_index[mask]
        used = np.unique(idx)
        remap = np.full(len(self.keys), -1, dtype=np.int32)
        remap[used] = np.arange(len(used), dtype=np.int32)
        keys = tuple(self.keys[k] for k in used.tolist())  # file order of the survivors
        return Trace(
            (self.times[mask] - shift) / scale if (shift or scale != 1.0) else self.times[mask],
            remap[idx],
            keys,
            self.prompt_tokens[mask],
            self.output_tokens[mask],
            self.fmt,
            self.source,
        )

    def drop_top(self, n: int) -> Trace:
        """Remove every arrival of the ``n`` busiest keys (ties broken by key string)."""
        if n <= 0:
            return self
        drop = {self.keys.index(k) for k in self.keys_by_popularity()[:n]}
        mask = ~np.isin(self.key_index, np.fromiter(drop, dtype=np.int32))
        return self._select(mask)

    def scaled(self, time_scale: float) -> Trace:
        """Compress time: ``t' = t / time_scale`` (``time_scale > 0``)."""
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if time_scale == 1.0:
            return self
        return Trace(
            self.times / time_scale,
            self.key_index,
            self.keys,
            self.prompt_tokens,
            self.output_tokens,
            self.fmt,
            self.source,
        )

    def sliced(self, start: float = 0.0, duration: float | None = None) -> Trace:
        """Arrivals with ``start <= t < start + duration``, rebased to start at t = 0."""
        if start == 0.0 and duration is None:
            return self
        if duration is not None and duration < 0:
            raise ValueError(f"duration must be >= 0, got {duration}")
        mask = self.times >= start
        if duration is not None:
            mask &= self.times < start + duration
        return self._select(mask, shift=start)

    def remap_keys(self, mapping: Mapping[str, str]) -> Trace:
        """Rename keys (e.g. onto adapter ids with :func:`map_keys_to_adapters`); keys that map
        to the same name merge. Keys missing from ``mapping`` keep their name."""
        vocab: dict[str, int] = {}
        table = np.array(
            [vocab.setdefault(mapping.get(k, k), len(vocab)) for k in self.keys], dtype=np.int32
        )
        return Trace(
            self.times,
            table[self.key_index] if len(self.keys) else self.key_index,
            tuple(vocab),
            self.prompt_tokens,
            self.output_tokens,
            self.fmt,
            self.source,
        )


def _as_tokens(v: np.ndarray | Sequence[int] | int, n: int) -> np.ndarray:
    if np.isscalar(v):
        return np.full(n, max(1, int(v)), dtype=np.int32)  # type: ignore[arg-type]
    arr = np.asarray(v, dtype=np.float64)
    if len(arr) != n:
        raise ValueError(f"token array has {len(arr)} rows, expected {n}")
    return np.maximum(1, np.nan_to_num(arr, nan=1.0)).astype(np.int32)


# ---------------------------------------------------------------------- format readers
def _parse_wall_clock(s: str) -> float:
    """``"YYYY-MM-DD HH:MM:SS[.fffffff]"`` (any number of fraction digits) -> UTC epoch seconds."""
    s = s.strip()
    base, _, frac = s.partition(".")
    dt = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    return dt.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _read_alibaba(path: Path, default_prompt: int, default_output: int) -> Trace:
    times: list[float] = []
    keys: list[str] = []
    prompt: list[float] = []
    cache: dict[str, float] = {}
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        _require_columns(path, reader.fieldnames, ("gmt_create", "groupId"))
        has_prompt = "prompt_length" in (reader.fieldnames or ())
        for row in reader:
            stamp = row["gmt_create"]
            stamp_s = cache.get(stamp)
            if stamp_s is None:
                stamp_s = cache[stamp] = _parse_wall_clock(stamp)
            times.append(stamp_s)
            keys.append(row["groupId"])
            pl = row.get("prompt_length", "") if has_prompt else ""
            prompt.append(float(pl) if pl else float(default_prompt))
    t = np.asarray(times, dtype=np.float64)
    if len(t):
        t -= t.min()
    return Trace.from_arrays(
        t, keys, np.asarray(prompt), default_output, fmt="alibaba", source=str(path)
    )


def _read_azure2019(path: Path, default_prompt: int, default_output: int) -> Trace:
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file, expected an Azure Functions 2019 header")
        _require_columns(path, header, ("HashFunction",))
        fcol = header.index("HashFunction")
        minute_cols = [i for i, h in enumerate(header) if h.strip().isdigit()]
        if not minute_cols:
            raise ValueError(f"{path}: no minute columns (1..1440) in the header")
        minutes = np.array([int(header[i]) for i in minute_cols], dtype=np.int64)
        m0 = int(minutes.min())
        vocab: dict[str, int] = {}
        rows: list[np.ndarray] = []
        row_key: list[int] = []
        lo, hi = minute_cols[0], minute_cols[-1] + 1
        contiguous = minute_cols == list(range(lo, hi))
        for row in reader:
            if not row:
                continue
            vals = row[lo:hi] if contiguous else [row[i] for i in minute_cols]
            counts = np.array([int(float(v)) if v else 0 for v in vals], dtype=np.int64)
            row_key.append(vocab.setdefault(row[fcol], len(vocab)))
            rows.append(counts)
    if not rows:
        return Trace.from_arrays([], [], fmt="azure2019", source=str(path))
    mat = np.stack(rows)  # [functions, minutes] invocation counts
    n_flat = mat.ravel()
    nz = np.flatnonzero(n_flat)
    n = n_flat[nz]  # counts of non-empty (function, minute) cells
    fn = np.asarray(row_key, dtype=np.int32)[nz // mat.shape[1]]
    minute_start = (minutes[nz % mat.shape[1]] - m0).astype(np.float64) * 60.0
    total = int(n.sum())
    cell = np.repeat(np.arange(len(n)), n)
    first = np.cumsum(n) - n  # index of each cell's first invocation
    i = np.arange(total, dtype=np.int64) - first[cell]
    t = minute_start[cell] + (i + 0.5) * 60.0 / n[cell]
    return Trace._build(
        t, fn[cell], tuple(vocab), default_prompt, default_output, "azure2019", str(path)
    )


def _read_azure2021(path: Path, default_prompt: int, default_output: int) -> Trace:
    import array

    starts = array.array("d")
    idx = array.array("i")
    vocab: dict[tuple[str, str], int] = {}
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file, expected app,func,end_timestamp,duration")
        _require_columns(path, header, ("app", "func", "end_timestamp", "duration"))
        ca, cf = header.index("app"), header.index("func")
        ce, cd = header.index("end_timestamp"), header.index("duration")
        for row in reader:
            if not row:
                continue
            starts.append(float(row[ce]) - float(row[cd]))
            idx.append(vocab.setdefault((row[ca], row[cf]), len(vocab)))
    t = np.maximum(np.frombuffer(starts, dtype=np.float64), 0.0)
    keys = tuple(f"{a}/{f}" for a, f in vocab)
    return Trace._build(
        t,
        np.frombuffer(idx, dtype=np.int32),
        keys,
        default_prompt,
        default_output,
        "azure2021",
        str(path),
    )


def _read_azure_llm2023(path: Path, seed: int, zipf_exponent: float, num_keys: int) -> Trace:
    if num_keys < 1:
        raise ValueError(f"num_keys must be >= 1, got {num_keys}")
    times: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        _require_columns(path, reader.fieldnames, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
        for row in reader:
            times.append(_parse_wall_clock(row["TIMESTAMP"]))
            prompt.append(int(row["ContextTokens"]))
            output.append(int(row["GeneratedTokens"]))
    t = np.asarray(times, dtype=np.float64)
    if len(t):
        t -= t.min()
    weights = (np.arange(num_keys, dtype=np.float64) + 1.0) ** -float(zipf_exponent)
    rng = np.random.default_rng(seed)
    draw = rng.choice(num_keys, size=len(t), p=weights / weights.sum())
    width = max(4, len(str(num_keys - 1)))
    names = [f"k{k:0{width}d}" for k in range(num_keys)]
    # vocabulary restricted to drawn keys, first-appearance order
    vocab: dict[int, int] = {}
    idx = np.fromiter((vocab.setdefault(int(k), len(vocab)) for k in draw), np.int32, len(draw))
    keys = tuple(names[k] for k in vocab)
    return Trace._build(
        t, idx, keys, np.asarray(prompt), np.asarray(output), "azure_llm2023", str(path)
    )


def _require_columns(path: Path, header: Sequence[str] | None, needed: Sequence[str]) -> None:
    missing = [c for c in needed if c not in (header or ())]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; header is {list(header or [])[:8]}")


def load_trace(
    path: str | Path,
    fmt: str,
    *,
    time_scale: float = 1.0,
    seed: int = 0,
    drop_top: int = 0,
    start: float = 0.0,
    duration: float | None = None,
    zipf_exponent: float = 1.0,
    num_keys: int = 100,
    default_prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    default_output_tokens: int = DEFAULT_OUTPUT_TOKENS,
) -> Trace:
    """Load a public request trace as a sorted :class:`Trace` (see the module doc per format).

    Args:
        path: CSV file.
        fmt: One of :data:`TRACE_FORMATS`.
        time_scale: Compression factor, ``t' = t / time_scale`` (> 0).
        seed: Seed of every random choice (only ``azure_llm2023`` draws keys).
        drop_top: Remove the N busiest keys of the whole file before scaling and slicing.
        start: Slice start, seconds of the scaled clock.
        duration: Slice length in scaled seconds (None = to the end).
        zipf_exponent: ``azure_llm2023`` only: Zipf exponent s of the key popularity.
        num_keys: ``azure_llm2023`` only: number K of keys drawn from.
        default_prompt_tokens: Prompt length where the format has none.
        default_output_tokens: Output length where the format has none.

    Returns:
        The trace; ``times`` start at 0 (trace start) unless sliced away.

    Raises:
        ValueError: Unknown format, a missing column, or a bad option.
        FileNotFoundError: ``path`` does not exist.
    """
    p = Path(path)
    if fmt == "alibaba":
        trace = _read_alibaba(p, default_prompt_tokens, default_output_tokens)
    elif fmt == "azure2019":
        trace = _read_azure2019(p, default_prompt_tokens, default_output_tokens)
    elif fmt == "azure2021":
        trace = _read_azure2021(p, default_prompt_tokens, default_output_tokens)
    elif fmt == "azure_llm2023":
        trace = _read_azure_llm2023(p, seed, zipf_exponent, num_keys)
    else:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {TRACE_FORMATS}")
    logger.info("loaded %s trace %s: %d arrivals, %d keys", fmt, p, len(trace), len(trace.keys))
    return trace.drop_top(drop_top).scaled(time_scale).sliced(start, duration)


def _seeded_rank(name: str, seed: int) -> bytes:
    return hashlib.sha256(f"{seed}:{name}".encode()).digest()


def map_keys_to_adapters(
    keys: Sequence[str], adapters: Sequence[str], seed: int = 0
) -> dict[str, str]:
    """Map trace keys onto K adapter names deterministically, by popularity rank.

    Rule: ``keys`` are given in popularity order, most requested first (e.g.
    :meth:`Trace.keys_by_popularity`). The adapters are put in a seeded pseudo-random order,
    sorting by ``sha256(f"{seed}:{adapter}")``, which does not depend on the order ``adapters``
    is given in. Key of rank i gets adapter ``shuffled[i % K]``: the K most popular keys get K
    distinct adapters, and less popular keys wrap around (rank i shares with rank i mod K), so
    popularity skew is kept and which adapter (e.g. which rank) is hot depends only on the seed.

    Args:
        keys: Trace keys, most popular first (duplicates are ignored after the first).
        adapters: Adapter ids/paths, at least one.
        seed: Seed of the adapter order.

    Returns:
        ``{key: adapter}`` for every key.

    Raises:
        ValueError: ``adapters`` is empty.
    """
    if not adapters:
        raise ValueError("map_keys_to_adapters needs at least one adapter")
    shuffled = sorted(dict.fromkeys(adapters), key=lambda a: (_seeded_rank(a, seed), a))
    out: dict[str, str] = {}
    for k in keys:
        if k not in out:
            out[k] = shuffled[len(out) % len(shuffled)]
    return out
