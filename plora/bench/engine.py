"""``plora bench engine``: our engine vs transformers ``generate`` and PEFT mixed batches.

One run, the same prompts everywhere, fixed-length generation (EOS ignored, so every system
produces exactly ``--new-tokens`` per request):

* ``engine_base_tok_s[b]``   our engine, base model only, ``b`` concurrent requests;
* ``engine_mixed_tok_s[b]``  our engine, ``b`` requests over 8 distinct adapters (ranks
  8/16/32/64, all 7 projections) in one continuous batch;
* ``hf_base_tok_s[b]``       transformers ``generate`` on a left-padded batch of ``b``;
* ``peft_mixed_tok_s[b]``    PEFT ``generate(adapter_names=...)`` with the same 8 adapters
  (PEFT's mixed-adapter batch inference);
* ``ttft_prompt256_s``       engine time to first token for one 256-token prompt (idle engine;
  ``ttft_prompt_tokens`` says how long it was: shorter on a model whose context is shorter);
* ratios ``mixed_over_base_b8``, ``mixed_over_peft_b8``, ``base_over_hf_b8``;
* ``kv``: KV memory per sequence and the most sequences one KV memory admits, slot cache vs
  paged cache side by side, for chats of ``--kv-chat-tokens`` tokens (half prompt, half
  generated) in the memory of ``--kv-slots`` slot-cache sequences of the context length. The
  slot cache admits one sequence per slot; the paged figure is measured: that many chats and
  more are submitted to an engine with a paged cache of that memory, and the most that ran
  at once is reported (``peak_running``).

Throughput is generated tokens / wall seconds from submission to the last token, prefill
included. With ``--threads 1`` the run also reports ``*_tok_per_cpu_s`` and ``*_b8_cpu``
ratios: tokens per CPU second of the computing thread, which stay comparable on a machine
that other processes load (wall-clock figures on a shared 2-core box swing by 2x). The
adapters are created by PEFT itself and handed to our engine as the very same tensors, so
both sides compute the same function.

``--adapter-ranks`` changes the 8 adapters' ranks: at rank 1 their weights are negligible,
which isolates the engine's per-adapter overhead (segments, masks, dispatch) from the cost of
reading the adapters' weights. The JSON also gives the weight bytes one decode step reads
(``base_weight_bytes_per_step``, ``adapter_weight_bytes_per_step_b8``) and
``mixed_over_base_weight_read_bound = base / (base + adapters)``: the mixed/base ratio of a
step whose time is its weight reads alone. It is a lower bound when the adapters add nothing
but their reads: per-step costs they do not add to (attention, sampling, dispatch) lift the
measured ratio above it, so a faster base engine moves the ratio towards it, not past it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import cast

import torch

from services.common.types import LoRAModuleWeights, ModelSpec
from services.worker.adapter_api import AdapterRef, ResidentAdapters
from services.worker.engine import Engine, EngineConfig, EngineRequest, RequestStream
from services.worker.model import DecoderModel
from services.worker.model_loader import default_cache_dir, resolve_model
from services.worker.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ADAPTER_RANKS = (8, 16, 32, 64, 8, 16, 32, 64)
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis in simple words.",
    "Give three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Describe a sunset over the mountains.",
    "How do airplanes stay in the air?",
    "Summarize the plot of Romeo and Juliet.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora bench engine``."""
    parser.add_argument("--out", default="bench_engine.json", help="JSON result file")
    parser.add_argument(
        "--model",
        default=None,
        help="base model: an HF directory, a .gguf file or a cached org/name, any served family "
        "(default: SmolLM2 GGUF)",
    )
    parser.add_argument("--cache-dir", default=None, help="converted-model cache directory")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per measurement (best is kept), all systems"
    )
    parser.add_argument(
        "--quick", action="store_true", help="short run: batch sizes 1,8 and 12 new tokens"
    )
    parser.add_argument(
        "--kv-cache",
        default="paged",
        choices=["paged", "slot"],
        help="KV cache of the throughput runs (the admission measurement compares both)",
    )
    parser.add_argument(
        "--kv-chat-tokens",
        type=int,
        default=64,
        help="tokens per chat (prompt + generated) of the KV-cache admission measurement",
    )
    parser.add_argument(
        "--kv-slots",
        type=int,
        default=4,
        help="KV memory of the admission measurement, in slot-cache sequences of the "
        "context length (--quick: 1)",
    )
    parser.add_argument(
        "--adapter-ranks",
        default=",".join(str(r) for r in ADAPTER_RANKS),
        help="ranks of the 8 distinct adapters (comma-separated); rank 1 isolates the "
        "engine's per-adapter overhead from the adapters' weight bytes",
    )


def _chat_ids(tok: Tokenizer, n: int) -> list[list[int]]:
    """``n`` prompts, chat-formatted when the model has a chat template, else plain text."""
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    if tok.chat_template is None:
        return [tok.encode(t) for t in texts]
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def submit_batch(
    engine: Engine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
) -> list[RequestStream]:
    """Submit request ``i`` = ``prompts[i]`` with ``adapters[i]`` (``None`` = base, version
    1), ``new_tokens`` tokens with EOS ignored, all at once; their streams in order."""
    return [
        engine.submit(
            EngineRequest(
                f"bench-{time.monotonic_ns()}-{i}",
                p,
                max_new_tokens=new_tokens,
                ignore_eos=True,
                adapter=AdapterRef(a, 1, "") if a else None,
            )
        )
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    ]


def engine_run(
    engine: Engine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
) -> tuple[float, float]:
    """(tokens per wall second, tokens per step-thread CPU second) of one batch through
    ``engine``: request ``i`` is ``prompts[i]`` with ``adapters[i]`` (``None`` = base), each
    generating ``new_tokens`` tokens with EOS ignored.

    Raises:
        Exception: the first error a request's stream reports.
    """
    c0 = engine.step_cpu_seconds
    t0 = time.perf_counter()
    streams = submit_batch(engine, prompts, adapters, new_tokens)
    total = 0
    for s in streams:
        for ev in s:
            if ev.error is not None:
                raise ev.error
            total += len(ev.token_ids)
    dt = time.perf_counter() - t0
    assert total == len(prompts) * new_tokens, (total, len(prompts) * new_tokens)
    return total / dt, total / max(engine.step_cpu_seconds - c0, 1e-9)


def _hf_run(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    adapter_names: list[str] | None = None,
) -> tuple[float, float]:
    """(tokens per wall second, per CPU second of this thread) of ``generate``, left-padded."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs: dict[str, object] = {}
    if adapter_names is not None:
        kwargs["adapter_names"] = adapter_names
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=2,
            **kwargs,
        )
    dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert out.shape[1] - width == new_tokens
    n = len(prompts) * new_tokens
    return n / dt, n / max(cpu, 1e-9)


def _peft_adapters(
    hf: torch.nn.Module, spec: ModelSpec, ranks: tuple[int, ...] = ADAPTER_RANKS
) -> tuple[object, dict]:
    """Wrap ``hf`` in PEFT with one random adapter per rank in ``ranks`` on every projection
    of ``spec``'s family; return it and our view of the same tensors."""
    import peft

    names = [f"bench-r{r}-{i}" for i, r in enumerate(ranks)]
    cfgs = [
        peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(spec.projections)) for r in ranks
    ]
    pm = peft.get_peft_model(hf, cfgs[0], adapter_name=names[0])
    for n, c in zip(names[1:], cfgs[1:], strict=True):
        pm.add_adapter(n, c)
    gen = torch.Generator().manual_seed(0)
    ours: dict[str, dict[tuple[int, str], LoRAModuleWeights]] = {n: {} for n in names}
    with torch.no_grad():
        for mod_name, mod in pm.named_modules():
            if not hasattr(mod, "lora_A") or not isinstance(mod.lora_A, torch.nn.ModuleDict):
                continue
            parts = mod_name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            proj = parts[-1]
            for n in names:
                if n not in mod.lora_A:
                    continue
                # PEFT's LoRA factors are nn.Linear layers (Module.__getattr__ is typed loosely).
                a = cast(torch.nn.Linear, mod.lora_A[n]).weight
                b = cast(torch.nn.Linear, mod.lora_B[n]).weight
                a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
                ours[n][(layer, proj)] = LoRAModuleWeights(
                    lora_a=a.detach().clone().contiguous(),
                    lora_b=b.detach().clone().contiguous(),
                    scaling=float(mod.scaling[n]),
                )
    assert all(len(v) == spec.num_layers * len(spec.projections) for v in ours.values())
    pm.eval()
    return pm, ours


def kv_admission(
    model: DecoderModel,
    tok: Tokenizer,
    device: str,
    dtype: str,
    chat_tokens: int,
    slots: int,
    max_model_len: int = 2048,
    block_size: int = 16,
) -> dict[str, object]:
    """KV memory per sequence and the most sequences one KV memory admits, slot vs paged.

    The memory is that of a slot cache of ``slots`` sequences of ``max_model_len`` tokens
    (capped by the model's context). Chats of ``chat_tokens`` tokens (half prompt, the rest
    generated with EOS ignored) are submitted, 25 % more than the paged cache can hold, to an
    engine whose paged cache has that memory and no other bound on running sequences; the
    most that ran at once is measured.

    Returns:
        ``{"context_tokens", "chat_tokens", "block_size", "memory_bytes", "bytes_per_token",
        "slot": {"bytes_per_sequence", "sequences"}, "paged": {"bytes_per_sequence",
        "sequences", "peak_running", "tok_s"}, "paged_over_slot"}``.

    Raises:
        ValueError: ``chat_tokens`` below 2 or above the context, or ``slots`` below 1.
    """
    context = min(max_model_len, model.spec.max_position_embeddings)
    if not 2 <= chat_tokens <= context or slots < 1:
        raise ValueError(
            f"--kv-chat-tokens must be in 2..{context} and --kv-slots >= 1, "
            f"got {chat_tokens} and {slots}"
        )
    prompt_len = chat_tokens // 2
    new_tokens = chat_tokens - prompt_len
    memory_tokens = slots * context
    fits = memory_tokens // (-(-chat_tokens // block_size) * block_size)
    engine = Engine(
        model,
        tok,
        None,
        EngineConfig(
            device=device,
            dtype=dtype,
            max_batch_size=fits * 2,
            max_model_len=context,
            max_num_batched_tokens=max(2048, fits * 2),
            kv_cache="paged",
            kv_block_size=block_size,
            kv_cache_tokens=memory_tokens,
        ),
    )
    source = " ".join(PROMPTS * (1 + chat_tokens // 8))
    ids = tok.encode(source)
    prompts = [ids[i % 7 : i % 7 + prompt_len] for i in range(fits + max(1, fits // 4))]
    engine.start()
    try:
        tok_s, _ = engine_run(engine, prompts, [None] * len(prompts), new_tokens)
    finally:
        engine.stop()
    kv = engine.kv
    per_token = kv.bytes_per_token
    slot_seq = context * per_token
    paged_seq = kv.tokens_reserved(chat_tokens) * per_token
    return {
        "context_tokens": context,
        "chat_tokens": chat_tokens,
        "block_size": block_size,
        "memory_bytes": memory_tokens * per_token,
        "bytes_per_token": per_token,
        "slot": {"bytes_per_sequence": slot_seq, "sequences": slots},
        "paged": {
            "bytes_per_sequence": paged_seq,
            "sequences": memory_tokens * per_token // paged_seq,
            "peak_running": engine.peak_running,
            "tok_s": tok_s,
        },
        "paged_over_slot": engine.peak_running / slots,
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print a table, write JSON to ``--out``."""
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    ranks = tuple(int(x) for x in str(args.adapter_ranks).split(",") if x)
    if not ranks or min(ranks) < 1:
        raise SystemExit(f"--adapter-ranks: positive integers expected, got {args.adapter_ranks!r}")
    sizes = [1, 8] if args.quick else [int(x) for x in str(args.batch_sizes).split(",") if x]
    new_tokens = 12 if args.quick else int(args.new_tokens)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    model_dir = resolve_model(args.model, cache)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype
    ]
    tok = Tokenizer(model_dir)
    model = DecoderModel.from_dir(model_dir, device=args.device, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(args.device)
    hf.eval()
    max_b = max(sizes)
    prompts = _chat_ids(tok, max_b)

    result: dict[str, object] = {
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "new_tokens": new_tokens,
        "repeats": max(1, int(args.repeats)),
        "batch_sizes": sizes,
        "kv_cache": args.kv_cache,
        "adapter_ranks": list(ranks),
        "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
    }
    hf_base: dict[str, float] = {}
    logger.info("transformers generate, base model")
    _hf_run(hf, prompts[:1], 2)  # warm-up
    hf_base_cpu: dict[str, float] = {}
    reps = max(1, int(args.repeats))
    for b in sizes:
        runs = [_hf_run(hf, prompts[:b], new_tokens) for _ in range(reps)]
        hf_base[str(b)] = max(r[0] for r in runs)
        hf_base_cpu[str(b)] = max(r[1] for r in runs)

    pm, ours = _peft_adapters(hf, model.spec, ranks)
    names = list(ours)
    peft_mixed: dict[str, float] = {}
    logger.info("PEFT mixed-adapter generate")
    _hf_run(pm, prompts[:1], 2, adapter_names=names[:1])  # type: ignore[arg-type]
    peft_mixed_cpu: dict[str, float] = {}
    for b in sizes:
        runs = [
            _hf_run(
                pm,  # type: ignore[arg-type]
                prompts[:b],
                new_tokens,
                adapter_names=[names[i % len(names)] for i in range(b)],
            )
            for _ in range(reps)
        ]
        peft_mixed[str(b)] = max(r[0] for r in runs)
        peft_mixed_cpu[str(b)] = max(r[1] for r in runs)
    del pm, hf

    model_elem_size = torch.empty((), dtype=dtype).element_size()
    provider = ResidentAdapters(ours)
    engine = Engine(
        model,
        tok,
        provider,
        EngineConfig(
            device=args.device,
            dtype=args.dtype,
            max_batch_size=max(max_b, 8),
            max_model_len=1024,
            max_num_batched_tokens=max(512, max_b),
            kv_cache=args.kv_cache,
        ),
    )
    engine.start()
    try:
        engine_run(engine, prompts[:2], [None, names[0]], 2)  # warm-up
        eng_base: dict[str, float] = {}
        eng_mixed: dict[str, float] = {}
        eng_base_cpu: dict[str, float] = {}
        eng_mixed_cpu: dict[str, float] = {}
        for b in sizes:
            logger.info("engine batch %d", b)
            mixed_adapters = [names[i % len(names)] for i in range(b)]
            base_runs, mixed_runs = [], []
            for _ in range(reps):  # interleaved, so load drift hits both alike
                base_runs.append(engine_run(engine, prompts[:b], [None] * b, new_tokens))
                mixed_runs.append(engine_run(engine, prompts[:b], mixed_adapters, new_tokens))
            eng_base[str(b)] = max(r[0] for r in base_runs)
            eng_mixed[str(b)] = max(r[0] for r in mixed_runs)
            eng_base_cpu[str(b)] = max(r[1] for r in base_runs)
            eng_mixed_cpu[str(b)] = max(r[1] for r in mixed_runs)
        long_text = " ".join(PROMPTS * 20)
        # 256 tokens, or one less than the context of a model whose context is shorter
        long_prompt = tok.encode(long_text)[: min(256, engine.max_model_len - 1)]
        ttfts = []
        for i in range(3):
            s = engine.submit(EngineRequest(f"ttft-{i}", long_prompt, max_new_tokens=1))
            evs = list(s)
            ttfts.append(float(evs[0].ttft_seconds or 0.0))
    finally:
        engine.stop()
    logger.info("KV cache admission, slot vs paged")
    kv = kv_admission(
        model,
        tok,
        args.device,
        args.dtype,
        int(args.kv_chat_tokens),
        1 if args.quick else int(args.kv_slots),
    )

    result.update(
        kv=kv,
        engine_base_tok_s=eng_base,
        engine_mixed_tok_s=eng_mixed,
        hf_base_tok_s=hf_base,
        peft_mixed_tok_s=peft_mixed,
        ttft_prompt256_s=statistics.median(ttfts),
        ttft_prompt_tokens=len(long_prompt),
    )
    if torch.get_num_threads() == 1:
        # With one intra-op thread all compute runs on the measuring thread, so tokens per
        # CPU second are comparable across systems and immune to other processes' load.
        result.update(
            engine_base_tok_per_cpu_s=eng_base_cpu,
            engine_mixed_tok_per_cpu_s=eng_mixed_cpu,
            hf_base_tok_per_cpu_s=hf_base_cpu,
            peft_mixed_tok_per_cpu_s=peft_mixed_cpu,
        )
    ref_b = "8" if "8" in eng_base else str(sizes[-1])
    result["mixed_over_base_b8"] = eng_mixed[ref_b] / eng_base[ref_b]
    result["mixed_over_peft_b8"] = eng_mixed[ref_b] / peft_mixed[ref_b]
    result["base_over_hf_b8"] = eng_base[ref_b] / hf_base[ref_b]
    # A decode step reads every base weight once whatever the batch (tied embeddings count once,
    # as the LM head), and every distinct adapter's A and B once (each row has its own adapter:
    # no reuse across rows). Where the step is bound by weight reads, mixed/base cannot exceed
    # base / (base + adapters): the bound the measured ratio is compared with.
    base_bytes = model.decode_weight_bytes
    adapter_bytes = sum(
        (m.lora_a.numel() + m.lora_b.numel()) * model_elem_size
        for w in ours.values()
        for m in w.values()
    )
    result["base_weight_bytes_per_step"] = base_bytes
    result["adapter_weight_bytes_per_step_b8"] = adapter_bytes
    result["mixed_over_base_weight_read_bound"] = base_bytes / (base_bytes + adapter_bytes)

    if torch.get_num_threads() == 1:
        result["mixed_over_base_b8_cpu"] = eng_mixed_cpu[ref_b] / eng_base_cpu[ref_b]
        result["mixed_over_peft_b8_cpu"] = eng_mixed_cpu[ref_b] / peft_mixed_cpu[ref_b]
        result["base_over_hf_b8_cpu"] = eng_base_cpu[ref_b] / hf_base_cpu[ref_b]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(
        f"engine benchmark ({args.device}, {args.dtype}, {torch.get_num_threads()} threads, "
        f"{new_tokens} new tokens/request), tokens/s:"
    )
    print(
        f"{'batch':>6} {'engine base':>12} {'engine mixed':>13} {'HF base':>9} {'PEFT mixed':>11}"
    )
    for b in sizes:
        k = str(b)
        print(
            f"{b:>6} {eng_base[k]:>12.1f} {eng_mixed[k]:>13.1f} {hf_base[k]:>9.1f} "
            f"{peft_mixed[k]:>11.1f}"
        )
    print(f"TTFT ({len(long_prompt)}-token prompt): {result['ttft_prompt256_s']:.3f} s")
    print(
        f"mixed/base b{ref_b}: {result['mixed_over_base_b8']:.2f} (target >= 0.85)  "
        f"mixed/PEFT b{ref_b}: {result['mixed_over_peft_b8']:.2f} (target >= 2.5)  "
        f"base/HF b{ref_b}: {result['base_over_hf_b8']:.2f} (target >= 1.0)"
    )
    print(
        f"weights read per decode step: base {base_bytes / 1e6:.0f} MB, the {len(ours)} adapters "
        f"{adapter_bytes / 1e6:.0f} MB -> mixed/base if a step were its weight reads alone: "
        f"{result['mixed_over_base_weight_read_bound']:.2f}"
    )
    if "mixed_over_base_b8_cpu" in result:
        print(
            f"per CPU second (1 thread): mixed/base {result['mixed_over_base_b8_cpu']:.2f}  "
            f"mixed/PEFT {result['mixed_over_peft_b8_cpu']:.2f}  "
            f"base/HF {result['base_over_hf_b8_cpu']:.2f}"
        )
    slot_kv = cast(dict[str, int], kv["slot"])
    paged_kv = cast(dict[str, float], kv["paged"])
    memory_mb = float(cast(int, kv["memory_bytes"])) / 1e6
    print(
        f"KV cache, {kv['chat_tokens']}-token chats in {memory_mb:.0f} MB "
        f"({slot_kv['sequences']} x {kv['context_tokens']}-token slots):"
    )
    print(f"{'cache':>6} {'KB/sequence':>12} {'sequences':>10}")
    print(f"{'slot':>6} {slot_kv['bytes_per_sequence'] / 1e3:>12.0f} {slot_kv['sequences']:>10}")
    print(
        f"{'paged':>6} {paged_kv['bytes_per_sequence'] / 1e3:>12.0f} "
        f"{paged_kv['peak_running']:>10} (measured; {paged_kv['sequences']} fit)"
    )
    print(f"paged/slot sequences: {kv['paged_over_slot']:.1f}x (target >= 8x)")
    print(f"wrote {out}")
    return 0


def main() -> int:  # pragma: no cover - convenience entry point
    """``python -m plora.bench.engine``."""
    logging.basicConfig(level=os.environ.get("PLORA_LOG_LEVEL", "INFO"))
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
