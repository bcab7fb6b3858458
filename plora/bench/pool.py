"""``plora bench pool``: replay a real adapter request trace through the paged and the
contiguous allocator at the same pool size, and measure the page size.

Workload (deterministic from ``--seed``):

* Arrivals: the Alibaba GenAI 2026 LoRA request trace (``plora.traces.load_trace``,
  format ``"alibaba"``); each ``groupId`` (tenant) is one adapter.
* Adapters: SmolLM2-135M shapes (30 layers, hidden 576, 9 heads / 3 KV heads of 64,
  MLP 1536), LoRA on all 7 projections, rank drawn per adapter from ``--ranks`` by
  ``sha256(f"{seed}:{groupId}")``. One rank unit is ``10176 * 30 = 305,280`` parameters
  (1,221,120 bytes in fp32, 610,560 in fp16).
* Pool: ``--pool-fraction`` (default 1/4) of the working set (the bytes of every distinct
  adapter in the replay), rounded down to whole pages; the host cache holds the working set.
* Each request takes a lease at its arrival and holds it for ``--hold-seconds`` of trace
  time (the trace's median ``exec_time_seconds`` is 22 s), so adapters in use are pinned
  while others load. Time is virtual: the replay releases leases whose hold ended before
  each arrival, then acquires and waits for the load. A load that would have to wait for a
  lease to end cannot be served in virtual time, so the store runs with
  ``load_wait_timeout_s=0`` and such a load counts as a failed allocation.

The replay drives the real :class:`~services.worker.store.AdapterStore` (allocator, eviction,
compaction, host cache, leases, loader thread). On the default ``--device meta`` the pool and
host tensors have no storage (byte accounting: every placement decision is real, no bytes are
copied), because the working set at real sizes (tens of GB) does not fit in RAM;
``--device cpu`` copies real bytes (use ``--max-requests`` to keep the working set small).

Metrics are the store's pressure-sampled means (definitions in ``store.py``): utilization
under pressure, external fragmentation (largest allocatable extent; ``paged`` counts what
compaction around pinned adapters joins and what a split allocation, cut between tensors,
places over the free runs), free-run fragmentation (largest free run as it stands), internal
waste, and mean extents per adapter; ``splits`` counts allocations spread over several runs.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from plora.traces import Trace, load_trace
from services.common.types import (
    PROJECTION_MODULES,
    SMOLLM2_135M,
    LoRAModuleWeights,
    LoRAWeights,
    ModelSpec,
)
from services.worker.adapter_api import AdapterRef
from services.worker.pool import DEFAULT_PAGE_BYTES
from services.worker.store import DTYPES, AdapterStore, StoreConfig, StoreLease

logger = logging.getLogger(__name__)

DEFAULT_RANKS = (8, 16, 32, 64, 128)
DEFAULT_PAGE_SWEEP = (4 << 20, 1 << 20, 256 << 10, 64 << 10)


def adapter_bytes(
    spec: ModelSpec,
    rank: int,
    element_size: int,
    modules: Sequence[str] = PROJECTION_MODULES,
) -> int:
    """Bytes of a rank-``rank`` LoRA on ``modules`` of every layer: ``r * (in + out)`` each."""
    per_layer = sum(sum(spec.module_shape(m)) for m in modules)
    return rank * per_layer * spec.num_layers * element_size


def assign_ranks(keys: Sequence[str], ranks: Sequence[int], seed: int) -> dict[str, int]:
    """Rank per key, ``ranks[sha256(f"{seed}:{key}") mod len(ranks)]`` (order-independent)."""
    out = {}
    for k in keys:
        h = int.from_bytes(hashlib.sha256(f"{seed}:{k}".encode()).digest()[:8], "big")
        out[k] = int(ranks[h % len(ranks)])
    return out


def page_waste(nbytes: int, page_bytes: int) -> float:
    """Internal waste of one ``nbytes`` adapter in ``page_bytes`` pages: unused / allocated."""
    pages = -(-nbytes // page_bytes)
    return (pages * page_bytes - nbytes) / (pages * page_bytes)


class SyntheticSource:
    """The bench's source tier: LoRA weights of the right shapes for each adapter.

    On ``meta`` the tensors have no storage; on ``cpu`` they are filled with a value derived
    from the adapter id (so copies are real and checkable).
    """

    def __init__(self, spec: ModelSpec, ranks: dict[str, int], device: str, dtype: torch.dtype):
        self.spec, self.ranks, self.device, self.dtype = spec, ranks, device, dtype
        self.calls = 0
        self._meta: dict[int, dict[tuple[int, str], LoRAModuleWeights]] = {}

    def __call__(self, ref: AdapterRef) -> LoRAWeights:
        self.calls += 1
        r = self.ranks[ref.adapter_id]
        if self.device == "meta":  # no data: tensors of one rank are interchangeable
            if r not in self._meta:
                self._meta[r] = self._build(r, 0.0)
            mods = self._meta[r]
        else:
            value = (int(hashlib.sha256(ref.adapter_id.encode()).hexdigest()[:4], 16) % 97) / 97
            mods = self._build(r, value)
        return LoRAWeights(ref.adapter_id, ref.version, mods, alpha=2.0 * r)

    def _build(self, r: int, value: float) -> dict[tuple[int, str], LoRAModuleWeights]:
        mods: dict[tuple[int, str], LoRAModuleWeights] = {}
        for layer in range(self.spec.num_layers):
            for m in PROJECTION_MODULES:
                fin, fout = self.spec.module_shape(m)
                a = torch.full((r, fin), value, dtype=self.dtype, device=self.device)
                b = torch.full((fout, r), -value, dtype=self.dtype, device=self.device)
                mods[(layer, m)] = LoRAModuleWeights(a, b, 2.0)
        return mods


def replay(
    trace: Trace,
    ranks: dict[str, int],
    *,
    allocator: str,
    pool_bytes: int,
    page_bytes: int,
    host_cache_bytes: int,
    hold_seconds: float,
    device: str,
    dtype: str,
    eviction: str = "lru",
    compaction_max_ratio: float | None = None,
    spec: ModelSpec = SMOLLM2_135M,
    progress: bool = False,
) -> dict[str, Any]:
    """Replay ``trace`` through one store configuration; returns its figures (JSON-ready).

    ``compaction_max_ratio`` None keeps the store's default (what the worker runs);
    ``progress`` shows a progress bar of the requests on stderr when it is a terminal."""
    if compaction_max_ratio is None:
        compaction_max_ratio = StoreConfig.compaction_max_ratio
    config = StoreConfig(
        allocator=allocator,
        eviction=eviction,
        pool_bytes=pool_bytes,
        page_bytes=page_bytes,
        host_cache_bytes=host_cache_bytes,
        device=device,
        dtype=dtype,
        load_wait_timeout_s=0.0,
        loader_threads=1,
        compaction_max_ratio=compaction_max_ratio,
    )
    esize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    source = SyntheticSource(spec, ranks, device, DTYPES[dtype])
    refs = {
        k: AdapterRef(k, 1, f"synthetic://{k}", adapter_bytes(spec, r, esize))
        for k, r in ranks.items()
    }
    held: list[tuple[float, int, StoreLease]] = []
    failed = 0
    t0 = time.perf_counter()
    arrivals = tqdm(
        zip(trace.times.tolist(), trace.key_index.tolist(), strict=True),
        total=len(trace),
        desc=f"{allocator} {page_bytes >> 10} KiB pages" if allocator == "paged" else allocator,
        unit="req",
        disable=None if progress else True,  # None: quiet unless stderr is a terminal
        leave=False,
    )
    with AdapterStore(config, source) as store:
        keys = trace.keys
        for i, (t, k) in enumerate(arrivals):
            while held and held[0][0] <= t:
                heapq.heappop(held)[2].release()
            lease = store.acquire(refs[keys[k]])
            if not lease.wait(timeout=120.0):
                raise RuntimeError(f"load of {keys[k]} did not finish in 120 s")
            if lease.error() is not None:
                failed += 1
                lease.release()
                continue
            heapq.heappush(held, (t + hold_seconds, i, lease))
        while held:
            heapq.heappop(held)[2].release()
        s = store.stats()
    wall = time.perf_counter() - t0
    return {
        "allocator": allocator,
        "eviction": eviction,
        "pool_bytes": s.pool_bytes,
        "page_bytes": s.page_bytes,
        "requests": len(trace),
        "utilization_under_pressure": s.utilization_under_pressure,
        "external_fragmentation": s.external_fragmentation_under_pressure,
        "free_run_fragmentation": s.free_run_fragmentation_under_pressure,
        "internal_waste": s.internal_waste_under_pressure,
        "pressure_samples": s.pressure_samples,
        "loads": sum(s.loads_by_tier.values()),
        "loads_by_tier": s.loads_by_tier,
        "device_hits": s.device_hits,
        "evictions": sum(s.evictions_by_reason.values()),
        "compactions": s.compactions,
        "bytes_moved": s.bytes_moved,
        "splits": s.split_allocations,
        "mean_extents_per_adapter": s.mean_extents_per_adapter_under_pressure,
        "mean_extents_per_adapter_at_end": s.mean_extents_per_adapter,
        "failed_allocations": failed,
        "compaction_max_ratio": compaction_max_ratio,
        "wall_seconds": wall,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora bench pool``."""
    parser.add_argument(
        "--trace",
        required=True,
        help="Alibaba GenAI LoRA request CSV (where to download it: docs/benchmarks.md)",
    )
    parser.add_argument("--out", required=True, help="write the JSON results here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the rank assignment")
    parser.add_argument(
        "--ranks", default=",".join(map(str, DEFAULT_RANKS)), help="ranks to draw from"
    )
    parser.add_argument(
        "--pool-fraction",
        type=float,
        default=0.25,
        help="pool bytes as a fraction of the working set (all distinct adapters' bytes)",
    )
    parser.add_argument("--page-bytes", type=int, default=DEFAULT_PAGE_BYTES, help="page size")
    parser.add_argument(
        "--page-sweep",
        default=",".join(map(str, DEFAULT_PAGE_SWEEP)),
        help="page sizes (bytes) to also replay with the paged allocator; empty to skip",
    )
    parser.add_argument("--hold-seconds", type=float, default=22.0, help="lease hold, trace s")
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    parser.add_argument(
        "--device",
        default="meta",
        help="meta = byte accounting (no storage); cpu/cuda copy real bytes",
    )
    parser.add_argument("--eviction", default="lru", choices=("lru", "predictive"))
    parser.add_argument(
        "--max-requests", type=int, default=0, help="replay only the first N requests (0 = all)"
    )
    parser.add_argument(
        "--compaction-max-ratio",
        type=float,
        default=float("inf"),
        help="also replay paged with this compaction budget (bytes moved per byte needed; "
        "0 to skip; default inf = always compact, the paper's design); the main paged run "
        "uses the worker's default",
    )


def run(args: argparse.Namespace) -> int:
    """Run the bench; print a table; write JSON to ``--out``. Returns the exit status."""
    path = Path(args.trace)
    if not path.exists():
        print(f"trace not found: {path} (run from the repository root or pass --trace)")
        return 2
    trace = load_trace(path, "alibaba")
    if args.max_requests:
        trace = Trace.from_arrays(
            trace.times[: args.max_requests],
            trace.adapter_keys[: args.max_requests],
            fmt=trace.fmt,
            source=trace.source,
        )
    ranks_choice = [int(x) for x in str(args.ranks).split(",") if x]
    ranks = assign_ranks(trace.keys, ranks_choice, args.seed)
    esize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    working_set = sum(adapter_bytes(SMOLLM2_135M, r, esize) for r in ranks.values())
    pool_bytes = int(working_set * args.pool_fraction)
    host_cache = max(working_set, pool_bytes)
    common: dict[str, Any] = {
        "progress": True,
        "pool_bytes": pool_bytes,
        "host_cache_bytes": host_cache,
        "hold_seconds": args.hold_seconds,
        "device": args.device,
        "dtype": args.dtype,
        "eviction": args.eviction,
    }
    results: dict[str, Any] = {
        "config": {
            "trace": str(path),
            "requests": len(trace),
            "adapters": len(ranks),
            "ranks": ranks_choice,
            "seed": args.seed,
            "dtype": args.dtype,
            "device": args.device,
            "byte_accounting_only": args.device == "meta",
            "working_set_bytes": working_set,
            "pool_fraction": args.pool_fraction,
            "pool_bytes": pool_bytes,
            "host_cache_bytes": host_cache,
            "hold_seconds": args.hold_seconds,
            "eviction": args.eviction,
            "page_bytes": args.page_bytes,
            "model": SMOLLM2_135M.name,
        }
    }
    results["paged"] = replay(trace, ranks, allocator="paged", page_bytes=args.page_bytes, **common)
    results["contiguous"] = replay(
        trace, ranks, allocator="contiguous", page_bytes=args.page_bytes, **common
    )
    if args.compaction_max_ratio > 0:
        results["paged_compaction_budget"] = replay(
            trace,
            ranks,
            allocator="paged",
            page_bytes=args.page_bytes,
            compaction_max_ratio=args.compaction_max_ratio,
            **common,
        )
    sweep_sizes = [int(x) for x in str(args.page_sweep).split(",") if x]
    sweep = []
    for pb in sweep_sizes:
        fig = (
            results["paged"]
            if pb == args.page_bytes
            else replay(trace, ranks, allocator="paged", page_bytes=pb, **common)
        )
        sweep.append(fig)
    results["page_sweep"] = sweep
    results["page_waste_by_rank"] = [
        {
            "rank": r,
            "adapter_bytes": adapter_bytes(SMOLLM2_135M, r, esize),
            **{
                str(pb): page_waste(adapter_bytes(SMOLLM2_135M, r, esize), pb)
                for pb in sorted(set(sweep_sizes) | {args.page_bytes})
            },
        }
        for r in ranks_choice
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, sort_keys=True))
    _print_table(results)
    return 0


def _print_table(results: dict[str, Any]) -> None:
    cfg = results["config"]
    assert isinstance(cfg, dict)
    print(
        f"{cfg['requests']} requests, {cfg['adapters']} adapters, working set "
        f"{cfg['working_set_bytes'] / 2**30:.2f} GiB, pool {cfg['pool_bytes'] / 2**30:.2f} GiB "
        f"({cfg['dtype']}, device {cfg['device']})"
    )
    cols = (
        "util_press",
        "ext_frag",
        "run_frag",
        "waste",
        "loads",
        "evict",
        "compact",
        "GiB_moved",
        "splits",
        "extents",
        "failed",
        "wall_s",
    )
    print(f"{'run':<22}" + "".join(f"{c:>11}" for c in cols))
    rows = [("paged", results["paged"]), ("contiguous", results["contiguous"])]
    if "paged_compaction_budget" in results:
        f = results["paged_compaction_budget"]
        rows.append((f"paged budget={f['compaction_max_ratio']:g}", f))
    rows += [(f"paged page={f['page_bytes'] >> 10}KiB", f) for f in results["page_sweep"]]
    for name, f in rows:
        assert isinstance(f, dict)
        vals = (
            f"{f['utilization_under_pressure']:.4f}",
            f"{f['external_fragmentation']:.4f}",
            f"{f['free_run_fragmentation']:.4f}",
            f"{f['internal_waste']:.4f}",
            str(f["loads"]),
            str(f["evictions"]),
            str(f["compactions"]),
            f"{f['bytes_moved'] / 2**30:.2f}",
            str(f["splits"]),
            f"{f['mean_extents_per_adapter']:.3f}",
            str(f["failed_allocations"]),
            f"{f['wall_seconds']:.1f}",
        )
        print(f"{name:<22}" + "".join(f"{v:>11}" for v in vals))


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (``python -m plora.bench.pool``)."""
    parser = argparse.ArgumentParser(prog="plora bench pool", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
