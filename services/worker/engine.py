"""Continuous-batching multi-LoRA generation engine.

One background thread runs *steps*. Before each step the scheduler

1. drops cancelled requests (freeing their KV slot and releasing their adapter lease);
2. admits waiting requests whose adapter lease is ready (a request whose adapter is still
   loading stays in the queue while everything else runs; it never blocks a step), up to
   ``max_batch_size`` running sequences. The lease is taken when the request is submitted,
   so a cold adapter's load starts on arrival and overlaps the step in progress: taken at
   the next step boundary instead, the load would still be running when the step after it
   starts, and every cold request would wait out one more whole step;
3. schedules the step (:func:`schedule_step`): one decode token for every running sequence
   whose prompt is in the cache, plus prompt chunks of prefilling sequences under the
   ``max_num_batched_tokens`` budget (chunked prefill, as in vLLM/Sarathi);
4. lays the rows out grouped by adapter as one flat batch (:func:`build_step_batch`, a pure
   function) and builds the step's :class:`~services.worker.lora_ops.LoRABatch` from each
   lease's *current* weights, inside the provider's ``compute_guard()``.

After the forward pass every sequence whose last prompt token or decode token was computed
samples one token, which is streamed at once as a :class:`TokenEvent`. Sequences leave the
batch the step they finish (EOS, stop string, length, context) or are cancelled.

The engine never imports grpc; the worker servicer maps :class:`TokenEvent` to protobuf and
the domain errors of :mod:`services.common.errors` to status codes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from services.common.errors import (
    ConfigError,
    DeadlineExceededError,
    IncompatibleAdapterError,
    InvalidRequestError,
    NoHealthyWorkerError,
    OverloadedError,
    PLoRAError,
    RequestCancelledError,
)
from services.common.types import LoRAModuleWeights
from services.worker.adapter_api import AdapterLease, AdapterProvider, AdapterRef, no_guard
from services.worker.decode_graphs import DecodeGraphs
from services.worker.estimates import ServiceEstimates
from services.worker.kv_cache import KV_CACHE_KINDS, PagedKVCache
from services.worker.lora_ops import LoRABatch, StackedLoRA
from services.worker.lora_pages import PagedLoRA, PageTableCache, resolve_lora_kernel
from services.worker.model import DecoderModel, KVCache
from services.worker.sampling import SamplingParams, StopMatcher, make_generator, sample_batch
from services.worker.step_plan import StepPlan, build_step_batch, schedule_step
from services.worker.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: ``TokenEvent.finish_reason`` values.
FINISH_REASONS = ("length", "stop", "eos", "context")


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizing and limits.

    Attributes:
        device: Torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (or the torch dtype itself); the
            model's weights, activations and KV cache use it.
        max_batch_size: Running sequences at most.
        max_num_batched_tokens: Tokens per step (decode rows + prefill chunks); prompts longer
            than the budget are prefilled in chunks over several steps.
        max_model_len: Prompt + generated tokens per sequence; ``None`` = the model's
            context, capped at 2048.
        max_new_tokens_limit: Largest ``max_new_tokens`` a request may ask for.
        max_queue: Waiting requests at most; more raise ``OverloadedError``.
        adapter_wait_timeout_s: A request waiting this long for its adapter fails with
            ``DeadlineExceededError``.
        lora_stack_max_rows: Steps of at most this many tokens apply LoRA in the stacked form
            (:class:`~services.worker.lora_ops.StackedLoRA`, three kernel calls per projection
            whatever the number of adapters); larger steps use the per-segment loop. 0 = never.
        lora_stack_min_steps: Consecutive steps with the same adapter set before it is stacked.
        lora_stack_max_bytes: Largest adapter set (bytes) that is stacked (it is a copy).
        lora_kernel: Multi-LoRA implementation (:func:`~services.worker.lora_pages.
            resolve_lora_kernel`): ``torch`` (segments, or stacked for decode steps), ``triton``
            (:class:`~services.worker.lora_pages.PagedLoRA`, kernels that read the adapters in
            the paged pool; steps whose adapters are not pool views, e.g. a provider of plain
            tensors, use torch), ``auto`` = triton on CUDA where Triton is installed, else torch.
    """

    device: str = "cpu"
    dtype: str | torch.dtype = "float32"
    max_batch_size: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    max_new_tokens_limit: int = 512
    max_queue: int = 256
    adapter_wait_timeout_s: float = 60.0
    lora_stack_max_rows: int = 64
    lora_stack_min_steps: int = 2
    lora_stack_max_bytes: int = 1 << 30
    lora_kernel: str = "auto"
    attention_kernel: str = "auto"
    cuda_graphs: str = "off"
    kv_cache: str = "paged"
    kv_block_size: int = 16
    kv_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES and self.dtype not in _DTYPES.values():
            raise ConfigError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.max_batch_size < 1:
            raise ConfigError("max_batch_size must be >= 1")
        if self.max_num_batched_tokens < self.max_batch_size:
            raise ConfigError("max_num_batched_tokens must be >= max_batch_size")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        if self.max_new_tokens_limit < 1 or self.max_queue < 1:
            raise ConfigError("max_new_tokens_limit and max_queue must be >= 1")
        if self.adapter_wait_timeout_s <= 0:
            raise ConfigError("adapter_wait_timeout_s must be > 0")
        if self.lora_stack_max_rows < 0 or self.lora_stack_min_steps < 1:
            raise ConfigError("lora_stack_max_rows must be >= 0 and lora_stack_min_steps >= 1")
        try:
            resolve_lora_kernel(self.lora_kernel, self.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ConfigError(f"kv_cache {self.kv_cache!r} is not one of {list(KV_CACHE_KINDS)}")
        if self.kv_block_size < 1:
            raise ConfigError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.cuda_graphs not in ("on", "off"):
            raise ConfigError(f"cuda_graphs must be 'on' or 'off', got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.kv_cache != "paged":
            raise ConfigError("cuda_graphs='on' runs over the paged KV cache; use kv_cache='paged'")
        if self.kv_cache == "slot" and self.attention_kernel == "triton":
            raise ConfigError(
                "the triton attention kernel reads the paged KV cache; use kv_cache='paged'"
            )
        try:
            self.resolved_attention_kernel  # noqa: B018 - validates the setting
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.kv_cache_tokens is not None:
            if self.kv_cache != "paged":
                raise ConfigError("kv_cache_tokens sizes the paged KV cache; set kv_cache='paged'")
            if self.kv_cache_tokens < 1:
                raise ConfigError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")

    @property
    def resolved_lora_kernel(self) -> str:
        """``"torch"`` or ``"triton"``: what :attr:`lora_kernel` means on :attr:`device`."""
        return resolve_lora_kernel(self.lora_kernel, self.device)

    @property
    def resolved_attention_kernel(self) -> str:
        """``"torch"`` or ``"triton"``: the decode attention :attr:`attention_kernel` means on
        :attr:`device` (always torch over the slot cache)."""
        if self.kv_cache == "slot":
            return "torch"
        return resolve_lora_kernel(self.attention_kernel, self.device, what="attention")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by :attr:`dtype`."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class EngineRequest:
    """One generation request as the engine sees it (prompt already tokenized).

    Attributes:
        request_id: Unique among in-flight requests.
        prompt_token_ids: The prompt (chat template already applied).
        max_new_tokens: Tokens to generate at most (1..``max_new_tokens_limit``).
        temperature: 0 = greedy.
        top_p: Nucleus mass in (0, 1].
        top_k: 0 = off.
        seed: Seed of the request's sampling generator (``None`` = random).
        stop: Stop strings; the returned text ends before the first one found.
        adapter: The adapter to apply, ``None`` for the base model.
        ignore_eos: Keep generating past EOS until ``max_new_tokens`` (benchmarks only).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    adapter: AdapterRef | None = None
    ignore_eos: bool = False


@dataclass
class TokenEvent:
    """One streamed step of a request (the last one has ``finish_reason`` or ``error``).

    Attributes:
        text: New text since the previous event (may be ``""`` while a multi-byte character
            or a possible stop string is held back).
        token_ids: The new token ids (the EOS or stop-completing token included).
        finish_reason: ``"length"``, ``"stop"``, ``"eos"``, ``"context"``, or ``None``.
        prompt_tokens: Prompt length in tokens.
        completion_tokens: Tokens generated so far.
        adapter_cold: The adapter was not resident when the request was scheduled.
        adapter_wait_seconds: Seconds the request waited for its adapter (0 when warm).
        adapter_cold_cause: Why it was cold (:data:`services.worker.cold.COLD_CAUSES`; ""
            when warm or unknown).
        ttft_seconds: Engine receipt -> first token, once known.
        error: The domain error that ended the request (then no ``finish_reason``).
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter_cold: bool = False
    adapter_wait_seconds: float = 0.0
    adapter_cold_cause: str = ""
    ttft_seconds: float | None = None
    error: Exception | None = None

    @property
    def final(self) -> bool:
        """True for the last event of a request."""
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """Iterator over one request's :class:`TokenEvent` s; ends after the final event."""

    def __init__(self, engine: Engine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._q: queue.Queue[TokenEvent] = queue.Queue()
        self._done = False

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        if self._done:
            raise StopIteration
        ev = self._q.get()
        if ev.final:
            self._done = True
        return ev

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """Next event, or ``None`` after ``timeout`` seconds or once the stream is over."""
        if self._done:
            return None
        try:
            ev = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev.final:
            self._done = True
        return ev

    def cancel(self) -> None:
        """Cancel the request (its slot and lease are freed at the next step)."""
        self._engine.cancel(self.request_id)

    def _put(self, ev: TokenEvent) -> None:
        self._q.put(ev)


@dataclass
class _Seq:
    """One request inside the engine: its tokens, KV slot, lease and streaming state."""

    req: EngineRequest
    stream: RequestStream
    arrival: float
    params: SamplingParams
    tokens: list[int]
    prompt_len: int
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    generator: torch.Generator | None = None
    lease: AdapterLease | None = None
    slot: int = -1
    num_cached: int = 0
    completion: int = 0
    ttft: float | None = None
    cold: bool = False
    cold_cause: str = ""
    wait_s: float = 0.0
    prefill_work: float = 0.0  # seconds of steps attributed to its prompt so far
    acquire_error: Exception | None = None  # the provider refused the lease (failed at admit)
    adapter_key: tuple[str, int] | None = None
    long_rope: bool = False  # its cached keys/values were computed with LongRoPE's long factors
    extra: dict[str, object] = field(default_factory=dict)


class Engine:
    """Continuous-batching generation over one base model and many LoRA adapters.

    Args:
        model: The base model.
        tokenizer: Its tokenizer (EOS ids and detokenization).
        provider: The adapter store, or ``None`` to serve the base model only.
        config: Sizing and limits.
    """

    def __init__(
        self,
        model: DecoderModel,
        tokenizer: Tokenizer,
        provider: AdapterProvider | None,
        config: EngineConfig | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.provider = provider
        self.config = config or EngineConfig()
        ctx = model.spec.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or min(ctx, 2048), ctx)
        cfg = self.config
        if cfg.kv_cache_tokens is not None and cfg.kv_cache_tokens < self.max_model_len:
            raise ConfigError(
                f"the KV cache's {cfg.kv_cache_tokens} tokens (--kv-cache-tokens) cannot hold "
                f"one {self.max_model_len}-token sequence (--max-model-len); raise the first "
                "or lower the second"
            )
        self.kv: KVCache = model.new_kv_cache(
            cfg.max_batch_size,
            self.max_model_len,
            kind=cfg.kv_cache,
            num_tokens=cfg.kv_cache_tokens,
            block_size=cfg.kv_block_size,
            decode_kernel=cfg.resolved_attention_kernel,
        )
        #: Most sequences that were running at once (admission, for benchmarks).
        self.peak_running = 0
        self.graphs: DecodeGraphs | None = None
        if cfg.cuda_graphs == "on" and isinstance(self.kv, PagedKVCache):
            if model.long_rope_after is not None:
                logger.warning(
                    "cuda graphs are off for LongRoPE models (their rotation depends "
                    "on each sequence's length)"
                )
            else:
                capture = torch.device(cfg.device).type == "cuda"
                self.graphs = DecodeGraphs(model, self.kv, capture=capture)
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._vocab = model.spec.vocab_size
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting: deque[_Seq] = deque()
        self._inflight: set[str] = set()
        self._cancels: set[str] = set()
        # ids whose submit() is taking the lease -> whether cancel() came meanwhile
        self._submitting: dict[str, bool] = {}
        self._running: list[_Seq] = []  # index == KV slot
        self._stop = False
        self._thread: threading.Thread | None = None
        # when the step loop last came round (or work arrived at an idle engine): stalled_for()
        self._progress = time.monotonic()
        self.steps = 0
        #: CPU seconds the step thread spent in steps (its own thread's CPU clock).
        self.step_cpu_seconds = 0.0
        self._stack_key: tuple[tuple[str, int], ...] = ()
        self._stack_streak = 0
        self._stacked: StackedLoRA | None = None
        self._page_tables: PageTableCache | None = None
        if self.config.resolved_lora_kernel == "triton":
            self._page_tables = PageTableCache(model.spec.num_layers)
        self._paged_fallback_logged = False
        self.estimates = ServiceEstimates()

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        """Start the step thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="plora-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the step thread; every unfinished request ends with ``NoHealthyWorkerError``."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            t = self._thread
        if t is not None:
            t.join(timeout)
        with self._lock:
            self._thread = None
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
        self._running = []
        self.kv.clear()
        for s in pending:
            s.slot = -1
        err = NoHealthyWorkerError("the worker is shutting down; retry on another worker")
        for s in pending:
            self._finish(s, None, error=err)

    def submit(self, req: EngineRequest) -> RequestStream:
        """Queue a request; returns its event stream. Thread-safe.

        A request with an adapter takes its lease here, on the caller's thread: a cold
        adapter's load starts now, not at the next step boundary. A lease the provider
        refuses (e.g. ``PoolExhaustedError``, ``AdapterNotFoundError``) ends the request
        with that error on its stream at admission, as a failed load does.

        Raises:
            InvalidRequestError: empty or too long prompt, token ids out of range,
                ``max_new_tokens`` out of range, bad sampling values, an adapter without a
                provider, or a duplicate in-flight ``request_id``.
            OverloadedError: ``max_queue`` requests are already waiting.
            NoHealthyWorkerError: the engine was stopped.
        """
        self._validate(req)
        stream = RequestStream(self, req.request_id)
        params = SamplingParams(req.temperature, req.top_p, req.top_k, req.seed)
        prompt = [int(t) for t in req.prompt_token_ids]
        seq = _Seq(
            req=req,
            stream=stream,
            arrival=time.monotonic(),
            params=params,
            tokens=list(prompt),
            prompt_len=len(prompt),
            detok=self.tokenizer.detokenizer(prompt),
            stopper=StopMatcher(req.stop),
            generator=None if params.greedy else make_generator(req.seed, self.model.device),
            adapter_key=(req.adapter.adapter_id, req.adapter.version) if req.adapter else None,
        )
        with self._cond:
            if self._stop:
                raise NoHealthyWorkerError("the engine is stopped; retry on another worker")
            if req.request_id in self._inflight:
                raise InvalidRequestError(f"request_id {req.request_id!r} is already in flight")
            if len(self._waiting) + len(self._submitting) >= self.config.max_queue:
                raise OverloadedError(
                    f"the worker queue is full ({self.config.max_queue} waiting, --max-queue); "
                    "retry later"
                )
            self._inflight.add(req.request_id)
            self._submitting[req.request_id] = False
        if req.adapter is not None:
            # On the caller's thread, outside the engine lock: the store starts a cold
            # adapter's load now, while the step in progress runs (see the module doc).
            assert self.provider is not None  # _validate
            try:
                seq.lease = self.provider.acquire(req.adapter)
                seq.cold = bool(seq.lease.cold)
                seq.cold_cause = str(getattr(seq.lease, "cold_cause", ""))
            except Exception as exc:  # noqa: BLE001 - reported on the stream at admission
                seq.acquire_error = exc
        with self._cond:
            cancelled = self._submitting.pop(req.request_id)
            stopped = self._stop
            if stopped:
                self._inflight.discard(req.request_id)
            else:
                if not self._running and not self._waiting:
                    self._progress = time.monotonic()  # idle until now, not stalled
                self._waiting.append(seq)
                if cancelled:  # cancel() came while the lease was being taken
                    self._cancels.add(req.request_id)
                self._cond.notify_all()
        if stopped:
            if seq.lease is not None:
                seq.lease.release()  # outside the engine lock, as _finish does
            raise NoHealthyWorkerError("the engine is stopped; retry on another worker")
        return stream

    def cancel(self, request_id: str) -> None:
        """Cancel a request by id (no-op when it is not in flight). Thread-safe."""
        with self._cond:
            if request_id in self._submitting:  # submit() hands the cancel on
                self._submitting[request_id] = True
            elif request_id in self._inflight:
                self._cancels.add(request_id)
                self._cond.notify_all()

    @property
    def queue_length(self) -> int:
        """Requests waiting to be admitted (including those waiting for an adapter)."""
        return len(self._waiting)

    @property
    def kv_tokens(self) -> tuple[int, int]:
        """``(total, held)`` KV cache positions: held by running sequences are the paged
        cache's taken and reserved blocks, or the slot cache's whole slots."""
        kv = self.kv
        if isinstance(kv, PagedKVCache):
            return kv.capacity_tokens, kv.capacity_tokens - kv.free_blocks * kv.block_size
        return kv.capacity_tokens, len(self._running) * kv.max_len

    @property
    def running(self) -> int:
        """Sequences in the running batch."""
        return len(self._running)

    # ------------------------------------------------------------------ validation
    def _validate(self, req: EngineRequest) -> None:
        """Raise :class:`InvalidRequestError` for a request :meth:`submit` must refuse."""
        n = len(req.prompt_token_ids)
        if not req.request_id:
            raise InvalidRequestError("request_id must not be empty")
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; this worker's context is {self.max_model_len} "
                "tokens (prompt + generated): shorten the prompt"
            )
        if not 1 <= req.max_new_tokens <= self.config.max_new_tokens_limit:
            raise InvalidRequestError(
                f"max_new_tokens must be in 1..{self.config.max_new_tokens_limit}, "
                f"got {req.max_new_tokens}"
            )
        if req.temperature < 0 or req.temperature != req.temperature:
            raise InvalidRequestError(f"temperature must be >= 0, got {req.temperature}")
        if not 0.0 < req.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {req.top_p}")
        if req.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {req.top_k}")
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= self._vocab:
            raise InvalidRequestError(f"prompt token ids must be in 0..{self._vocab - 1}")
        if req.adapter is not None and self.provider is None:
            raise InvalidRequestError("this engine serves the base model only (no adapter store)")

    # ------------------------------------------------------------------ the step loop
    def stalled_for(self) -> float:
        """Seconds the step loop has gone without coming round while it had requests: 0.0
        when it is idle or progressing (or not started), ``inf`` when its thread died.

        The loop comes round after every step and every few milliseconds while requests wait
        for adapter loads, so only a step that never returns (a deadlock, a hung device call)
        makes this grow past a step's length. The worker's watchdog reads it
        (``--stall-timeout-s``).
        """
        t = self._thread
        if t is None:
            return 0.0
        with self._lock:
            busy = bool(self._running or self._waiting)
            since = self._progress
            stopping = self._stop
        if not t.is_alive():
            return 0.0 if stopping else math.inf
        return time.monotonic() - since if busy else 0.0

    def _loop(self) -> None:
        """The step thread: until :meth:`stop`, handle cancels, admit, then step.

        Rule per round: take the cancels that arrived; sleep on the condition while there is
        nothing running, waiting or cancelled; else fail the cancelled requests
        (:meth:`_handle_cancels`), admit what is ready (:meth:`_admit`) and run one step
        (:meth:`_step`, its thread CPU time added to :attr:`step_cpu_seconds`) when any
        sequence runs, or wait up to 2 ms (woken by a submit or cancel) when only adapter
        loads are pending. :attr:`_progress` is stamped at the top of every round
        (:meth:`stalled_for`). An exception in a round fails every running sequence with it
        (a :class:`PLoRAError` as it is, anything else wrapped in one) and the loop goes on.
        """
        while True:
            self._progress = time.monotonic()
            with self._cond:
                if self._stop:
                    return
                cancels, self._cancels = self._cancels, set()
                if not self._running and not self._waiting and not cancels:
                    self._cond.wait()
                    continue
            try:
                self._handle_cancels(cancels)
                self._admit()
                if self._running:
                    c0 = time.thread_time()
                    self._step()
                    self.step_cpu_seconds += time.thread_time() - c0
                elif self._waiting:
                    # Only adapter loads are pending: wait briefly without spinning.
                    with self._cond:
                        if not self._stop and not self._cancels:
                            self._cond.wait(0.002)
            except Exception as exc:
                logger.exception("engine step failed; failing the running requests")
                err = (
                    exc
                    if isinstance(exc, PLoRAError)
                    else PLoRAError(f"internal error in the generation step: {exc!r}")
                )
                for s in list(self._running):
                    self._finish(s, None, error=err)

    def _handle_cancels(self, cancels: set[str]) -> None:
        """End every running or waiting request whose id is in ``cancels`` with
        :class:`RequestCancelledError` (its KV slot and lease are freed): running ones first
        (slot order), then waiting ones (queue order)."""
        if not cancels:
            return
        for s in list(self._running):
            if s.req.request_id in cancels:
                self._finish(s, None, error=RequestCancelledError("the request was cancelled"))
        with self._lock:
            keep: deque[_Seq] = deque()
            dropped: list[_Seq] = []
            for s in self._waiting:
                (dropped if s.req.request_id in cancels else keep).append(s)
            self._waiting = keep
        for s in dropped:
            self._finish(s, None, error=RequestCancelledError("the request was cancelled"))

    def _admit(self) -> None:
        """Move waiting requests whose adapter is ready into the batch (FIFO among ready).

        Rule, for each waiting request in arrival order: a base-model request is ready; an
        adapter request whose lease the provider refused, whose load failed, or whose load has
        not finished ``adapter_wait_timeout_s`` after arrival fails with that error (whatever
        the room); one whose load is still running stays waiting (it never blocks the ones
        behind it); one whose lease is ready records its wait (``wait_s``; a cold one feeds
        :meth:`ServiceEstimates.observe_cold_wait`). Ready requests are admitted in that order
        while fewer than ``max_batch_size`` run and the KV cache can reserve the request's
        prompt plus its ``max_new_tokens`` (capped by ``max_model_len``); the first ready one
        the cache cannot hold stops admission for this step (first come, first served: a
        long request is not overtaken forever by short ones). Each is appended to the running
        list (slot = its index); the rest stay waiting for a later step.
        """
        with self._lock:
            waiting = list(self._waiting)
        if not waiting:
            return
        now = time.monotonic()
        admitted: list[_Seq] = []
        failed: list[tuple[_Seq, Exception]] = []
        room = self.config.max_batch_size - len(self._running)
        for s in waiting:
            ref = s.req.adapter
            if ref is not None:
                if s.acquire_error is not None:
                    failed.append((s, s.acquire_error))
                    continue
                assert s.lease is not None  # taken in submit()
                if not s.lease.ready():
                    if now - s.arrival > self.config.adapter_wait_timeout_s:
                        failed.append(
                            (
                                s,
                                DeadlineExceededError(
                                    f"adapter {ref.adapter_id!r} did not load within "
                                    f"{self.config.adapter_wait_timeout_s:.0f} s; retry later"
                                ),
                            )
                        )
                    continue
                err = s.lease.error()
                if err is not None:
                    failed.append((s, err))
                    continue
                s.wait_s = float(s.lease.wait_seconds)
                if s.cold:
                    self.estimates.observe_cold_wait(s.wait_s)
            if room > 0:
                need = self._kv_tokens(s)
                if self.kv.can_reserve(need):
                    self.kv.reserve(len(self._running) + len(admitted), need)
                    admitted.append(s)
                    room -= 1
                else:
                    room = 0
        if admitted or failed:
            gone = {id(s) for s in admitted} | {id(s) for s, _ in failed}
            with self._lock:
                self._waiting = deque(s for s in self._waiting if id(s) not in gone)
        for s in admitted:
            s.slot = len(self._running)
            self._running.append(s)
        self.peak_running = max(self.peak_running, len(self._running))
        for s, exc in failed:
            self._finish(s, None, error=exc)

    def _kv_tokens(self, s: _Seq) -> int:
        """KV positions ``s`` may fill: its prompt plus its ``max_new_tokens``, at most the
        context."""
        return min(s.prompt_len + s.req.max_new_tokens, self.max_model_len)

    def _free(self, s: _Seq) -> None:
        """Remove a running sequence and return its KV memory, keeping slots compact (the
        last one moves into the hole)."""
        if s.slot < 0:
            return
        slot = s.slot
        self.kv.free(slot)
        last = self._running.pop()
        if last is not s:
            self.kv.move(last.slot, slot, last.num_cached)
            last.slot = slot
            self._running[slot] = last
        s.slot = -1

    def _finish(
        self,
        s: _Seq,
        finish_reason: str | None,
        error: Exception | None = None,
        text: str = "",
        token_ids: list[int] | None = None,
    ) -> None:
        """End ``s``: free its KV slot, release its lease, drop its id from the in-flight set
        and put its final event (``finish_reason`` or ``error``, with ``text`` and
        ``token_ids``) on its stream."""
        self._free(s)
        if s.lease is not None:
            s.lease.release()
        with self._lock:
            self._inflight.discard(s.req.request_id)
        s.stream._put(self._event(s, text, token_ids or [], finish_reason, error))

    def _event(
        self, s: _Seq, text: str, ids: list[int], reason: str | None, error: Exception | None = None
    ) -> TokenEvent:
        """A :class:`TokenEvent` of ``s`` with its current counters."""
        return TokenEvent(
            text=text,
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=s.prompt_len,
            completion_tokens=s.completion,
            adapter_cold=s.cold,
            adapter_wait_seconds=s.wait_s,
            adapter_cold_cause=s.cold_cause,
            ttft_seconds=s.ttft,
            error=error,
        )

    def _step(self) -> None:
        """Run one step over the running sequences.

        (a) :func:`schedule_step` picks the rows (decode rows, then prefill chunks under the
        token budget), (b) :func:`build_step_batch` lays them out as the step's flat batch
        (pure), (c) :meth:`_forward` runs the model with the adapters' current weights and
        :meth:`_sample_and_emit` samples and streams one token per sequence whose uncached
        tokens are all in the step.
        """
        self._switch_long_rope()
        work = schedule_step(self._running, self.config.max_num_batched_tokens)
        if not work:
            return
        plan = build_step_batch(work)
        started = time.perf_counter()
        logits = self._forward(plan)
        if logits is not None:
            self._sample_and_emit(plan, logits, started)

    def _switch_long_rope(self) -> None:
        """Re-prefill a sequence that has grown past LongRoPE's switch point (Phi-3).

        Rule (transformers' Phi-3 ``generate``): a sequence longer than
        ``original_max_position_embeddings`` uses the long factors at every position, so the
        keys and values cached while it was shorter are computed again, once, in the next
        step (its ``num_cached`` drops to 0 and it prefills prompt and generated tokens).
        """
        limit = self.model.long_rope_after
        if limit is None:
            return
        for s in self._running:
            if not s.long_rope and len(s.tokens) > limit:
                s.long_rope = True
                s.num_cached = 0

    def _forward(self, plan: StepPlan[_Seq]) -> torch.Tensor | None:
        """Attach the step's LoRA weights to ``plan`` and run the model on it.

        Rule: inside the provider's ``compute_guard()`` (the store moves no adapter while it is
        held), each adapter of ``plan.adapter_keys`` gives its *current* weights through the
        lease of its first sequence in row order. An adapter whose weights cannot be read fails
        every request in the step that uses it and the step is not run (returns None; the next
        step is scheduled without them). Otherwise the model runs, :attr:`steps` counts the step,
        every scheduled sequence's ``num_cached`` advances by its tokens, and the logits are
        returned.

        Returns:
            ``float32 [len(plan.logits_rows), vocab]`` next-token logits in the order of
            ``plan.logits_rows`` (None when the step was not run).
        """
        leases: dict[tuple[str, int], AdapterLease] = {}
        for s, _ in plan.work:
            if s.adapter_key is not None and s.adapter_key not in leases:
                assert s.lease is not None
                leases[s.adapter_key] = s.lease
        guard = self.provider.compute_guard() if self.provider is not None else no_guard()
        with guard:
            weights = []
            broken: dict[tuple[str, int], Exception] = {}
            for key in plan.adapter_keys:
                try:
                    weights.append(leases[key].weights())
                except Exception as exc:  # noqa: BLE001 - a lost adapter fails its requests only
                    broken[key] = exc
            if broken:
                for s, _ in plan.work:
                    if s.adapter_key in broken:
                        self._finish(s, None, error=broken[s.adapter_key])
                return None  # the next step is rebuilt without them
            logits = self._forward_graphed(plan, weights)
            if logits is None:
                lora = None
                if plan.adapter_keys:
                    paged = self._paged_for(plan.adapter_keys, plan.row_adapter, weights)
                    stacked = None
                    if paged is None:
                        stacked = self._stacked_for(plan.adapter_keys, weights, plan.num_rows)
                    lora = LoRABatch(plan.row_adapter, weights, stacked, paged)
                logits = self.model.forward(plan.step_batch(lora), self.kv)
        self.steps += 1
        for s, n in plan.work:
            s.num_cached += n
        return logits

    def _sample_and_emit(self, plan: StepPlan[_Seq], logits: torch.Tensor, started: float) -> None:
        """Sample one token for each of ``plan.samplers`` and stream it.

        Rule: a sequence whose logits row holds NaN/Inf ends with :func:`_non_finite_error`
        and is not sampled; the others draw their next token with their own sampling
        parameters and generator (:func:`~services.worker.sampling.sample_batch`), and each
        token goes through :meth:`_emit`. When at least one token was sampled, the step's wall
        time since ``started`` (``time.perf_counter()`` before the forward pass) updates the
        service estimates: split over the step's tokens, each sequence without a first token
        yet adds its tokens' share to its prefill time; a step of one token per sequence is a
        decode step sample of :meth:`ServiceEstimates.observe_decode_step`.

        Args:
            plan: The step that ran.
            logits: ``float32 [len(plan.samplers), vocab]``, aligned with ``plan.samplers``.
            started: ``time.perf_counter()`` taken before the forward pass.
        """
        samplers = list(plan.samplers)
        if not samplers:
            return
        # One device-to-host transfer for the step: each row's finiteness (NaN/Inf anywhere)
        # and its greedy token; only rows that sample draw on their own afterwards.
        finite_t = torch.isfinite(logits.sum(dim=1)).to(torch.long)
        flags, greedy = torch.stack([finite_t, torch.argmax(logits, dim=-1)]).tolist()
        finite = [bool(f) for f in flags]
        if not all(finite):
            for s, ok in zip(samplers, finite, strict=True):
                if not ok:
                    self._finish(s, None, error=_non_finite_error(s))
            keep = [i for i, ok in enumerate(finite) if ok]
            samplers = [samplers[i] for i in keep]
            greedy = [greedy[i] for i in keep]
            logits = logits[keep]
            if not samplers:
                return
        next_ids = sample_batch(
            logits, [s.params for s in samplers], [s.generator for s in samplers], greedy
        )
        elapsed = time.perf_counter() - started
        per_token = elapsed / plan.num_rows
        if plan.num_rows == len(plan.work):
            # one token per sequence: decode rows (or a prompt's last token left over from a
            # chunk, which costs a step the same)
            self.estimates.observe_decode_step(len(plan.work), elapsed)
        for s, n in plan.work:
            if s.ttft is None:
                s.prefill_work += per_token * n
        now = time.monotonic()
        for s, tok in zip(samplers, next_ids, strict=True):
            self._emit(s, tok, now)

    def _forward_graphed(
        self, plan: StepPlan[_Seq], weights: list[dict[tuple[int, str], LoRAModuleWeights]]
    ) -> torch.Tensor | None:
        """Run a decode-only step through :attr:`graphs` (logits in the order of
        ``plan.logits_rows``), or return None when graphs are off or the step is not eligible
        (prefill rows, too many rows, adapters the Triton kernels cannot read)."""
        if self.graphs is None or plan.num_rows != len(plan.work):
            return None
        tables = None
        if plan.adapter_keys:
            if self._page_tables is None:
                return None
            try:
                tables = self._page_tables.tables(plan.adapter_keys, weights)
            except ValueError:
                return None
        batch = plan.step_batch(None)
        chunks = sorted(batch.chunks, key=lambda c: c.row)
        out = self.graphs.run(batch.input_ids, chunks, plan.row_adapter, tables)
        if out is None:
            return None
        rows = torch.tensor(batch.logits_rows, dtype=torch.long, device=out.device)
        return out.index_select(0, rows)

    def _paged_for(
        self,
        keys: tuple[tuple[str, int], ...],
        row_adapter: list[int],
        weights: list[dict[tuple[int, str], LoRAModuleWeights]],
    ) -> PagedLoRA | None:
        """The Triton form of this step's LoRA when the engine runs the ``triton`` kernel and
        the adapters are views of one pool (else None: the torch path runs)."""
        if self._page_tables is None:
            return None
        try:
            tables = self._page_tables.tables(keys, weights)
            return PagedLoRA(row_adapter, tables, self.model.device)
        except ValueError as exc:
            if not self._paged_fallback_logged:
                self._paged_fallback_logged = True
                logger.warning(
                    "the triton lora kernel cannot read this provider's adapters (%s); "
                    "using the torch kernel",
                    exc,
                )
            return None

    def _stacked_for(
        self,
        key: tuple[tuple[str, int], ...],
        weights: list[dict[tuple[int, str], LoRAModuleWeights]],
        num_rows: int,
    ) -> StackedLoRA | None:
        """The stacked form of this step's adapter set, when the step is decode-sized.

        Built (a copy of the set's tensors) only once the same set has been seen on
        ``lora_stack_min_steps`` consecutive steps, so churning sets never pay the copy;
        dropped as soon as the set changes.
        """
        cfg = self.config
        if key != self._stack_key:
            self._stack_key, self._stack_streak, self._stacked = key, 1, None
        else:
            self._stack_streak += 1
        if not cfg.lora_stack_max_rows or num_rows > cfg.lora_stack_max_rows:
            return None
        if self._stacked is None and self._stack_streak >= cfg.lora_stack_min_steps:
            nbytes = sum(
                m.lora_a.numel() * m.lora_a.element_size()
                + m.lora_b.numel() * m.lora_b.element_size()
                for w in weights
                for m in w.values()
            )
            if nbytes <= cfg.lora_stack_max_bytes:
                self._stacked = StackedLoRA(key, weights, self.model.device, self.model.dtype)
        return self._stacked

    def _emit(self, s: _Seq, tok: int, now: float) -> None:
        """Append the sampled token ``tok`` to ``s`` and stream it (``now``: monotonic time).

        Rule: the first token sets ``ttft`` and feeds the prefill estimate. Then, first match
        wins: EOS (unless ``ignore_eos``) finishes with ``"eos"`` and the held-back text; a
        stop string completed by the token finishes with ``"stop"`` and the text before it;
        ``max_new_tokens`` reached finishes with ``"length"``, and a full context
        (``max_model_len`` tokens) with ``"context"``, after flushing the detokenizer (a stop
        string found in that tail still makes it ``"stop"``). Otherwise a non-final event
        carries the text released so far.
        """
        s.tokens.append(tok)
        s.completion += 1
        if s.ttft is None:
            s.ttft = now - s.arrival
            self.estimates.observe_prefill(s.prefill_work)
        if tok in self._eos and not s.req.ignore_eos:
            text, _ = s.stopper.feed(s.detok.flush())
            self._finish(s, "eos", text=text + s.stopper.flush(), token_ids=[tok])
            return
        text, stopped = s.stopper.feed(s.detok.add([tok]))
        if stopped:
            self._finish(s, "stop", text=text, token_ids=[tok])
            return
        reason = None
        if s.completion >= s.req.max_new_tokens:
            reason = "length"
        elif len(s.tokens) >= self.max_model_len:
            reason = "context"
        if reason is not None:
            tail, stopped = s.stopper.feed(s.detok.flush())
            text += tail
            if not stopped:
                text += s.stopper.flush()
            self._finish(s, "stop" if stopped else reason, text=text, token_ids=[tok])
            return
        s.stream._put(self._event(s, text, [tok], None))


def _non_finite_error(s: _Seq) -> PLoRAError:
    """The error that ends a sequence whose next-token logits hold NaN/Inf: sampling them
    would stream garbage (argmax of NaN is token 0) as if it were an answer.

    With an adapter it is the adapter's (``FAILED_PRECONDITION``: e.g. a ``lora_alpha`` of
    1e30 registers, its scaled products overflow float32); without one, an internal error.
    """
    if s.adapter_key is None:
        return PLoRAError("the base model gave non-finite logits (NaN/Inf) for this prompt")
    adapter_id, version = s.adapter_key
    return IncompatibleAdapterError(
        f"adapter {adapter_id!r} (v{version}) gave non-finite logits (NaN/Inf) for this "
        "prompt: its weights times its scaling (lora_alpha / r) overflow the serving dtype; "
        "fix the adapter and register it again"
    )


@contextlib.contextmanager
def running_engine(engine: Engine) -> Iterator[Engine]:
    """``with running_engine(e):`` starts ``e`` and stops it on exit."""
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()
