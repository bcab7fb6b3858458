"""Tests of the bounds on adapter inspection (services/common/adapters.py with
InspectionLimits): each kind of refusal is INVALID_ARGUMENT with a message that names the
bound and the setting that raises it, and each is decided before the bytes it guards are read
(a sparse file claiming gigabytes is refused at once)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from plora.make_adapters import write_peft_adapter
from services.common.adapters import (
    MAX_HEADER_VALUES,
    InspectionLimits,
    inspect_adapter,
    json_depth,
    load_lora_weights,
    parse_adapter_config,
)
from services.common.errors import AdapterSourceError, InvalidAdapterError, PoolExhaustedError
from services.common.peft_config import MAX_CONFIG_BYTES, MAX_HEADER_BYTES, MAX_JSON_DEPTH
from services.worker.adapter_api import AdapterRef
from services.worker.config import WorkerConfig
from services.worker.server import WorkerService
from tests.adapter_builders import (
    CONFIG,
    WEIGHTS,
    claim_header,
    edit_config,
    nest_config,
    pad_config,
    sparse_size,
)
from tests.helpers import TINY


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A valid r=4 adapter on all 7 projections of TINY."""
    return write_peft_adapter(tmp_path / "a", TINY, rank=4, alpha=8, seed=1)


def _refused(fn, match: str, within_s: float = 1.0) -> InvalidAdapterError:
    t0 = time.perf_counter()
    with pytest.raises(InvalidAdapterError, match=match) as info:
        fn()
    assert time.perf_counter() - t0 < within_s
    assert info.value.status_code_name == "INVALID_ARGUMENT"
    return info.value


# ---------------------------------------------------------------------------------------
# adapter_config.json size


def test_a_config_over_the_bound_is_refused_naming_the_setting(good: Path) -> None:
    pad_config(good, MAX_CONFIG_BYTES + 1)
    _refused(
        lambda: inspect_adapter(good, TINY),
        rf"adapter_config.json is {MAX_CONFIG_BYTES + 1} bytes; at most {MAX_CONFIG_BYTES} "
        r"are accepted \(--max-adapter-config-bytes / PLORA_MAX_ADAPTER_CONFIG_BYTES",
    )
    pad_config(good, MAX_CONFIG_BYTES)
    assert inspect_adapter(good, TINY).rank == 4


def test_the_config_size_is_checked_before_it_is_read(good: Path) -> None:
    """A 4 GiB (sparse) config is refused by its size in milliseconds, for the gateway's
    inspection and the worker's load alike."""
    with (good / CONFIG).open("r+b") as f:
        f.truncate(4 << 30)
    assert sparse_size(good / CONFIG) < 1 << 20
    _refused(lambda: inspect_adapter(good, TINY), "is 4294967296 bytes", within_s=0.5)
    _refused(
        lambda: load_lora_weights(good, TINY, adapter_id="a", version=1),
        "is 4294967296 bytes",
        within_s=0.5,
    )


def test_the_config_bound_is_configurable(good: Path) -> None:
    size = (good / CONFIG).stat().st_size
    small = InspectionLimits(max_config_bytes=size - 1)
    _refused(lambda: inspect_adapter(good, TINY, limits=small), f"at most {size - 1}")
    assert inspect_adapter(good, TINY, limits=InspectionLimits(max_config_bytes=size)).rank == 4


# ---------------------------------------------------------------------------------------
# JSON nesting


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ('"[[["', 0),
        ("[]", 1),
        ('[[1, {"a": [2]}]]', 4),
        ('{"a\\"[[[": 1}', 1),
        ('{"a\\\\": [[1]]}', 3),
        ("[" * 5000 + "]" * 5000, 5000),
    ],
)
def test_json_depth(text: str, depth: int) -> None:
    assert json_depth(text) == depth
    if depth < 500:
        assert json.loads(text) is not None


def test_deep_nesting_is_refused_as_invalid_argument_not_a_crash(good: Path) -> None:
    """Python's parser raises RecursionError on deep nesting (which became INTERNAL); the
    depth is bounded before parsing."""
    with pytest.raises(RecursionError):
        json.loads("[" * 100_000 + "]" * 100_000)
    nest_config(good, 100_000)
    _refused(lambda: inspect_adapter(good, TINY), "nests arrays/objects 100000 deep; at most 32")


def test_nesting_up_to_the_bound_is_accepted(tmp_path: Path) -> None:
    ok = nest_config(write_peft_adapter(tmp_path / "ok", TINY, rank=4, alpha=8, seed=1), 32)
    assert inspect_adapter(ok, TINY).rank == 4
    deep = nest_config(write_peft_adapter(tmp_path / "deep", TINY, rank=4, alpha=8, seed=1), 33)
    _refused(lambda: inspect_adapter(deep, TINY), f"33 deep; at most {MAX_JSON_DEPTH}")


def test_a_deeply_nested_safetensors_header_is_refused(good: Path) -> None:
    header = ('{"__metadata__": ' + "[" * 40 + "]" * 40 + "}").encode()
    (good / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header)
    _refused(lambda: inspect_adapter(good, TINY), "safetensors header nests arrays/objects 41")


# ---------------------------------------------------------------------------------------
# safetensors header size


def test_a_header_over_the_bound_is_refused_before_it_is_read(good: Path) -> None:
    """A header claiming 100 MB (the file sparse, as large as the claim) is refused on its
    8-byte length, by the gateway's inspection and the worker's load."""
    claim_header(good, 100_000_000)
    assert sparse_size(good / WEIGHTS) < 1 << 20
    message = (
        rf"declares a safetensors header of 100000000 bytes; at most {MAX_HEADER_BYTES} are "
        r"accepted \(--max-safetensors-header-bytes / PLORA_MAX_SAFETENSORS_HEADER_BYTES"
    )
    _refused(lambda: inspect_adapter(good, TINY), message, within_s=0.5)
    _refused(
        lambda: load_lora_weights(good, TINY, adapter_id="a", version=1), message, within_s=0.5
    )


def test_the_header_bound_is_configurable(good: Path) -> None:
    (n,) = struct.unpack("<Q", (good / WEIGHTS).read_bytes()[:8])
    _refused(
        lambda: inspect_adapter(good, TINY, limits=InspectionLimits(max_header_bytes=n - 1)),
        f"header of {n} bytes; at most {n - 1}",
    )
    assert inspect_adapter(good, TINY, limits=InspectionLimits(max_header_bytes=n)).rank == 4


def test_a_header_of_many_small_entries_is_refused_before_it_is_parsed(good: Path) -> None:
    """10,000 entries (under 2 MiB, far below the size bound) would hold the GIL in the JSON
    parser; they are counted in C first."""
    entries = {
        f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
        for i in range(10_000)
    }
    header = json.dumps(entries).encode()
    values = header.count(b",") + header.count(b"[") + header.count(b"{")
    assert values > MAX_HEADER_VALUES
    (good / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 40_000)
    _refused(
        lambda: inspect_adapter(good, TINY),
        rf"safetensors header holds {values} commas and brackets; at most {MAX_HEADER_VALUES}",
        within_s=0.1,
    )


def test_bytes_after_the_last_tensor_are_refused(good: Path) -> None:
    """The tensors must tile the data (as the safetensors library requires), so a file is
    never larger than the tensors the pool-fit check counted."""
    with (good / WEIGHTS).open("ab") as f:
        f.write(b"\0" * 4096)
    _refused(lambda: inspect_adapter(good, TINY), "4096 bytes after its last tensor")


def test_a_tensor_whose_bytes_disagree_with_its_shape_is_refused(good: Path) -> None:
    data = (good / WEIGHTS).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [header[key]["shape"][0] * 2, header[key]["shape"][1]]
    raw = json.dumps(header).encode()
    (good / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    _refused(lambda: inspect_adapter(good, TINY), "the file is corrupt")


def test_an_overlong_tensor_name_is_refused(good: Path) -> None:
    path = good / WEIGHTS
    tensors = load_file(str(path))
    key = next(iter(tensors))
    tensors["x" * 5000 + key] = tensors.pop(key)
    save_file(tensors, str(path))
    _refused(lambda: inspect_adapter(good, TINY), "a tensor name is 5")


# ---------------------------------------------------------------------------------------
# Rank cap


def test_a_rank_over_the_cap_is_refused_before_the_weights_are_read(good: Path) -> None:
    """Refused right after the config is parsed: with the weights file gone, the rank is
    still what the refusal names."""
    edit_config(good, r=65536)
    (good / WEIGHTS).unlink()
    _refused(
        lambda: inspect_adapter(good, TINY),
        r"adapter_config.json: r is 65536, above this server's largest LoRA rank 256 "
        r"\(--max-lora-rank / PLORA_MAX_LORA_RANK\)",
    )


@pytest.mark.parametrize(
    ("fields", "limits", "fragment"),
    [
        ({"r": 257}, InspectionLimits(), "r is 257"),
        ({"r": 8, "rank_pattern": {"q_proj": 512}}, InspectionLimits(), r"\['q_proj'\] is 512"),
        ({"r": 64}, InspectionLimits(max_lora_rank=32), "largest LoRA rank 32"),
    ],
)
def test_the_rank_cap_covers_r_and_rank_pattern(
    fields: dict[str, object], limits: InspectionLimits, fragment: str
) -> None:
    with pytest.raises(InvalidAdapterError, match=fragment):
        parse_adapter_config({"peft_type": "LORA", **fields}, limits)


def test_ranks_up_to_the_cap_or_without_one_are_accepted() -> None:
    assert parse_adapter_config({"peft_type": "LORA", "r": 256}).r == 256
    no_cap = InspectionLimits(max_lora_rank=None)
    assert parse_adapter_config({"peft_type": "LORA", "r": 65536}, no_cap).r == 65536


# ---------------------------------------------------------------------------------------
# Pool fit before hashing and value scan


def test_pool_fit_is_checked_before_the_value_scan(good: Path) -> None:
    """An adapter holding NaN and too large for the pool gets the pool's answer: its values
    were never scanned."""
    path = good / WEIGHTS
    tensors = load_file(str(path))
    key = next(iter(tensors))
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    save_file(tensors, str(path))
    with pytest.raises(
        PoolExhaustedError, match=r"needs \d+ bytes .* largest worker pool holds 1;"
    ):
        inspect_adapter(good, TINY, max_bytes=1)
    with pytest.raises(InvalidAdapterError, match="NaN"):
        inspect_adapter(good, TINY)


def test_pool_fit_is_checked_before_the_weights_are_hashed(tmp_path: Path) -> None:
    """A 4 GiB adapter (sparse) is refused for the pool in a fraction of the time hashing it
    would take."""
    d = tmp_path / "big"
    d.mkdir()
    r = 8 << 20
    (d / CONFIG).write_text(
        json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    a_bytes = r * TINY.hidden_size * 4
    header = json.dumps(
        {
            f"{stem}.lora_A.weight": {
                "dtype": "F32",
                "shape": [r, TINY.hidden_size],
                "data_offsets": [0, a_bytes],
            },
            f"{stem}.lora_B.weight": {
                "dtype": "F32",
                "shape": [TINY.num_heads * TINY.head_dim, r],
                "data_offsets": [a_bytes, 2 * a_bytes],
            },
        }
    ).encode()
    with (d / WEIGHTS).open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2 * a_bytes)
    assert (d / WEIGHTS).stat().st_size > 4 << 30
    t0 = time.perf_counter()
    with pytest.raises(PoolExhaustedError, match=f"needs {2 * a_bytes} bytes"):
        inspect_adapter(d, TINY, limits=InspectionLimits(max_lora_rank=None), max_bytes=512 << 20)
    assert time.perf_counter() - t0 < 0.5


def test_a_worker_loads_within_its_own_bounds(good: Path) -> None:
    """A worker's load applies its config's size bounds (the request that needed the adapter
    gets FAILED_PRECONDITION naming it) and no rank cap."""
    manifest = inspect_adapter(good, TINY)
    ref = AdapterRef("mine", 1, str(good), manifest.size_bytes, manifest.sha256)
    size = (good / CONFIG).stat().st_size
    strict = SimpleNamespace(
        spec=TINY,
        dtype=torch.float32,
        confinement=None,
        config=WorkerConfig(max_adapter_config_bytes=size - 1),
    )
    with pytest.raises(AdapterSourceError, match=f"'mine' .* at most {size - 1}") as info:
        WorkerService._load_adapter(strict, ref)  # type: ignore[arg-type]
    assert info.value.status_code_name == "FAILED_PRECONDITION"
    assert WorkerConfig().inspection_limits.max_lora_rank is None
