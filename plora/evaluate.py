"""``plora eval predictor``: replay a trace through the forecasters and score their rankings.

The replay uses the same forecaster code as the predictor service, with no network: arrivals are
put in 1 s buckets (an arrival at time ``x`` belongs to bucket ``ceil(x)``, i.e. ``(b - 1, b]``);
at every whole second ``t`` the forecaster observes bucket ``t``, ticks, and its ranking is
compared with what happens in ``(t, t + 5 s]`` (buckets ``t+1 .. t+5``). Training (LSTM) runs
after the tick and is timed separately.

Metrics (``W_t`` = the requests in ``(t, t + h]``, h = 5 s):

* ``recall_at_3_5s``: the truth is the (up to) 3 adapters with the most requests in ``W_t``,
  ties broken by the trace's key order (its first row); score
  ``|predicted top-3 ∩ true top-3| / |true top-3|``, averaged over the seconds whose window
  has at least one request.
* ``hit_at_8_5s`` / ``hit_at_32_5s``: request-weighted within a window: the share of the
  requests of ``W_t`` whose adapter is in the predicted top 8 / top 32, averaged over the
  seconds whose window has at least one request (as recall).
* ``prefetch_precision``: the prefetch set of a second is the predicted top 8 restricted to
  probability >= 0.5; precision = (prefetched adapters requested in ``W_t``) / (prefetched
  adapters), summed over all seconds (``null`` when nothing was ever prefetched).
* ``prefetch_per_s``: mean size of that prefetch set.
* ``recall_bound_seen_before``: per second, the share of the true top 3 that had at least one
  request at or before ``t``, averaged like recall: the ceiling of any forecaster that can only
  rank adapters it has seen.
* ``tick_seconds_p50`` / ``tick_seconds_p99``: wall time of the forecaster's ``tick()``, the
  call that closes the bucket and makes the forecast (the predictor service runs exactly this
  call per tick, under its lock; its Redis publication, placement and prefetch RPCs that follow
  are not part of it); ``train_seconds_p50`` / ``_p99``: wall time of the ``train()`` call that
  follows it (off the forecast path, as in the service).
* ``adapters_seen``: distinct adapters the forecaster had observed by the end.

``oracle`` ranks by the true counts of ``W_t`` (probability 1 for a requested adapter): the
ceiling of every metric.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from plora.traces import load_trace
from services.predictor.forecast import FORECASTER_NAMES, Forecaster, make_forecaster

logger = logging.getLogger(__name__)

EVAL_FORMATS = ("alibaba", "azure2019", "azure2021", "azure_llm2023")
DEFAULT_FORECASTERS = ("lstm", "frequency", "ewma", "ensemble")


@dataclass
class _Score:
    """Running sums of one forecaster's metrics."""

    recall_sum: float = 0.0
    recall_n: int = 0
    hits8: float = 0.0
    hits32: float = 0.0
    prefetched: int = 0
    prefetched_hit: int = 0
    tick_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    adapters_seen: int = 0

    def result(self, bound: float | None) -> dict:
        def pct(xs: list[float], q: float) -> float | None:
            return float(np.percentile(xs, q)) if xs else None

        return {
            "recall_at_3_5s": self.recall_sum / self.recall_n if self.recall_n else None,
            "hit_at_8_5s": self.hits8 / self.recall_n if self.recall_n else None,
            "hit_at_32_5s": self.hits32 / self.recall_n if self.recall_n else None,
            "prefetch_precision": (
                self.prefetched_hit / self.prefetched if self.prefetched else None
            ),
            "prefetch_per_s": self.prefetched / max(1, self.recall_n_total),
            "recall_bound_seen_before": bound,
            "tick_seconds_p50": pct(self.tick_s, 50),
            "tick_seconds_p99": pct(self.tick_s, 99),
            "train_seconds_p50": pct(self.train_s, 50),
            "train_seconds_p99": pct(self.train_s, 99),
            "adapters_seen": self.adapters_seen,
        }

    recall_n_total: int = 0


def _score_ranking(
    s: _Score,
    pred_keys: np.ndarray,
    pred_prob: np.ndarray,
    win_keys: np.ndarray,
    win_counts: np.ndarray,
    true3: np.ndarray,
) -> None:
    """Add one second's ranking (``pred_keys`` best first, trace key indices) to ``s``."""
    s.recall_n_total += 1
    top8 = pred_keys[:8]
    pf = top8[pred_prob[:8] >= 0.5]
    s.prefetched += len(pf)
    if len(win_keys) == 0:
        return
    s.recall_sum += len(np.intersect1d(pred_keys[:3], true3)) / len(true3)
    s.recall_n += 1
    total = float(win_counts.sum())
    s.hits8 += float(win_counts[np.isin(win_keys, top8)].sum()) / total
    s.hits32 += float(win_counts[np.isin(win_keys, pred_keys[:32])].sum()) / total
    s.prefetched_hit += int(np.isin(pf, win_keys).sum())


def evaluate_trace(
    times: np.ndarray,
    key_index: np.ndarray,
    keys: tuple[str, ...],
    forecasters: dict[str, Forecaster],
    *,
    horizon_s: float = 5.0,
    max_seconds: int | None = None,
    train_budget_s: float = 0.05,
    with_oracle: bool = True,
    progress: bool = False,
) -> dict[str, dict]:
    """Replay arrivals through ``forecasters`` and score them (see the module doc).

    Args:
        times: ``float64 [n]`` sorted arrival seconds (from 0).
        key_index: ``int [n]`` index into ``keys`` per arrival.
        keys: Adapter ids.
        forecasters: ``{name: forecaster}``; each is ticked every second.
        horizon_s: Window length h (whole seconds).
        max_seconds: Evaluate only ticks ``t < max_seconds``.
        train_budget_s: Budget passed to ``train()`` after each tick.
        with_oracle: Also score the oracle.
        progress: Show a progress bar of the ticks on stderr when it is a terminal.

    Returns:
        ``{name: metrics}`` with ``"oracle"`` added when asked.
    """
    h = int(round(horizon_s))
    bucket = np.ceil(times).astype(np.int64)
    n_ticks = int(bucket[-1]) + 1 if len(bucket) else 0
    if max_seconds is not None:
        n_ticks = min(n_ticks, int(max_seconds))
    # arrivals of bucket b are [starts[b], starts[b+1])
    starts = np.searchsorted(bucket, np.arange(n_ticks + h + 2), side="left")
    scores = {name: _Score() for name in forecasters}
    oracle = _Score()
    seen = np.zeros(len(keys), dtype=bool)
    bound_sum, bound_n = 0.0, 0
    row_key: dict[str, np.ndarray] = {name: np.zeros(0, dtype=np.int64) for name in forecasters}
    key_of = {k: i for i, k in enumerate(keys)}
    quiet = None if progress else True  # None: quiet unless stderr is a terminal
    ticks = tqdm(range(n_ticks), desc="forecasters", unit="tick", disable=quiet, leave=False)
    for t in ticks:
        lo, hi = starts[t], starts[t + 1]
        if hi > lo:
            ks, cs = np.unique(key_index[lo:hi], return_counts=True)
            counts = {keys[k]: int(c) for k, c in zip(ks.tolist(), cs.tolist(), strict=True)}
            seen[ks] = True
        else:
            counts = {}
        # the truth: window (t, t + h]
        wlo, whi = starts[t + 1], starts[min(t + h + 1, len(starts) - 1)]
        wk, wc = np.unique(key_index[wlo:whi], return_counts=True)
        order = np.lexsort((wk, -wc))  # count desc, then trace key order
        true_rank = wk[order]
        true3 = true_rank[:3]
        if len(wk):
            bound_sum += float(seen[true3].mean())
            bound_n += 1
        for name, f in forecasters.items():
            s = scores[name]
            f.observe_counts(counts, float(t))
            t0 = time.perf_counter()
            fc = f.tick(float(t))
            t1 = time.perf_counter()
            f.train(train_budget_s)
            t2 = time.perf_counter()
            s.tick_s.append(t1 - t0)
            s.train_s.append(t2 - t1)
            rk = row_key[name]
            if len(rk) < len(f.ids):
                rk = np.concatenate(
                    [rk, np.array([key_of.get(a, -1) for a in f.ids[len(rk) :]], dtype=np.int64)]
                )
                row_key[name] = rk
            idx = fc.ranking(64)
            _score_ranking(s, rk[fc.rows[idx]], fc.probability[idx], wk, wc, true3)
        if with_oracle:
            _score_ranking(oracle, true_rank, np.ones(len(true_rank)), wk, wc, true3)
    bound = bound_sum / bound_n if bound_n else None
    out = {}
    for name, f in forecasters.items():
        scores[name].adapters_seen = len(f.ids)
        out[name] = scores[name].result(bound)
    if with_oracle:
        oracle.adapters_seen = int(seen.sum())
        out["oracle"] = oracle.result(bound)
        out["oracle"]["tick_seconds_p50"] = out["oracle"]["tick_seconds_p99"] = None
    return out


def tick_benchmark(
    name: str,
    n_adapters: int = 5000,
    seconds: int = 300,
    rate_per_s: float = 200.0,
    zipf_exponent: float = 1.0,
    seed: int = 0,
    train_budget_s: float = 0.05,
    progress: bool = False,
) -> dict:
    """Tick latency with many adapter ids: the worst case of a large tracked set.

    Every one of ``n_adapters`` ids is requested once at t = 0 (so all are tracked: the LSTM
    steps every one of them each tick), then for ``seconds`` seconds ``Poisson(rate_per_s)``
    requests per second go to ids drawn from a Zipf law. The timed call is the forecaster's
    ``tick()``, as in :func:`evaluate_trace`; ``train()`` follows it, timed apart. Returns tick
    p50/p99 and train p50/p99, in seconds. ``progress`` shows a progress bar of the ticks on
    stderr when it is a terminal.
    """
    rng = np.random.default_rng(seed)
    f = make_forecaster(name, seed=seed)
    ids = [f"adapter-{i:05d}" for i in range(n_adapters)]
    p = (np.arange(n_adapters) + 1.0) ** -zipf_exponent
    p /= p.sum()
    f.observe_counts(dict.fromkeys(ids, 1), 0.0)
    tick_s: list[float] = []
    train_s: list[float] = []
    scored = 0
    quiet = None if progress else True  # None: quiet unless stderr is a terminal
    ticks = tqdm(range(seconds), desc=f"tick {name}", unit="tick", disable=quiet, leave=False)
    for t in ticks:
        ks, cs = np.unique(
            rng.choice(n_adapters, size=rng.poisson(rate_per_s), p=p), return_counts=True
        )
        f.observe_counts({ids[k]: int(c) for k, c in zip(ks, cs, strict=True)}, float(t))
        t0 = time.perf_counter()
        fc = f.tick(float(t))
        t1 = time.perf_counter()
        f.train(train_budget_s)
        train_s.append(time.perf_counter() - t1)
        tick_s.append(t1 - t0)
        scored = len(fc)
    return {
        "adapters": n_adapters,
        "scored_last_tick": scored,
        "tick_seconds_p50": float(np.percentile(tick_s, 50)),
        "tick_seconds_p99": float(np.percentile(tick_s, 99)),
        "train_seconds_p50": float(np.percentile(train_s, 50)),
        "train_seconds_p99": float(np.percentile(train_s, 99)),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora eval predictor``."""
    parser.add_argument("--trace", required=True, help="trace CSV file")
    parser.add_argument("--format", required=True, choices=EVAL_FORMATS, dest="fmt")
    parser.add_argument("--time-scale", type=float, default=1.0, help="t' = t / X (default 1)")
    parser.add_argument("--drop-top", type=int, default=0, help="remove the N busiest adapters")
    parser.add_argument("--start", type=float, default=0.0, help="slice start, scaled seconds")
    parser.add_argument(
        "--max-seconds",
        "--duration",
        type=float,
        default=None,
        dest="max_seconds",
        help="evaluate only this many (scaled) seconds from --start",
    )
    parser.add_argument(
        "--forecasters",
        default=",".join(DEFAULT_FORECASTERS),
        help=f"comma-separated subset of {','.join(FORECASTER_NAMES)} (oracle is always added)",
    )
    parser.add_argument("--horizon", type=float, default=5.0, help="horizon seconds (default 5)")
    parser.add_argument("--train-budget", type=float, default=0.05, help="train() budget, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bench-ids",
        type=int,
        default=5000,
        help="also time tick() with this many synthetic adapter ids (0: skip)",
    )
    parser.add_argument(
        "--bench-seconds",
        type=int,
        default=300,
        help="ticks of that timing run (default 300: p99 is then the 3rd-slowest tick)",
    )
    parser.add_argument("--out", required=True, help="JSON output file")


def run(args: argparse.Namespace) -> int:
    """Run the evaluation, print a table, write JSON to ``args.out``; returns the exit code."""
    trace = load_trace(
        args.trace,
        args.fmt,
        time_scale=args.time_scale,
        seed=args.seed,
        drop_top=args.drop_top,
        start=args.start,
        duration=args.max_seconds,
    )
    names = [n.strip() for n in args.forecasters.split(",") if n.strip()]
    forecasters = {n: make_forecaster(n, horizon_s=args.horizon, seed=args.seed) for n in names}
    t0 = time.perf_counter()
    results = evaluate_trace(
        trace.times,
        trace.key_index,
        trace.keys,
        forecasters,
        horizon_s=args.horizon,
        train_budget_s=args.train_budget,
        progress=True,
    )
    wall = time.perf_counter() - t0
    bench = {}
    if args.bench_ids > 0:
        bench = {
            n: tick_benchmark(
                n,
                n_adapters=args.bench_ids,
                seconds=args.bench_seconds,
                seed=args.seed,
                progress=True,
            )
            for n in names
        }
    report = {
        "config": {
            "trace": str(args.trace),
            "format": args.fmt,
            "time_scale": args.time_scale,
            "drop_top": args.drop_top,
            "start": args.start,
            "max_seconds": args.max_seconds,
            "horizon_s": args.horizon,
            "seed": args.seed,
            "arrivals": len(trace),
            "adapters": len(trace.keys),
            "seconds": int(math.ceil(trace.duration)) + 1 if len(trace) else 0,
            "wall_seconds": wall,
        },
        "forecasters": results,
        "tick_bench": bench,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(format_table(results))
    for n, b in bench.items():
        print(
            f"tick with {b['adapters']} ids, {n}: p50 {b['tick_seconds_p50'] * 1e3:.3f} ms, "
            f"p99 {b['tick_seconds_p99'] * 1e3:.3f} ms (train p99 "
            f"{b['train_seconds_p99'] * 1e3:.3f} ms)"
        )
    return 0


def format_table(results: dict[str, dict]) -> str:
    """A short fixed-width table of the main metrics."""
    cols = [
        ("recall@3", "recall_at_3_5s"),
        ("hit@8", "hit_at_8_5s"),
        ("hit@32", "hit_at_32_5s"),
        ("pf_prec", "prefetch_precision"),
        ("seen_bound", "recall_bound_seen_before"),
        ("tick_p50_ms", "tick_seconds_p50"),
        ("tick_p99_ms", "tick_seconds_p99"),
        ("seen", "adapters_seen"),
    ]
    lines = [f"{'forecaster':<12}" + "".join(f"{c:>12}" for c, _ in cols)]
    for name, r in results.items():
        cells = []
        for _c, k in cols:
            v = r.get(k)
            if v is None:
                cells.append(f"{'-':>12}")
            elif k.startswith("tick"):
                cells.append(f"{v * 1e3:>12.3f}")
            elif isinstance(v, int):
                cells.append(f"{v:>12d}")
            else:
                cells.append(f"{v:>12.3f}")
        lines.append(f"{name:<12}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - thin CLI wrapper
    parser = argparse.ArgumentParser(prog="plora eval predictor", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
