"""Tests of services/common/adapters.py: PEFT parsing, validation, loading, refusals.

The scaling / rank_pattern / alpha_pattern / rsLoRA / target_modules logic is checked against
PEFT itself: adapters are built with ``peft.LoraConfig`` on a tiny random Llama, saved with
``save_pretrained``, and PEFT's per-module delta weight must equal ``scaling * B @ A`` from
our loader, module by module.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from plora.make_adapters import write_peft_adapter
from services.common.adapters import (
    AdapterManifest,
    LoraAdapterConfig,
    adapter_sha256,
    get_pattern_key,
    inspect_adapter,
    load_lora_weights,
    parse_adapter_config,
    parse_tensor_key,
    sha256_file,
)
from services.common.errors import (
    AdapterSourceError,
    IncompatibleAdapterError,
    InvalidAdapterError,
)
from services.common.types import PROJECTION_MODULES, SMOLLM2_135M, ModelSpec
from services.worker.adapter_api import AdapterRef
from services.worker.config import WorkerConfig
from services.worker.server import WorkerService
from tests.helpers import TINY, tiny_llama

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
ADAPTERS = DATA / "adapters"
CONFIGS = DATA / "adapter_configs"

SMOLLM2 = SMOLLM2_135M
# Gemma-3-270m: hidden 640, q out 1024 = 4 heads x 256, k/v out 256 = 1 head x 256, 18 layers —
# all read off the adapter headers (test_gemma_spec_matches_headers). intermediate_size (2048)
# and vocab are Gemma-3-270m's config values; the adapters (q/k/v/o only) cannot show them.
GEMMA3_270M = ModelSpec(
    name="gemma-3-270m-it",
    num_layers=18,
    hidden_size=640,
    intermediate_size=2048,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    vocab_size=262144,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def _write_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(d: Path, fn) -> None:
    path = d / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file(fn(dict(tensors)), str(path), metadata={"format": "pt"})


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A valid r=4 adapter on all 7 projections of TINY."""
    return write_peft_adapter(tmp_path / "a", TINY, rank=4, alpha=8, seed=1)


# ---------------------------------------------------------------------------------------
# Pure functions


@pytest.mark.parametrize(
    ("patterns", "key", "expected"),
    [
        (["q_proj"], "model.layers.0.self_attn.q_proj", "q_proj"),
        (
            ["model.layers.0.self_attn.q_proj"],
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.q_proj",
        ),
        (["layers.1.mlp.up_proj"], "model.layers.1.mlp.up_proj", "layers.1.mlp.up_proj"),
        (["layers.1.mlp.up_proj"], "model.layers.11.mlp.up_proj", "model.layers.11.mlp.up_proj"),
        (
            ["proj"],
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.q_proj",
        ),  # not a dot suffix
        ([r"layers\.[0-1]\..*"], "model.layers.1.mlp.down_proj", r"layers\.[0-1]\..*"),
        (
            ["v_proj", "model.layers.0.self_attn.v_proj"],
            "model.layers.0.self_attn.v_proj",
            "v_proj",
        ),  # first wins
        ([], "model.layers.0.mlp.up_proj", "model.layers.0.mlp.up_proj"),
    ],
)
def test_get_pattern_key_matches_peft(patterns, key, expected):
    from peft.utils.other import get_pattern_key as peft_get_pattern_key

    assert get_pattern_key(patterns, key) == expected
    assert peft_get_pattern_key(patterns, key) == expected


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (
            "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight",
            (3, "up_proj", "lora_B", None),
        ),
        ("model.layers.0.self_attn.q_proj.lora_A.weight", (0, "q_proj", "lora_A", None)),
        (
            "base_model.model.model.layers.12.self_attn.o_proj.lora_A.default.weight",
            (12, "o_proj", "lora_A", "default"),
        ),
        ("layers.2.mlp.down_proj.lora_B.default.weight", (2, "down_proj", "lora_B", "default")),
        (
            "base_model.model.model.language_model.layers.1.self_attn.k_proj.lora_A.weight",
            (1, "k_proj", "lora_A", None),
        ),
    ],
)
def test_parse_tensor_key(key, expected):
    assert parse_tensor_key(key) == expected


@pytest.mark.parametrize(
    ("key", "error", "fragment"),
    [
        ("base_model.model.model.embed_tokens.lora_A.weight", InvalidAdapterError, "embed_tokens"),
        ("base_model.model.lm_head.lora_B.weight", InvalidAdapterError, "lm_head"),
        (
            "base_model.model.model.layers.0.input_layernorm.lora_A.weight",
            InvalidAdapterError,
            "input_layernorm",
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
            InvalidAdapterError,
            "DoRA",
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",
            InvalidAdapterError,
            "lora_bias",
        ),
        ("base_model.model.model.embed_tokens.lora_embedding_A", InvalidAdapterError, "plain LoRA"),
        (
            "base_model.model.lm_head.modules_to_save.default.weight",
            InvalidAdapterError,
            "modules_to_save",
        ),
        (
            "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight",
            IncompatibleAdapterError,
            "another architecture",
        ),
        (
            "base_model.model.model.layers.0.self_attn.gate_proj.lora_A.weight",
            IncompatibleAdapterError,
            "self_attn.gate_proj",
        ),
    ],
)
def test_parse_tensor_key_refusals(key, error, fragment):
    with pytest.raises(error, match=fragment):
        parse_tensor_key(key)


BASE_CFG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(
    ("changes", "check"),
    [
        (
            {},
            lambda c: (
                (c.r, c.lora_alpha, c.use_rslora, c.target_modules)
                == (8, 16.0, False, ("q_proj", "v_proj"))
            ),
        ),
        ({"target_modules": r".*\.(q|v)_proj"}, lambda c: c.target_modules == r".*\.(q|v)_proj"),
        (
            {"target_modules": "all-linear"},
            lambda c: all(c.targets(f"model.layers.0.mlp.{p}") for p in ("up_proj", "down_proj")),
        ),
        ({"target_modules": None}, lambda c: c.target_modules == ("q_proj", "v_proj")),
        (
            {"use_rslora": True},
            lambda c: c.scaling("model.layers.0.self_attn.q_proj") == 16 / math.sqrt(8),
        ),
        (
            {"rank_pattern": {"q_proj": 4}},
            lambda c: c.resolve("model.layers.5.self_attn.q_proj") == (4, 16.0),
        ),
        (
            {"alpha_pattern": {"v_proj": 2}},
            lambda c: c.resolve("model.layers.5.self_attn.v_proj") == (8, 2.0),
        ),
        (
            {"layers_to_transform": 1},
            lambda c: (
                c.targets("model.layers.1.self_attn.q_proj")
                and not c.targets("model.layers.0.self_attn.q_proj")
            ),
        ),
        (
            {"exclude_modules": ["model.layers.0.self_attn.q_proj"]},
            lambda c: (
                not c.targets("model.layers.0.self_attn.q_proj")
                and c.targets("model.layers.1.self_attn.q_proj")
            ),
        ),
        (
            {"use_dora": False, "bias": "none", "modules_to_save": None, "lora_bias": False},
            lambda c: c.r == 8,
        ),
        (
            {"some_field_from_peft_9": {"x": 1}, "arrow_config": None, "target_parameters": None},
            lambda c: c.r == 8,
        ),
        ({"init_lora_weights": "gaussian"}, lambda c: c.r == 8),
        ({"modules_to_save": []}, lambda c: c.r == 8),
    ],
)
def test_parse_adapter_config_table(changes, check):
    assert check(parse_adapter_config({**BASE_CFG, **changes}))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"peft_type": "IA3"}, "peft_type"),
        ({"peft_type": None}, "peft_type"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"bias": "lora_only"}, "bias"),
        ({"lora_bias": True}, "lora_bias"),
        ({"alora_invocation_tokens": [1, 2]}, "aLoRA"),
        ({"use_qalora": True}, "QA-LoRA"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"trainable_token_indices": [5]}, "trainable_token_indices"),
        ({"init_lora_weights": "pissa_niter_4"}, "path_initial_model_for_weight_conversion"),
        ({"r": 0}, "r must be"),
        ({"r": "eight"}, "r must be"),
        ({"lora_alpha": None}, "lora_alpha"),
        ({"rank_pattern": {"q_proj": -1}}, "rank_pattern"),
        ({"target_modules": 5}, "target_modules"),
        ({"target_modules": "(unclosed"}, "regex"),
    ],
)
def test_parse_adapter_config_refusals(changes, fragment):
    with pytest.raises(InvalidAdapterError, match=fragment):
        parse_adapter_config({**BASE_CFG, **changes})


def test_real_adapter_configs_parse():
    files = sorted(CONFIGS.glob("*.json")) if CONFIGS.is_dir() else []
    if not files:
        pytest.skip(f"{CONFIGS} absent")
    for f in files:
        raw = json.loads(f.read_text())
        cfg = parse_adapter_config(raw)
        assert cfg.r == raw["r"] and cfg.lora_alpha == raw["lora_alpha"], f.name
        assert set(cfg.target_modules) == set(raw["target_modules"]), f.name


# ---------------------------------------------------------------------------------------
# Against PEFT itself


def _peft_adapter(
    tmp: Path, seed: int = 0, **lora_kwargs
) -> tuple[Path, dict[tuple[int, str], torch.Tensor]]:
    """Save a PEFT LoRA adapter built on tiny_llama; return it and PEFT's delta per module."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(tiny_llama(seed), LoraConfig(init_lora_weights=False, **lora_kwargs))
    deltas = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            parts = name.split(".")
            layer, proj = int(parts[parts.index("layers") + 1]), parts[-1]
            deltas[(layer, proj)] = mod.get_delta_weight("default").detach().clone()
    model.save_pretrained(str(tmp))
    return tmp, deltas


def _strip_prefix(t):
    return {k.removeprefix("base_model.model."): v for k, v in t.items()}


def _add_adapter_name(t):
    return {
        k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        ): v
        for k, v in t.items()
    }


PEFT_CASES = {
    "list-all7-plain": {"r": 8, "lora_alpha": 16, "target_modules": list(PROJECTION_MODULES)},
    "rslora-qv": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj"],
    },
    "patterns-full-and-suffix": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"],
        "rank_pattern": {"model.layers.1.self_attn.q_proj": 2, "down_proj": 6},
        "alpha_pattern": {"v_proj": 3, "model.layers.0.mlp.up_proj": 40},
    },
    "regex-targets-regex-pattern": {
        "r": 4,
        "lora_alpha": 4,
        "target_modules": r".*\.layers\.[02]\.self_attn\.(q|k)_proj",
        "rank_pattern": {r"layers\.2\..*": 3},
    },
    "all-linear-rslora-patterns": {
        "r": 8,
        "lora_alpha": 16,
        "use_rslora": True,
        "target_modules": "all-linear",
        "rank_pattern": {"o_proj": 2},
        "alpha_pattern": {"gate_proj": 5},
    },
    "layers-to-transform": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["k_proj", "gate_proj"],
        "layers_to_transform": [0, 2],
    },
    "exclude-modules": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "o_proj"],
        "exclude_modules": ["model.layers.1.self_attn.o_proj"],
    },
}


@pytest.mark.parametrize("case", sorted(PEFT_CASES))
def test_scaling_matches_peft(tmp_path, case):
    d, deltas = _peft_adapter(tmp_path / case, **PEFT_CASES[case])
    w = load_lora_weights(d, TINY, adapter_id=case, version=1)
    assert set(w.modules) == set(deltas)
    for key, ref in deltas.items():
        m = w.modules[key]
        ours = m.scaling * (m.lora_b @ m.lora_a)
        torch.testing.assert_close(
            ours, ref, rtol=1e-5, atol=1e-6, msg=lambda s, key=key: f"{case} {key}: {s}"
        )
    man = inspect_adapter(d, TINY)
    assert {k: v[1] for k, v in man.modules.items()} == {k: m.scaling for k, m in w.modules.items()}
    assert (
        man.sha256
        == w.sha256
        == adapter_sha256(
            sha256_file(d / "adapter_config.json"), sha256_file(d / "adapter_model.safetensors")
        )
    )


@pytest.mark.parametrize(
    ("variant", "dtype", "tol"),
    [
        ("no-prefix", torch.float32, 1e-6),
        ("adapter-name", torch.float32, 1e-6),
        ("no-prefix+adapter-name", torch.float32, 1e-6),
        ("fp16", torch.float16, 2e-3),
        ("bf16", torch.bfloat16, 2e-2),
    ],
)
def test_key_and_dtype_variants_match_peft(tmp_path, variant, dtype, tol):
    d, deltas = _peft_adapter(
        tmp_path / "v",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"model.layers.2.self_attn.q_proj": 1},
    )

    def fn(t):
        if "no-prefix" in variant:
            t = _strip_prefix(t)
        if "adapter-name" in variant:
            t = _add_adapter_name(t)
        return {k: v.to(dtype) for k, v in t.items()}

    _rewrite_tensors(d, fn)
    for serve_dtype in (torch.float32, torch.float16):
        w = load_lora_weights(d, TINY, adapter_id="v", version=3, dtype=serve_dtype)
        assert set(w.modules) == set(deltas) and w.version == 3
        for key, ref in deltas.items():
            m = w.modules[key]
            assert m.lora_a.dtype == serve_dtype and m.lora_b.dtype == serve_dtype
            ours = m.scaling * (m.lora_b.float() @ m.lora_a.float())
            err = (ours - ref).abs().max().item() / ref.abs().max().item()
            assert err < max(tol, 2e-3 if serve_dtype == torch.float16 else 0), (variant, key, err)


def test_manifest_fields(tmp_path):
    d = write_peft_adapter(
        tmp_path / "m",
        TINY,
        rank=4,
        alpha=8,
        seed=3,
        target_modules=["q_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
    )
    m = inspect_adapter(d, TINY, torch.float16)
    assert isinstance(m, AdapterManifest)
    assert m.rank == 4 and m.alpha == 8 and not m.use_rslora
    assert m.target_modules == ("q_proj", "down_proj")
    assert m.num_modules == len(m.modules) == 2 * TINY.num_layers
    assert m.modules[(0, "q_proj")] == (4, 2.0) and m.modules[(2, "down_proj")] == (2, 4.0)
    per_layer = 4 * (64 + 64) + 2 * (96 + 64)
    assert m.size_bytes == per_layer * TINY.num_layers * 2
    assert m.base_model_name_or_path == TINY.name
    w = load_lora_weights(d, TINY, adapter_id="m", version=1, dtype=torch.float16)
    assert w.nbytes == m.size_bytes and w.rank == 4 and w.target_modules == m.target_modules
    assert json.loads(json.dumps(m.to_dict()))["modules"]["0.q_proj"] == [4, 2.0]


# ---------------------------------------------------------------------------------------
# Real adapters


def _need(path: Path) -> Path:
    if not path.is_dir():
        pytest.skip(f"{path} absent")
    return path


def test_llama32_1b_adapter_refused_on_smollm2():
    d = _need(ADAPTERS / "llama32_1b_desmason")
    with pytest.raises(IncompatibleAdapterError) as e:
        inspect_adapter(d, SMOLLM2)
    msg = str(e.value)
    assert "self_attn.q_proj" in msg and "2048" in msg and "576" in msg, msg
    assert "does not fit the served model 'SmolLM2-135M-Instruct'" in msg, msg
    assert "base_model_name_or_path='meta-llama/Llama-3.2-1B'" in msg, msg
    with pytest.raises(IncompatibleAdapterError):
        load_lora_weights(d, SMOLLM2, adapter_id="x", version=1)


def test_gemma_spec_matches_headers():
    d = _need(ADAPTERS / "gemma3_270m_it_aowei_adapter")
    from safetensors import safe_open

    shapes = {}
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            layer, proj, kind, _ = parse_tensor_key(k)
            shapes[(layer, proj, kind)] = tuple(f.get_slice(k).get_shape())
    assert max(k[0] for k in shapes) + 1 == GEMMA3_270M.num_layers
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        in_f, out_f = GEMMA3_270M.module_shape(proj)
        assert shapes[(0, proj, "lora_A")][1] == in_f and shapes[(0, proj, "lora_B")][0] == out_f


@pytest.mark.parametrize(
    "name",
    [
        "gemma3_270m_it_aowei_adapter",
        "gemma3_270m_it_aowei_seed123",
        "gemma3_270m_it_aowei_curriculum1",
    ],
)
def test_gemma_adapters_parse_and_load(name):
    d = _need(ADAPTERS / name)
    m = inspect_adapter(d, GEMMA3_270M)
    assert m.rank == 4 and m.alpha == 16 and m.num_modules == 4 * 18
    assert m.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert all(v == (4, 4.0) for v in m.modules.values())
    w = load_lora_weights(d, GEMMA3_270M, adapter_id=name, version=1, dtype=torch.bfloat16)
    assert w.modules[(17, "o_proj")].lora_a.shape == (4, 1024)
    assert w.modules[(17, "o_proj")].lora_b.dtype == torch.bfloat16
    assert w.sha256 == m.sha256
    with pytest.raises(IncompatibleAdapterError):
        inspect_adapter(d, SMOLLM2)


# ---------------------------------------------------------------------------------------
# Refusals on directories


def test_refuse_missing_dir(tmp_path):
    with pytest.raises(InvalidAdapterError, match="does not exist"):
        inspect_adapter(tmp_path / "nope", TINY)


def test_refuse_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InvalidAdapterError, match="not a directory"):
        inspect_adapter(f, TINY)


def test_refuse_no_config(good):
    (good / "adapter_config.json").unlink()
    with pytest.raises(InvalidAdapterError, match="no adapter_config.json"):
        inspect_adapter(good, TINY)


def test_refuse_invalid_json(good):
    (good / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidAdapterError, match="not valid JSON"):
        inspect_adapter(good, TINY)


def test_refuse_non_lora(good):
    _write_config(good, peft_type="PREFIX_TUNING")
    with pytest.raises(InvalidAdapterError, match="peft_type"):
        inspect_adapter(good, TINY)


def test_refuse_no_weights(good):
    (good / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidAdapterError, match="no adapter_model.safetensors"):
        inspect_adapter(good, TINY)


def test_refuse_pickle_bin(good):
    (good / "adapter_model.safetensors").rename(good / "adapter_model.bin")
    with pytest.raises(InvalidAdapterError, match="pickle.*convert them to safetensors"):
        inspect_adapter(good, TINY)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
    ],
)
def test_refuse_config_features(good, changes, fragment):
    _write_config(good, **changes)
    with pytest.raises(InvalidAdapterError, match=fragment):
        inspect_adapter(good, TINY)
    with pytest.raises(InvalidAdapterError, match=fragment):
        load_lora_weights(good, TINY, adapter_id="a", version=1)


def test_refuse_dora_tensors(good):
    def fn(t):
        t["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(64)
        return t

    _rewrite_tensors(good, fn)
    with pytest.raises(InvalidAdapterError, match="DoRA"):
        inspect_adapter(good, TINY)


@pytest.mark.parametrize(
    ("module", "shape_a", "shape_b"),
    [
        ("model.embed_tokens", (4, 128), (64, 4)),
        ("lm_head", (4, 64), (128, 4)),
        ("model.layers.0.post_attention_layernorm", (4, 64), (64, 4)),
    ],
)
def test_refuse_lora_outside_projections(good, module, shape_a, shape_b):
    def fn(t):
        t[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(shape_a)
        t[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(shape_b)
        return t

    _rewrite_tensors(good, fn)
    with pytest.raises(InvalidAdapterError, match=module.rsplit(".", 1)[-1]):
        inspect_adapter(good, TINY)


@pytest.mark.parametrize("drop", ["lora_A", "lora_B"])
def test_refuse_unpaired(good, drop):
    key = f"base_model.model.model.layers.1.mlp.up_proj.{drop}.weight"
    _rewrite_tensors(good, lambda t: {k: v for k, v in t.items() if k != key})
    other = "lora_B" if drop == "lora_A" else "lora_A"
    with pytest.raises(
        InvalidAdapterError, match=rf"layers\.1\.mlp\.up_proj has {other}.*but no {drop}"
    ):
        inspect_adapter(good, TINY)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_refuse_nan_inf_at_registration_and_at_load(good, bad):
    """A new user registered an adapter holding NaN: ``inspect_adapter`` read only the header,
    so it registered and every request naming it failed at load. Both now refuse it."""

    def fn(t):
        t["base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight"][3, 1] = bad
        return t

    _rewrite_tensors(good, fn)
    for check in (
        lambda: inspect_adapter(good, TINY),
        lambda: load_lora_weights(good, TINY, adapter_id="a", version=1),
    ):
        with pytest.raises(
            InvalidAdapterError, match=r"layers\.2\.self_attn\.v_proj lora_B holds NaN or Inf"
        ):
            check()


def test_refuse_overflow_in_serving_dtype(good):
    def fn(t):
        t["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"][0, 0] = 1e6
        return t

    _rewrite_tensors(good, fn)
    load_lora_weights(good, TINY, adapter_id="a", version=1, dtype=torch.float32)
    inspect_adapter(good, TINY, torch.float32)
    with pytest.raises(InvalidAdapterError, match="overflows"):
        load_lora_weights(good, TINY, adapter_id="a", version=1, dtype=torch.float16)
    with pytest.raises(InvalidAdapterError, match="overflows"):
        inspect_adapter(good, TINY, torch.float16)


def test_refuse_config_rank_mismatch(good):
    _write_config(good, r=8)
    with pytest.raises(
        InvalidAdapterError, match=r"model\.layers\.0\.self_attn\.q_proj.*r=8.*rank 4"
    ):
        inspect_adapter(good, TINY)


def test_refuse_rank_pattern_mismatch(good):
    _write_config(good, rank_pattern={"model.layers.1.mlp.down_proj": 2})
    with pytest.raises(InvalidAdapterError, match=r"model\.layers\.1\.mlp\.down_proj.*r=2.*rank 4"):
        inspect_adapter(good, TINY)


def test_refuse_untargeted_tensors(good):
    _write_config(good, target_modules=["q_proj"])
    with pytest.raises(InvalidAdapterError, match="does not select"):
        inspect_adapter(good, TINY)


def test_refuse_incompatible_shapes(tmp_path):
    other = ModelSpec(**{**TINY.to_dict(), "hidden_size": 48, "name": "other"})  # type: ignore[arg-type]
    d = write_peft_adapter(
        tmp_path / "o", other, rank=4, alpha=8, seed=0, target_modules=["k_proj"]
    )
    with pytest.raises(IncompatibleAdapterError, match=r"k_proj.*\[4, 48\].*in=64") as e:
        inspect_adapter(d, TINY)
    msg = str(e.value)
    # the served model is named as the one the adapter does not fit, never as the one it was
    # trained for; the config's own claim is quoted as such
    assert "does not fit the served model 'tiny-llama'" in msg, msg
    assert "probably trained for another base model" in msg, msg
    assert "base_model_name_or_path='other'" in msg, msg
    assert "trained for another model (tiny-llama)" not in msg


def test_refuse_incompatible_shapes_whose_config_names_the_served_model(tmp_path):
    """A config naming the served model does not make the message say it was trained for it."""
    other = ModelSpec(**{**TINY.to_dict(), "hidden_size": 48, "name": TINY.name})  # type: ignore[arg-type]
    d = write_peft_adapter(
        tmp_path / "o", other, rank=4, alpha=8, seed=0, target_modules=["k_proj"]
    )
    with pytest.raises(IncompatibleAdapterError) as e:
        inspect_adapter(d, TINY)
    msg = str(e.value)
    assert "does not fit the served model 'tiny-llama'" in msg, msg
    assert "lora_A [4, 48]" in msg and "in=64" in msg, msg  # the shape details stay
    assert "trained for another model (tiny-llama)" not in msg, msg
    assert "the tensor shapes decide" in msg, msg


def test_refuse_incompatible_shapes_without_a_base_name(tmp_path):
    other = ModelSpec(**{**TINY.to_dict(), "hidden_size": 48, "name": "other"})  # type: ignore[arg-type]
    d = write_peft_adapter(
        tmp_path / "o", other, rank=4, alpha=8, seed=0, target_modules=["k_proj"]
    )
    _write_config(d, base_model_name_or_path=None)
    with pytest.raises(IncompatibleAdapterError) as e:
        inspect_adapter(d, TINY)
    msg = str(e.value)
    assert msg.endswith("(it was probably trained for another base model)"), msg


def test_refuse_layer_out_of_range(tmp_path):
    bigger = ModelSpec(**{**TINY.to_dict(), "num_layers": 5})  # type: ignore[arg-type]
    d = write_peft_adapter(
        tmp_path / "b", bigger, rank=4, alpha=8, seed=0, layers=[4], target_modules=["q_proj"]
    )
    with pytest.raises(IncompatibleAdapterError, match="layer index 4.*3 layers") as e:
        inspect_adapter(d, TINY)
    assert "does not fit the served model 'tiny-llama'" in str(e.value)


def test_refuse_foreign_module_names(good):
    def fn(t):
        return {k.replace("model.layers.", "transformer.h."): v for k, v in t.items()}

    _rewrite_tensors(good, fn)
    with pytest.raises(IncompatibleAdapterError, match="no module of the"):
        inspect_adapter(good, TINY)


def test_refuse_truncated_file(good):
    p = good / "adapter_model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(InvalidAdapterError, match="outside the file"):
        inspect_adapter(good, TINY)
    p.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(InvalidAdapterError, match="header length"):
        inspect_adapter(good, TINY)


def test_refuse_int_tensors(good):
    def fn(t):
        t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(
            4, 64, dtype=torch.int8
        )
        return t

    _rewrite_tensors(good, fn)
    with pytest.raises(InvalidAdapterError, match="dtype I8"):
        inspect_adapter(good, TINY)


def test_refuse_changed_file(good):
    sha = inspect_adapter(good, TINY).sha256
    load_lora_weights(good, TINY, adapter_id="a", version=1, expected_sha256=sha)
    _rewrite_tensors(good, lambda t: {k: v * 2 for k, v in t.items()})
    with pytest.raises(InvalidAdapterError, match="changed since registration"):
        load_lora_weights(good, TINY, adapter_id="a", version=1, expected_sha256=sha)


def test_refuse_two_adapter_names(good):
    def fn(t):
        out = {}
        for k, v in t.items():
            out[k.replace(".weight", ".default.weight")] = v
            out[k.replace(".weight", ".other.weight")] = v.clone()
        return out

    _rewrite_tensors(good, fn)
    with pytest.raises(InvalidAdapterError, match="two lora_A tensors|several adapter names"):
        inspect_adapter(good, TINY)


def test_loraadapterconfig_is_frozen():
    c = LoraAdapterConfig(r=4, lora_alpha=8)
    with pytest.raises(AttributeError):
        c.r = 5  # type: ignore[misc]


def test_refuse_no_lora_tensors(good):
    _rewrite_tensors(good, lambda t: {})
    with pytest.raises(InvalidAdapterError, match="holds no LoRA tensors"):
        inspect_adapter(good, TINY)


def test_a_registered_adapter_whose_files_went_away_is_a_failed_precondition(good):
    """At serve time the request is fine and the registered adapter is not: files removed or
    changed after registration give FAILED_PRECONDITION naming the adapter and the fix (they
    gave INVALID_ARGUMENT, which reads as a bad request field)."""
    manifest = inspect_adapter(good, TINY)
    worker = SimpleNamespace(
        spec=TINY, dtype=torch.float32, confinement=None, config=WorkerConfig()
    )
    ref = AdapterRef("mine", 3, str(good), manifest.size_bytes, manifest.sha256)
    assert WorkerService._load_adapter(worker, ref).nbytes > 0  # type: ignore[arg-type]

    _rewrite_tensors(good, lambda t: {k: v * 2 for k, v in t.items()})  # changed since
    with pytest.raises(AdapterSourceError, match=r"'mine' \(v3\) can no longer be loaded") as e:
        WorkerService._load_adapter(worker, ref)  # type: ignore[arg-type]
    assert e.value.status_code_name == "FAILED_PRECONDITION" and "register it again" in str(e.value)

    assert str(good) not in str(e.value)  # no server path goes back to the client

    shutil.rmtree(good)  # removed
    with pytest.raises(AdapterSourceError, match="does not exist") as e:
        WorkerService._load_adapter(worker, ref)  # type: ignore[arg-type]
    assert str(good) not in str(e.value)
