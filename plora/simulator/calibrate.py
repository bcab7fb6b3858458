"""Calibrate the ``cpu`` preset to the machine as it was during a live replay.

The ``cpu`` preset's figures (:data:`plora.simulator.presets.CPU_STEP_MEASUREMENTS`) were
taken on a shared 2-core host whose speed swings several-fold with the other jobs on it, within
minutes. Timing the real engine in a separate process just before and just after a replay was
tried first and failed: the two timings differed by 1.6x and were 3-5x slower than the workers'
own steps during the replay in between. So the machine's speed is read from the replay itself,
from the requests that had their worker to themselves, and only that: queueing, batching,
adapter residency, cold starts, eviction and routing, which make up the validated figures (TTFT
mean and cold start rate), are left to the simulator.

From a replay's per-request records (``DIR/<policy>/requests.jsonl``, every policy pooled):

* a request is **solo** when no other request was in flight on its worker between its send and
  its last token;
* **decode**: solo requests with ``n >= 2`` tokens give ``(end_s - first_token_s) / (n - 1)``
  per decode step at batch 1 (median), i.e. ``base_s + per_row_s``; the growth with batch rows
  keeps the preset's ratio (``per_row_s / (base_s + per_row_s)``), which solo requests cannot
  show;
* **prefill**: solo warm requests give one prefill step each, ``worker_ttft_s`` for a prompt of
  ``prompt_tokens``: ``per_prefill_token_s`` is the median of ``(ttft - base_s) / tokens``
  (without decode samples, a least-squares line gives both);
* **loads**: solo cold requests give ``adapter_wait_s`` for their adapter's bytes; a
  least-squares line ``fixed + bytes / bandwidth`` (the median as a fixed cost when the sizes
  do not spread).

The network overhead is the median of ``first_token_s - sent_s - worker_ttft_s``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plora.simulator.presets import CPU_PRESET, Preset, StepTimeModel

#: Fewest solo requests a fit uses; with fewer the preset's figure is kept.
MIN_SAMPLES = 5


def read_records(replay_dir: str | Path, policies: Sequence[str]) -> list[dict[str, Any]]:
    """Every policy's request records of a ``plora bench replay`` output directory, each with
    ``policy`` added.

    Raises:
        FileNotFoundError: A policy has no ``requests.jsonl``.
    """
    out: list[dict[str, Any]] = []
    for p in policies:
        path = Path(replay_dir) / p / "requests.jsonl"
        for line in path.read_text("utf-8").splitlines():
            if line.strip():
                out.append({**json.loads(line), "policy": p})
    return out


def solo_mask(records: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """``bool [n]``: the completed request had no other request of its run in flight on its
    worker between its send and its last token."""
    n = len(records)
    ok = np.array([r.get("status") == "OK" for r in records])
    out = np.zeros(n, dtype=bool)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(records):
        if ok[i]:
            groups.setdefault((str(r.get("policy", "")), str(r["worker_id"])), []).append(i)
    for idx in groups.values():
        s = np.array([records[i]["sent_s"] for i in idx], dtype=np.float64)
        e = np.array([records[i]["end_s"] for i in idx], dtype=np.float64)
        order = np.argsort(s, kind="stable")
        s, e = s[order], e[order]
        prev_end = np.maximum.accumulate(np.concatenate([[-np.inf], e[:-1]]))
        next_start = np.concatenate([s[1:], [np.inf]])
        solo = (prev_end <= s) & (next_start >= e)
        out[np.asarray(idx)[order]] = solo
    return out


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    """``(intercept, slope)`` of a least-squares line, or None if ``x`` does not spread."""
    if len(x) < 2 or np.ptp(x) <= 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def fit_replay(
    records: Sequence[Mapping[str, Any]],
    adapter_bytes: Mapping[str, int],
    adapter_rank: Mapping[str, int],
    base: Preset = CPU_PRESET,
) -> tuple[Preset, dict[str, Any]]:
    """The preset fitted to the solo requests of a replay (see the module doc).

    Args:
        records: Request records (:func:`read_records`).
        adapter_bytes: Pool bytes of each adapter id.
        adapter_rank: Rank of each adapter id.
        base: Preset whose other figures (sizes, LoRA terms, ratios) are kept.

    Returns:
        ``(preset, figures)``: the fitted preset and what it was fitted from (sample counts,
        medians, fitted terms), for the report.
    """
    st = base.step
    solo = solo_mask(records)
    warm = [r for r, s in zip(records, solo, strict=True) if s and not r["adapter_cold"]]
    cold = [r for r, s in zip(records, solo, strict=True) if s and r["adapter_cold"]]
    figures: dict[str, Any] = {"requests": len(records), "solo": int(solo.sum())}

    # decode at batch 1: base + per_row + seg + ltr * r (solo: nothing else in the batch)
    base_s, per_row, per_prefill = st.base_s, st.per_row_s, st.per_prefill_token_s
    row_share = st.per_row_s / (st.base_s + st.per_row_s)
    dec = [r for r, s in zip(records, solo, strict=True) if s and r["completion_tokens"] >= 2]
    if len(dec) >= MIN_SAMPLES:
        d = np.array(
            [
                (r["end_s"] - r["first_token_s"]) / (r["completion_tokens"] - 1)
                - st.lora_segment_s
                - st.lora_token_rank_s * adapter_rank[r["adapter_id"]]
                for r in dec
            ]  # fmt: skip
        )
        d1 = float(np.median(d))
        per_row = max(0.0, d1 * row_share)
        base_s = max(0.0, d1 - per_row)
        figures["decode"] = {"samples": len(dec), "step_b1_s": d1}

    # prefill: worker TTFT of a warm solo request = base + seg + (per_prefill + ltr r) * P
    if len(warm) >= MIN_SAMPLES:
        p = np.array([r["prompt_tokens"] for r in warm], dtype=np.float64)
        rk = np.array([adapter_rank[r["adapter_id"]] for r in warm], dtype=np.float64)
        y = np.array([r["worker_ttft_s"] for r in warm], dtype=np.float64)
        y = y - st.lora_token_rank_s * rk * p - st.lora_segment_s
        if "decode" in figures:
            per_prefill = max(0.0, float(np.median((y - base_s) / np.maximum(p, 1.0))))
        else:
            fit = _line(p, y)
            if fit is not None and fit[0] > 0 and fit[1] > 0:
                base_s, per_prefill = fit
            else:
                per_prefill = max(0.0, float(np.median((y - base_s) / np.maximum(p, 1.0))))
        figures["prefill"] = {"samples": len(warm), "per_token_s": per_prefill,
                              "median_s": float(np.median(y))}  # fmt: skip

    # loads
    fixed, bandwidth = base.source_fixed_s, base.source_bytes_per_s
    if len(cold) >= MIN_SAMPLES:
        b = np.array([adapter_bytes[r["adapter_id"]] for r in cold], dtype=np.float64)
        w = np.array([r["adapter_wait_s"] for r in cold], dtype=np.float64)
        fit = _line(b, w)
        if fit is not None and fit[1] > 0 and fit[0] >= 0:
            fixed, bandwidth = fit[0], 1.0 / fit[1]
        else:
            fixed = max(0.0, float(np.median(w - b / bandwidth)))
        figures["loads"] = {"samples": len(cold), "fixed_s": fixed, "bytes_per_s": bandwidth,
                            "median_wait_s": float(np.median(w))}  # fmt: skip

    nets = [r["first_token_s"] - r["sent_s"] - r["worker_ttft_s"] for r in records
            if r.get("status") == "OK"]  # fmt: skip
    network = float(np.median(nets)) if nets else base.network_s
    figures["network_s"] = network
    preset = base.with_overrides(
        step=StepTimeModel(
            base_s, per_row, per_prefill, st.lora_segment_s, st.lora_token_rank_s, st.rank_mode
        ),
        source_fixed_s=fixed,
        source_bytes_per_s=bandwidth,
        network_s=network,
        notes=f"cpu preset fitted to the solo requests of a live replay: {figures}",
    )
    return preset, figures
