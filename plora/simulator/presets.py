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
    load latency is drawn from a distribution fitted to Alibaba's real measurements, shipped
    here as numbers (:data:`ALIBABA_LOAD_LATENCY_MS`, :func:`alibaba_load_latencies`: median
    4.4 s, p90 6.1 s).

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

MiB = 1 << 20
GiB = 1 << 30


#: ``StepTimeModel.rank_mode`` values (module doc).
RANK_MODES = ("max", "sum")


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
        if self.rank_mode not in RANK_MODES:
            modes = " or ".join(map(repr, RANK_MODES))
            raise ValueError(f"rank_mode must be {modes}, got {self.rank_mode!r}")
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
        source: ``"alibaba"`` (latency drawn from the distribution of real measurements:
            :func:`source_latencies`) or ``"fixed"``.
        source_fixed_s: ``fixed``: seconds per source read on top of the bytes term.
        source_bytes_per_s: ``fixed``: read + pack bandwidth of the source tier, bytes/s.
        loader_threads: Concurrent adapter loads per worker.
        load_wait_timeout_s: A demand load waiting longer for pool space fails its requests,
            and a request waiting longer for its adapter fails (``DeadlineExceededError``):
            the worker gives its engine ``--load-wait-timeout-s`` as that bound too.
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
#: Calibration run: ``plora bench replay --trace
#: alibaba_genai2026_lora_requests_nov.csv --format alibaba --time-scale 60 --start 6000
#: --duration 60 --policies baseline --workers 2`` (142 requests, 8 output tokens, prompts
#: capped at 64 words). From its first five requests (one running sequence,
#: so no queueing): decode step 0.10-0.16 s (median 0.14 s); worker TTFT minus adapter wait,
#: i.e. one prefill step of 51-64 prompt tokens, 0.36-0.95 s (median 0.54 s); cold adapter
#: waits 0.19 / 0.41 s (rank 16, 19.5 MB), 0.62 s (rank 32, 39 MB), 0.72 / 1.11 s (rank 64,
#: 78 MB), i.e. about 0.1 s + bytes / 100 MB/s (read, convert, pack, copy); client TTFT minus
#: worker TTFT 13 ms (gateway and two gRPC hops). The growth with batch size is taken from the
#: reference figures for the same model on this machine (17 tokens/s at batch 1 and
#: 95 tokens/s at batch 8, i.e. batch 8 costs 1.43x batch 1).
#: The machine was shared with other jobs (load average 6-11) during that run: the preset
#: describes it loaded, not idle.
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
    load_wait_timeout_s=_WORKER.load_wait_timeout_s,
    network_s=CPU_STEP_MEASUREMENTS["gateway_overhead_s"],
    # 2 cores, and `plora up` gives each worker cores // workers torch threads: two busy
    # workers run side by side (one core each), a third and more share. The solo-request fit
    # already holds the contention the calibration run saw, so two busy workers add none.
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
        "from remote storage, median 4.4 s, p90 6.1 s, p99 8.2 s; drawn per load from their "
        "fitted distribution (ALIBABA_LOAD_LATENCY_MS, alibaba_load_latencies)."
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


# ---------------------------------------------------------------------- source latencies
#: Probabilities of the knots of :data:`ALIBABA_LOAD_LATENCY_MS`: every 1 %, then the tail.
ALIBABA_LOAD_LATENCY_P: tuple[float, ...] = (
    *(i / 100 for i in range(100)),
    0.995,
    0.999,
    0.9995,
    0.9999,
    1.0,
)

#: Remote-storage LoRA load latency, ms, at the probabilities :data:`ALIBABA_LOAD_LATENCY_P`
#: (the fit of :func:`alibaba_load_latencies`; refit with :func:`fit_load_latency_quantiles`).
ALIBABA_LOAD_LATENCY_MS: tuple[int, ...] = (
    631, 793, 833, 883, 961, 1131, 1289, 1476, 1990, 2500,
    2701, 2840, 2929, 3002, 3068, 3132, 3186, 3235, 3282, 3330,
    3374, 3415, 3457, 3498, 3534, 3571, 3607, 3643, 3674, 3710,
    3742, 3777, 3809, 3841, 3866, 3898, 3934, 3967, 3997, 4030,
    4062, 4096, 4128, 4156, 4188, 4218, 4250, 4282, 4316, 4346,
    4378, 4411, 4444, 4474, 4507, 4540, 4575, 4610, 4648, 4683,
    4719, 4758, 4792, 4827, 4859, 4894, 4931, 4967, 5002, 5042,
    5083, 5124, 5163, 5198, 5240, 5284, 5325, 5374, 5418, 5464,
    5510, 5556, 5606, 5656, 5710, 5772, 5835, 5906, 5979, 6053,
    6143, 6238, 6344, 6453, 6589, 6767, 6953, 7209, 7565, 8214,
    8927, 21453, 24461, 34983, 38703,
)  # fmt: skip

#: Draws :func:`alibaba_load_latencies` spreads over the distribution by default.
ALIBABA_LOAD_LATENCY_POINTS = 100_000


def alibaba_load_latencies(n: int = ALIBABA_LOAD_LATENCY_POINTS) -> np.ndarray:
    """Remote-storage LoRA load latencies, seconds: the ``h100-8b`` preset's source tier.

    Data: Alibaba's ``cluster-trace-v2026-GenAI`` (github.com/alibaba/clusterdata, file
    ``cluster-trace-v2026-GenAI/lora_update_latency_anon.tar.gz``, commit 7a6c496e): 27,415
    measured LoRA load times from remote storage in production, column ``value`` in ms
    (extracted as ``alibaba_genai2026_lora_load_latency_ms.csv``, sha256 ``35136799...``).

    Distribution: the measurements' empirical distribution, kept as its quantile function at
    105 knots (:data:`ALIBABA_LOAD_LATENCY_P`: every 1 %, then 99.5, 99.9, 99.95, 99.99 and
    100 %; values :data:`ALIBABA_LOAD_LATENCY_MS`, each the sample order statistic, numpy's
    ``inverted_cdf`` quantile), linear between knots, i.e. a piecewise-uniform density. The
    data are bimodal (about 7 % fast loads of 0.6-1.5 s, the rest around 4.4 s) with a thin
    long tail (0.1 % above 21 s, max 38.7 s), which a single lognormal misses (KS distance
    0.16; a two-lognormal mixture 0.017 but loses the tail: p99.9 10.4 s). Fitted numbers,
    seconds: min 0.631, p10 2.701, p25 3.571, p50 4.378, p75 5.284, p90 6.143, p99 8.214,
    p99.9 21.453, max 38.703. Against the 27,415 samples the returned points (default
    ``n``) have a Kolmogorov-Smirnov distance of 0.005, a mean of 4.410 s (samples 4.396 s),
    the same p50, p90 and p99 to 1 ms, p99.9 21.4 s (samples 21.4 s).

    Refit: ``fit_load_latency_quantiles(path_to_the_csv)`` returns the knot values for
    :data:`ALIBABA_LOAD_LATENCY_P`; paste them into :data:`ALIBABA_LOAD_LATENCY_MS` (a test
    checks the two agree when the file is present).

    Args:
        n: Points returned: the fitted quantile function at the probabilities
            ``(i + 0.5) / n``, so a uniformly drawn point (how the simulator draws a load,
            ``SimConfig.source_latencies_s``) follows the fitted distribution.

    Returns:
        ``float64 [n]`` latencies in seconds, ascending.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    p = (np.arange(n, dtype=np.float64) + 0.5) / n
    ms = np.interp(p, ALIBABA_LOAD_LATENCY_P, np.asarray(ALIBABA_LOAD_LATENCY_MS, np.float64))
    return ms / 1000.0


def fit_load_latency_quantiles(path: str | Path) -> tuple[int, ...]:
    """Refit :data:`ALIBABA_LOAD_LATENCY_MS` from a latency file (see
    :func:`alibaba_load_latencies`): the sample order statistics at
    :data:`ALIBABA_LOAD_LATENCY_P`, whole ms.

    Raises:
        FileNotFoundError: The file is absent.
        ValueError: No ``value`` column.
    """
    ms = load_source_latencies(path) * 1000.0
    q = np.quantile(ms, ALIBABA_LOAD_LATENCY_P, method="inverted_cdf")
    return tuple(int(round(v)) for v in q.tolist())


def source_latencies(preset: Preset, path: str | Path | None = None) -> np.ndarray | None:
    """What ``SimConfig.source_latencies_s`` needs for ``preset``.

    Args:
        preset: The preset.
        path: A latency file (:func:`load_source_latencies`) to draw its samples from instead
            of the fitted distribution (:func:`alibaba_load_latencies`).

    Returns:
        ``None`` for a ``"fixed"`` source; else latencies in seconds to draw from.

    Raises:
        FileNotFoundError: ``path`` is absent.
        ValueError: ``path`` has no ``value`` column.
    """
    if preset.source != "alibaba":
        return None
    return alibaba_load_latencies() if path is None else load_source_latencies(path)


def load_source_latencies(path: str | Path) -> np.ndarray:
    """Measured LoRA load latencies from a file, seconds.

    Args:
        path: A CSV with a ``value`` column in ms, such as Alibaba's
            ``alibaba_genai2026_lora_load_latency_ms.csv`` (see :func:`alibaba_load_latencies`).

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
