"""Hardware presets of the simulator: step-time model, memory sizes, copy and load costs.

A preset says how long one continuous-batching step takes on one worker, how big the adapters
and the pools are, and what loading an adapter costs. Two are built in:

``cpu``
    One worker process of this project's live cluster on this machine (2 CPU cores shared by
    two workers and the other services, float32 SmolLM2-135M-Instruct, the worker's default
    sizes from :class:`services.worker.config.WorkerConfig`). Step and load times are fitted
    to a live replay on this machine (see :data:`CPU_STEP_MEASUREMENTS`); the source tier is
    a local PEFT directory, so a load costs ``source_fixed_s`` + bytes / ``source_bytes_per_s``.
``h100-8b``
    One NVIDIA H100 SXM 80 GB serving a Llama-3-8B-class model in bf16 (32 layers, hidden
    4096, MLP 14336, 32 heads, 8 KV heads), adapters on all seven projections, pool of 16 GiB,
    host tier in pinned RAM. The step time is a roofline model checked against published
    measurements (figures in :data:`H100_8B_SOURCES`); the source tier is remote storage whose
    load latency is drawn from Alibaba's real measurements
    (``alibaba_genai2026_lora_load_latency_ms.csv``: median 4.4 s, p90 6.1 s).

Step-time model (:class:`StepTimeModel`), seconds, for a step with ``rows`` decode rows,
``prefill`` prompt tokens, ``segments`` distinct adapters and per-row ranks::

    t = base_s + per_row_s * rows + per_prefill_token_s * prefill
        + lora_segment_s * segments * R_seg + lora_token_rank_s * L

``rank_mode = "max"`` (padded multi-LoRA kernels: S-LoRA's MBGMV and Punica's BGMV launch one
kernel over the batch and pad every row to the largest rank in it): ``R_seg = max rank`` and
``L = (rows + prefill) * max rank``; mixing ranks therefore slows every row down, which is the
effect LoRAServe (arXiv 2511.22880) removes by routing by rank. ``rank_mode = "sum"`` (this
project's CPU engine: one ``addmm`` per adapter segment, no padding): ``R_seg = 1`` and
``L = sum over rows and prefill tokens of their adapter's rank``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from services.common.types import PROJECTION_MODULES, SMOLLM2_135M, ModelSpec
from services.worker.config import WorkerConfig
from services.worker.engine import EngineConfig
from services.worker.store import StoreConfig

#: Presets understood by :func:`get_preset`.
PRESET_NAMES: tuple[str, ...] = ("cpu", "h100-8b")

#: Real remote-storage LoRA load latencies (ms), relative to the repository root.
ALIBABA_LOAD_LATENCY_CSV = Path("../shared/data/traces/alibaba_genai2026_lora_load_latency_ms.csv")

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class StepTimeModel:
    """Duration of one engine step (see the module doc for the formula).

    Attributes:
        base_s: Fixed cost of a step (weights read once, launch overhead), seconds.
        per_row_s: Extra seconds per decode row (KV-cache read, sampling).
        per_prefill_token_s: Seconds per prompt token in the step.
        lora_segment_s: Seconds per adapter segment (per unit rank in ``max`` mode).
        lora_token_rank_s: Seconds per token per unit of rank.
        rank_mode: ``"max"`` (padded kernels) or ``"sum"`` (per-segment matmuls).
    """

    base_s: float
    per_row_s: float
    per_prefill_token_s: float
    lora_segment_s: float
    lora_token_rank_s: float
    rank_mode: str = "max"

    def __post_init__(self) -> None:
        if self.rank_mode not in ("max", "sum"):
            raise ValueError(f"rank_mode must be 'max' or 'sum', got {self.rank_mode!r}")
        if min(self.base_s, self.per_row_s, self.per_prefill_token_s) < 0:
            raise ValueError("step-time coefficients must be >= 0")

    def step_s(
        self, rows: int, prefill: int, segments: int, rank_tokens: float, max_rank: int
    ) -> float:
        """Seconds of one step.

        Args:
            rows: Decode rows (one token each).
            prefill: Prompt tokens prefilled in the step.
            segments: Distinct adapters in the step.
            rank_tokens: ``sum`` mode: sum of the rank over every token of the step.
            max_rank: Largest rank in the step (0 = base model only).
        """
        if self.rank_mode == "max":
            lora = (
                self.lora_segment_s * segments * max_rank
                + self.lora_token_rank_s * (rows + prefill) * max_rank
            )
        else:
            lora = self.lora_segment_s * segments + self.lora_token_rank_s * rank_tokens
        return self.base_s + self.per_row_s * rows + self.per_prefill_token_s * prefill + lora


@dataclass(frozen=True)
class Preset:
    """Everything the simulator needs to know about one worker type.

    Attributes:
        name: Preset name.
        model: Shape of the base model (adapter sizes follow from it).
        dtype_bytes: Bytes per adapter element in the pool.
        ranks: Adapter ranks, cycled over the adapters (as ``plora make-adapters`` does).
        step: Step-time model.
        max_batch_size: Running sequences per worker at most.
        max_num_batched_tokens: Prefill token budget of one step.
        max_queue: Waiting requests per worker at most; more are rejected (the gateway then
            tries another worker).
        pool_bytes: Device adapter pool, bytes.
        page_bytes: Page of the paged allocator, bytes.
        alignment_bytes: Granularity of the contiguous allocator, bytes.
        host_cache_bytes: Host tier bound, bytes.
        h2d_bytes_per_s: Host -> device copy bandwidth, bytes/s.
        device_copy_bytes_per_s: Device-internal copy bandwidth (compaction moves), bytes/s.
        source: ``"alibaba"`` (latency drawn from the real measurements) or ``"fixed"``.
        source_fixed_s: ``fixed``: seconds per source read on top of the bytes term.
        source_bytes_per_s: ``fixed``: read + pack bandwidth of the source tier, bytes/s.
        loader_threads: Concurrent adapter loads per worker.
        adapter_wait_timeout_s: A request waiting longer for its adapter fails.
        load_wait_timeout_s: A demand load waiting longer for pool space fails its requests.
        network_s: Gateway -> worker -> gateway overhead added to every TTFT, seconds.
        shared_compute: 0 when every worker owns its accelerator; else the workers share one
            processor worth this many busy workers, and a step planned while ``b`` workers are
            busy takes ``max(1, b / shared_compute)`` times longer (the CPU cluster on one box).
        notes: Where the figures come from.
    """

    name: str
    model: ModelSpec
    dtype_bytes: int
    ranks: tuple[int, ...]
    step: StepTimeModel
    max_batch_size: int
    max_num_batched_tokens: int
    max_queue: int
    pool_bytes: int
    page_bytes: int
    alignment_bytes: int
    host_cache_bytes: int
    h2d_bytes_per_s: float
    device_copy_bytes_per_s: float
    source: str
    source_fixed_s: float
    source_bytes_per_s: float
    loader_threads: int
    adapter_wait_timeout_s: float
    load_wait_timeout_s: float
    network_s: float
    shared_compute: float = 0.0
    notes: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.source not in ("alibaba", "fixed"):
            raise ValueError(f"source must be 'alibaba' or 'fixed', got {self.source!r}")
        if self.host_cache_bytes < self.pool_bytes:
            raise ValueError("host_cache_bytes must be >= pool_bytes (as the store requires)")
        if self.max_num_batched_tokens < self.max_batch_size or self.max_batch_size < 1:
            raise ValueError("need max_num_batched_tokens >= max_batch_size >= 1")

    def adapter_bytes(self, rank: int) -> int:
        """Bytes of one adapter of ``rank`` on all seven projections of every layer."""
        per_layer = sum(sum(self.model.module_shape(m)) for m in PROJECTION_MODULES)
        return int(rank) * per_layer * self.model.num_layers * self.dtype_bytes

    def adapter_pieces(self, rank: int) -> list[int]:
        """Byte sizes of one adapter's tensors in the store's packed order (for each layer and
        projection, sorted: A ``[r, in]`` then B ``[out, r]``), the pieces a split allocation
        is cut between (``services.worker.store.slot_pieces``)."""
        r, e = int(rank), self.dtype_bytes
        layer: list[int] = []
        for m in sorted(PROJECTION_MODULES):
            fan_in, fan_out = self.model.module_shape(m)
            layer += [r * fan_in * e, fan_out * r * e]
        return layer * self.model.num_layers

    def with_overrides(self, **kw: object) -> Preset:
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return replace(self, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- models

#: Llama-3-8B (Meta's ``config.json``: 32 layers, hidden 4096, MLP 14336, 32 heads, 8 KV
#: heads, vocab 128,256).
LLAMA3_8B = ModelSpec(
    name="Llama-3-8B",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

# ---------------------------------------------------------------------------------- cpu
#: Measurements behind the ``cpu`` preset, seconds (the live cluster on this machine: 2 CPU
#: cores shared by 2 workers, the gateway, the predictor, Redis and the replay client).
#:
#: Calibration run: ``plora bench replay --trace ../shared/data/traces/
#: alibaba_genai2026_lora_requests_nov.csv --format alibaba --time-scale 60 --start 6000
#: --duration 60 --policies baseline --workers 2`` (``bench-out/calib1``, 142 requests, 8 output
#: tokens, prompts capped at 64 words). From its first five requests (one running sequence,
#: so no queueing): decode step 0.10-0.16 s (median 0.14 s); worker TTFT minus adapter wait,
#: i.e. one prefill step of 51-64 prompt tokens, 0.36-0.95 s (median 0.54 s); cold adapter
#: waits 0.19 / 0.41 s (rank 16, 19.5 MB), 0.62 s (rank 32, 39 MB), 0.72 / 1.11 s (rank 64,
#: 78 MB), i.e. about 0.1 s + bytes / 100 MB/s (read, convert, pack, copy); client TTFT minus
#: worker TTFT 13 ms (gateway and two gRPC hops). The growth with batch size is taken from the
#: stated reference figures of ``shared/data/README.md`` for the same model on this machine
#: (17 tokens/s at batch 1 and 95 tokens/s at batch 8, i.e. batch 8 costs 1.43x batch 1).
#: Note that the machine was shared with other jobs (load average 6-11) during calibration:
#: the preset describes this machine as it was, not an idle one. ``plora bench engine`` JSON
#: was not available when the preset was written.
CPU_STEP_MEASUREMENTS: dict[str, float] = {
    "decode_batch1_s": 0.13,
    "prefill_57_tokens_s": 0.54,
    "reference_batch8_over_batch1": (8.0 / 95.0) / (1.0 / 17.0),
    "load_fixed_s": 0.1,
    "load_bytes_per_s": 100e6,
    "gateway_overhead_s": 0.013,
}

#: The live worker's defaults (sizes, queue, loader threads, timeouts): the cpu preset uses them.
_WORKER, _ENGINE, _STORE = WorkerConfig(), EngineConfig(), StoreConfig()

_cpu_base = CPU_STEP_MEASUREMENTS["decode_batch1_s"]
_cpu_row = _cpu_base * (CPU_STEP_MEASUREMENTS["reference_batch8_over_batch1"] - 1.0) / 7.0
_cpu_prefill = (CPU_STEP_MEASUREMENTS["prefill_57_tokens_s"] - _cpu_base) / 57.0

CPU_PRESET = Preset(
    name="cpu",
    model=SMOLLM2_135M,
    dtype_bytes=4,
    ranks=(8, 16, 32, 64),
    step=StepTimeModel(
        base_s=_cpu_base - _cpu_row,
        per_row_s=_cpu_row,
        per_prefill_token_s=_cpu_prefill,
        # per adapter segment: 210 small addmm pairs in Python; per token and unit rank: the
        # LoRA matmuls (about 1 % of the base model's FLOPs per unit rank at this width)
        lora_segment_s=4.0e-3,
        lora_token_rank_s=3.0e-6,
        rank_mode="sum",
    ),
    max_batch_size=_WORKER.max_batch_size,
    max_num_batched_tokens=_WORKER.max_num_batched_tokens,
    max_queue=_ENGINE.max_queue,
    pool_bytes=_WORKER.pool_bytes,
    page_bytes=_WORKER.page_bytes,
    alignment_bytes=_STORE.alignment_bytes,
    host_cache_bytes=_WORKER.host_cache_bytes,
    h2d_bytes_per_s=4.0e9,  # CPU "device": one memcpy into the pool tensor
    device_copy_bytes_per_s=4.0e9,
    source="fixed",
    source_fixed_s=CPU_STEP_MEASUREMENTS["load_fixed_s"],
    source_bytes_per_s=CPU_STEP_MEASUREMENTS["load_bytes_per_s"],
    loader_threads=_STORE.loader_threads,
    adapter_wait_timeout_s=_ENGINE.adapter_wait_timeout_s,
    load_wait_timeout_s=_WORKER.load_wait_timeout_s,
    network_s=CPU_STEP_MEASUREMENTS["gateway_overhead_s"],
    # 2 cores, and `plora up` gives each worker cores // workers torch threads: two busy
    # workers run side by side (one core each), a third and more share. (1.0, "every busy
    # worker halves the other's speed", made the simulated TTFT 34-47 % high against an idle
    # live replay; the solo-request fit already holds the contention the replay saw.)
    shared_compute=2.0,
    notes="SmolLM2-135M float32, 2 workers on 2 shared CPU cores; see CPU_STEP_MEASUREMENTS",
)

# ---------------------------------------------------------------------------------- h100
#: Published figures behind the ``h100-8b`` preset.
H100_8B_SOURCES: dict[str, str] = {
    "hbm_bandwidth": "NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16.",
    "decode_batch1": (
        "J. Musgrave, 'vLLM throughput-latency sweep on NVIDIA A100' (Llama-3.1-8B-Instruct BF16, "
        "vLLM 0.23): ~75 tokens/s at one request on an A100-40GB (1.55 TB/s), 77 % of the "
        "memory roofline, and 6.6x throughput from batching to 8 with almost no latency cost. "
        "Scaled to H100 SXM (3.35 TB/s) at the same 77 %: 16.1 GB of weights / (0.77 * "
        "3.35 TB/s) = 6.2 ms per decode step. Lambda's vLLM benchmark (H100-80GB-SXM vs "
        "A100-80GB-SXM) reports ~2x lower latency on H100, consistent with this."
    ),
    "per_row": (
        "KV read per decode row: Llama-3-8B holds 128 KiB of KV per token (32 layers x 8 KV "
        "heads x 128 x 2 x bf16); ~200 tokens of context = 25 MiB per row per step = 10 us at "
        "2.6 TB/s, plus sampling and scheduling per row; we use 40 us, so batch 64 takes "
        "8.8 ms (7,300 tokens/s), in line with vLLM's published 8B-on-H100 throughput."
    ),
    "prefill": (
        "Prefill is compute-bound: 2 x 8.0 GFLOP = 16 GFLOP per token; at 50 % of 989 TFLOP/s "
        "dense BF16 that is 32 us per prompt token (a 1,024-token prompt: ~33 ms)."
    ),
    "lora": (
        "Punica (Chen et al., MLSys 2024, arXiv 2310.18547, section 7, figures 11-12): serving "
        "many LoRA models in one batch costs about 2 ms extra per generated token with the "
        "SGMV/BGMV kernels (7B, rank 16). S-LoRA (arXiv 2311.03285) pads rows to the largest "
        "rank of the batch (MBGMV). We model 1.0 us per token per unit of the batch's largest "
        "rank plus reading each distinct adapter's weights padded to that rank "
        "(5.24 MB per unit rank for Llama-3-8B, all 7 projections, bf16) at 2.6 TB/s = 2.0 us "
        "per segment per unit rank: a batch of 32 rows over 8 adapters of max rank 16 adds "
        "0.26 + 0.51 = 0.77 ms; max rank 64 adds 3.1 ms."
    ),
    "h2d": (
        "PCIe Gen5 x16: 64 GB/s per direction theoretical; pinned cudaMemcpyAsync reaches "
        "about 50 GB/s; we use 25 GB/s to leave room for concurrent KV and activation traffic."
    ),
    "source": (
        "Alibaba cluster-trace-v2026-GenAI lora_update_latency: 27,415 real LoRA load times "
        "from remote storage, median 4.4 s, p90 6.1 s, p99 8.2 s (drawn per load)."
    ),
    "vllm_defaults": "vLLM defaults: max_num_seqs 256; chunked prefill budget 2,048-8,192 tokens.",
}

H100_8B_PRESET = Preset(
    name="h100-8b",
    model=LLAMA3_8B,
    dtype_bytes=2,
    ranks=(8, 16, 32, 64),
    step=StepTimeModel(
        base_s=6.2e-3,
        per_row_s=40e-6,
        per_prefill_token_s=32e-6,
        lora_segment_s=2.0e-6,
        lora_token_rank_s=1.0e-6,
        rank_mode="max",
    ),
    max_batch_size=256,
    max_num_batched_tokens=4096,
    max_queue=1024,
    pool_bytes=16 * GiB,
    page_bytes=4 * MiB,  # the Predictive-LoRA paper's page size
    alignment_bytes=512,  # cudaMalloc granularity
    host_cache_bytes=128 * GiB,
    h2d_bytes_per_s=25e9,
    device_copy_bytes_per_s=1.3e12,  # device-to-device copy: read + write at ~2.6 TB/s
    source="alibaba",
    source_fixed_s=0.0,
    source_bytes_per_s=1.0,
    loader_threads=4,
    adapter_wait_timeout_s=60.0,
    load_wait_timeout_s=30.0,
    network_s=0.002,
    notes="Llama-3-8B bf16 on one H100 SXM 80 GB; see H100_8B_SOURCES",
)

PRESETS: dict[str, Preset] = {"cpu": CPU_PRESET, "h100-8b": H100_8B_PRESET}


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ValueError: Unknown name.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {PRESET_NAMES}") from None


def load_source_latencies(path: str | Path = ALIBABA_LOAD_LATENCY_CSV) -> np.ndarray:
    """The real LoRA load latencies, seconds.

    Args:
        path: ``alibaba_genai2026_lora_load_latency_ms.csv`` (column ``value``, ms).

    Returns:
        ``float64 [n]`` latencies in seconds, in file order.

    Raises:
        FileNotFoundError: The file is absent.
        ValueError: No ``value`` column.
    """
    p = Path(path)
    with p.open() as fh:
        header = fh.readline().strip().split(",")
    if "value" not in header:
        raise ValueError(f"{p}: no 'value' column in {header}")
    ms = np.loadtxt(p, delimiter=",", skiprows=1, usecols=header.index("value"), ndmin=1)
    return ms.astype(np.float64) / 1000.0
