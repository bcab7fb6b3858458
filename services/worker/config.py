"""Worker configuration: one frozen dataclass built from flags with ``PLORA_*`` fallbacks."""

from __future__ import annotations

import argparse
import re
import secrets
import socket
from dataclasses import dataclass, field

from services.common.config import (
    DEFAULT_REDIS_URL,
    adapter_roots_or_env,
    add_adapter_root_argument,
    add_adapter_source_allow_argument,
    add_server_arguments,
    choice_or_env,
    env_or,
    float_flag_or_env,
    inspection_size_limits,
    int_flag_or_env,
    parse_bytes,
    require_at_least_one,
    require_inspection_sizes,
    require_seconds,
    require_server_ports,
    source_allow_or_env,
)
from services.common.errors import ConfigError
from services.common.peft_config import MAX_CONFIG_BYTES, MAX_HEADER_BYTES, InspectionLimits
from services.common.remote_sources import SourceAllowList
from services.common.sources import resolve_roots

ALLOCATORS = ("paged", "contiguous")
EVICTIONS = ("lru", "predictive")
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Multi-LoRA implementations (:func:`services.worker.lora_pages.resolve_lora_kernel`).
LORA_KERNELS = ("auto", "torch", "triton")
#: KV cache kinds (:mod:`services.worker.kv_cache`).
KV_CACHE_KINDS = ("paged", "slot")


def default_worker_id(hostname: str | None = None) -> str:
    """A worker id unique without configuration: the host name (the pod name under
    Kubernetes, the container id under Docker), characters other than letters, digits,
    ``.``, ``_`` and ``-`` replaced by ``-``, then ``-`` and 6 random hex digits, new for
    every process (``gpu-node-3-5f2a9c``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", hostname or socket.gethostname()).strip("-")
    return f"{name or 'worker'}-{secrets.token_hex(3)}"


#: Threads of the worker's gRPC pool beyond its running and waiting streams: adapter, status
#: and health calls, and the streams refused as beyond ``max_queue``.
RESERVED_THREADS = 16


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker process.

    Attributes:
        worker_id: Id in the registry (``PLORA_WORKER_ID``), used as given (a StatefulSet's
            pod name, ``worker-0`` under ``plora up``); unset (empty), a unique one is made:
            :func:`default_worker_id`. One live process holds an id at a time: a second one
            claiming it is refused at start
            (:meth:`~services.common.registry.Registry.claim_worker_id`).
        host: Interface of the gRPC server (``PLORA_WORKER_HOST``).
        port: gRPC port; 0 = any free port (``PLORA_WORKER_PORT``).
        advertise_host: Host the worker publishes in the registry for its peers (gateway,
            predictor) to dial, instead of ``host`` (``PLORA_WORKER_ADVERTISE_HOST``; the
            container name under docker compose, the pod IP under Kubernetes); defaults to
            ``host``.
        metrics_port: Prometheus port; 0 = any (``PLORA_WORKER_METRICS_PORT``).
        redis_url: Metadata store (``PLORA_REDIS_URL``).
        internal_token_file: File holding the internal token
            (``PLORA_INTERNAL_TOKEN_FILE``; :mod:`services.common.internal_auth`).
        internal_token: The internal token itself (``PLORA_INTERNAL_TOKEN``; the file wins);
            with neither, internal authentication is off. Never logged.
        model: Base model: ``smollm2`` (the default GGUF), a ``.gguf`` path, a Hugging Face
            directory, or a Hub model id ``org/name[@revision]`` already in the local Hugging
            Face cache (``PLORA_MODEL``); families Llama, Mistral, Qwen 2/3, Gemma 2/3, Phi-3.
        cache_dir: Where converted models are cached (``PLORA_CACHE_DIR``; empty = default).
        device: ``cpu``, ``cuda``, ``cuda:1``... ; ``auto`` = CUDA when present (``PLORA_DEVICE``).
        dtype: Serving dtype; ``auto`` = float32 on CPU, bfloat16 on CUDA (``PLORA_DTYPE``).
        lora_kernel: Multi-LoRA implementation: ``torch`` (per-segment matmuls), ``triton``
            (kernels that read the paged pool), ``auto`` = triton on CUDA where Triton is
            installed, else torch (``PLORA_LORA_KERNEL``).
        max_batch_size: Most sequences in the running batch.
        attention_kernel: Decode attention over the paged KV cache: ``torch``, ``triton``
            (the paged kernel), ``auto`` = triton on CUDA where installed, else torch
            (``PLORA_ATTENTION_KERNEL``).
        cuda_graphs: ``on``: decode steps run over static, bucketed buffers captured as CUDA
            graphs on CUDA (``PLORA_CUDA_GRAPHS``); ``off`` (default).
        kv_cache: ``paged`` (KV blocks through a block table per sequence; admission counts
            blocks) or ``slot`` (one ``max_model_len`` slot per running sequence)
            (``PLORA_KV_CACHE``).
        kv_block_size: Tokens per KV block (``PLORA_KV_BLOCK_SIZE``).
        kv_cache_tokens: Tokens the paged KV cache holds across all sequences
            (``PLORA_KV_CACHE_TOKENS``); 0 = ``max_batch_size * max_model_len``, the slot
            cache's memory.
        max_queue: Requests waiting for a batch slot (or their adapter) at most; one more is
            refused with RESOURCE_EXHAUSTED (``PLORA_MAX_QUEUE``). The gRPC server has a thread
            for each running and each waiting request plus a reserve
            (:attr:`server_threads`), so a flood meets this bound, not a hidden queue.
        max_num_batched_tokens: Prefill token budget per engine step.
        max_model_len: Context window served (prompt + completion), capped by the model's.
        max_new_tokens_limit: Largest ``max_new_tokens`` accepted.
        pool_bytes: Device adapter pool size in bytes (``PLORA_POOL_BYTES``, e.g. ``512MiB``).
        page_bytes: Page size of the paged allocator (``PLORA_PAGE_BYTES``).
        host_cache_bytes: Host adapter cache bound; must be >= pool_bytes.
        allocator: ``paged`` (first-fit pages + compaction) or ``contiguous`` (baseline).
        eviction: ``predictive`` (lowest forecast demand per byte) or ``lru`` (baseline).
        load_wait_timeout_s: How long a load may wait for pool space before failing its request.
        host_staging: ``on``: read registered adapters into free host-cache space ahead of
            demand (``PLORA_HOST_STAGING``; :meth:`services.worker.store.AdapterStore.stage`);
            ``off`` (the baseline policy): the source is read on demand only.
        threads: Intra-op CPU threads of the engine (``PLORA_WORKER_THREADS``); 0 = all cores.
            Several workers on one host should split the cores (the launcher does): OpenMP
            threads that outnumber the cores wait on each other and run many times slower.
        stall_timeout_s: Seconds the engine's step loop may go without progress while it has
            requests before the worker exits (status 70) for its supervisor to restart it, its
            threads' stacks in the log (``PLORA_STALL_TIMEOUT_S``; 0 = never). vLLM's
            ``VLLM_ENGINE_ITERATION_TIMEOUT_S`` is 60 s too; a step of the default model takes
            well under a second, a long prefill of a large model on CPU may need more.
        heartbeat_interval_s / heartbeat_ttl_s: Registry heartbeat period and liveness TTL.
        adapter_roots: Directories adapter sources must lie under, every symlink followed
            (``--adapter-root``, repeatable; ``PLORA_ADAPTER_ROOTS``, ``os.pathsep``-separated);
            resolved to real paths; empty = sources are read wherever they are.
        adapter_source_allow: Prefixes of the remote sources (``s3://``, ``hf://``) this
            worker downloads (``--adapter-source-allow``; ``PLORA_ADAPTER_SOURCE_ALLOW``; keep
            it at the gateway's); empty = every remote source refused.
        adapter_cache_dir: Node-local directory of downloaded remote adapters
            (``PLORA_ADAPTER_CACHE_DIR``; empty = ``<cache_dir>/adapter-cache/<worker_id>``);
            one worker per directory (:mod:`services.worker.adapter_cache`).
        adapter_cache_bytes: Bound of that cache, least recently used out first
            (``PLORA_ADAPTER_CACHE_BYTES``, e.g. ``20GiB``).
        max_adapter_config_bytes: Largest ``adapter_config.json`` a load reads
            (``PLORA_MAX_ADAPTER_CONFIG_BYTES``, as the gateway's).
        max_safetensors_header_bytes: Largest safetensors header a load reads
            (``PLORA_MAX_SAFETENSORS_HEADER_BYTES``, as the gateway's).
        ready_file: Where to write ``{"grpc_port", "metrics_port"}`` once serving (launcher).
    """

    worker_id: str = ""  # resolved in __post_init__: default_worker_id()
    host: str = "127.0.0.1"
    port: int = 50061
    advertise_host: str = ""
    metrics_port: int = 9101
    redis_url: str = DEFAULT_REDIS_URL
    internal_token_file: str = ""
    internal_token: str = field(default="", repr=False)
    model: str = "smollm2"
    cache_dir: str = ""
    device: str = "auto"
    dtype: str = "auto"
    lora_kernel: str = "auto"
    max_batch_size: int = 32
    attention_kernel: str = "auto"
    cuda_graphs: str = "off"
    kv_cache: str = "paged"
    kv_block_size: int = 16
    kv_cache_tokens: int = 0
    max_queue: int = 256
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    max_new_tokens_limit: int = 512
    pool_bytes: int = 512 << 20
    page_bytes: int = 64 << 10  # measured by `plora bench pool` (see docs/benchmarks.md)
    host_cache_bytes: int = 2048 << 20
    allocator: str = "paged"
    eviction: str = "predictive"
    load_wait_timeout_s: float = 30.0
    host_staging: str = "on"
    threads: int = 0
    stall_timeout_s: float = 60.0
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    adapter_roots: tuple[str, ...] = ()
    adapter_source_allow: tuple[str, ...] = ()
    adapter_cache_dir: str = ""
    adapter_cache_bytes: int = 8 << 30
    max_adapter_config_bytes: int = MAX_CONFIG_BYTES
    max_safetensors_header_bytes: int = MAX_HEADER_BYTES
    ready_file: str = ""

    def __post_init__(self) -> None:
        if not self.worker_id:
            object.__setattr__(self, "worker_id", default_worker_id())
        object.__setattr__(self, "adapter_roots", resolve_roots(self.adapter_roots))
        object.__setattr__(
            self,
            "adapter_source_allow",
            SourceAllowList.parse(self.adapter_source_allow).prefixes,
        )
        require_at_least_one(
            self.adapter_cache_bytes, "--adapter-cache-bytes", "PLORA_ADAPTER_CACHE_BYTES"
        )
        require_server_ports("worker", self.port, self.metrics_port)
        require_inspection_sizes(self.max_adapter_config_bytes, self.max_safetensors_header_bytes)
        if self.allocator not in ALLOCATORS:
            raise ConfigError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.lora_kernel not in LORA_KERNELS:
            raise ConfigError(
                f"lora_kernel must be one of {LORA_KERNELS}, got {self.lora_kernel!r}"
            )
        if self.page_bytes <= 0:
            raise ConfigError(
                f"--page-bytes / PLORA_PAGE_BYTES must be positive, got {self.page_bytes}"
            )
        if self.pool_bytes < self.page_bytes:
            raise ConfigError(
                f"--pool-bytes / PLORA_POOL_BYTES must be at least one page "
                f"({self.page_bytes} bytes, --page-bytes), got {self.pool_bytes}"
            )
        if self.host_cache_bytes < self.pool_bytes:
            raise ConfigError(
                f"--host-cache-bytes / PLORA_HOST_CACHE_BYTES ({self.host_cache_bytes}) must be "
                f">= --pool-bytes / PLORA_POOL_BYTES ({self.pool_bytes}): the host tier backs "
                "every resident adapter"
            )
        if self.threads < 0:
            raise ConfigError(
                f"--threads / PLORA_WORKER_THREADS must be >= 0 (0 = all cores), got {self.threads}"
            )
        require_seconds(self.stall_timeout_s, "--stall-timeout-s", "PLORA_STALL_TIMEOUT_S", True)
        require_seconds(
            self.load_wait_timeout_s, "--load-wait-timeout-s", "PLORA_LOAD_WAIT_TIMEOUT_S"
        )
        # the engine would refuse these after the model loaded, less clearly
        require_at_least_one(
            self.max_new_tokens_limit, "--max-new-tokens-limit", "PLORA_MAX_NEW_TOKENS_LIMIT"
        )
        require_at_least_one(self.max_batch_size, "--max-batch-size", "PLORA_MAX_BATCH_SIZE")
        require_at_least_one(self.max_queue, "--max-queue", "PLORA_MAX_QUEUE")
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ConfigError(
                f"--max-num-batched-tokens / PLORA_MAX_NUM_BATCHED_TOKENS "
                f"({self.max_num_batched_tokens}) must be >= --max-batch-size / "
                f"PLORA_MAX_BATCH_SIZE ({self.max_batch_size}): every running sequence "
                "decodes one token per step"
            )
        if self.max_model_len < 2:
            raise ConfigError(
                f"--max-model-len / PLORA_MAX_MODEL_LEN must be >= 2 (a prompt token and a "
                f"generated one), got {self.max_model_len}"
            )
        if self.attention_kernel not in LORA_KERNELS:
            raise ConfigError(
                f"--attention-kernel / PLORA_ATTENTION_KERNEL must be one of "
                f"{list(LORA_KERNELS)}, got {self.attention_kernel!r}"
            )
        if self.attention_kernel == "triton" and self.kv_cache != "paged":
            raise ConfigError(
                "--attention-kernel triton reads the paged KV cache; drop --kv-cache slot"
            )
        if self.cuda_graphs not in ("on", "off"):
            raise ConfigError(
                f"--cuda-graphs / PLORA_CUDA_GRAPHS must be 'on' or 'off', got {self.cuda_graphs!r}"
            )
        if self.cuda_graphs == "on" and self.kv_cache != "paged":
            raise ConfigError("--cuda-graphs on runs over the paged KV cache; drop --kv-cache slot")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ConfigError(
                f"--kv-cache / PLORA_KV_CACHE must be one of {list(KV_CACHE_KINDS)}, "
                f"got {self.kv_cache!r}"
            )
        require_at_least_one(self.kv_block_size, "--kv-block-size", "PLORA_KV_BLOCK_SIZE")
        if self.kv_cache_tokens < 0:
            raise ConfigError(
                f"--kv-cache-tokens / PLORA_KV_CACHE_TOKENS must be >= 0 (0 = --max-batch-size "
                f"x --max-model-len), got {self.kv_cache_tokens}"
            )
        if self.kv_cache_tokens and self.kv_cache != "paged":
            raise ConfigError(
                "--kv-cache-tokens sizes the paged KV cache; drop it or use --kv-cache paged"
            )
        if 0 < self.kv_cache_tokens < self.max_model_len:
            raise ConfigError(
                f"--kv-cache-tokens / PLORA_KV_CACHE_TOKENS ({self.kv_cache_tokens}) cannot hold "
                f"one --max-model-len ({self.max_model_len}) sequence; raise the first or lower "
                "the second"
            )
        if self.host_staging not in ("on", "off"):
            raise ConfigError(f"host_staging must be 'on' or 'off', got {self.host_staging!r}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ConfigError("heartbeat_ttl_s must exceed heartbeat_interval_s")

    @property
    def server_threads(self) -> int:
        """Threads of the worker's gRPC pool: one per running and per waiting Generate stream
        (each holds its thread while it lives) plus :data:`RESERVED_THREADS` for the adapter,
        status and health calls and for the stream the engine refuses as one too many."""
        return self.max_batch_size + self.max_queue + RESERVED_THREADS

    @property
    def address(self) -> str:
        """``host:port`` the gateway dials (set after binding when port was 0)."""
        return f"{self.advertise_host or self.host}:{self.port}"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the worker's flags (defaults None: the env fallback applies).

        Each help ends ``(env PLORA_X; default D)``, D being the field default above
        (tests/unit/test_config.py checks both against ``from_args`` and the dataclass).
        """
        add_server_arguments(parser, "worker", WorkerConfig.port, WorkerConfig.metrics_port)
        parser.add_argument(
            "--worker-id",
            help="id of this worker in the registry, used as given (a pod name); a second "
            "process claiming a live worker's id is refused (env PLORA_WORKER_ID; default "
            "none = <host name>-<6 random hex digits>)",
        )
        parser.add_argument(
            "--advertise-host",
            help="host published in the registry for the gateway and predictor to dial instead "
            "of --host: the container name under docker compose, the pod IP under Kubernetes "
            "(env PLORA_WORKER_ADVERTISE_HOST; default none = --host)",
        )
        parser.add_argument(
            "--model",
            help="base model: smollm2, a .gguf file, a Hugging Face directory, or a model id "
            "org/name[@revision] already in the local Hugging Face cache (never downloaded); "
            "Llama, Mistral, Qwen 2/3, Gemma 2/3 or Phi-3 (env PLORA_MODEL; default smollm2)",
        )
        parser.add_argument(
            "--cache-dir",
            help="where converted models are cached "
            "(env PLORA_CACHE_DIR; default none = ~/.cache/plora)",
        )
        parser.add_argument(
            "--device",
            help="cpu, cuda, cuda:1, ...: auto = CUDA when present "
            "(env PLORA_DEVICE; default auto)",
        )
        parser.add_argument(
            "--dtype",
            choices=DTYPES,
            help="serving dtype: auto = float32 on CPU, bfloat16 on CUDA "
            "(env PLORA_DTYPE; default auto)",
        )
        parser.add_argument(
            "--lora-kernel",
            choices=LORA_KERNELS,
            help="multi-LoRA implementation: torch, or triton kernels reading the paged pool; "
            "auto = triton on CUDA when installed (env PLORA_LORA_KERNEL; default auto)",
        )
        parser.add_argument(
            "--max-batch-size",
            type=int,
            help="most sequences in the running batch (env PLORA_MAX_BATCH_SIZE; default 32)",
        )
        parser.add_argument(
            "--attention-kernel",
            choices=LORA_KERNELS,
            help="decode attention over the paged KV cache: torch, or a triton kernel reading "
            "the blocks in place; auto = triton on CUDA when installed "
            "(env PLORA_ATTENTION_KERNEL; default auto)",
        )
        parser.add_argument(
            "--cuda-graphs",
            choices=("on", "off"),
            help="on: decode steps of up to 64 rows replay CUDA graphs captured per batch "
            "bucket (CUDA; checked by plora bench gpu) (env PLORA_CUDA_GRAPHS; default off)",
        )
        parser.add_argument(
            "--kv-cache",
            choices=KV_CACHE_KINDS,
            help="KV cache: paged (blocks through a block table per sequence; admission counts "
            "blocks) or slot (one --max-model-len slot per sequence) "
            "(env PLORA_KV_CACHE; default paged)",
        )
        parser.add_argument(
            "--kv-block-size",
            type=int,
            help="tokens per KV block (env PLORA_KV_BLOCK_SIZE; default 16)",
        )
        parser.add_argument(
            "--kv-cache-tokens",
            type=int,
            help="tokens the paged KV cache holds across all sequences; 0 = --max-batch-size x "
            "--max-model-len (env PLORA_KV_CACHE_TOKENS; default 0)",
        )
        parser.add_argument(
            "--max-queue",
            type=int,
            help="most requests waiting for a batch slot; more get RESOURCE_EXHAUSTED "
            "(env PLORA_MAX_QUEUE; default 256)",
        )
        parser.add_argument(
            "--max-num-batched-tokens",
            type=int,
            help="tokens per engine step, decode rows + prefill chunks "
            "(env PLORA_MAX_NUM_BATCHED_TOKENS; default 512)",
        )
        parser.add_argument(
            "--max-model-len",
            type=int,
            help="context served, prompt + completion, capped by the model's "
            "(env PLORA_MAX_MODEL_LEN; default 2048)",
        )
        parser.add_argument(
            "--max-new-tokens-limit",
            type=int,
            help="largest max_new_tokens accepted (env PLORA_MAX_NEW_TOKENS_LIMIT; default 512)",
        )
        parser.add_argument(
            "--pool-bytes",
            help="device adapter pool per worker, e.g. 512MiB "
            "(env PLORA_POOL_BYTES; default 512MiB)",
        )
        parser.add_argument(
            "--page-bytes",
            help="page size of the paged allocator, e.g. 64KiB "
            "(env PLORA_PAGE_BYTES; default 64KiB)",
        )
        parser.add_argument(
            "--host-cache-bytes",
            help="host adapter cache, at least the pool, e.g. 2GiB "
            "(env PLORA_HOST_CACHE_BYTES; default 2GiB, or the pool if larger)",
        )
        parser.add_argument(
            "--allocator",
            choices=ALLOCATORS,
            help="pool allocator: paged (first-fit pages + compaction) or contiguous, the "
            "baseline (env PLORA_ALLOCATOR; default paged)",
        )
        parser.add_argument(
            "--eviction",
            choices=EVICTIONS,
            help="pool eviction: predictive (lowest forecast demand per byte) or lru, the "
            "baseline (env PLORA_EVICTION; default predictive)",
        )
        parser.add_argument(
            "--load-wait-timeout-s",
            type=float,
            help="seconds a load may wait for pool space before its request fails "
            "(env PLORA_LOAD_WAIT_TIMEOUT_S; default 30)",
        )
        parser.add_argument(
            "--host-staging",
            choices=("on", "off"),
            help="on: read registered adapters into free host-cache space ahead of demand; "
            "off, the baseline: read on demand only (env PLORA_HOST_STAGING; default on)",
        )
        parser.add_argument(
            "--threads",
            type=int,
            help="CPU threads of the engine; workers sharing a host should split the cores "
            "(env PLORA_WORKER_THREADS; default 0 = all cores)",
        )
        parser.add_argument(
            "--stall-timeout-s",
            type=float,
            help="seconds the engine may go without progress while it has requests before "
            "the worker exits (status 70) to be restarted, thread stacks in its log; 0 = "
            "never (env PLORA_STALL_TIMEOUT_S; default 60)",
        )
        add_adapter_root_argument(parser)
        add_adapter_source_allow_argument(parser)
        parser.add_argument(
            "--adapter-cache-dir",
            help="node-local directory of adapters downloaded from s3:// and hf:// sources, "
            "one worker per directory (env PLORA_ADAPTER_CACHE_DIR; default none, which is "
            "<--cache-dir>/adapter-cache/<worker id>)",
        )
        parser.add_argument(
            "--adapter-cache-bytes",
            help="bound of that cache, least recently used adapters out first, e.g. 20GiB "
            "(env PLORA_ADAPTER_CACHE_BYTES; default 8GiB)",
        )
        parser.add_argument(
            "--max-adapter-config-bytes",
            help="largest adapter_config.json a load reads, e.g. 1MiB; keep it at the "
            "gateway's (env PLORA_MAX_ADAPTER_CONFIG_BYTES; default 1MiB)",
        )
        parser.add_argument(
            "--max-safetensors-header-bytes",
            help="largest safetensors header a load reads, e.g. 16MiB; keep it at the "
            "gateway's (env PLORA_MAX_SAFETENSORS_HEADER_BYTES; default 16MiB)",
        )
        parser.add_argument(
            "--ready-file",
            help="write {grpc_port, metrics_port} as JSON here once serving, for the launcher "
            "(no env variable; default none)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """Flags first, then ``PLORA_*`` environment variables, then defaults."""
        d = cls()

        def pick(flag: object, env: str, default: str) -> str:
            return str(flag) if flag not in (None, "") else (env_or(env, default) or default)

        def size(flag_value: object, flag: str, env: str, default: int) -> int:
            try:
                return parse_bytes(pick(flag_value, env, str(default)))
            except ConfigError as exc:
                raise ConfigError(f"{flag} / {env}: {exc}") from exc

        pool = size(args.pool_bytes, "--pool-bytes", "PLORA_POOL_BYTES", d.pool_bytes)
        host_cache = size(
            args.host_cache_bytes,
            "--host-cache-bytes",
            "PLORA_HOST_CACHE_BYTES",
            max(d.host_cache_bytes, pool),
        )
        return cls(
            worker_id=pick(args.worker_id, "PLORA_WORKER_ID", ""),
            host=pick(args.host, "PLORA_WORKER_HOST", d.host),
            port=int_flag_or_env(args.port, "PLORA_WORKER_PORT", d.port),
            advertise_host=pick(args.advertise_host, "PLORA_WORKER_ADVERTISE_HOST", ""),
            metrics_port=int_flag_or_env(
                args.metrics_port, "PLORA_WORKER_METRICS_PORT", d.metrics_port
            ),
            redis_url=pick(args.redis_url, "PLORA_REDIS_URL", d.redis_url),
            internal_token_file=args.internal_token_file
            or env_or("PLORA_INTERNAL_TOKEN_FILE", "")
            or "",
            internal_token=env_or("PLORA_INTERNAL_TOKEN", "") or "",
            model=pick(args.model, "PLORA_MODEL", d.model),
            cache_dir=pick(args.cache_dir, "PLORA_CACHE_DIR", ""),
            device=pick(args.device, "PLORA_DEVICE", d.device),
            dtype=choice_or_env(args.dtype, "--dtype", "PLORA_DTYPE", d.dtype, DTYPES),
            lora_kernel=choice_or_env(
                args.lora_kernel, "--lora-kernel", "PLORA_LORA_KERNEL", d.lora_kernel, LORA_KERNELS
            ),
            max_batch_size=int_flag_or_env(
                args.max_batch_size, "PLORA_MAX_BATCH_SIZE", d.max_batch_size
            ),
            attention_kernel=choice_or_env(
                args.attention_kernel,
                "--attention-kernel",
                "PLORA_ATTENTION_KERNEL",
                d.attention_kernel,
                LORA_KERNELS,
            ),
            cuda_graphs=choice_or_env(
                args.cuda_graphs, "--cuda-graphs", "PLORA_CUDA_GRAPHS", d.cuda_graphs, ("on", "off")
            ),
            kv_cache=choice_or_env(
                args.kv_cache, "--kv-cache", "PLORA_KV_CACHE", d.kv_cache, KV_CACHE_KINDS
            ),
            kv_block_size=int_flag_or_env(
                args.kv_block_size, "PLORA_KV_BLOCK_SIZE", d.kv_block_size
            ),
            kv_cache_tokens=int_flag_or_env(
                args.kv_cache_tokens, "PLORA_KV_CACHE_TOKENS", d.kv_cache_tokens
            ),
            max_queue=int_flag_or_env(args.max_queue, "PLORA_MAX_QUEUE", d.max_queue),
            max_num_batched_tokens=int_flag_or_env(
                args.max_num_batched_tokens,
                "PLORA_MAX_NUM_BATCHED_TOKENS",
                d.max_num_batched_tokens,
            ),
            max_model_len=int_flag_or_env(
                args.max_model_len, "PLORA_MAX_MODEL_LEN", d.max_model_len
            ),
            max_new_tokens_limit=int_flag_or_env(
                args.max_new_tokens_limit, "PLORA_MAX_NEW_TOKENS_LIMIT", d.max_new_tokens_limit
            ),
            pool_bytes=pool,
            page_bytes=size(args.page_bytes, "--page-bytes", "PLORA_PAGE_BYTES", d.page_bytes),
            host_cache_bytes=host_cache,
            allocator=choice_or_env(
                args.allocator, "--allocator", "PLORA_ALLOCATOR", d.allocator, ALLOCATORS
            ),
            eviction=choice_or_env(
                args.eviction, "--eviction", "PLORA_EVICTION", d.eviction, EVICTIONS
            ),
            load_wait_timeout_s=float_flag_or_env(
                args.load_wait_timeout_s, "PLORA_LOAD_WAIT_TIMEOUT_S", d.load_wait_timeout_s
            ),
            host_staging=choice_or_env(
                args.host_staging,
                "--host-staging",
                "PLORA_HOST_STAGING",
                d.host_staging,
                ("on", "off"),
            ),
            threads=int_flag_or_env(args.threads, "PLORA_WORKER_THREADS", d.threads),
            stall_timeout_s=float_flag_or_env(
                args.stall_timeout_s, "PLORA_STALL_TIMEOUT_S", d.stall_timeout_s
            ),
            adapter_roots=adapter_roots_or_env(args.adapter_roots, "PLORA_ADAPTER_ROOTS"),
            adapter_source_allow=source_allow_or_env(
                args.adapter_source_allow, "PLORA_ADAPTER_SOURCE_ALLOW"
            ),
            adapter_cache_dir=pick(args.adapter_cache_dir, "PLORA_ADAPTER_CACHE_DIR", ""),
            adapter_cache_bytes=size(
                args.adapter_cache_bytes,
                "--adapter-cache-bytes",
                "PLORA_ADAPTER_CACHE_BYTES",
                d.adapter_cache_bytes,
            ),
            **inspection_size_limits(args),
            ready_file=args.ready_file or "",
        )

    @property
    def inspection_limits(self) -> InspectionLimits:
        """The bounds a load reads an adapter within; no rank cap (the gateway admitted the
        adapter, and the pool decides what fits)."""
        return InspectionLimits(
            max_config_bytes=self.max_adapter_config_bytes,
            max_header_bytes=self.max_safetensors_header_bytes,
            max_lora_rank=None,
        )
