"""Write synthetic PEFT LoRA adapters for the served base model (``plora make-adapters``).

The files are exactly what ``PeftModel.save_pretrained`` writes for a ``LlamaForCausalLM``
(``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``), so PEFT itself
loads them, and they are deterministic functions of the seed.

Initialisation (why the adapters change the output without wrecking it): PEFT's default init
sets B = 0, which would make every adapter a no-op. Here

- ``A ~ U(-1/sqrt(in), 1/sqrt(in))``, which is PEFT's ``kaiming_uniform_(a=sqrt(5))`` for
  ``lora_A``; for an input ``x`` with per-entry RMS ``rho``, ``||A x|| ~ sqrt(r/3) * rho``.
- ``B ~ N(0, sigma)`` with ``sigma = relative_delta * sqrt(3 / r) / scaling``, so that
  ``||scaling * B A x|| ~ relative_delta * sqrt(out) * rho``, i.e. ``relative_delta`` times
  ``||W x||`` for a base projection ``W`` of unit gain (``||W x|| ~ sqrt(out/in) ||x||``).
  The size of the change is thus the same for every rank and alpha.

Measured on SmolLM2-135M-Instruct (float32, transformers + PEFT, chat prompts; real trained
projections have a gain of ~5 over the unit-gain assumption, so the real ratio is about
``relative_delta / 5.5``): ``relative_delta`` 0.05 -> median ``||dW x|| / ||W x||`` 0.009;
0.15 (the default) -> 0.027 (max 0.053); 0.5 -> 0.094. With the default, the greedy
continuation of an open prompt ("Write a short poem about the sea.") changes within a few
tokens and stays fluent for ranks 16 and 64, while a factual answer ("The capital of France is
Paris.") is unchanged. At 0.5 the text starts to repeat itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from services.common.adapters import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    LoraAdapterConfig,
    canonical_module_name,
)
from services.common.config import parse_ranks
from services.common.errors import ConfigError
from services.common.types import ALL_PROJECTION_MODULES, ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_RELATIVE_DELTA = 0.15
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def lora_init(
    in_features: int,
    out_features: int,
    r: int,
    scaling: float,
    generator: torch.Generator,
    relative_delta: float = DEFAULT_RELATIVE_DELTA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random LoRA pair for one module (see the module docstring for the scale).

    Returns:
        ``(A [r, in] float32, B [out, r] float32)``.
    """
    bound = 1.0 / math.sqrt(in_features)
    a = (torch.rand(r, in_features, generator=generator) * 2.0 - 1.0) * bound
    sigma = relative_delta * math.sqrt(3.0 / r) / scaling
    b = torch.randn(out_features, r, generator=generator) * sigma
    return a, b


def adapter_config_dict(
    spec: ModelSpec,
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    use_rslora: bool,
    rank_pattern: Mapping[str, int] | None,
    alpha_pattern: Mapping[str, float] | None,
    layers: Sequence[int] | None,
) -> dict[str, object]:
    """The ``adapter_config.json`` PEFT's ``LoraConfig`` writes, for these settings."""
    return {
        "alpha_pattern": dict(alpha_pattern or {}),
        "auto_mapping": None,
        "base_model_name_or_path": spec.name,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": list(layers) if layers is not None else None,
        "loftq_config": {},
        "lora_alpha": alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": dict(rank_pattern or {}),
        "revision": None,
        "target_modules": list(target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": use_rslora,
    }


def write_peft_adapter(
    out_dir: str | os.PathLike[str],
    spec: ModelSpec,
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str] | None = None,
    seed: int,
    use_rslora: bool = False,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    dtype: torch.dtype = torch.float32,
    layers: Sequence[int] | None = None,
    relative_delta: float = DEFAULT_RELATIVE_DELTA,
) -> Path:
    """Write one PEFT LoRA adapter directory for ``spec``.

    Per-module rank and alpha are resolved through ``rank_pattern`` / ``alpha_pattern`` exactly
    as PEFT resolves them (:meth:`LoraAdapterConfig.resolve`), so the tensors agree with the
    config. The files are written to temporary names and renamed into place.

    Args:
        out_dir: Directory to create (or overwrite the two adapter files in).
        spec: Base model shapes.
        rank: Default LoRA rank r.
        alpha: Default ``lora_alpha``.
        target_modules: Projection names, a subset of ``spec.projections`` (the family's:
            Phi-3's are fused); ``None`` = all of them.
        seed: Seed of the CPU generator; same arguments + seed -> identical bytes.
        use_rslora: Write ``use_rslora: true`` (scaling ``alpha / sqrt(r)``).
        rank_pattern: PEFT ``rank_pattern`` (pattern -> r).
        alpha_pattern: PEFT ``alpha_pattern`` (pattern -> alpha).
        dtype: Dtype of the stored tensors.
        layers: Layers that get LoRA (written as ``layers_to_transform``); all when ``None``.
        relative_delta: Target ``||scaling B A x|| / ||W x||`` for a unit-gain ``W``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: a target module the model does not have, rank < 1, layer out of range.
    """
    from safetensors.torch import save_file

    targets = list(spec.projections if target_modules is None else target_modules)
    bad = [t for t in targets if t not in spec.projections]
    if bad or not targets:
        raise ValueError(
            f"target_modules must be a non-empty subset of {spec.name or 'the model'}'s "
            f"projections {spec.projections}, got {bad or targets}"
        )
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    layer_ids = list(range(spec.num_layers)) if layers is None else sorted(set(layers))
    if any(not 0 <= i < spec.num_layers for i in layer_ids):
        raise ValueError(f"layers must lie in [0, {spec.num_layers}), got {list(layers or [])}")

    cfg_dict = adapter_config_dict(
        spec,
        rank=rank,
        alpha=alpha,
        target_modules=targets,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        layers=layers,
    )
    cfg = LoraAdapterConfig(
        r=rank,
        lora_alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=tuple(targets),
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
    )
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    tensors: dict[str, torch.Tensor] = {}
    for layer in layer_ids:
        for proj in spec.projections:
            if proj not in targets:
                continue
            name = canonical_module_name(layer, proj)
            r, _ = cfg.resolve(name)
            in_f, out_f = spec.module_shape(proj)
            a, b = lora_init(in_f, out_f, r, cfg.scaling(name, r), gen, relative_delta)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.to(dtype).contiguous()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(
        out / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt"})
    )
    _atomic_write(
        out / CONFIG_NAME,
        lambda p: p.write_text(
            json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        ),
    )
    logger.debug("wrote adapter %s (r=%d, %d tensors)", out, rank, len(tensors))
    return out


def _atomic_write(path: Path, write: object) -> None:
    """Write ``path`` through a temporary file in its directory, renamed into place.

    The file gets the mode ``open()`` gives a new file (``0o666`` less the umask, e.g. 0644
    under umask 022), so workers running as another user can read it. ``tempfile.mkstemp``
    would leave it 0600, and so does safetensors' ``save_file`` since 0.8 (it writes through a
    temporary file of its own: safetensors issue #782), so the mode is set after writing.
    """
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0o666 less the umask, set by the kernel
    finally:
        os.close(fd)
    try:
        write(tmp)  # type: ignore[operator]
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def max_rank(spec: ModelSpec, target_modules: Sequence[str] | None = None) -> int:
    """The largest LoRA rank that means something for ``target_modules`` of ``spec`` (default:
    all its projections): the smallest ``min(in_features, out_features)`` among them (a rank
    above it adds parameters but no expressiveness, and its tensors can exhaust memory).

    Raises:
        KeyError: a module that is not one of :data:`ALL_PROJECTION_MODULES`.
    """
    targets = spec.projections if target_modules is None else target_modules
    return min(min(spec.module_shape(proj)) for proj in targets)


def check_ranks(
    ranks: Sequence[int],
    spec: ModelSpec,
    flag: str,
    target_modules: Sequence[str] | None = None,
) -> None:
    """Refuse ranks above :func:`max_rank` before any adapter is written (rank 100000 would
    allocate tensors until the OOM killer ends the process).

    Args:
        ranks: The ranks asked for.
        spec: The base model.
        flag: The flag that gave them (named in the message).
        target_modules: The projections the adapters adapt (default: all of ``spec``'s).

    Raises:
        ConfigError: a rank is too large, with the largest one ``spec`` allows and why.
    """
    targets = spec.projections if target_modules is None else target_modules
    limit = max_rank(spec, targets)
    too_large = [r for r in ranks if r > limit]
    if too_large:
        proj = min(targets, key=lambda m: min(spec.module_shape(m)))
        in_f, out_f = spec.module_shape(proj)
        raise ConfigError(
            f"{flag} {too_large[0]}: the largest rank {spec.name or 'the base model'} allows "
            f"is {limit}, min(in_features, out_features) of {proj} ({in_f} x {out_f}); a "
            "LoRA rank above it adds nothing"
        )


def adapter_name(index: int, rank: int) -> str:
    """Directory name of the ``index``-th generated adapter, e.g. ``adapter-007-r16``."""
    return f"adapter-{index:03d}-r{rank}"


def make_adapter_set(
    out_dir: str | os.PathLike[str],
    spec: ModelSpec,
    *,
    count: int,
    ranks: Sequence[int],
    seed: int,
    target_modules: Sequence[str] | None = None,
    alpha: float | None = None,
    dtype: torch.dtype = torch.float32,
    relative_delta: float = DEFAULT_RELATIVE_DELTA,
) -> list[Path]:
    """Write ``count`` adapters ``adapter-000-r8``, ``adapter-001-r16``, ... under ``out_dir``.

    Adapter ``i`` has rank ``ranks[i % len(ranks)]``, ``lora_alpha = alpha`` (default ``2 r``),
    and seed ``seed * 1_000_003 + i``, on ``target_modules`` (default: every projection of
    ``spec``'s family).

    Returns:
        The adapter directories, in index order.
    """
    if count < 0 or not ranks:
        raise ValueError("count must be >= 0 and ranks non-empty")
    paths = []
    for i in range(count):
        r = int(ranks[i % len(ranks)])
        paths.append(
            write_peft_adapter(
                Path(out_dir) / adapter_name(i, r),
                spec,
                rank=r,
                alpha=float(alpha if alpha is not None else 2 * r),
                target_modules=target_modules,
                seed=int(seed) * 1_000_003 + i,
                dtype=dtype,
                relative_delta=relative_delta,
            )
        )
    return paths


# ----------------------------------------------------------------------------------------
# CLI: plora make-adapters


def _module_list(text: str) -> list[str] | None:
    """``None`` for ``all`` (every projection of the model), else the names (checked against
    the model in :func:`run`)."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    if text.strip() == "all":
        return None
    bad = [t for t in out if t not in ALL_PROJECTION_MODULES]
    if bad or not out:
        raise argparse.ArgumentTypeError(
            "target modules must be 'all' or a comma-separated subset of "
            + ",".join(ALL_PROJECTION_MODULES)
            + " that the model has"
        )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora make-adapters``."""
    parser.add_argument("--out", required=True, help="directory to write the adapters into")
    parser.add_argument("--count", type=int, default=8, help="number of adapters (default 8)")
    parser.add_argument(
        "--ranks",
        type=parse_ranks,
        default=[8, 16, 32, 64],
        help="comma-separated ranks, cycled over the adapters (default 8,16,32,64)",
    )
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument(
        "--model",
        default=None,
        help="base model: a Hugging Face directory, a GGUF file or a model id org/name in the "
        "local Hugging Face cache (default SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="converted-model cache (default $PLORA_CACHE_DIR or ~/.cache/plora)",
    )
    parser.add_argument(
        "--target-modules",
        type=_module_list,
        default=None,
        help="comma-separated projections or 'all' (default all: the 7 of Llama-like models, "
        "Phi-3's 4 with the fused qkv_proj and gate_up_proj)",
    )
    parser.add_argument("--alpha", type=float, default=None, help="lora_alpha (default 2 * rank)")
    parser.add_argument(
        "--relative-delta",
        type=float,
        default=DEFAULT_RELATIVE_DELTA,
        help=f"size of the LoRA change per projection (default {DEFAULT_RELATIVE_DELTA}; "
        "see plora/make_adapters.py)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="float32", help="tensor dtype (default float32)"
    )


def run(args: argparse.Namespace) -> int:
    """Write the adapters, ``<out>/adapters.json`` (a manifest), and print a table."""
    from services.common.adapters import InspectionLimits, inspect_adapter
    from services.worker.model_loader import default_cache_dir, load_model_spec

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    spec = load_model_spec(args.model, cache_dir)
    targets = list(spec.projections if args.target_modules is None else args.target_modules)
    missing = [t for t in targets if t not in spec.projections]
    if missing:
        print(
            f"plora make-adapters: --target-modules {','.join(missing)}: {spec.name} has no such "
            f"projection (its projections: {','.join(spec.projections)})",
            file=sys.stderr,
        )
        return 2
    try:
        check_ranks(args.ranks, spec, "--ranks", targets)
    except ConfigError as exc:
        print(f"plora make-adapters: {exc}", file=sys.stderr)
        return 2
    dtype = _DTYPES[args.dtype]
    paths = make_adapter_set(
        args.out,
        spec,
        count=args.count,
        ranks=args.ranks,
        seed=args.seed,
        target_modules=targets,
        alpha=args.alpha,
        dtype=dtype,
        relative_delta=args.relative_delta,
    )
    rows: list[dict[str, Any]] = []
    for p in paths:
        # no rank cap: that is a serving setting (--max-lora-rank), checked at registration
        m = inspect_adapter(p, spec, dtype, limits=InspectionLimits(max_lora_rank=None))
        rows.append(
            {
                "adapter_id": p.name,
                "path": str(p.resolve()),
                "rank": m.rank,
                "alpha": m.alpha,
                "num_modules": m.num_modules,
                "size_bytes": m.size_bytes,
                "sha256": m.sha256,
            }
        )
    summary = {
        "base_model": spec.name,
        "seed": args.seed,
        "dtype": args.dtype,
        "relative_delta": args.relative_delta,
        "target_modules": targets,
        "adapters": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapters.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    w = sys.stdout.write
    w(f"base model {spec.name}: wrote {len(rows)} adapters to {out}\n")
    w(f"{'adapter':<20} {'rank':>5} {'alpha':>7} {'modules':>8} {'MiB':>9}  sha256\n")
    for row in rows:
        w(
            f"{row['adapter_id']:<20} {row['rank']:>5} {row['alpha']:>7g} {row['num_modules']:>8} "
            f"{row['size_bytes'] / 2**20:>9.2f}  {str(row['sha256'])[:12]}\n"
        )
    return 0
