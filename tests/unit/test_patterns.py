"""Tests of services/common/patterns.py and its use by the adapter config: PEFT's own matching
functions (peft 0.21, installed for the tests) against ours on a table of patterns and module
names, pathological patterns that freeze Python's backtracking engine answered in
milliseconds, and the refusal of every pattern the two engines would not read alike."""

from __future__ import annotations

import time
from typing import Any

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key as peft_get_pattern_key

from services.common import patterns
from services.common.errors import InvalidAdapterError
from services.common.peft_config import LoraAdapterConfig, get_pattern_key, parse_adapter_config
from services.common.types import PROJECTION_MODULES

#: Every projection of a 12-layer Llama (two-digit indexes included), plus names of other
#: trunks PEFT's suffix rules must also handle.
NAMES = [
    f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}"
    for i in (0, 1, 2, 10, 11)
    for p in PROJECTION_MODULES
] + [
    "model.language_model.layers.3.self_attn.q_proj",
    "layers.4.mlp.up_proj",
    "q_proj",
]

#: ``target_modules`` / ``exclude_modules`` regex strings (full match).
FULL_MATCH_PATTERNS = [
    r".*\.(q|v)_proj",
    r"model\.layers\.[0-2]\..*",
    "q_proj",
    r".*(q|k)_proj$",
    r".*\.(self_attn|mlp)\..*",
    r"(?i).*Q_PROJ",
    r".*layers\.1\d*\.mlp\.(up|down)_proj",
    "model.layers.1.self_attn.o_proj",  # dots as wildcards, as PEFT reads them
    r".*\.[qkvo]_proj|.*\.gate_proj",
    "",
    "a|",
    r"\w+\.layers\.\d+\.mlp\.\w+",
    r"^model\.layers\.\d\.self_attn\.(?:q|k)_proj$",
    r".*\b(up|down)_proj",
    r"(?s).*",
    r".{10,}q_proj",
    r"[^.]+\.layers\.(\d+)\.mlp\.up_proj",
]

#: ``rank_pattern`` / ``alpha_pattern`` keys (matched as ``(.*\.)?(KEY)$``).
KEYS = [
    "q_proj",
    "layers.1.mlp.up_proj",
    r"layers\.[01]\..*",
    "model.layers.0.self_attn.q_proj",
    "mlp.*",
    r"^model.*",
    "self_attn.(q|k)_proj",
    r"\d\.mlp\.down_proj",
    "layers.1",
    "(?i:Q_PROJ)",
    r"1\d\.self_attn\.v_proj",
    "proj",
    "_proj",
    ".*",
]


def _ours(**kw: Any) -> LoraAdapterConfig:
    return LoraAdapterConfig(r=8, lora_alpha=16, **kw)


@pytest.mark.parametrize("pattern", FULL_MATCH_PATTERNS)
def test_target_modules_string_matches_as_peft_does(pattern: str) -> None:
    ours = _ours(target_modules=pattern)
    theirs = LoraConfig(target_modules=pattern)
    got = {n: ours.targets(n) for n in NAMES}
    want = {n: bool(check_target_module_exists(theirs, n)) for n in NAMES}
    assert got == want


@pytest.mark.parametrize("pattern", FULL_MATCH_PATTERNS)
def test_exclude_modules_string_matches_as_peft_does(pattern: str) -> None:
    targets = list(PROJECTION_MODULES)
    ours = _ours(target_modules=tuple(targets), exclude_modules=pattern)
    theirs = LoraConfig(target_modules=targets, exclude_modules=pattern)
    got = {n: ours.targets(n) for n in NAMES}
    want = {n: bool(check_target_module_exists(theirs, n)) for n in NAMES}
    assert got == want


@pytest.mark.parametrize(
    ("target", "exclude", "layers", "layers_pattern"),
    [
        (["q_proj", "v_proj"], None, None, None),
        (["self_attn.q_proj", "mlp.up_proj"], ["layers.1.mlp.up_proj"], None, None),
        (["model.layers.0.self_attn.q_proj", "down_proj"], None, None, None),
        (["q_proj", "up_proj"], None, [1, 10], None),
        (["q_proj", "up_proj"], None, [0, 3], "layers"),
        (["q_proj", "up_proj"], None, [1], ["language_model", "layers"]),
        (["q_proj", "up_proj"], None, [2], r"lay\w+"),
        (["q_proj", "k_proj"], r".*\.1\d\..*", [0, 1, 10, 11], None),
    ],
)
def test_list_targets_and_layers_match_as_peft_does(
    target: list[str], exclude: Any, layers: list[int] | None, layers_pattern: Any
) -> None:
    ours = parse_adapter_config(
        {
            "peft_type": "LORA",
            "r": 8,
            "target_modules": target,
            "exclude_modules": exclude,
            "layers_to_transform": layers,
            "layers_pattern": layers_pattern,
        }
    )
    theirs = LoraConfig(
        target_modules=target,
        exclude_modules=exclude,
        layers_to_transform=layers,
        layers_pattern=layers_pattern,
    )
    got = {n: ours.targets(n) for n in NAMES}
    want = {n: bool(check_target_module_exists(theirs, n)) for n in NAMES}
    assert got == want


@pytest.mark.parametrize("start", range(len(KEYS)))
def test_pattern_keys_resolve_as_peft_does(start: int) -> None:
    """Every key first in turn (file order decides when several match), then the rest."""
    keys = KEYS[start:] + KEYS[:start]
    for name in NAMES:
        assert get_pattern_key(keys, name) == peft_get_pattern_key(keys, name), name
    for key in KEYS:
        for name in NAMES:
            assert get_pattern_key([key], name) == peft_get_pattern_key([key], name), (key, name)


def test_rank_and_alpha_patterns_resolve_per_module_as_peft_does() -> None:
    rank = {r"layers\.1\..*": 4, "q_proj": 16, "mlp.down_proj": 2}
    alpha = {"v_proj": 3.0, r"1\d\.mlp\..*": 7.0}
    ours = _ours(rank_pattern=rank, alpha_pattern=alpha)
    for name in NAMES:
        r_key = peft_get_pattern_key(rank.keys(), name)
        a_key = peft_get_pattern_key(alpha.keys(), name)
        assert ours.resolve(name) == (rank.get(r_key, 8), alpha.get(a_key, 16.0)), name


PATHOLOGICAL = ["(.|.)*Z", "(.|.|.)*Z", "(a+)+$", "(a|aa)+$", "(.*)*x", r"(\w+\.?)+!"]


@pytest.mark.parametrize("pattern", PATHOLOGICAL)
def test_pathological_patterns_return_in_milliseconds(pattern: str) -> None:
    """``(.|.|.)*Z`` over a 40-character name takes Python's re longer than a run of the
    suite (it froze a gateway); with RE2 every field of a config that carries it answers
    over 2,000-character names in well under the 100 ms a config may hold the gateway."""
    long_names = ["model.layers.0.self_attn." + "a" * 2000, "a" * 2000 + "q_proj", "a" * 2000]
    cfg = _ours(
        target_modules=pattern,
        exclude_modules=pattern,
        rank_pattern={pattern: 4},
        alpha_pattern={pattern: 2.0},
    )
    layered = _ours(target_modules=("a",), layers_to_transform=(0,), layers_pattern=(pattern,))
    t0 = time.perf_counter()
    for name in long_names:
        cfg.targets(name)
        cfg.resolve(name)
        layered.targets(name)
    assert time.perf_counter() - t0 < 0.1


def test_peft_backtracks_where_we_do_not() -> None:
    """What the test above guards against: PEFT's own full match of ``(.|.)*Z`` over a
    21-character module name takes Python's re about a quarter of a second (doubling with
    every character more: 10 s at 26), ours microseconds."""
    name = "model.layers.0.mlp.up"
    t0 = time.perf_counter()
    assert not check_target_module_exists(LoraConfig(target_modules="(.|.)*Z"), name)
    peft_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert not _ours(target_modules="(.|.)*Z").targets(name)
    ours_s = time.perf_counter() - t0
    assert peft_s > 0.05
    assert ours_s < peft_s / 20


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(?=q)q_proj", "lookahead"),
        ("(?!k)._proj", "negative lookahead"),
        (r"(?<=\.)q_proj", "lookbehind"),
        (r"(q)\1_proj", "backreference"),
        ("q_proj++", "possessive"),
        ("(?>q_proj)", "atomic group"),
        (r"q_proj\Z", r"\\Z \(write \$ instead\)"),
        ("a{2000}", "repetition count above 1000"),
        ("q{,3}_proj", r"\{0,n\}"),
        ("[[:alpha:]]+", "POSIX class"),
        ("(q_proj", "not a valid regex"),
        ("[a--z]_proj", "ambiguous: Python's re warns"),
        ("x" * (patterns.MAX_PATTERN_CHARS + 1), "characters long"),
    ],
)
@pytest.mark.parametrize(
    ("field", "config"),
    [
        ("target_modules", lambda p: {"target_modules": p}),
        ("exclude_modules", lambda p: {"target_modules": ["q_proj"], "exclude_modules": p}),
        ("rank_pattern key", lambda p: {"rank_pattern": {p: 4}}),
        ("alpha_pattern key", lambda p: {"alpha_pattern": {p: 4}}),
        (
            "layers_pattern",
            lambda p: {
                "target_modules": ["q_proj"],
                "layers_to_transform": [0],
                "layers_pattern": p,
            },
        ),
    ],
)
def test_patterns_refused_with_the_field_the_pattern_and_why(
    field: str, config: Any, pattern: str, why: str
) -> None:
    with pytest.raises(InvalidAdapterError, match=why) as info:
        parse_adapter_config({"peft_type": "LORA", "r": 8, **config(pattern)})
    message = str(info.value)
    assert message.startswith(f"adapter_config.json: {field} ")
    assert repr(pattern[:20])[:-1] in message
    assert info.value.status_code_name == "INVALID_ARGUMENT"
    assert len(message) < 600


@pytest.mark.parametrize(
    "config",
    [
        {"target_modules": [f"m{i}" for i in range(patterns.MAX_PATTERNS + 1)]},
        {"rank_pattern": {f"m{i}": 4 for i in range(patterns.MAX_PATTERNS + 1)}},
        {"alpha_pattern": {f"m{i}": 4 for i in range(patterns.MAX_PATTERNS + 1)}},
        {"target_modules": ["q_proj"], "layers_to_transform": list(range(2000))},
    ],
    ids=["target_modules", "rank_pattern", "alpha_pattern", "layers_to_transform"],
)
def test_too_many_entries_are_refused(config: dict[str, Any]) -> None:
    field = next(iter(config)) if "layers_to_transform" not in config else "layers_to_transform"
    with pytest.raises(InvalidAdapterError, match=rf"{field} has \d+ entries; at most 1024"):
        parse_adapter_config({"peft_type": "LORA", "r": 8, **config})


def test_as_many_entries_as_allowed_resolve_fast() -> None:
    """A full-name ``rank_pattern`` for every module of a 146-layer model (1,022 keys) resolves
    all 210 modules of a 30-layer model in well under a second."""
    keys = {f"model.layers.{i}.mlp.{p}": 4 for i in range(146) for p in ("up_proj", "down_proj")}
    keys |= {"q_proj": 2, "k_proj": 2}
    cfg = parse_adapter_config({"peft_type": "LORA", "r": 8, "rank_pattern": keys})
    names = [f"model.layers.{i}.self_attn.o_proj" for i in range(30)] * 7
    t0 = time.perf_counter()
    assert {cfg.resolve(n)[0] for n in names} == {8}
    assert time.perf_counter() - t0 < 1.0
