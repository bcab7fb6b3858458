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
  ``"all-linear"`` selects every projection (the decoder's linear layers minus ``lm_head``).
  ``exclude_modules``, ``layers_to_transform`` and ``layers_pattern`` apply as in PEFT.
- Module names are the ones PEFT sees on the served family's ``*ForCausalLM``:
  ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` / ``model.layers.{i}.mlp.{gate,up,down}_proj``
  (Llama, Mistral, Qwen, Gemma), or Phi-3's fused ``self_attn.qkv_proj`` and
  ``mlp.gate_up_proj``; ``ModelSpec.projections`` lists the served model's.
- Tensor keys may carry the ``base_model.model.`` prefix or not, and the adapter-name segment
  (``.lora_A.default.weight``) or not (``.lora_A.weight``, what ``save_pretrained`` writes).

Reading is bounded (:class:`InspectionLimits`): the config's size is checked with ``stat``
and the header's on its 8-byte length before either is read, JSON nesting is bounded before
it is parsed, the rank is capped right after the config is parsed, every pattern of the
config is matched in linear time (:mod:`services.common.patterns`), and
:func:`inspect_adapter` checks the adapter's size against ``max_bytes`` (the largest pool)
before it hashes or scans a byte of the weights.

Errors: :class:`InvalidAdapterError` (INVALID_ARGUMENT) for malformed adapters, adapters
beyond a bound, or features that change the math we serve (DoRA, biases, modules_to_save,
...); :class:`IncompatibleAdapterError` (FAILED_PRECONDITION) when the tensors do not fit the
base; :class:`PoolExhaustedError` (RESOURCE_EXHAUSTED) when no pool could ever hold it.
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

import numpy as np
import torch

from services.common.errors import (
    MAX_ECHO_PATH,
    IncompatibleAdapterError,
    InvalidAdapterError,
    PoolExhaustedError,
    quoted,
)
from services.common.peft_config import (
    CONFIG_NAME,
    DEFAULT_LIMITS,
    InspectionLimits,
    LoraAdapterConfig,
    get_pattern_key,
    parse_adapter_config,
)
from services.common.sources import Confinement

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_LIMITS",
    "AdapterManifest",
    "Confinement",
    "InspectionLimits",
    "adapter_sha256",
    "check_pool_fit",
    "header_length",
    "LoraAdapterConfig",
    "manifest_of",
    "parse_safetensors_header",
    "plan_modules",
    "scan_weights",
    "get_pattern_key",
    "inspect_adapter",
    "load_lora_weights",
    "load_json",
    "parse_adapter_config",
    "parse_config_bytes",
    "parse_tensor_key",
    "read_adapter_config",
    "read_config_bytes",
    "sha256_file",
]
from services.common.types import (
    ALL_PROJECTION_MODULES,
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

#: Modules of a decoder that exist but cannot carry LoRA here.
_LLAMA_NON_PROJECTIONS = frozenset(
    {
        "embed_tokens",
        "lm_head",
        "norm",
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "q_norm",
        "k_norm",
        "rotary_emb",
        "act_fn",
        "self_attn",
        "mlp",
    }
)

# A decoder projection. Anything before "layers." is accepted as the model trunk
# ("model.", "model.language_model.", none), matching PEFT's suffix semantics.
_LLAMA_MODULE_RE = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\.(?P<proj>[A-Za-z0-9_]+)$"
)

#: Projections that live under ``self_attn`` (the rest are under ``mlp``).
_ATTN_PROJECTIONS = frozenset(ATTN_MODULES) | {"qkv_proj"}

WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"


#: safetensors dtype strings of floating-point tensors we accept, with their torch dtype.
_ST_FLOAT_DTYPES: dict[str, torch.dtype] = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
_ST_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
#: Longest tensor name accepted in a safetensors header (PEFT's are under 100 characters).
MAX_TENSOR_KEY_CHARS = 1024
#: Most JSON values (counted as commas and opening brackets) in a safetensors header: a
#: tensor takes 8, so this is 8,192 tensors (a LoRA of every projection of 585 layers), and
#: parsing it holds the GIL for well under 100 ms where 16 MiB of small entries would hold it
#: for over a second.
MAX_HEADER_VALUES = 65536

#: JSON escapes (a backslash and the character after it), removed first so that every quote
#: left delimits a string; then the strings; then everything but brackets. Each regex is
#: linear-time (no nested quantifier).
_JSON_ESCAPE_RE = re.compile(r"\\.", re.DOTALL)
_JSON_STRING_RE = re.compile(r'"[^"]*"')
_NOT_BRACKET_RE = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """Deepest nesting of arrays and objects in JSON ``text`` (0 for a scalar), in linear time
    and without recursion; unbalanced text gets some depth and is left to the parser."""
    brackets = _NOT_BRACKET_RE.sub("", _JSON_STRING_RE.sub("", _JSON_ESCAPE_RE.sub("", text)))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return max(0, int(np.cumsum(steps, dtype=np.int64).max()))


def load_json(
    raw: bytes, where: str, max_depth: int, what: str = "", max_values: int | None = None
) -> object:
    """Decode UTF-8 JSON whose nesting is at most ``max_depth`` deep.

    Args:
        raw: The JSON bytes (already bounded in size by the caller).
        where: The file, for messages.
        max_depth: Deepest nesting of arrays/objects accepted.
        what: How the messages call the text (default: ``where`` itself).
        max_values: When given, most commas plus opening brackets in ``raw`` (strings
            included: a bound on the values, counted in C before any parsing).

    Returns:
        The decoded value.

    Raises:
        InvalidAdapterError: not UTF-8, not JSON, more values than ``max_values``, or nested
            deeper than ``max_depth`` (Python's parser would otherwise hit its recursion
            limit).
    """
    what = what or where
    if max_values is not None:
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if values > max_values:
            raise InvalidAdapterError(
                f"{what} holds {values} commas and brackets; at most {max_values} are accepted "
                "(a LoRA tensor needs 8)"
            )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidAdapterError(f"{what} is not valid JSON: not UTF-8 ({e.reason})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise InvalidAdapterError(
            f"{what} nests arrays/objects {depth} deep; at most {max_depth} levels are "
            "accepted (a PEFT file needs 3)"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidAdapterError(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidAdapterError(f"{what} nests arrays/objects too deep") from None


# ----------------------------------------------------------------------------------------
# Config parsing (pure)


# ----------------------------------------------------------------------------------------
# Tensor key parsing (pure)


def canonical_module_name(layer: int, projection: str) -> str:
    """The module's name in the served ``*ForCausalLM`` (what PEFT matches patterns against)."""
    group = "self_attn" if projection in _ATTN_PROJECTIONS else "mlp"
    return f"model.layers.{layer}.{group}.{projection}"


@dataclass(frozen=True)
class _TensorInfo:
    key: str
    dtype: str  # safetensors dtype string, e.g. "F32"
    shape: tuple[int, ...]


def parse_tensor_key(
    key: str, projections: tuple[str, ...] = PROJECTION_MODULES
) -> tuple[int, str, str, str | None]:
    """Map a PEFT LoRA tensor key onto ``(layer, projection, "lora_A"|"lora_B", adapter_name)``.

    Examples: ``base_model.model.model.layers.3.mlp.up_proj.lora_B.weight`` ->
    ``(3, "up_proj", "lora_B", None)``; ``model.layers.0.self_attn.q_proj.lora_A.default.weight``
    -> ``(0, "q_proj", "lora_A", "default")``.

    Args:
        key: The safetensors tensor name.
        projections: The served family's projection names (``ModelSpec.projections``).

    Raises:
        InvalidAdapterError: the key is not a LoRA A/B weight (DoRA magnitude, a bias, embedding
            LoRA, a full module weight) or puts LoRA on a module other than the projections
            (``embed_tokens``, ``lm_head``, norms).
        IncompatibleAdapterError: the module path is not a projection of the served family (a
            projection another family has, e.g. Phi-3's ``qkv_proj`` on Llama), or no decoder
            projection at all
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
    proj = mm.group("proj") if mm is not None else None
    if proj is not None and proj in ALL_PROJECTION_MODULES and proj not in projections:
        raise IncompatibleAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} puts LoRA on {proj}, which the served model does "
            f"not have (its projections: {', '.join(projections)}); this adapter was trained "
            "for another architecture"
        )
    if last in _LLAMA_NON_PROJECTIONS or (proj is not None and proj not in projections):
        raise InvalidAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} puts LoRA on {module!r}; only the decoder "
            f"projections {', '.join(projections)} can carry LoRA here (retrain with "
            "target_modules limited to them)"
        )
    if mm is None or proj is None:
        raise IncompatibleAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} names module {module!r}, which is no module of the "
            "base model served here (expected model.layers.<i>.self_attn.<projection> or "
            f"model.layers.<i>.mlp.<projection> with a projection among "
            f"{', '.join(projections)}); this adapter was trained for another architecture"
        )
    group = mm.group("group")
    if (group == "self_attn") != (proj in _ATTN_PROJECTIONS):
        raise IncompatibleAdapterError(
            f"{WEIGHTS_NAME}: tensor {key!r} names {group}.{proj}, which the served model's "
            "decoder layers do not have; this adapter was trained for another architecture"
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
    path: Path,
    limits: InspectionLimits = DEFAULT_LIMITS,
    confinement: Confinement | None = None,
    data: bytes | None = None,
) -> LoraAdapterConfig:
    """Read and parse ``<path>/adapter_config.json`` within ``limits``
    (:func:`read_config_bytes`, then :func:`parse_config_bytes`).

    Args:
        path: The adapter directory.
        limits: Bounds on the config's size, nesting and rank.
        confinement: Adapter roots the file is opened under (:meth:`Confinement.open`);
            None = read as given.
        data: The file's bytes when already read by :func:`read_config_bytes` (so the bytes
            hashed are the bytes parsed).

    Raises:
        InvalidAdapterError: as those two.
        SourceRefusedError: the file is refused by ``confinement``.
    """
    if data is None:
        data = read_config_bytes(path, limits, confinement)
    return parse_config_bytes(data, limits)


def read_config_bytes(
    path: Path,
    limits: InspectionLimits = DEFAULT_LIMITS,
    confinement: Confinement | None = None,
) -> bytes:
    """The bytes of ``<path>/adapter_config.json``, its size bounded before it is read.

    The size of the opened file is checked with ``fstat`` before it is read, and no more than
    ``limits.max_config_bytes + 1`` bytes are read (a file growing meanwhile is still refused).
    With ``confinement`` the file is opened under the adapter roots.

    Raises:
        InvalidAdapterError: missing or unreadable file, or larger than
            ``limits.max_config_bytes``.
        SourceRefusedError: refused by ``confinement``.
    """
    bound = limits.max_config_bytes
    try:
        with _open(path / CONFIG_NAME, confinement) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(bound + 1) if size <= bound else b""
    except FileNotFoundError:
        raise InvalidAdapterError(
            f"{str(path)!r} has no {CONFIG_NAME}; a PEFT adapter directory holds {CONFIG_NAME} "
            f"and {WEIGHTS_NAME} (what PeftModel.save_pretrained writes)"
        ) from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as e:
        raise InvalidAdapterError(f"{path / CONFIG_NAME} cannot be read: {e.strerror}") from None
    if raw:
        size = len(raw)
    if size > bound:
        raise InvalidAdapterError(
            f"{CONFIG_NAME} is {size} bytes; at most {bound} are accepted "
            "(--max-adapter-config-bytes / PLORA_MAX_ADAPTER_CONFIG_BYTES; PEFT writes about "
            "1 KiB)"
        )
    return raw


def parse_config_bytes(raw: bytes, limits: InspectionLimits = DEFAULT_LIMITS) -> LoraAdapterConfig:
    """Parse the bytes of an ``adapter_config.json`` (from :func:`read_config_bytes`).

    Raises:
        InvalidAdapterError: not UTF-8 JSON, nested deeper than ``limits.max_json_depth``, or a
            refused config (:func:`parse_adapter_config`, the rank cap included).
    """
    cfg = load_json(raw, CONFIG_NAME, limits.max_json_depth)
    return parse_adapter_config(cfg, limits)  # type: ignore[arg-type]  # checks it is a dict


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


def header_length(head: bytes, file_size: int, where: str, limits: InspectionLimits) -> int:
    """The header length ``N`` a safetensors file's first 8 bytes declare, checked against the
    file size and ``limits.max_header_bytes`` before any of the header is read.

    Raises:
        InvalidAdapterError: fewer than 8 bytes, ``N`` beyond the file, or ``N`` above the
            bound.
    """
    if len(head) < 8:
        raise InvalidAdapterError(f"{where} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head[:8])
    if 8 + n > file_size:
        raise InvalidAdapterError(f"{where} is not a valid safetensors file (bad header length)")
    if n > limits.max_header_bytes:
        raise InvalidAdapterError(
            f"{WEIGHTS_NAME} declares a safetensors header of {n} bytes; at most "
            f"{limits.max_header_bytes} are accepted (--max-safetensors-header-bytes / "
            "PLORA_MAX_SAFETENSORS_HEADER_BYTES; a LoRA adapter's header is well under 1 MiB)"
        )
    return int(n)


def parse_safetensors_header(
    raw: bytes, file_size: int, where: str, limits: InspectionLimits = DEFAULT_LIMITS
) -> dict[str, _TensorInfo]:
    """Parse a safetensors header: ``u64 little-endian N`` then ``N`` bytes of JSON.

    Besides the format (as the ``safetensors`` library checks it), the tensors must cover the
    data after the header exactly, each ``numel * itemsize`` bytes, so the file is no larger
    than the tensors it declares (the pool-fit check bounds those before the file is hashed).

    Args:
        raw: At least the first ``8 + N`` bytes of the file.
        file_size: Size of the whole file in bytes (to detect truncation).
        where: File name for messages.
        limits: ``max_header_bytes`` bounds ``N``; ``max_json_depth`` the nesting.

    Returns:
        Tensor name -> dtype string and shape (the ``__metadata__`` entry is skipped).

    Raises:
        InvalidAdapterError: not a safetensors file, truncated, a header above the bound,
            with more than :data:`MAX_HEADER_VALUES` values or nested too deep, a tensor name
            over :data:`MAX_TENSOR_KEY_CHARS`, tensors that do not tile the data, or a
            non-float tensor.
    """
    n = header_length(raw, file_size, where, limits)
    if len(raw) < 8 + n:
        raise InvalidAdapterError(f"{where} is not a valid safetensors file (bad header length)")
    header = load_json(
        raw[8 : 8 + n],
        where,
        limits.max_json_depth,
        what=f"{where}: the safetensors header",
        max_values=MAX_HEADER_VALUES,
    )
    if not isinstance(header, dict):
        raise InvalidAdapterError(f"{where} has a corrupt safetensors header")
    data_len = file_size - 8 - n
    out: dict[str, _TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if len(key) > MAX_TENSOR_KEY_CHARS:
            raise InvalidAdapterError(
                f"{where}: a tensor name is {len(key)} characters long; at most "
                f"{MAX_TENSOR_KEY_CHARS} are accepted (PEFT's are under 100)"
            )
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            dims = tuple(int(s) for s in shape)
            start, end = int(start), int(end)
            if not isinstance(dtype, str):
                raise TypeError(dtype)
        except (KeyError, TypeError, ValueError):
            raise InvalidAdapterError(f"{where}: header entry {key!r} is malformed") from None
        if dtype not in _ST_FLOAT_DTYPES:
            raise InvalidAdapterError(
                f"{where}: tensor {key!r} has dtype {str(dtype)[:16]}; LoRA weights must be "
                "F16, BF16, F32 or F64 (quantized adapters are not supported)"
            )
        if not (0 <= start <= end <= data_len):
            raise InvalidAdapterError(
                f"{where}: tensor {key!r} lies outside the file (truncated download?)"
            )
        if any(d < 0 for d in dims) or end - start != math.prod(dims) * _ST_ITEMSIZE[dtype]:
            raise InvalidAdapterError(
                f"{where}: tensor {key!r} has shape {list(dims)} of {dtype} but "
                f"{end - start} bytes (data_offsets {[start, end]}); the file is corrupt"
            )
        spans.append((start, end, key))
        out[key] = _TensorInfo(key, dtype, dims)
    covered = 0
    for start, end, key in sorted(spans):
        if start != covered:
            raise InvalidAdapterError(
                f"{where}: tensor {key!r} starts at byte {start} of the data, where the tensors "
                f"before it end at {covered} (overlapping or unused bytes); the file is corrupt"
            )
        covered = end
    if covered != data_len:
        raise InvalidAdapterError(
            f"{where} holds {data_len - covered} bytes after its last tensor; the file is "
            "corrupt (re-export it with save_pretrained)"
        )
    return out


def _open(path: Path, confinement: Confinement | None) -> BinaryIO:
    """``path`` opened for reading: under the adapter roots with ``confinement``
    (:meth:`Confinement.open`), else as given.

    Raises:
        SourceRefusedError: refused by ``confinement``.
        OSError: the file cannot be opened (without ``confinement``).
    """
    return path.open("rb") if confinement is None else confinement.open(path)


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


def _read_header(
    weights: Path, limits: InspectionLimits, confinement: Confinement | None = None
) -> dict[str, _TensorInfo]:
    """The header of ``weights``: its length checked on the first 8 bytes, then only that
    many bytes read (:func:`header_length`, :func:`parse_safetensors_header`); opened under
    the adapter roots with ``confinement``."""
    with _open(weights, confinement) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = header_length(head, size, str(weights), limits)
        body = f.read(n)
    return parse_safetensors_header(head + body, size, str(weights), limits)


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
            hashlib.sha256(read_config_bytes(path, confinement=confinement)).hexdigest(),
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
        layer, proj, kind, adapter = parse_tensor_key(key, spec.projections)
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
        pairs.items(), key=lambda kv: (kv[0][0], spec.projections.index(kv[0][1]))
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
        r_cfg, alpha = cfg.resolve(name)
        if r_cfg != r:
            raise InvalidAdapterError(
                f"{prefix}{name}: {CONFIG_NAME} gives r={r_cfg} (r / rank_pattern) but the "
                f"tensors have rank {r} (lora_A {list(a.shape)}); the config does not belong to "
                "these weights — fix r / rank_pattern"
            )
        plans[(layer, proj)] = _ModulePlan(
            layer, proj, a.key, b.key, r, in_features, out_features, cfg.scaling_of(alpha, r)
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
        target_modules: Projection names that carry LoRA, in ``ModelSpec.projections`` order.
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


def _size_bytes(plans: Mapping[tuple[int, str], _ModulePlan], dtype: torch.dtype) -> int:
    """Bytes of every A and B tensor in the serving ``dtype``."""
    itemsize = _dtype_size(dtype)
    return sum(p.r * (p.in_features + p.out_features) for p in plans.values()) * itemsize


def manifest_of(
    cfg: LoraAdapterConfig,
    plans: Mapping[tuple[int, str], _ModulePlan],
    sha: str,
    dtype: torch.dtype,
    projections: tuple[str, ...],
) -> AdapterManifest:
    """The :class:`AdapterManifest` of a parsed config and its module plans."""
    present = {p.projection for p in plans.values()}
    return AdapterManifest(
        rank=max(p.r for p in plans.values()),
        alpha=cfg.lora_alpha,
        use_rslora=cfg.use_rslora,
        target_modules=tuple(m for m in projections if m in present),
        modules={k: (p.r, p.scaling) for k, p in plans.items()},
        num_modules=len(plans),
        size_bytes=_size_bytes(plans, dtype),
        sha256=sha,
        base_model_name_or_path=cfg.base_model_name_or_path,
    )


def inspect_adapter(
    source: str | os.PathLike[str],
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    *,
    confinement: Confinement | None = None,
    limits: InspectionLimits = DEFAULT_LIMITS,
    max_bytes: int | None = None,
) -> AdapterManifest:
    """Validate an adapter directory against the base model without keeping its tensors.

    In this order, each step only once the ones before passed: reads ``adapter_config.json``
    (size-checked, rank-capped) and the safetensors header (size-checked), plans the modules
    from the header (every shape check of :func:`load_lora_weights`), checks the adapter's
    size against ``max_bytes``, and only then hashes the weights file (streamed) and scans
    its values (each tensor memory-mapped and reduced once, then dropped).

    Args:
        source: Directory in PEFT layout.
        spec: Served base model.
        dtype: Serving dtype (decides ``size_bytes``).
        confinement: Adapter roots (and tenant) the directory and each file read must lie
            under; None = read as given.
        limits: Bounds on the config, the header and the rank.
        max_bytes: Largest ``size_bytes`` any pool could hold (the gateway passes its
            largest worker pool); ``None`` = no check.

    Returns:
        The adapter's manifest.

    Raises:
        InvalidAdapterError: malformed adapter, beyond ``limits``, or an unsupported feature
            (INVALID_ARGUMENT).
        SourceRefusedError: refused by ``confinement`` (an :class:`InvalidAdapterError`).
        IncompatibleAdapterError: does not fit ``spec`` (FAILED_PRECONDITION).
        PoolExhaustedError: ``size_bytes`` above ``max_bytes`` (RESOURCE_EXHAUSTED).
    """
    path = _adapter_dir(source, confinement)
    config_bytes = read_config_bytes(path, limits, confinement)
    cfg = read_adapter_config(path, limits, confinement, config_bytes)
    weights = _weights_path(path, confinement)
    plans = plan_modules(cfg, _read_header(weights, limits, confinement), spec, str(path))
    check_pool_fit(plans, dtype, max_bytes)
    sha = adapter_sha256(
        hashlib.sha256(config_bytes).hexdigest(), sha256_file(weights, confinement=confinement)
    )
    with _pinned(weights, confinement) as name:
        scan_weights(name, plans, dtype, str(path), str(weights))
    return manifest_of(cfg, plans, sha, dtype, spec.projections)


def check_pool_fit(
    plans: Mapping[tuple[int, str], _ModulePlan], dtype: torch.dtype, max_bytes: int | None
) -> None:
    """Refuse an adapter whose tensors need more than ``max_bytes`` in the serving ``dtype``
    (None = no check).

    Raises:
        PoolExhaustedError: above ``max_bytes`` (RESOURCE_EXHAUSTED).
    """
    size = _size_bytes(plans, dtype)
    if max_bytes is not None and size > max_bytes:
        raise PoolExhaustedError(
            f"the adapter needs {size} bytes in the serving dtype "
            f"{str(dtype).removeprefix('torch.')} but the largest worker pool holds "
            f"{max_bytes}; raise --pool-bytes or use a smaller rank"
        )


def scan_weights(
    name: str,
    plans: Mapping[tuple[int, str], _ModulePlan],
    dtype: torch.dtype,
    where: str,
    label: str = "",
) -> None:
    """Scan every planned tensor of the safetensors file ``name`` for NaN/Inf and for values
    beyond ``dtype`` (one tensor at a time, memory-mapped).

    Args:
        name: A path safetensors can open.
        plans: :func:`plan_modules` of the file's header.
        dtype: Serving dtype.
        where: The adapter, for messages.
        label: The file, for messages (default ``name``).

    Raises:
        InvalidAdapterError: a bad value, or the file cannot be read as safetensors.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(name, framework="pt") as f:
            for key, plan in plans.items():
                module = canonical_module_name(*key)
                for tkey, kind in ((plan.key_a, "lora_A"), (plan.key_b, "lora_B")):
                    _check_values(f.get_tensor(tkey), dtype, f"{where}: {module} {kind}")
    except SafetensorError as e:
        raise InvalidAdapterError(
            f"{label or name} could not be read as safetensors: {e}"
        ) from None


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
    limits: InspectionLimits = DEFAULT_LIMITS,
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
        limits: Bounds on the config, the header and the rank (a worker passes its own).

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
    config_bytes = read_config_bytes(path, limits, confinement)
    config_sha = hashlib.sha256(config_bytes).hexdigest()
    cfg = read_adapter_config(path, limits, confinement, config_bytes)
    weights = _weights_path(path, confinement)
    with _open(weights, confinement) as f:  # the header's length is bounded before the read
        header_length(f.read(8), os.fstat(f.fileno()).st_size, str(weights), limits)
        f.seek(0)
        data = f.read()
    sha = adapter_sha256(config_sha, hashlib.sha256(data).hexdigest())
    if expected_sha256 and sha != expected_sha256:
        raise InvalidAdapterError(
            f"{path}: {CONFIG_NAME} or {WEIGHTS_NAME} changed since registration (sha256 "
            f"{sha[:12]}..., registered {expected_sha256[:12]}...)"  # the caller says what to do
        )
    n = header_length(data, len(data), str(weights), limits)
    header = parse_safetensors_header(data[: 8 + n], len(data), str(weights), limits)
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
    manifest = manifest_of(cfg, plans, sha, dtype, spec.projections)
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
