"""Tests of plora.traces: synthetic CSVs in tmp_path (exact values) and the real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plora.traces import (
    TRACE_FORMATS,
    Arrival,
    Trace,
    load_trace,
    map_keys_to_adapters,
)

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"


def _real(name: str) -> Path:
    p = DATA / name
    if not p.exists():
        pytest.skip(f"real trace {p} absent (shared/data not laid out next to the repo)")
    return p


# ---------------------------------------------------------------- synthetic files, exact values
ALIBABA_HEADER = ",".join(
    [
        "gmt_create",
        "predict_type",
        "predict_status",
        "exec_time_seconds",
        "groupId",
        "prompt_length",
        "negative_prompt_length",
        "num_images_per_prompt",
        "num_inference_steps",
        "checkpoint_model_version_id",
        "num_lora",
    ]
)
ALIBABA_CSV = (
    ALIBABA_HEADER
    + """
2024-11-15 16:57:50,TXT_2_IMG,SUCCEED,32.0,G1,63.0,26.0,1.0,30.0,M0,0
2024-11-15 16:57:52,TXT_2_IMG,SUCCEED,32.0,G2,,26.0,1.0,30.0,M0,0
2024-11-15 16:57:52,TXT_2_IMG,FAILED,32.0,G1,10.0,26.0,1.0,30.0,M0,0
2024-11-15 16:58:50,TXT_2_IMG,SUCCEED,32.0,G3,5.0,26.0,1.0,30.0,M0,0
"""
)

AZ2019_CSV = """HashOwner,HashApp,HashFunction,Trigger,480,481,482
o,a,f1,http,2,0,1
o,a,f2,timer,0,4,0
"""

AZ2021_CSV = """app,func,end_timestamp,duration
a,x,10.0,1.0
a,y,3.0,0.5
b,x,1.0,2.0
a,x,5.0,0.0
"""

LLM_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.0000000,100,200
"""


@pytest.mark.parametrize(
    ("fmt", "text", "times", "keys", "prompt", "output"),
    [
        (
            "alibaba",
            ALIBABA_CSV,
            [0.0, 2.0, 2.0, 60.0],
            ["G1", "G2", "G1", "G3"],
            [63, 128, 10, 5],
            [64, 64, 64, 64],
        ),
        (
            # minute 480: n=2 -> 15 s, 45 s; minute 481: n=4 -> 67.5, 82.5, 97.5, 112.5;
            # minute 482: n=1 -> 150 s
            "azure2019",
            AZ2019_CSV,
            [15.0, 45.0, 67.5, 82.5, 97.5, 112.5, 150.0],
            ["f1", "f1", "f2", "f2", "f2", "f2", "f1"],
            [128] * 7,
            [64] * 7,
        ),
        (
            # start = end - duration, negative clamps to 0, output sorted
            "azure2021",
            AZ2021_CSV,
            [0.0, 2.5, 5.0, 9.0],
            ["b/x", "a/y", "a/x", "a/x"],
            [128] * 4,
            [64] * 4,
        ),
    ],
)
def test_load_synthetic_exact(tmp_path, fmt, text, times, keys, prompt, output):
    p = tmp_path / "t.csv"
    p.write_text(text)
    tr = load_trace(p, fmt)
    np.testing.assert_allclose(tr.times, times)
    assert list(tr.adapter_keys) == keys
    assert tr.prompt_tokens.tolist() == prompt
    assert tr.output_tokens.tolist() == output
    assert tr.fmt == fmt
    assert tr.arrivals()[0] == Arrival(times[0], keys[0], prompt[0], output[0])


def test_azure_llm2023_synthetic_zipf_is_seeded(tmp_path):
    p = tmp_path / "llm.csv"
    p.write_text(LLM_CSV)
    a = load_trace(p, "azure_llm2023", seed=3, num_keys=5)
    b = load_trace(p, "azure_llm2023", seed=3, num_keys=5)
    np.testing.assert_allclose(a.times, [0.0, 0.052, 1.02004], atol=1e-6)
    assert a.prompt_tokens.tolist() == [4808, 3180, 100]
    assert a.output_tokens.tolist() == [10, 8, 200]
    assert list(a.adapter_keys) == list(b.adapter_keys)
    assert all(k in {f"k{i:04d}" for i in range(5)} for k in a.keys)


def test_azure2019_full_day_columns_load_unchanged(tmp_path):
    """A full-day file has minute columns 1..1440; t = 0 at minute 1."""
    header = "HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(m) for m in range(1, 1441))
    counts = np.zeros(1440, dtype=int)
    counts[0] = 1  # minute 1 -> 30 s
    counts[1439] = 3  # minute 1440 -> 1439*60 + 10, 30, 50
    row = "o,a,fn,http," + ",".join(map(str, counts))
    empty = "o,a,quiet,timer," + ",".join("0" for _ in range(1440))
    p = tmp_path / "invocations_per_function_md.anon.d01.csv"
    p.write_text(header + "\n" + row + "\n" + empty + "\n")
    tr = load_trace(p, "azure2019")
    np.testing.assert_allclose(tr.times, [30.0, 86350.0, 86370.0, 86390.0])
    assert tr.keys == ("fn",)


@pytest.mark.parametrize(
    ("kwargs", "times", "keys"),
    [
        ({}, [0, 1, 2, 3, 4, 5], list("aabacb")),
        ({"drop_top": 1}, [2, 4, 5], list("bcb")),  # a is busiest
        ({"drop_top": 2}, [4], ["c"]),  # then b (2) beats c (1)
        ({"time_scale": 2.0}, [0, 0.5, 1, 1.5, 2, 2.5], list("aabacb")),
        ({"start": 2.0, "duration": 2.0}, [0, 1], list("ba")),
        ({"time_scale": 2.0, "start": 1.0}, [0, 0.5, 1, 1.5], list("bacb")),
        ({"drop_top": 1, "time_scale": 2.0, "duration": 2.0}, [1], ["b"]),
    ],
)
def test_post_processing_order(tmp_path, kwargs, times, keys):
    p = tmp_path / "a.csv"
    p.write_text(
        "app,func,end_timestamp,duration\n"
        + "".join(f"{k},f,{t},0\n" for t, k in enumerate("aabacb"))
    )
    tr = load_trace(p, "azure2021", **kwargs)
    np.testing.assert_allclose(tr.times, times)
    assert [k.split("/")[0] for k in tr.adapter_keys] == keys
    assert set(tr.keys) == set(tr.adapter_keys)  # vocabulary shrinks with the data


@pytest.mark.parametrize(
    ("fmt", "text", "match"),
    [
        ("nope", "x\n", "unknown trace format"),
        ("azure2021", "app,func,end\n", "missing column"),
        ("alibaba", "gmt_create\n", "missing column"),
        ("azure2019", "HashOwner,HashApp,HashFunction,Trigger\n", "no minute columns"),
    ],
)
def test_bad_inputs_raise(tmp_path, fmt, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_trace(p, fmt)


def test_bad_options_raise(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text(AZ2021_CSV)
    with pytest.raises(ValueError, match="time_scale"):
        load_trace(p, "azure2021", time_scale=0)
    with pytest.raises(ValueError, match="duration"):
        load_trace(p, "azure2021", duration=-1)


def test_from_arrays_sorts_and_rejects_unsorted():
    tr = Trace.from_arrays([3.0, 1.0, 2.0], ["x", "y", "x"], [5, 6, 7], 9)
    assert tr.times.tolist() == [1.0, 2.0, 3.0]
    assert list(tr.adapter_keys) == ["y", "x", "x"]
    assert tr.prompt_tokens.tolist() == [6, 7, 5]
    assert tr.key_counts() == {"x": 2, "y": 1}
    assert tr.keys_by_popularity() == ["x", "y"]
    with pytest.raises(ValueError, match="sorted"):
        Trace(
            np.array([2.0, 1.0]),
            np.zeros(2, np.int32),
            ("a",),
            np.ones(2, np.int32),
            np.ones(2, np.int32),
        )


def test_remap_keys_merges():
    tr = Trace.from_arrays([0, 1, 2], ["a", "b", "c"])
    m = tr.remap_keys({"a": "A", "b": "A"})
    assert list(m.adapter_keys) == ["A", "A", "c"]
    assert m.key_counts() == {"A": 2, "c": 1}


# ---------------------------------------------------------------- map_keys_to_adapters
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_map_keys_to_adapters_rank_wraps_and_is_order_free(seed):
    keys = [f"key{i}" for i in range(7)]
    adapters = ["r4", "r8", "r16"]
    m = map_keys_to_adapters(keys, adapters, seed)
    assert set(m) == set(keys)
    assert len({m[k] for k in keys[:3]}) == 3  # the 3 most popular keys get distinct adapters
    for i, k in enumerate(keys):
        assert m[k] == m[keys[i % 3]]  # rank i shares with rank i mod K
    assert m == map_keys_to_adapters(keys, list(reversed(adapters)), seed)


def test_map_keys_to_adapters_seed_changes_assignment():
    keys = [f"k{i}" for i in range(20)]
    adapters = [f"a{i}" for i in range(20)]
    maps = {tuple(map_keys_to_adapters(keys, adapters, s).values()) for s in range(5)}
    assert len(maps) > 1
    with pytest.raises(ValueError):
        map_keys_to_adapters(keys, [], 0)


# ---------------------------------------------------------------- real files
@pytest.mark.parametrize(
    ("name", "fmt", "n", "n_keys", "duration_range"),
    [
        ("alibaba_genai2026_lora_requests_nov.csv", "alibaba", 14279, 2380, (1.2e6, 1.4e6)),
        ("azure_functions_2019_500fn_first4h.csv", "azure2019", None, 446, (14390, 14400)),
        ("azure_functions_2021_first998.csv", "azure2021", 998, 49, (6400, 6486)),
        ("azure_llm_2023_code.csv", "azure_llm2023", 8819, None, (3400, 3500)),
    ],
)
def test_real_files_load(name, fmt, n, n_keys, duration_range):
    tr = load_trace(_real(name), fmt)
    if n is not None:
        assert len(tr) == n
    if n_keys is not None:
        assert len(tr.keys) == n_keys
    assert tr.times[0] >= 0
    assert bool(np.all(np.diff(tr.times) >= 0))
    assert duration_range[0] <= tr.duration <= duration_range[1]
    assert int(tr.prompt_tokens.min()) >= 1 and int(tr.output_tokens.min()) >= 1


def test_real_azure2019_totals_and_hot_function():
    import csv

    p = _real("azure_functions_2019_500fn_first4h.csv")
    with p.open() as fh:
        rows = list(csv.reader(fh))[1:]
    total = sum(sum(int(v) for v in r[4:]) for r in rows)
    tr = load_trace(p, "azure2019")
    assert len(tr) == total
    top = tr.keys_by_popularity()[0]
    share = tr.key_counts()[top] / len(tr)
    assert 0.6 < share < 0.66  # the README's "one event-triggered function carries 63 %"
    dropped = load_trace(p, "azure2019", drop_top=1)
    assert top not in dropped.keys and len(dropped) == len(tr) - tr.key_counts()[top]
    assert len(tr.keys) == 446  # 54 of the 500 functions have no invocation in these 4 h


def test_real_alibaba_scaled_slice():
    p = _real("alibaba_genai2026_lora_requests_nov.csv")
    full = load_trace(p, "alibaba", time_scale=60.0)
    part = load_trace(p, "alibaba", time_scale=60.0, start=1000.0, duration=500.0)
    expect = int(np.sum((full.times >= 1000.0) & (full.times < 1500.0)))
    assert len(part) == expect
    assert part.times.max() < 500.0 if len(part) else True


def test_all_formats_listed():
    assert set(TRACE_FORMATS) == {"alibaba", "azure2019", "azure2021", "azure_llm2023"}
