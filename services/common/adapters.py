"""Parse, validate and load PEFT LoRA adapters (``adapter_config.json`` + safetensors).

Two entry points share one validation path:

- :func:`inspect_adapter` reads the config and the safetensors header (names, dtypes,
  shapes), checks the adapter against the served base model's :class:`ModelSpec`, scans each
  tensor's values (NaN/Inf, overflow of the serving dtype; one tensor at a time, memory-mapped)
  and returns an :class:`AdapterManifest` (rank, per-module scaling, bytes in the serving
  dtype, sha256). The gateway runs it at registration, so a broken adapter is refused there
  rather than failing every request that names it.
- :func:`load_lora_weights` repeats the same checks on the bytes it loads and returns
  :class:`LoRAWeights` (A ``[r, in]``, B ``[out, r]``, per-module scaling) cast to the serving
  dtype. The worker's store runs it.

PEFT conventions followed exactly (peft 0.21, ``tuners/lora/model.py`` ``_create_and_replace``,
``tuners/lora/layer.py`` ``update_layer``, ``tuners/tuners_utils.py``
``check_target_module_exists``, ``utils/other.py`` ``get_pattern_key`` /
``match_target_against_key``, ``utils/save_and_load.py``):

- scaling = ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``; ``r`` and ``alpha`` are
  resolved *separately* per module through ``rank_pattern`` / ``alpha_pattern``: the first
  pattern key ``k`` (in file order) with ``re.match(rf"(.*\\.)?({k})$", module_name)`` wins, so
  full names (``model.layers.0.self_attn.q_proj``), suffixes (``q_proj``,
  ``layers.3.mlp.up_proj``) and regexes all work as in PEFT.
- ``target_modules``: a list selects a module whose name equals an entry or ends with
  ``"." + entry``; a string is a regex that must ``re.fullmatch`` the module name;
  ``"all-linear"`` selects every projection (a Llama model's linear layers minus ``lm_head``).
  ``exclude_modules``, ``layers_to_transform`` and ``layers_pattern`` apply as in PEFT.
- Module names are the ones PEFT sees on a ``LlamaForCausalLM``:
  ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` / ``model.layers.{i}.mlp.{gate,up,down}_proj``.
- Tensor keys may carry the ``base_model.model.`` prefix or not, and the adapter-name segment
  (``.lora_A.default.weight``) or not (``.lora_A.weight``, what ``save_pretrained`` writes).

Errors: :class:`InvalidAdapterError` (INVALID_ARGUMENT) for malformed adapters or features
that change the math we serve (DoRA, biases, modules_to_save, ...);
:class:`IncompatibleAdapterError` (FAILED_PRECONDITION) when the tensors do not fit the base.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from services.common.errors import (
    MAX_ECHO_PATH,
    IncompatibleAdapterError,
    InvalidAdapterError,
    quoted,
)
from services.common.peft_config import (
    CONFIG_NAME,
    LoraAdapterConfig,
    get_pattern_key,
    parse_adapter_config,
)
from services.common.sources import Confinement

__all__ = [
    "CONFIG_NAME",
    "AdapterManifest",
    "Confinement",
    "adapter_sha256",
    "LoraAdapterConfig",
    "get_pattern_key",
    "inspect_adapter",
    "load_lora_weights",
    "parse_adapter_config",
    "parse_tensor_key",
    "read_adapter_config",
    "read_config_bytes",
    "sha256_file",
]
from services.common.types import (
    ATTN_MODULES,
    PROJECTION_MODULES,
    LoRAModuleWeights,
    LoRAWeights,
    ModelSpec,
)

logger = logging.getLogger(__name__)

# Tensor keys: optional "base_model.model." prefix, module path, lora_A/lora_B, optional
# adapter name, ".weight". Other LoRA tensors (DoRA magnitude, embedding LoRA, biases) are
# recognized so the refusal can say what they are.
_LORA_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?P<kind>lora_A|lora_B)"
    r"(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$"
)

_OTHER_LORA_RE = re.compile(r"lora_magnitude_vector|lora_embedding_[AB]|lora_diag|lora_[A-Z]\b")

#: Modules of a Llama model that exist but cannot carry LoRA here.
_LLAMA_NON_PROJECTIONS = frozenset(
    {
        "embed_tokens",
        "lm_head",
        "norm",
        "input_layernorm",
        "post_attention_layernorm",
        "rotary_emb",
        "act_fn",
        "self_attn",
        "mlp",
    }
)

# A Llama decoder projection. Anything before "layers." is accepted as the model trunk
# ("model.", "model.language_model.", none), matching PEFT's suffix semantics.
_LLAMA_MODULE_RE = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\.(?P<proj>[A-Za-z0-9_]+)$"
)

WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"


#: safetensors dtype strings of floating-point tensors we accept, with their torch dtype.
_ST_FLOAT_DTYPES: dict[str, torch.dtype] = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
#: Largest safetensors header we read (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100_000_000


# ----------------------------------------------------------------------------------------
# Config parsing (pure)


# ----------------------------------------------------------------------------------------
# Tensor key parsing (pure)


def canonical_module_name(layer: int, projection: str) -> str:
    """The module's name in a ``LlamaForCausalLM`` (what PEFT matches patterns against)."""
    group = "self_attn" if projection in ATTN_MODULES else "mlp"
    return f"model.layers.{layer}.{group}.{projection}"


@dataclass(frozen=True)
class _TensorInfo:
    key: str
    dtype: str  # safetensors dtype string, e.g. "F32"
    shape: tuple[int, ...]


def parse_tensor_key(key: str) -> tuple[int, str, str, str | None]:
    """Map a PEFT LoRA tensor key onto ``(layer, projection, "lora_A"|"lora_B", adapter_name)``.

    Examples: ``base_model.model.model.layers.3.mlp.up_proj.lora_B.weight`` ->
    ``(3, "up_proj", "lora_B", None)``; ``model.layers.0.self_attn.q_proj.lora_A.default.weight``
    -> ``(0, "q_proj", "lora_A", "default")``.

    Raises:
        InvalidAdapterError: the key is not a LoRA A/B weight (DoRA magnitude, a bias, embedding
            LoRA, a full module weight) or puts LoRA on a module other than the 7 projections
            (``embed_tokens``, ``lm_head``, norms).
        IncompatibleAdapterError: the module path is not a Llama decoder projection at all
            (another architecture's naming, e.g. ``transformer.h.0.attn.c_attn``).
    """
    m = _LORA_KEY_RE.match(key)
    if m is None:
        if _OTHER_LORA_RE.search(key):
            what = (
                "a DoRA magnitude vector (use_dora)"
                if "magnitude" in key
                else "a LoRA tensor kind this server does not serve"
            )
            raise InvalidAdapterError(
                f"{WEIGHTS_NAME}: tensor {key!r} is {what}; only plain LoRA lora_A/lora_B "
                "weights can be served"
            )
        raise InvalidAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} is not a LoRA lora_A/lora_B weight (full module "
            "weights such as modules_to_save cannot be served per adapter); remove it"
        )
    if m.group("param") == "bias":
        raise InvalidAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} is a LoRA bias (lora_bias), which this server "
            "does not implement; retrain without lora_bias"
        )
    module = m.group("module")
    last = module.rsplit(".", 1)[-1]
    mm = _LLAMA_MODULE_RE.match(module)
    if last in _LLAMA_NON_PROJECTIONS or (
        mm is not None and mm.group("proj") not in PROJECTION_MODULES
    ):
        raise InvalidAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} puts LoRA on {module!r}; only the decoder "
            f"projections {', '.join(PROJECTION_MODULES)} can carry LoRA here (retrain with "
            "target_modules limited to them)"
        )
    if mm is None:
        raise IncompatibleAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} names module {module!r}, which is no module of the "
            "Llama-family base model served here (expected "
            "model.layers.<i>.self_attn.<q|k|v|o>_proj or "
            "model.layers.<i>.mlp.<gate|up|down>_proj); this adapter was trained for another "
            "architecture"
        )
    proj, group = mm.group("proj"), mm.group("group")
    if (group == "self_attn") != (proj in ATTN_MODULES):
        raise IncompatibleAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} names {group}.{proj}, which a Llama decoder layer "
            "does not have; this adapter was trained for another architecture"
        )
    return int(mm.group("layer")), proj, m.group("kind"), m.group("adapter")


# ----------------------------------------------------------------------------------------
# Files


def _adapter_dir(source: str | os.PathLike[str], confinement: Confinement | None = None) -> Path:
    """The adapter directory ``source`` names: with ``confinement``, its real path checked
    under the adapter roots (:meth:`Confinement.directory`: one message for every refusal);
    without, the path as given (``~`` expanded).

    Raises:
        InvalidAdapterError: missing or not a directory (without ``confinement``).
        SourceRefusedError: refused by ``confinement``.
    """
    if confinement is not None:
        return confinement.directory(source)
    path = Path(source).expanduser()
    if not path.exists():
        raise InvalidAdapterError(
            f"adapter directory {quoted(str(path), MAX_ECHO_PATH)} does not exist"
        )
    if not path.is_dir():
        raise InvalidAdapterError(
            f"adapter source {quoted(str(path), MAX_ECHO_PATH)} is not a directory; pass the "
            f"directory that holds {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    return path


def read_adapter_config(
    path: Path, confinement: Confinement | None = None, data: bytes | None = None
) -> LoraAdapterConfig:
    """Read and parse ``<path>/adapter_config.json`` (with ``confinement``, opened under the
    adapter roots: :meth:`Confinement.open`; ``data``: the file's bytes, already read by
    :func:`read_config_bytes`, so the bytes hashed are the bytes parsed).

    Raises:
        InvalidAdapterError: missing file, invalid JSON, or a refused config.
        SourceRefusedError: the file is refused by ``confinement``.
    """
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise InvalidAdapterError(
            f"{str(path)!r} has no {CONFIG_NAME}; a PEFT adapter directory holds {CONFIG_NAME} "
            f"and {WEIGHTS_NAME} (what PeftModel.save_pretrained writes)"
        )
    try:
        if data is None:
            data = read_config_bytes(path, confinement)
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidAdapterError(f"{cfg_path} is not valid JSON: {e}") from None
    return parse_adapter_config(raw)


def _weights_path(path: Path, confinement: Confinement | None = None) -> Path:
    """``<path>/adapter_model.safetensors``; with ``confinement`` it was checked with the
    directory (:meth:`Confinement.directory`) and is opened under the roots when read.

    Raises:
        InvalidAdapterError: the file is missing, or only pickle weights are there (without
            ``confinement``).
    """
    w = path / WEIGHTS_NAME
    if confinement is not None or w.is_file():
        return w
    if (path / PICKLE_WEIGHTS_NAME).is_file():
        raise InvalidAdapterError(
            f"{str(path)!r} holds only {PICKLE_WEIGHTS_NAME}: pickle .bin weights can execute "
            "arbitrary code when loaded, so they are refused; convert them to safetensors "
            "(e.g. PeftModel.from_pretrained(...).save_pretrained(dir, safe_serialization=True))"
        )
    raise InvalidAdapterError(f"{str(path)!r} has no {WEIGHTS_NAME}")


def parse_safetensors_header(raw: bytes, file_size: int, where: str) -> dict[str, _TensorInfo]:
    """Parse a safetensors header: ``u64 little-endian N`` then ``N`` bytes of JSON.

    Args:
        raw: At least the first ``8 + N`` bytes of the file.
        file_size: Size of the whole file in bytes (to detect truncation).
        where: File name for messages.

    Returns:
        Tensor name -> dtype string and shape (the ``__metadata__`` entry is skipped).

    Raises:
        InvalidAdapterError: not a safetensors file, truncated, or a non-float tensor.
    """
    if len(raw) < 8:
        raise InvalidAdapterError(f"{where} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > file_size or len(raw) < 8 + n:
        raise InvalidAdapterError(f"{where} is not a valid safetensors file (bad header length)")
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidAdapterError(f"{where} has a corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise InvalidAdapterError(f"{where} has a corrupt safetensors header")
    data_len = file_size - 8 - n
    out: dict[str, _TensorInfo] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise InvalidAdapterError(f"{where}: header entry {key!r} is malformed") from None
        if dtype not in _ST_FLOAT_DTYPES:
            raise InvalidAdapterError(
                f"{where}: tensor {key!r} has dtype {dtype}; LoRA weights must be F16, BF16, F32 "
                "or F64 (quantized adapters are not supported)"
            )
        if not (0 <= start <= end <= data_len):
            raise InvalidAdapterError(
                f"{where}: tensor {key!r} lies outside the file (truncated download?)"
            )
        out[key] = _TensorInfo(key, dtype, tuple(int(s) for s in shape))
    return out


def _open(path: Path, confinement: Confinement | None) -> BinaryIO:
    """``path`` opened for reading: under the adapter roots with ``confinement``
    (:meth:`Confinement.open`), else as given.

    Raises:
        SourceRefusedError: refused by ``confinement``.
        OSError: the file cannot be opened (without ``confinement``).
    """
    return path.open("rb") if confinement is None else confinement.open(path)


def _read_bytes(path: Path, confinement: Confinement | None) -> bytes:
    """The whole of ``path`` (:func:`_open`)."""
    with _open(path, confinement) as f:
        return f.read()


def read_config_bytes(path: Path, confinement: Confinement | None = None) -> bytes:
    """The bytes of ``<path>/adapter_config.json`` (under the adapter roots with
    ``confinement``).

    Raises:
        InvalidAdapterError: the file is missing or unreadable.
        SourceRefusedError: refused by ``confinement``.
    """
    try:
        return _read_bytes(path / CONFIG_NAME, confinement)
    except FileNotFoundError:
        raise InvalidAdapterError(
            f"{str(path)!r} has no {CONFIG_NAME}; a PEFT adapter directory holds {CONFIG_NAME} "
            f"and {WEIGHTS_NAME} (what PeftModel.save_pretrained writes)"
        ) from None
    except OSError as e:
        raise InvalidAdapterError(f"{path / CONFIG_NAME} cannot be read: {e.strerror}") from None


@contextmanager
def _pinned(path: Path, confinement: Confinement | None) -> Iterator[str]:
    """A path to hand a reader that opens files by name (safetensors' ``safe_open``): with
    ``confinement``, ``/proc/self/fd/N`` of the file opened under the roots (the very file
    checked, whatever is swapped in later), held open meanwhile; else ``path`` itself.

    Raises:
        SourceRefusedError: refused by ``confinement``.
    """
    if confinement is None:
        yield str(path)
        return
    with confinement.open(path) as f:
        proc = f"/proc/self/fd/{f.fileno()}"
        yield proc if os.path.exists(proc) else str(path)


def _read_header(weights: Path, confinement: Confinement | None = None) -> dict[str, _TensorInfo]:
    with _open(weights, confinement) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise InvalidAdapterError(f"{weights} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        body = f.read(min(n, _MAX_HEADER_BYTES))
    return parse_safetensors_header(head + body, size, str(weights))


def sha256_file(path: Path, chunk: int = 1 << 20, confinement: Confinement | None = None) -> str:
    """Hex sha256 of a file, streamed in ``chunk``-byte pieces (opened under the adapter roots
    with ``confinement``).

    Raises:
        SourceRefusedError: refused by ``confinement``.
    """
    h = hashlib.sha256()
    with _open(path, confinement) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def adapter_sha256(config_sha256: str, weights_sha256: str) -> str:
    """The digest registration records for an adapter and a worker checks on every load:
    ``sha256(sha256(adapter_config.json) || sha256(adapter_model.safetensors))``, the two
    inner digests as raw 32-byte values, the config's first. A change to either file (the
    config alone changes scaling, rank patterns, targets) changes it.

    Args:
        config_sha256: Hex sha256 of the ``adapter_config.json`` bytes.
        weights_sha256: Hex sha256 of the ``adapter_model.safetensors`` bytes.

    Returns:
        64 hex characters.

    Raises:
        ValueError: an argument is not hex.
    """
    return hashlib.sha256(bytes.fromhex(config_sha256) + bytes.fromhex(weights_sha256)).hexdigest()


def adapter_dir_sha256(
    source: str | os.PathLike[str], confinement: Confinement | None = None
) -> str:
    """:func:`adapter_sha256` of the adapter directory ``source`` (both files read whole).

    Raises:
        InvalidAdapterError: a file is missing or unreadable.
        SourceRefusedError: refused by ``confinement``.
    """
    path = _adapter_dir(source, confinement)
    try:
        return adapter_sha256(
            hashlib.sha256(read_config_bytes(path, confinement)).hexdigest(),
            sha256_file(_weights_path(path, confinement), confinement=confinement),
        )
    except OSError as e:
        raise InvalidAdapterError(f"{path} cannot be read: {e.strerror}") from None


# ----------------------------------------------------------------------------------------
# Validation against the base model (pure, over header information)


@dataclass(frozen=True)
class _ModulePlan:
    layer: int
    projection: str
    key_a: str
    key_b: str
    r: int
    in_features: int
    out_features: int
    scaling: float


def plan_modules(
    cfg: LoraAdapterConfig, tensors: Mapping[str, _TensorInfo], spec: ModelSpec, where: str = ""
) -> dict[tuple[int, str], _ModulePlan]:
    """Pair lora_A/lora_B tensors per module and check them against the config and the base.

    Args:
        cfg: Parsed config.
        tensors: Header entries of the safetensors file.
        spec: Served base model.
        where: Adapter directory, for messages.

    Returns:
        ``(layer, projection) -> plan`` (rank from the tensor shapes, PEFT scaling).

    Raises:
        InvalidAdapterError: unpaired A/B, several adapter names in one file, wrong tensor rank,
            A/B rank mismatch, config ``r`` (after ``rank_pattern``) disagreeing with the
            tensors, tensors for modules the config does not target, no tensors at all.
        IncompatibleAdapterError: layer index >= ``spec.num_layers``, shapes that do not fit
            the base projections (``spec.module_shape``), module names foreign to the base.
    """
    prefix = f"{where}: " if where else ""
    pairs: dict[tuple[int, str], dict[str, _TensorInfo]] = {}
    adapter_names: set[str | None] = set()
    for key, info in tensors.items():
        layer, proj, kind, adapter = parse_tensor_key(key)
        adapter_names.add(adapter)
        slot = pairs.setdefault((layer, proj), {})
        if kind in slot:
            raise InvalidAdapterError(
                f"{prefix}{WEIGHTS_NAME} holds two {kind} tensors for "
                f"{canonical_module_name(layer, proj)} ({slot[kind].key!r} and {key!r}); "
                "save one adapter per directory"
            )
        slot[kind] = info
    if len(adapter_names) > 1:
        raise InvalidAdapterError(
            f"{prefix}{WEIGHTS_NAME} mixes tensors of several adapter names "
            f"{sorted(str(a) for a in adapter_names)}; save one adapter per directory"
        )
    if not pairs:
        raise InvalidAdapterError(f"{prefix}{WEIGHTS_NAME} holds no LoRA tensors")

    plans: dict[tuple[int, str], _ModulePlan] = {}
    for (layer, proj), slot in sorted(
        pairs.items(), key=lambda kv: (kv[0][0], PROJECTION_MODULES.index(kv[0][1]))
    ):
        name = canonical_module_name(layer, proj)
        if "lora_A" not in slot or "lora_B" not in slot:
            have, miss = ("lora_A", "lora_B") if "lora_A" in slot else ("lora_B", "lora_A")
            raise InvalidAdapterError(
                f"{prefix}{name} has {have} ({slot[have].key!r}) but no {miss}; "
                "the adapter file is incomplete"
            )
        a, b = slot["lora_A"], slot["lora_B"]
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise InvalidAdapterError(
                f"{prefix}{name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} must both be "
                "2-D (Linear weights)"
            )
        r, in_features = a.shape
        out_features, r_b = b.shape
        if r != r_b or r < 1:
            raise InvalidAdapterError(
                f"{prefix}{name}: lora_A is {list(a.shape)} ([r, in]) but lora_B is "
                f"{list(b.shape)} ([out, r]); their ranks differ"
            )
        if not cfg.targets(name):
            raise InvalidAdapterError(
                f"{prefix}{WEIGHTS_NAME} has weights for {name}, which target_modules="
                f"{_fmt_targets(cfg.target_modules)} in {CONFIG_NAME} does not select (PEFT would "
                "silently ignore them); fix target_modules or remove those tensors"
            )
        if layer >= spec.num_layers:
            raise IncompatibleAdapterError(
                f"{prefix}{name}: layer index {layer} does not exist in the base model, which has "
                f"{spec.num_layers} layers: {_does_not_fit(cfg, spec)}"
            )
        exp_in, exp_out = spec.module_shape(proj)
        if (in_features, out_features) != (exp_in, exp_out):
            raise IncompatibleAdapterError(
                f"{prefix}{name}: adapter shapes lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                f"mean in={in_features}, out={out_features}, where the base model has "
                f"in={exp_in}, out={exp_out} (lora_A [r, {exp_in}], lora_B [{exp_out}, r]): "
                f"{_does_not_fit(cfg, spec)}"
            )
        r_cfg, _ = cfg.resolve(name)
        if r_cfg != r:
            raise InvalidAdapterError(
                f"{prefix}{name}: {CONFIG_NAME} gives r={r_cfg} (r / rank_pattern) but the "
                f"tensors have rank {r} (lora_A {list(a.shape)}); the config does not belong to "
                "these weights — fix r / rank_pattern"
            )
        plans[(layer, proj)] = _ModulePlan(
            layer, proj, a.key, b.key, r, in_features, out_features, cfg.scaling(name, r)
        )
    return plans


def _does_not_fit(cfg: LoraAdapterConfig, spec: ModelSpec) -> str:
    """The end of an :class:`IncompatibleAdapterError` message: the served model is named as
    the one the adapter does not fit, and the config's ``base_model_name_or_path`` (only
    informational) as what the adapter itself claims."""
    claimed = cfg.base_model_name_or_path
    if not claimed:
        note = ""
    elif claimed == spec.name:
        note = (
            f"; its {CONFIG_NAME} names base_model_name_or_path={claimed!r}, but the tensor "
            "shapes decide"
        )
    else:
        note = f"; its {CONFIG_NAME} names base_model_name_or_path={claimed!r}"
    return (
        f"this adapter does not fit the served model {spec.name!r} (it was probably trained "
        f"for another base model{note})"
    )


def _fmt_targets(t: tuple[str, ...] | str) -> str:
    return repr(t) if isinstance(t, str) else repr(list(t))


# ----------------------------------------------------------------------------------------
# Public API


@dataclass(frozen=True)
class AdapterManifest:
    """What registration records about an adapter (no tensor data).

    Attributes:
        rank: Largest rank over the modules (from tensor shapes).
        alpha: ``lora_alpha`` of the config (per-module alphas are folded into ``modules``).
        use_rslora: Scaling is ``alpha / sqrt(r)``.
        target_modules: Projection names that carry LoRA, in :data:`PROJECTION_MODULES` order.
        modules: ``(layer, projection) -> (r, scaling)``.
        num_modules: ``len(modules)``.
        size_bytes: Bytes of all A and B tensors in the serving dtype.
        sha256: :func:`adapter_sha256` of the config and the weights file.
        base_model_name_or_path: From the config (informational; shapes decide compatibility).
    """

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    modules: dict[tuple[int, str], tuple[int, float]]
    num_modules: int
    size_bytes: int
    sha256: str
    base_model_name_or_path: str

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict; module keys become ``"<layer>.<projection>"``."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "target_modules": list(self.target_modules),
            "modules": {f"{i}.{p}": [r, s] for (i, p), (r, s) in self.modules.items()},
            "num_modules": self.num_modules,
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "base_model_name_or_path": self.base_model_name_or_path,
        }


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _manifest(
    cfg: LoraAdapterConfig,
    plans: Mapping[tuple[int, str], _ModulePlan],
    sha: str,
    dtype: torch.dtype,
) -> AdapterManifest:
    itemsize = _dtype_size(dtype)
    present = {p.projection for p in plans.values()}
    return AdapterManifest(
        rank=max(p.r for p in plans.values()),
        alpha=cfg.lora_alpha,
        use_rslora=cfg.use_rslora,
        target_modules=tuple(m for m in PROJECTION_MODULES if m in present),
        modules={k: (p.r, p.scaling) for k, p in plans.items()},
        num_modules=len(plans),
        size_bytes=sum(p.r * (p.in_features + p.out_features) for p in plans.values()) * itemsize,
        sha256=sha,
        base_model_name_or_path=cfg.base_model_name_or_path,
    )


def inspect_adapter(
    source: str | os.PathLike[str],
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    *,
    confinement: Confinement | None = None,
) -> AdapterManifest:
    """Validate an adapter directory against the base model without keeping its tensors.

    Reads ``adapter_config.json`` and the safetensors header, hashes the weights file
    (streamed), and runs every check of :func:`load_lora_weights`, the value scan included
    (each tensor memory-mapped and reduced once, then dropped).

    Args:
        source: Directory in PEFT layout.
        spec: Served base model.
        dtype: Serving dtype (decides ``size_bytes``).
        confinement: Adapter roots (and tenant) the directory and each file read must lie
            under; None = read as given.

    Returns:
        The adapter's manifest.

    Raises:
        InvalidAdapterError: malformed adapter or unsupported feature (INVALID_ARGUMENT).
        SourceRefusedError: refused by ``confinement`` (an :class:`InvalidAdapterError`).
        IncompatibleAdapterError: does not fit ``spec`` (FAILED_PRECONDITION).
    """
    from safetensors import SafetensorError, safe_open

    path = _adapter_dir(source, confinement)
    config_bytes = read_config_bytes(path, confinement)
    cfg = read_adapter_config(path, confinement, config_bytes)
    weights = _weights_path(path, confinement)
    plans = plan_modules(cfg, _read_header(weights, confinement), spec, str(path))
    sha = adapter_sha256(
        hashlib.sha256(config_bytes).hexdigest(), sha256_file(weights, confinement=confinement)
    )
    try:
        with _pinned(weights, confinement) as name, safe_open(name, framework="pt") as f:
            for key, plan in plans.items():
                name = canonical_module_name(*key)
                for tkey, label in ((plan.key_a, "lora_A"), (plan.key_b, "lora_B")):
                    _check_values(f.get_tensor(tkey), dtype, f"{path}: {name} {label}")
    except SafetensorError as e:
        raise InvalidAdapterError(f"{weights} could not be read as safetensors: {e}") from None
    return _manifest(cfg, plans, sha, dtype)


def _check_values(t: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    """Refuse a tensor holding NaN/Inf, or values beyond ``dtype``'s range (they would be Inf
    once cast to the serving dtype).

    Raises:
        InvalidAdapterError: naming ``where`` (``"<dir>: <module> lora_A"``).
    """
    # One reduction per tensor (aminmax propagates NaN; far cheaper than isfinite().all()).
    lo, hi = (float(v) for v in torch.aminmax(t))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise InvalidAdapterError(
            f"{where} holds NaN or Inf values; the adapter is broken (retrain or re-export it)"
        )
    limit = torch.finfo(dtype).max
    if max(-lo, hi) > limit:
        raise InvalidAdapterError(
            f"{where} overflows {dtype} (max |value| {max(-lo, hi):.3g} > {limit:.3g}); serve "
            "in a wider dtype"
        )


def load_lora_weights(
    source: str | os.PathLike[str],
    spec: ModelSpec,
    *,
    adapter_id: str,
    version: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    expected_sha256: str | None = None,
    confinement: Confinement | None = None,
) -> LoRAWeights:
    """Validate and load an adapter's tensors, cast to the serving dtype.

    The file is read once; the header, the sha256 and the tensors all come from those bytes.

    Args:
        source: Directory in PEFT layout.
        spec: Served base model.
        adapter_id: Registry id to record.
        version: Registry version to record.
        dtype: Serving dtype; fp16/bf16/fp32/fp64 tensors are cast to it.
        device: Where the returned tensors live.
        expected_sha256: When given, :func:`adapter_sha256` of the config and weights read
            must equal it (neither file was changed since registration).
        confinement: Adapter roots the directory and each file read must lie under; None =
            read as given.

    Returns:
        ``LoRAWeights`` with A ``[r, in]`` and B ``[out, r]`` per module (contiguous) and the
        per-module PEFT scaling.

    Raises:
        InvalidAdapterError: as :func:`inspect_adapter`, plus NaN/Inf values (also after the
            cast, i.e. values that overflow ``dtype``) and a sha256 mismatch.
        SourceRefusedError: refused by ``confinement`` (an :class:`InvalidAdapterError`).
        IncompatibleAdapterError: does not fit ``spec``.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    path = _adapter_dir(source, confinement)
    config_bytes = read_config_bytes(path, confinement)
    config_sha = hashlib.sha256(config_bytes).hexdigest()
    cfg = read_adapter_config(path, confinement, config_bytes)
    weights = _weights_path(path, confinement)
    data = _read_bytes(weights, confinement)
    sha = adapter_sha256(config_sha, hashlib.sha256(data).hexdigest())
    if expected_sha256 and sha != expected_sha256:
        raise InvalidAdapterError(
            f"{path}: {CONFIG_NAME} or {WEIGHTS_NAME} changed since registration (sha256 "
            f"{sha[:12]}..., registered {expected_sha256[:12]}...)"  # the caller says what to do
        )
    if len(data) >= 8:
        (n,) = struct.unpack("<Q", data[:8])
        header = parse_safetensors_header(
            data[: 8 + min(n, _MAX_HEADER_BYTES)], len(data), str(weights)
        )
    else:
        header = parse_safetensors_header(data, len(data), str(weights))
    plans = plan_modules(cfg, header, spec, str(path))
    try:
        tensors = st_load(data)
    except SafetensorError as e:
        raise InvalidAdapterError(f"{weights} could not be read as safetensors: {e}") from None

    modules: dict[tuple[int, str], LoRAModuleWeights] = {}
    for key, plan in plans.items():
        name = canonical_module_name(*key)
        pair = []
        for tkey, label in ((plan.key_a, "lora_A"), (plan.key_b, "lora_B")):
            src = tensors[tkey]
            _check_values(src, dtype, f"{path}: {name} {label}")
            pair.append(src.to(device=device, dtype=dtype).contiguous())
        modules[key] = LoRAModuleWeights(lora_a=pair[0], lora_b=pair[1], scaling=plan.scaling)
    manifest = _manifest(cfg, plans, sha, dtype)
    logger.debug(
        "loaded adapter %s v%d: %d modules, rank %d, %d bytes",
        adapter_id,
        version,
        manifest.num_modules,
        manifest.rank,
        manifest.size_bytes,
    )
    return LoRAWeights(
        adapter_id=adapter_id,
        version=version,
        modules=modules,
        alpha=cfg.lora_alpha,
        use_rslora=cfg.use_rslora,
        sha256=sha,
        target_modules=manifest.target_modules,
    )
