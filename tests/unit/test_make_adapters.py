"""Tests of plora/make_adapters.py: PEFT-exact files, determinism, scale, CLI."""

from __future__ import annotations

import argparse
import json
import math
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from plora.make_adapters import (
    DEFAULT_RELATIVE_DELTA,
    adapter_name,
    add_arguments,
    check_ranks,
    lora_init,
    make_adapter_set,
    max_rank,
    run,
    write_peft_adapter,
)
from services.common.adapters import inspect_adapter, load_lora_weights, sha256_file
from services.common.errors import ConfigError
from services.common.types import PROJECTION_MODULES
from tests.helpers import TINY, tiny_llama


def _peft_deltas(model) -> dict[tuple[int, str], torch.Tensor]:
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            parts = name.split(".")
            out[(int(parts[parts.index("layers") + 1]), parts[-1])] = mod.get_delta_weight(
                "default"
            )
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rank": 8, "alpha": 16},
        {"rank": 4, "alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj"]},
        {
            "rank": 4,
            "alpha": 8,
            "rank_pattern": {"model.layers.1.self_attn.q_proj": 2, "down_proj": 6},
            "alpha_pattern": {"v_proj": 3, "model.layers.0.mlp.up_proj": 40},
        },
        {"rank": 4, "alpha": 4, "layers": [0, 2], "target_modules": ["k_proj", "gate_proj"]},
        {"rank": 4, "alpha": 8, "dtype": torch.float16},
    ],
)
def test_peft_loads_generated_adapter_and_output_changes(tmp_path, kwargs):
    from peft import PeftModel

    d = write_peft_adapter(tmp_path / "a", TINY, seed=7, **kwargs)
    base = tiny_llama(0)
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 2, 3]])
    with torch.no_grad():
        ref = base(ids).logits.clone()
        peft_model = PeftModel.from_pretrained(base, str(d)).eval()
        out = peft_model(ids).logits
    assert not torch.allclose(out, ref, atol=1e-4), "the adapter does not change the output"
    # PEFT's merged delta == scaling * B @ A from our loader, module by module.
    deltas = _peft_deltas(peft_model)
    w = load_lora_weights(d, TINY, adapter_id="a", version=1)
    assert set(deltas) == set(w.modules)
    for key, ref_delta in deltas.items():
        m = w.modules[key]
        torch.testing.assert_close(m.scaling * (m.lora_b @ m.lora_a), ref_delta.float())
        assert torch.count_nonzero(m.lora_b) == m.lora_b.numel()


def test_config_fields_and_keys(tmp_path):
    d = write_peft_adapter(tmp_path / "a", TINY, rank=4, alpha=8, seed=0)
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["bias"]) == (4, 8, 0.0, "none")
    assert cfg["use_rslora"] is False and cfg["use_dora"] is False
    assert cfg["fan_in_fan_out"] is False and cfg["modules_to_save"] is None
    assert cfg["inference_mode"] is True and cfg["base_model_name_or_path"] == TINY.name
    assert cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}
    assert cfg["target_modules"] == list(PROJECTION_MODULES)
    tensors = load_file(str(d / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * TINY.num_layers
    a = tensors["base_model.model.model.layers.2.mlp.down_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.2.mlp.down_proj.lora_B.weight"]
    assert a.shape == (4, TINY.intermediate_size) and b.shape == (TINY.hidden_size, 4)
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (
        TINY.num_kv_heads * TINY.head_dim,
        4,
    )


def test_deterministic_from_seed(tmp_path):
    a = write_peft_adapter(tmp_path / "a", TINY, rank=8, alpha=16, seed=11)
    b = write_peft_adapter(tmp_path / "b", TINY, rank=8, alpha=16, seed=11)
    c = write_peft_adapter(tmp_path / "c", TINY, rank=8, alpha=16, seed=12)
    sha = [sha256_file(p / "adapter_model.safetensors") for p in (a, b, c)]
    assert sha[0] == sha[1] != sha[2]
    assert (a / "adapter_config.json").read_bytes() == (b / "adapter_config.json").read_bytes()


@pytest.mark.parametrize(("r", "alpha", "rslora"), [(4, 8, False), (64, 16, False), (16, 32, True)])
def test_relative_delta_scale(r, alpha, rslora):
    """||scaling B A x|| ~ relative_delta * sqrt(out) * rms(x), whatever r and alpha."""
    gen = torch.Generator().manual_seed(0)
    in_f, out_f = 576, 1536
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    a, b = lora_init(in_f, out_f, r, scaling, gen)
    x = torch.randn(256, in_f, generator=gen) * 3.0
    dy = scaling * (x @ a.T @ b.T)
    ratio = dy.norm(dim=1) / (math.sqrt(out_f) * x.pow(2).mean(dim=1).sqrt())
    assert 0.6 * DEFAULT_RELATIVE_DELTA < ratio.mean().item() < 1.5 * DEFAULT_RELATIVE_DELTA


def test_adapter_set_names_and_ranks(tmp_path):
    paths = make_adapter_set(tmp_path, TINY, count=6, ranks=[8, 16, 4], seed=3)
    assert [p.name for p in paths] == [
        "adapter-000-r8",
        "adapter-001-r16",
        "adapter-002-r4",
        "adapter-003-r8",
        "adapter-004-r16",
        "adapter-005-r4",
    ]
    assert adapter_name(7, 32) == "adapter-007-r32"
    manifests = [inspect_adapter(p, TINY) for p in paths]
    assert [m.rank for m in manifests] == [8, 16, 4, 8, 16, 4]
    assert all(m.alpha == 2 * m.rank for m in manifests)
    assert len({m.sha256 for m in manifests}) == 6
    again = make_adapter_set(tmp_path / "again", TINY, count=2, ranks=[8, 16, 4], seed=3)
    assert [inspect_adapter(p, TINY).sha256 for p in again] == [m.sha256 for m in manifests[:2]]


def test_write_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="target_modules"):
        write_peft_adapter(tmp_path, TINY, rank=4, alpha=8, seed=0, target_modules=["lm_head"])
    with pytest.raises(ValueError, match="rank"):
        write_peft_adapter(tmp_path, TINY, rank=0, alpha=8, seed=0)
    with pytest.raises(ValueError, match="layers"):
        write_peft_adapter(tmp_path, TINY, rank=4, alpha=8, seed=0, layers=[TINY.num_layers])


def _cli(tmp_path, *flags: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser of ``plora make-adapters`` and ``flags`` parsed with a tiny model saved under
    ``tmp_path`` (``--out tmp_path/adapters``)."""
    model_dir = tmp_path / "tiny-model"
    tiny_llama(0).save_pretrained(str(model_dir))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--out", str(tmp_path / "adapters"), "--model", str(model_dir),
            "--cache-dir", str(tmp_path / "cache"), *flags,
        ]
    )  # fmt: skip
    return parser, args


def test_cli(tmp_path, capsys):
    out = tmp_path / "adapters"
    parser, args = _cli(
        tmp_path, "--count", "3", "--ranks", "4,8", "--seed", "5",
        "--target-modules", "q_proj,v_proj", "--dtype", "bfloat16",
    )  # fmt: skip
    assert run(args) == 0
    summary = json.loads((out / "adapters.json").read_text())
    assert [a["adapter_id"] for a in summary["adapters"]] == [
        "adapter-000-r4",
        "adapter-001-r8",
        "adapter-002-r4",
    ]
    assert summary["target_modules"] == ["q_proj", "v_proj"]
    spec = TINY
    m = inspect_adapter(out / "adapter-001-r8", spec)
    assert m.target_modules == ("q_proj", "v_proj") and m.rank == 8
    assert (
        load_file(str(out / "adapter-001-r8" / "adapter_model.safetensors"))[
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        ].dtype
        == torch.bfloat16
    )
    printed = capsys.readouterr().out
    assert "adapter-002-r4" in printed and "rank" in printed
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x", "--ranks", "8,zero"])


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002], ids=lambda u: f"umask-{u:03o}")
def test_adapter_files_get_the_mode_open_gives_under_the_umask(tmp_path, umask):
    """The workers may run as another user: both files get the mode ``open()`` gives a new
    file (0644 under umask 022), not the 0600 that ``tempfile.mkstemp`` and safetensors'
    ``save_file`` (0.8, through a temporary file of its own) leave."""
    old = os.umask(umask)
    try:
        d = write_peft_adapter(tmp_path / "a", TINY, rank=4, alpha=8, seed=0)
        (tmp_path / "by-open").write_text("x")
        again = write_peft_adapter(d, TINY, rank=4, alpha=8, seed=1)  # overwrite in place
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "by-open").stat().st_mode) == expected
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert stat.S_IMODE((again / name).stat().st_mode) == expected, name
    assert sorted(p.name for p in d.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]  # no temporary file left behind


def test_a_rank_above_the_model_s_is_refused_before_anything_is_written(tmp_path, capsys):
    """``plora make-adapters --ranks 100000`` allocated tensors until the OOM killer ended it; a
    rank above min(in_features, out_features) of a target module is now refused up front
    (exit 2), naming the flag, the largest rank and why."""
    assert max_rank(TINY) == 32  # k_proj / v_proj: 64 -> 32
    assert max_rank(TINY, ["q_proj"]) == 64
    check_ranks([1, 32], TINY, "--ranks")
    with pytest.raises(ConfigError, match=r"^--ranks 33: the largest rank tiny-llama allows is 32"):
        check_ranks([8, 33], TINY, "--ranks")

    _, args = _cli(tmp_path, "--count", "1", "--ranks", "100000")
    capsys.readouterr()  # save_pretrained's progress bar
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("plora make-adapters: --ranks 100000: the largest rank ")
    assert "is 32, min(in_features, out_features) of k_proj (64 x 32)" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "adapters").exists()


def test_phi3_adapters_target_its_fused_projections(tmp_path, capsys):
    """On Phi-3 the adapters go on its own projections (the fused ``qkv_proj`` and
    ``gate_up_proj``, ``o_proj``, ``down_proj``): PEFT loads them onto the model and they equal
    our loader's view; a split name it lacks is refused (exit 2) naming its projections."""
    from peft import PeftModel

    from services.worker.model_loader import spec_from_dir
    from tests import tiny_models

    base = tiny_models.save("phi3", tmp_path / "phi3")
    spec = spec_from_dir(tmp_path / "phi3")
    _, args = _cli(tmp_path, "--model", str(tmp_path / "phi3"), "--count", "1", "--ranks", "8")
    assert run(args) == 0
    summary = json.loads((tmp_path / "adapters" / "adapters.json").read_text())
    assert summary["target_modules"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    d = tmp_path / "adapters" / "adapter-000-r8"
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 2, 3]])
    with torch.no_grad():
        ref = base(ids).logits.clone()
        peft_model = PeftModel.from_pretrained(base, str(d)).eval()
        assert not torch.allclose(peft_model(ids).logits, ref, atol=1e-4)
    deltas = _peft_deltas(peft_model)
    w = load_lora_weights(d, spec, adapter_id="a", version=1)
    assert set(deltas) == set(w.modules)
    assert {proj for _, proj in deltas} == set(summary["target_modules"])
    for key, ref_delta in deltas.items():
        m = w.modules[key]
        torch.testing.assert_close(m.scaling * (m.lora_b @ m.lora_a), ref_delta.float())

    capsys.readouterr()
    _, args = _cli(tmp_path, "--model", str(tmp_path / "phi3"), "--target-modules", "q_proj")
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "--target-modules q_proj" in err and "qkv_proj,o_proj,gate_up_proj,down_proj" in err
