"""Adapters that probe the bounds of adapter inspection, each built from a valid adapter
directory (``plora.make_adapters.write_peft_adapter``) in a test's own temporary directory:
an oversized or deeply nested ``adapter_config.json``, a safetensors header that claims more
bytes than the bound, a rank above the cap, a pathological ``target_modules`` regex."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def copy_adapter(src: Path, dst: Path) -> Path:
    """A copy of the adapter directory ``src`` at ``dst`` (returned)."""
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes: Any) -> Path:
    """Set fields of ``d``'s ``adapter_config.json``; returns ``d``."""
    path = d / CONFIG
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return d


def pad_config(d: Path, size_bytes: int) -> Path:
    """Make ``d``'s config a valid JSON object of exactly ``size_bytes`` bytes (a ``padding``
    string field PEFT would ignore); returns ``d``."""
    path = d / CONFIG
    cfg = json.loads(path.read_text())
    cfg["padding"] = ""
    base = len(json.dumps(cfg).encode())
    if size_bytes < base:
        raise ValueError(f"the config is already {base} bytes")
    cfg["padding"] = "x" * (size_bytes - base)
    path.write_text(json.dumps(cfg))
    assert path.stat().st_size == size_bytes
    return d


def nest_config(d: Path, depth: int) -> Path:
    """Add a field nesting arrays so that the config is ``depth`` levels deep (the object
    itself is the first); returns ``d``."""
    path = d / CONFIG
    text = path.read_text().rstrip()
    assert text.endswith("}")
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    path.write_text(f'{text[:-1]}, "nested": {inner}}}')
    return d


def claim_header(d: Path, header_bytes: int) -> Path:
    """Rewrite ``d``'s weights as a file whose 8-byte prefix declares a ``header_bytes``-byte
    header, the file extended (sparse, no data written) to hold it; returns ``d``."""
    path = d / WEIGHTS
    with path.open("r+b") as f:
        f.write(struct.pack("<Q", header_bytes))
        f.truncate(8 + header_bytes + 64)
    return d


def sparse_size(path: Path) -> int:
    """Bytes ``path`` occupies on disk (a sparse file's claim costs nothing)."""
    return os.stat(path).st_blocks * 512
