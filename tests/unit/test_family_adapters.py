"""Adapter checks follow the served family: PEFT's module names for it and its shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plora.make_adapters import check_ranks, write_peft_adapter
from services.common.adapters import inspect_adapter, load_lora_weights
from services.common.errors import ConfigError, IncompatibleAdapterError
from services.common.types import ModelSpec
from services.worker.model_loader import spec_from_config
from tests import tiny_models


def _spec(family: str) -> ModelSpec:
    return spec_from_config(tiny_models.hf_config(family).to_dict(), f"tiny-{family}")


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_spec_names_the_family_and_its_projections(family: str) -> None:
    spec = _spec(family)
    assert spec.family == family
    assert list(spec.projections) == tiny_models.projections(family)
    assert ModelSpec.from_dict(spec.to_dict()) == spec  # survives the registry's JSON


def test_phi3_fused_projection_shapes() -> None:
    spec = _spec("phi3")
    d, q, kv, m = 64, 4 * 16, 2 * 16, 96
    assert spec.module_shape("qkv_proj") == (d, q + 2 * kv)
    assert spec.module_shape("gate_up_proj") == (d, 2 * m)


def test_fused_adapter_serves_on_phi3(tmp_path: Path) -> None:
    spec = _spec("phi3")
    path = write_peft_adapter(tmp_path / "a", spec, rank=8, alpha=16, seed=0)
    m = inspect_adapter(path, spec)
    assert m.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert m.num_modules == 4 * spec.num_layers
    w = load_lora_weights(path, spec, adapter_id="a", version=1)
    assert tuple(w.modules[(0, "qkv_proj")].lora_b.shape) == (64 + 2 * 32, 8)


def test_split_adapter_is_refused_on_phi3_naming_its_projections(tmp_path: Path) -> None:
    path = write_peft_adapter(tmp_path / "a", _spec("qwen2"), rank=4, alpha=8, seed=0)
    with pytest.raises(IncompatibleAdapterError) as e:
        inspect_adapter(path, _spec("phi3"))
    assert "qkv_proj, o_proj, gate_up_proj, down_proj" in str(e.value)
    assert "another architecture" in str(e.value)


def test_fused_adapter_is_refused_on_llama(tmp_path: Path) -> None:
    path = write_peft_adapter(tmp_path / "a", _spec("phi3"), rank=4, alpha=8, seed=0)
    refused = "(qkv_proj|gate_up_proj), which the served model does not have"
    with pytest.raises(IncompatibleAdapterError, match=refused):
        inspect_adapter(path, _spec("llama"))


def test_fused_shape_mismatch_is_refused(tmp_path: Path) -> None:
    small = _spec("phi3")
    wide = spec_from_config(
        {**tiny_models.hf_config("phi3").to_dict(), "intermediate_size": 128}, "wide"
    )
    path = write_peft_adapter(
        tmp_path / "a", wide, rank=4, alpha=8, seed=0, target_modules=["gate_up_proj"]
    )
    with pytest.raises(IncompatibleAdapterError, match=r"gate_up_proj: adapter shapes .* out=256"):
        inspect_adapter(path, small)


def test_rank_limit_uses_the_family_projections() -> None:
    spec = _spec("phi3")
    check_ranks([64], spec, "--ranks")  # min(in, out) over the fused projections is 64
    with pytest.raises(ConfigError, match="is 64"):
        check_ranks([65], spec, "--ranks")


def _hf_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    import json

    from safetensors.torch import save_file

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config), "utf-8")
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "supported model_type"),
        (
            {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
            "gemma3_text",
        ),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"hidden_act": "relu"}, "activation 'relu'"),
        ({"layer_types": ["full_attention"]}, "one entry per layer"),
        ({"layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
    ],
)
def test_an_unservable_model_is_refused_at_start_naming_what_is_served(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    from services.worker.model_loader import resolve_model

    config = {**tiny_models.hf_config("llama").to_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        resolve_model(str(_hf_dir(tmp_path, config)), tmp_path / "cache")
