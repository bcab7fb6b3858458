"""``plora bench gpu``: one command that checks and measures the engine on one CUDA GPU.

Needs torch with CUDA, triton, transformers, peft, safetensors and tokenizers (``pip install
'plora[gpu,test]'`` brings triton and peft). In order, writing one JSON file and a table:

1. ``kernels``: the Triton multi-LoRA kernels against the torch path on a random mixed batch
   (ranks 1 to 128, base-only rows, different target modules) whose adapters the real store
   placed in its pool: max difference over ``max |y|``, float32 <= 1e-5, bfloat16 <= 2e-2;
   and ``attention``: the Triton paged decode-attention kernel against the torch path over a
   paged KV cache of shuffled blocks (GQA, lengths across block boundaries, a sliding window,
   soft-capping), the same tolerances.
2. ``exactness``: a small random Llama with three PEFT adapters (ranks 4 to 64), PEFT in
   float32 on the CPU as the reference; our decoder on the device through the chosen kernel
   over the store's pool, one mixed prefill step: max ``|logit difference|`` over
   ``max |logit|``, float32 <= 1e-4, bfloat16 <= 5e-2; greedy argmax agreement is reported.
3. ``decode``: time of one decode step (``--decode-batch`` rows at position 64, paged KV cache,
   the device's default decode attention) of a model of ``--shape`` with random weights: base
   only, and mixed adapters through each kernel, next to the time to read the base weights
   once at the measured device-copy bandwidth.
4. ``engine``: generated tokens per second of the engine (base alone; mixed adapters through
   each kernel; ``--adapters`` distinct adapters of ``--ranks`` on all seven projections) and
   of PEFT's mixed-adapter ``generate``, per batch size, with ``mixed_over_base`` and
   ``mixed_over_peft`` at each size; with Triton, the same with CUDA graphs
   (``--cuda-graphs on``: ``base_graphs``, ``mixed_triton_graphs``), whose greedy tokens on a
   mixed batch of 8 must equal the plain pass's (``graphs_tokens_agree``). Each batch size
   runs once untimed first (Triton compiles, CUDA graph capture).
5. ``loads`` (run before parts 3 and 4): the adapter store's load path, what a cold start
   pays: per rank, one adapter of ``--shape`` on all seven projections loaded from the
   loader (``source``) and from the host cache (``host``), beside the pinned host-to-device
   copy rate and the ``h100-8b`` simulator preset's host-load rate.

``--device cpu`` is a dry run of the same code on the ``tiny`` shape with small sizes (the
Triton kernels run through Triton's interpreter): it checks the command, not the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Model shapes (transformers ``LlamaConfig`` fields) the decode and engine parts build.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
    },
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Tolerances of the kernel check (max |difference| / max |y|) per dtype.
KERNEL_TOL = {"float32": 1e-5, "bfloat16": 2e-2}
#: Tolerances of the exactness check (max |logit difference| / max |logit|) per dtype.
LOGIT_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora bench gpu``; a count or size below 1 is a usage error (exit 2)."""
    from services.common.config import checked_type, parse_ranks

    count = checked_type(int, lambda v: v >= 1, "a positive integer")
    sizes = checked_type(
        lambda t: [int(x) for x in t.split(",") if x.strip()],
        lambda v: bool(v) and min(v) >= 1,
        "comma-separated positive integers",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu: a dry run")
    parser.add_argument("--out", default="bench_gpu.json", help="JSON result file")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    parser.add_argument(
        "--batch-sizes", type=sizes, default=None, help="engine batch sizes (1,8,32,64)"
    )
    parser.add_argument("--adapters", type=count, default=None, help="distinct adapters (64)")
    parser.add_argument(
        "--ranks", type=parse_ranks, default=[8, 16, 32, 64, 128], help="adapter ranks, cycled"
    )
    parser.add_argument("--new-tokens", type=count, default=None, help="tokens per request (32)")
    parser.add_argument("--prompt-tokens", type=count, default=None, help="prompt length (64)")
    parser.add_argument("--decode-batch", type=count, default=None, help="decode-step rows (32)")
    parser.add_argument("--skip-peft", action="store_true", help="no PEFT generate runs")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes: the flags, else GPU defaults, else dry-run defaults on the CPU."""
    dry = not str(args.device).startswith("cuda")

    def pick(value: Any, gpu: Any, cpu: Any) -> Any:
        return value if value is not None else (cpu if dry else gpu)

    return {
        "dry_run": dry,
        "device": str(args.device),
        "shape": pick(args.shape, "llama3-8b", "tiny"),
        "dtype": pick(args.dtype, "bfloat16", "float32"),
        "batch_sizes": list(pick(args.batch_sizes, [1, 8, 32, 64], [1, 2])),
        "adapters": pick(args.adapters, 64, 2),
        "ranks": list(args.ranks),
        "new_tokens": pick(args.new_tokens, 32, 2),
        "prompt_tokens": pick(args.prompt_tokens, 64, 6),
        "decode_batch": pick(args.decode_batch, 32, 2),
        "peft": not args.skip_peft,
    }


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _store(device: str, dtype: str, weights: dict[str, Any], pool_bytes: int) -> Iterator[Any]:
    """A real adapter store on ``device`` whose loader returns ``weights[adapter_id]``."""
    from services.worker.store import AdapterStore
    from services.worker.store_types import StoreConfig

    pool_bytes = max(pool_bytes, 1 << 20)
    cfg = StoreConfig(
        pool_bytes=pool_bytes,
        page_bytes=64 * 1024,
        host_cache_bytes=pool_bytes,
        device=device,
        dtype=dtype,
        load_wait_timeout_s=600.0,
    )
    with AdapterStore(cfg, lambda ref: weights[ref.adapter_id]) as store:
        yield store


def _leased(store: Any, names: list[str]) -> tuple[list[Any], list[dict]]:
    """Leases (ready) on ``names`` and their pool views."""
    from services.worker.adapter_api import AdapterRef

    leases = [store.acquire(AdapterRef(n, 1, "")) for n in names]
    for lease in leases:
        if not lease.wait(600):
            raise RuntimeError(f"adapter {lease.ref.adapter_id} did not load")
    return leases, [lease.weights() for lease in leases]


def _random_lora(
    name: str, rank: int, targets: list[str], dims: dict[str, tuple[int, int]], layers: int, g: Any
) -> Any:
    import torch

    from services.common.types import LoRAModuleWeights, LoRAWeights

    mods = {}
    for layer in range(layers):
        for mod in targets:
            din, dout = dims[mod]
            a = torch.randn(rank, din, generator=g) / din**0.5
            b = torch.randn(dout, rank, generator=g) / rank**0.5
            mods[(layer, mod)] = LoRAModuleWeights(a, b, 2.0 / rank)
    return LoRAWeights(name, 1, mods)


def check_kernels(device: str, dtype: str) -> dict[str, Any]:
    """Part 1: the Triton kernels against the torch path over the store's pool."""
    import torch

    from services.worker.lora_ops import NO_ADAPTER, LoRABatch
    from services.worker.lora_pages import PagedLoRA, PageTableCache

    g = torch.Generator().manual_seed(0)
    dims = {m: (192, 320) for m in PROJECTIONS} | {"k_proj": (192, 64), "down_proj": (320, 192)}
    specs = [(1, ["q_proj", "v_proj"]), (16, list(PROJECTIONS)), (64, ["o_proj", "down_proj"])]
    specs.append((128, ["k_proj", "gate_proj", "up_proj"]))
    weights = {f"k{i}": _random_lora(f"k{i}", r, t, dims, 2, g) for i, (r, t) in enumerate(specs)}
    names = list(weights)
    rows = [0, 0, NO_ADAPTER, 1, 3, 3, 3, NO_ADAPTER, 2, 1, 1, 0] * 3
    td = getattr(torch, dtype)
    out: dict[str, Any] = {"dtype": dtype, "tolerance": KERNEL_TOL[dtype]}
    with _store(device, dtype, weights, 64 << 20) as store:
        leases, views = _leased(store, names)
        tables = PageTableCache(2).tables(names, views)
        ref = LoRABatch(rows, views)
        tri = LoRABatch(rows, views, paged=PagedLoRA(rows, tables, device))
        worst = 0.0
        for layer in range(2):
            for mod, (din, dout) in dims.items():
                x = torch.randn(len(rows), din, generator=g).to(device, td)
                y0 = torch.randn(len(rows), dout, generator=g).to(device, td)
                a, b = y0.clone(), y0.clone()
                ref.apply(layer, mod, x, a)
                tri.apply(layer, mod, x, b)
                diff = (a.float() - b.float()).abs().max().item()
                worst = max(worst, diff / max(a.float().abs().max().item(), 1e-30))
        for lease in leases:
            lease.release()
    out["max_rel_diff"] = worst
    out["ok"] = worst <= KERNEL_TOL[dtype]
    return out


def check_attention(device: str, dtype: str) -> dict[str, Any]:
    """Part 1b: the Triton paged decode-attention kernel against the torch path."""
    import torch

    from services.worker.kernels.attention_triton import (
        paged_decode_attention,
        paged_decode_attention_torch,
    )

    g = torch.Generator().manual_seed(1)
    td = getattr(torch, dtype)
    kv_heads, group, hd, bs, blocks = 2, 4, 64, 16, 64
    lens = torch.tensor([1, 16, 17, 100, 250, 64], dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    perm = torch.randperm(blocks - 1, generator=g) + 1  # shuffled, block 0 left as padding
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens.tolist()):
        k = -(-n // bs)
        tables[i, :k] = perm[used : used + k].to(torch.int32)
        used += k
    shape = (kv_heads, blocks, bs, hd)
    kc = torch.randn(shape, generator=g).to(device, td)
    vc = torch.randn(shape, generator=g).to(device, td)
    q = torch.randn(len(lens), kv_heads * group, hd, generator=g).to(device, td)
    tables, lens = tables.to(device), lens.to(device)
    worst = 0.0
    for window, softcap in ((None, None), (40, None), (None, 20.0), (33, 30.0)):
        args = (q, kc, vc, tables, lens, hd**-0.5)
        a = paged_decode_attention_torch(*args, window=window, softcap=softcap).float()
        b = paged_decode_attention(*args, window=window, softcap=softcap).float()
        worst = max(worst, (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30))
    return {
        "dtype": dtype,
        "tolerance": KERNEL_TOL[dtype],
        "max_rel_diff": worst,
        "ok": worst <= KERNEL_TOL[dtype],
    }


def _hf_config(shape: str) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def _decoder(hf: Any, device: str, dtype: Any) -> Any:
    """Our decoder over the same weights as the transformers model ``hf``."""
    from services.worker.families import describe
    from services.worker.model import DecoderModel
    from services.worker.model_loader import spec_from_config

    config = hf.config.to_dict()
    state = {k: v for k, v in hf.state_dict().items()}
    spec = spec_from_config(config, "bench")
    return DecoderModel(spec, describe(config), state, device=device, dtype=dtype)


def _peft(hf: Any, ranks: list[int], g: Any) -> tuple[Any, dict[str, Any]]:
    """PEFT with one adapter per rank on all projections (random A and B); our copy of them."""
    import peft
    import torch

    from services.common.types import LoRAModuleWeights, LoRAWeights

    names = [f"a{i}-r{r}" for i, r in enumerate(ranks)]
    device = next(hf.parameters()).device
    pm = None
    for n, r in zip(names, ranks, strict=True):
        c = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(PROJECTIONS))
        if pm is None:
            pm = peft.get_peft_model(hf, c, adapter_name=n)
        else:
            pm.add_adapter(n, c)
    assert pm is not None
    ours: dict[str, dict] = {n: {} for n in names}
    with torch.no_grad():
        for mod_name, mod in pm.named_modules():
            if not isinstance(getattr(mod, "lora_A", None), torch.nn.ModuleDict):
                continue
            parts = mod_name.split(".")
            layer, proj = int(parts[parts.index("layers") + 1]), parts[-1]
            for n in names:
                a, b = mod.lora_A[n].weight, mod.lora_B[n].weight
                a.copy_(torch.randn(a.shape, generator=g, device=device) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=g, device=device) * 0.02)
                ours[n][(layer, proj)] = LoRAModuleWeights(
                    a.detach(), b.detach(), float(mod.scaling[n])
                )
    pm.eval()
    return pm, {n: LoRAWeights(n, 1, m) for n, m in ours.items()}


def _on(w: Any, device: str) -> Any:
    """A copy of adapter weights ``w`` on ``device``."""
    from services.common.types import LoRAModuleWeights, LoRAWeights

    mods = {
        k: LoRAModuleWeights(m.lora_a.to(device), m.lora_b.to(device), m.scaling)
        for k, m in w.modules.items()
    }
    return LoRAWeights(w.adapter_id, w.version, mods)


def _adapter_bytes(w: Any, elem: int) -> int:
    return sum((m.lora_a.numel() + m.lora_b.numel()) * elem for m in w.modules.values())


def check_exactness(device: str, kernel: str) -> dict[str, Any]:
    """Part 2: our decoder (device, fp32 and bf16, through ``kernel``) vs PEFT fp32 on CPU."""
    import torch
    from transformers import LlamaForCausalLM

    from services.worker.lora_ops import NO_ADAPTER, LoRABatch
    from services.worker.lora_pages import PagedLoRA, PageTableCache
    from services.worker.model import SeqChunk, StepBatch

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    hf = LlamaForCausalLM(_hf_config("tiny")).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    # our decoders first: PEFT wraps the base model's projections in place
    models = {d: _decoder(hf, device, getattr(torch, d)) for d in ("float32", "bfloat16")}
    pm, ours = _peft(hf, [4, 16, 64], g)
    ours = {n: _on(w, "cpu") for n, w in ours.items()}
    names = list(ours)
    prompts = [[5, 9, 11, 30, 7, 8], [40, 41, 42], [8, 8, 9, 10, 77], [12, 13, 99, 100]]
    adapters = [0, NO_ADAPTER, 1, 2]
    refs = []
    with torch.no_grad():
        for p, a in zip(prompts, adapters, strict=True):
            if a == NO_ADAPTER:
                with pm.disable_adapter():
                    refs.append(pm(input_ids=torch.tensor([p])).logits[0, -1].float())
            else:
                pm.set_adapter(names[a])
                refs.append(pm(input_ids=torch.tensor([p])).logits[0, -1].float())
    out: dict[str, Any] = {"kernel": kernel}
    for dtype in ("float32", "bfloat16"):
        model = models[dtype]
        with _store(device, dtype, ours, 16 << 20) as store:
            leases, views = _leased(store, names)
            ids: list[int] = []
            pos: list[int] = []
            rows: list[int] = []
            chunks: list[SeqChunk] = []
            last: list[int] = []
            for slot, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
                chunks.append(SeqChunk(slot=slot, row=len(ids), num_tokens=len(p), start_pos=0))
                ids += p
                pos += range(len(p))
                rows += [a] * len(p)
                last.append(len(ids) - 1)
            paged = None
            if kernel == "triton":
                tables = PageTableCache(model.spec.num_layers).tables(names, views)
                paged = PagedLoRA(rows, tables, device)
            lora = LoRABatch(rows, views, paged=paged)
            kv = model.new_kv_cache(len(prompts), 32)
            step = StepBatch(torch.tensor(ids), torch.tensor(pos), chunks, last, lora)
            with torch.no_grad():
                logits = model.forward(step, kv).float().cpu()
            for lease in leases:
                lease.release()
        ref = torch.stack(refs)
        rel = ((logits - ref).abs().max() / ref.abs().max()).item()
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        out[dtype] = {
            "max_rel_logit_diff": rel,
            "tolerance": LOGIT_TOL[dtype],
            "ok": rel <= LOGIT_TOL[dtype],
            "argmax_agreement": agree,
        }
    out["ok"] = all(out[d]["ok"] for d in ("float32", "bfloat16"))
    return out


def _bandwidth(device: str) -> float:
    """Device memory bandwidth, bytes/s, from a copy of 1 GiB (256 MiB on the CPU)."""
    import torch

    n = (1 << 30) if torch.device(device).type == "cuda" else (1 << 28)
    src = torch.empty(n // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    return 2 * n / _best_copy_s(dst, src, device)  # read + write


def _best_copy_s(dst: Any, src: Any, device: str, non_blocking: bool = False) -> float:
    """Best wall time, seconds, of 5 copies of ``src`` into ``dst`` (each synchronized)."""
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=non_blocking)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _decode_step_s(model: Any, lora: Any, rows: int, reps: int) -> float:
    """Best wall time of one decode step of ``rows`` sequences at position 64."""
    import torch

    from services.worker.lora_pages import resolve_lora_kernel
    from services.worker.model import SeqChunk, StepBatch

    device = model.device
    attention = resolve_lora_kernel("auto", device, what="attention")
    kv = model.new_kv_cache(rows, 128, kind="paged", decode_kernel=attention)
    chunks = [SeqChunk(slot=i, row=i, num_tokens=1, start_pos=64) for i in range(rows)]
    step = StepBatch(
        torch.full((rows,), 5, dtype=torch.long, device=device),
        torch.full((rows,), 64, dtype=torch.long, device=device),
        chunks,
        list(range(rows)),
        lora,
    )
    best = float("inf")
    with torch.no_grad():
        for _ in range(reps + 1):
            _sync(device)
            t0 = time.perf_counter()
            model.forward(step, kv)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    return best


def write_word_tokenizer(out: Path, vocab: int) -> Path:
    """Write a word-level ``tokenizer.json`` (``w0`` .. ``w{vocab-1}``, whitespace split; ``w2``
    is EOS) and its ``tokenizer_config.json`` into ``out``, for a random-weight model that has
    no tokenizer of its own. Returns ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "w1", "eos_token": "w2", "unk_token": "w3", "pad_token": "w0"}),
        "utf-8",
    )
    return out


def _engine_tok_s(
    engine: Any, prompts: list[list[int]], adapters: Sequence[str | None], n: int
) -> float:
    from plora.bench.engine import engine_run

    return engine_run(engine, prompts, list(adapters), n)[0]


def _greedy(
    engine: Any, prompts: list[list[int]], adapters: Sequence[str | None], n: int
) -> list[list[int]]:
    """Each prompt's ``n`` greedy tokens (EOS ignored), all prompts in one batch."""
    from plora.bench.engine import submit_batch

    streams = submit_batch(engine, prompts, list(adapters), n)
    return [[t for ev in st for t in ev.token_ids] for st in streams]


def _peft_tok_s(pm: Any, prompts: list[list[int]], names: list[str], n: int) -> float:
    import torch

    device = next(pm.parameters()).device
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = pm.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            adapter_names=names,
        )
    _sync(device)
    assert out.shape[1] - ids.shape[1] == n
    return len(prompts) * n / (time.perf_counter() - t0)


def _pinned_copy_bytes_s(device: str) -> float:
    """Host-to-device copy rate, bytes/s: best of 5 copies of 256 MiB from pinned host memory
    (pageable memory on the CPU dry run)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    n = 1 << 28
    src = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    return n / _best_copy_s(dst, src, device, non_blocking=cuda)


def measure_loads(s: dict[str, Any]) -> dict[str, Any]:
    """Part 5: the store's load path on the device, the cost a cold start pays.

    Per rank of ``s["ranks"]``, one adapter of ``s["shape"]`` on all seven projections
    (``s["dtype"]`` in the pool) goes through a real :class:`AdapterStore` whose pool holds
    one such adapter: two adapters are acquired in turn, so each acquire after the first two
    evicts the other and loads from the host cache. The store's own ``load`` events give the
    seconds per tier: ``source`` (the loader's tensors packed into pinned host memory, then
    copied) and ``host`` (room found and the host copy moved to the device). Host loads are
    set beside the pinned copy rate measured here and the ``h100-8b`` simulator preset's
    ``h2d_bytes_per_s`` (the rate its host-tier cold starts are charged at).

    Returns:
        ``{"pinned_copy_bytes_s", "preset_h2d_bytes_s", "ranks": {rank: {"bytes",
        "source_s", "host_s", "host_bytes_s", "loads"}}}``: bytes in the pool's dtype,
        seconds the medians over the loads of each tier, ``loads`` the count per tier (2
        from the source, 6 from the host cache).
    """
    import statistics

    import torch

    from plora.simulator.presets import H100_8B_PRESET
    from services.common.types import LoRAWeights
    from services.worker.adapter_api import AdapterRef
    from services.worker.store import AdapterStore
    from services.worker.store_types import StoreConfig, StoreEvent

    shape = SHAPES[s["shape"]]
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    dims = {m: (h, h) for m in PROJECTIONS} | {
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    elem = torch.empty((), dtype=getattr(torch, s["dtype"])).element_size()
    g = torch.Generator().manual_seed(4)
    out: dict[str, Any] = {
        "pinned_copy_bytes_s": _pinned_copy_bytes_s(s["device"]),
        "preset_h2d_bytes_s": H100_8B_PRESET.h2d_bytes_per_s,
        "ranks": {},
    }
    for rank in sorted(set(s["ranks"])):
        w = _random_lora("a", rank, list(PROJECTIONS), dims, shape["num_hidden_layers"], g)
        weights = {n: LoRAWeights(n, 1, w.modules) for n in ("a", "b")}
        nbytes = _adapter_bytes(w, elem)
        events: list[StoreEvent] = []
        cfg = StoreConfig(
            pool_bytes=int(nbytes * 1.5),
            host_cache_bytes=4 * nbytes,
            device=s["device"],
            dtype=s["dtype"],
            load_wait_timeout_s=600.0,
        )
        loader = lambda ref, w=weights: w[ref.adapter_id]  # noqa: E731
        with AdapterStore(cfg, loader, on_event=events.append) as st:
            for i in range(8):
                lease = st.acquire(AdapterRef("ab"[i % 2], 1, ""))
                if not lease.wait(600):
                    raise RuntimeError(f"rank {rank}: adapter did not load: {lease.error()}")
                lease.release()
        by_tier: dict[str, list[float]] = {}
        for e in events:
            if e.kind == "load":
                by_tier.setdefault(e.tier, []).append(e.seconds)
        host_s = statistics.median(by_tier["host"])
        out["ranks"][str(rank)] = {
            "bytes": nbytes,
            "source_s": statistics.median(by_tier["source"]),
            "host_s": host_s,
            "host_bytes_s": nbytes / host_s,
            "loads": {k: len(v) for k, v in by_tier.items()},
        }
    return out


def measure(s: dict[str, Any], kernels: list[str]) -> dict[str, Any]:
    """Parts 3 and 4 on a random model of ``s["shape"]``."""
    import torch
    from transformers import LlamaForCausalLM

    from services.worker.engine import Engine, EngineConfig
    from services.worker.lora_ops import LoRABatch
    from services.worker.lora_pages import PagedLoRA, PageTableCache
    from services.worker.tokenizer import Tokenizer

    device, td = s["device"], getattr(torch, s["dtype"])
    torch.manual_seed(0)
    g = torch.Generator(device=device).manual_seed(2)
    with torch.device(device):
        hf = LlamaForCausalLM(_hf_config(s["shape"])).to(td).eval()
    with torch.no_grad():  # explicit random weights (the constructor may leave them unset)
        for p in hf.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    ranks = [s["ranks"][i % len(s["ranks"])] for i in range(s["adapters"])]
    model = _decoder(hf, device, td)  # shares hf's tensors; before PEFT wraps them
    pm, ours = _peft(hf, ranks, g)
    elem = torch.empty((), dtype=td).element_size()
    names = list(ours)
    pool_bytes = int(sum(_adapter_bytes(w, elem) for w in ours.values()) * 1.1)
    res: dict[str, Any] = {"base_weight_bytes": model.decode_weight_bytes}
    res["bandwidth_bytes_s"] = bw = _bandwidth(device)
    res["base_read_s"] = model.decode_weight_bytes / bw
    b = s["decode_batch"]
    rows = [i % len(names) for i in range(b)]
    with _store(device, s["dtype"], ours, pool_bytes) as store:
        leases, views = _leased(store, names)
        step: dict[str, float] = {"base": _decode_step_s(model, None, b, 3)}
        for k in kernels:
            paged = None
            if k == "triton":
                tables = PageTableCache(model.spec.num_layers).tables(names, views)
                paged = PagedLoRA(rows, tables, device)
            step[f"mixed_{k}"] = _decode_step_s(model, LoRABatch(rows, views, paged=paged), b, 3)
        for lease in leases:
            lease.release()
        res["decode_step_s"] = step
        res["decode_over_base_read"] = {k: v / res["base_read_s"] for k, v in step.items()}

        vocab = SHAPES[s["shape"]]["vocab_size"]
        gp = torch.Generator().manual_seed(3)
        sizes = s["batch_sizes"]
        prompts = torch.randint(4, vocab, (max(sizes), s["prompt_tokens"]), generator=gp).tolist()
        n = s["new_tokens"]
        tok_s: dict[str, dict[str, float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            tok = Tokenizer(write_word_tokenizer(Path(tmp), vocab))
            variants = [(k, "off") for k in kernels]
            if "triton" in kernels:
                variants.append(("triton", "on"))
            greedy: dict[str, list[list[int]]] = {}
            for k, graphs in variants:
                cfg = EngineConfig(
                    device=device,
                    dtype=td,
                    max_batch_size=max(sizes),
                    max_model_len=s["prompt_tokens"] + n + 8,
                    max_num_batched_tokens=max(512, max(sizes)),
                    lora_kernel=k,
                    cuda_graphs=graphs,
                )
                name = f"mixed_{k}" + ("_graphs" if graphs == "on" else "")
                engine = Engine(model, tok, store, cfg)
                engine.start()
                try:
                    _engine_tok_s(engine, prompts[:2], [None, names[0]], 2)  # warm-up
                    m = min(8, len(prompts))
                    check = [names[i % len(names)] if i % 4 else None for i in range(m)]
                    greedy[name] = _greedy(engine, prompts[:m], check, 8)
                    for bs in sizes:
                        mixed = [names[i % len(names)] for i in range(bs)]
                        timed_base = k == kernels[0] or graphs == "on"
                        # each size once untimed first: Triton compiles a kernel for each new
                        # specialisation of its integer arguments (equal to 1, divisible by
                        # 16), and a CUDA graph is captured on its bucket's first use
                        if timed_base:
                            _engine_tok_s(engine, prompts[:bs], [None] * bs, 2)
                        _engine_tok_s(engine, prompts[:bs], mixed, 2)
                        if timed_base:
                            base = _engine_tok_s(engine, prompts[:bs], [None] * bs, n)
                            key = "base" if graphs == "off" else "base_graphs"
                            tok_s.setdefault(key, {})[str(bs)] = base
                        got = _engine_tok_s(engine, prompts[:bs], mixed, n)
                        tok_s.setdefault(name, {})[str(bs)] = got
                    if engine.graphs is not None:
                        res["graphs_captured"] = engine.graphs.captured
                        res["graph_steps"] = engine.graphs.steps
                finally:
                    engine.stop()
            if "mixed_triton_graphs" in greedy:
                res["graphs_tokens_agree"] = greedy["mixed_triton_graphs"] == greedy["mixed_triton"]
        if s["peft"]:
            for bs in sizes:
                mixed = [names[i % len(names)] for i in range(bs)]
                tok_s.setdefault("peft_mixed", {})[str(bs)] = _peft_tok_s(
                    pm, prompts[:bs], mixed, n
                )
    res["tok_s"] = tok_s
    ratios: dict[str, dict[str, float]] = {}
    for k in [*kernels, *(["triton_graphs"] if "mixed_triton_graphs" in tok_s else [])]:
        base_key = "base_graphs" if k.endswith("_graphs") else "base"
        for bs in map(str, s["batch_sizes"]):
            r = ratios.setdefault(k, {})
            r[f"mixed_over_base_b{bs}"] = tok_s[f"mixed_{k}"][bs] / tok_s[base_key][bs]
            if "peft_mixed" in tok_s:
                r[f"mixed_over_peft_b{bs}"] = tok_s[f"mixed_{k}"][bs] / tok_s["peft_mixed"][bs]
    res["ratios"] = ratios
    return res


def run(args: argparse.Namespace) -> int:
    """Run the checks and measurements, print a table, write JSON to ``--out``.

    The JSON is rewritten after each part, so a run that is stopped keeps what it measured;
    a part that raises is recorded under ``errors`` (its traceback logged) and the others
    still run.

    Returns:
        0 when every part ran and every check passed, 1 otherwise (the figures are written
        either way).
    """
    s = _settings(args)
    if s["dry_run"]:
        # the kernels run through Triton's interpreter on the CPU; it must be on before
        # Triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from services.worker.lora_pages import triton_available

    if not s["dry_run"] and not torch.cuda.is_available():
        raise SystemExit(f"--device {s['device']}: CUDA is not available (use --device cpu)")
    kernels = ["torch", "triton"] if triton_available() else ["torch"]
    result: dict[str, Any] = {
        "settings": s,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "kernels": kernels,
        },
    }
    dtypes = ("float32", "bfloat16")
    parts: list[tuple[str, Any]] = []
    if "triton" in kernels:
        parts.append(("kernels", lambda: {d: check_kernels(s["device"], d) for d in dtypes}))
        parts.append(("attention", lambda: {d: check_attention(s["device"], d) for d in dtypes}))
    parts.append(("exactness", lambda: check_exactness(s["device"], kernels[-1])))
    parts.append(("loads", lambda: measure_loads(s)))
    parts.append(("", lambda: measure(s, kernels)))  # "": its keys go to the top level
    t0 = time.perf_counter()
    for name, part in parts:
        try:
            value = part()
        except Exception as e:  # a check command reports every part it can
            logger.exception("plora bench gpu: part %r failed", name or "measure")
            result.setdefault("errors", {})[name or "measure"] = f"{type(e).__name__}: {e}"
        else:
            if name:
                result[name] = value
            else:
                result.update(value)
        result["wall_s"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(result, indent=2), "utf-8")
    checks = [*result.get("kernels", {}).values(), *result.get("attention", {}).values()]
    ok = "errors" not in result and result["exactness"]["ok"] and all(v["ok"] for v in checks)
    ok = ok and result.get("graphs_tokens_agree", True)
    result["ok"] = ok
    Path(args.out).write_text(json.dumps(result, indent=2), "utf-8")
    print(_table(result))
    print(f"wrote {args.out}")
    return 0 if ok else 1


def _table(r: dict[str, Any]) -> str:
    """The run's figures as text; parts that did not run are left out, errors listed last."""
    lines = [f"plora bench gpu  {r['environment']}  shape {r['settings']['shape']}"]
    for d, k in r.get("kernels", {}).items():
        lines.append(f"kernels {d}: max rel diff {k['max_rel_diff']:.2e} ok={k['ok']}")
    for d, k in r.get("attention", {}).items():
        lines.append(f"attention {d}: max rel diff {k['max_rel_diff']:.2e} ok={k['ok']}")
    if "exactness" in r:
        e = r["exactness"]
        for d in ("float32", "bfloat16"):
            x = e[d]
            lines.append(
                f"exactness {d} ({e['kernel']}): max rel logit diff "
                f"{x['max_rel_logit_diff']:.2e} (tol {x['tolerance']}) argmax agreement "
                f"{x['argmax_agreement']:.2f} ok={x['ok']}"
            )
    if "bandwidth_bytes_s" in r:
        lines.append(
            f"base weights {r['base_weight_bytes'] / 1e9:.2f} GB, bandwidth "
            f"{r['bandwidth_bytes_s'] / 1e9:.0f} GB/s, one read {r['base_read_s'] * 1e3:.2f} ms"
        )
    for k, v in r.get("decode_step_s", {}).items():
        lines.append(
            f"decode step b{r['settings']['decode_batch']} {k:>13}: {v * 1e3:8.2f} ms "
            f"({r['decode_over_base_read'][k]:.2f}x one read)"
        )
    if "tok_s" in r:
        sizes = [str(b) for b in r["settings"]["batch_sizes"]]
        lines.append(f"{'tok/s':>14} " + " ".join(f"{'b' + b:>10}" for b in sizes))
        for k, v in r["tok_s"].items():
            lines.append(f"{k:>14} " + " ".join(f"{v[b]:10.1f}" for b in sizes))
    for k, v in r.get("ratios", {}).items():
        lines.append(f"{k}: " + "  ".join(f"{n} {x:.2f}" for n, x in v.items()))
    if "graphs_tokens_agree" in r:
        lines.append(
            f"cuda graphs: {r.get('graphs_captured', 0)} captured, {r.get('graph_steps', 0)} "
            f"steps; greedy tokens equal to the plain pass: {r['graphs_tokens_agree']}"
        )
    if "loads" in r:
        ld = r["loads"]
        lines.append(
            f"loads: pinned host-to-device copy {ld['pinned_copy_bytes_s'] / 1e9:.1f} GB/s; the "
            f"h100-8b preset charges host loads at {ld['preset_h2d_bytes_s'] / 1e9:.0f} GB/s"
        )
        for rank, x in ld["ranks"].items():
            lines.append(
                f"  rank {rank:>4}: {x['bytes'] / 1e6:8.1f} MB  from source "
                f"{x['source_s'] * 1e3:8.2f} ms  from host {x['host_s'] * 1e3:8.2f} ms "
                f"({x['host_bytes_s'] / 1e9:.1f} GB/s)"
            )
    for part, why in r.get("errors", {}).items():
        lines.append(f"FAILED {part}: {why}")
    lines.append(f"ok={r['ok']}  wall {r['wall_s']:.0f} s")
    return "\n".join(lines)
