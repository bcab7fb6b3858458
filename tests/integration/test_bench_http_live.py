"""``plora bench http`` against a live cluster (real gateway, workers, model; the official
``openai`` client): the JSON it writes, figures that add up to the gateway's own counts, and
the ratios computed from the figures. Nothing here asserts a speed."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from plora import cli
from plora.bench.http import DOORS, TOKENS_PER_S_RATIO_MIN, TTFT_P50_RATIO_MAX

pytestmark = pytest.mark.slow

DOOR_KEYS = {
    "requests",
    "errors",
    "first_error",
    "ttft_s",
    "completion_tokens",
    "wall_s",
    "tokens_per_s",
    "decode_tokens_per_s_per_stream",
    "tokens_per_s_by_round",
    "cpu_ms_per_token",
    "gateway_ttft_s_mean",
    "worker_tpot_s_mean",
}


def _gateway_counts(cluster: dict) -> dict[str, float]:
    """The gateway's counters this test checks the bench against."""
    text = urllib.request.urlopen(cluster["metrics"]["gateway"], timeout=10).read().decode()
    counts = {"ok": 0.0, "tokens": 0.0, "http_chat": 0.0, "http_completions": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "plora_gateway_requests_total" and s.labels["code"] == "OK":
                counts["ok"] = s.value
            elif s.name == "plora_gateway_generated_tokens_total":
                counts["tokens"] = s.value
            elif s.name == "plora_gateway_http_requests_total" and s.labels["code"] == "200":
                route = s.labels["route"]
                if route == "/v1/chat/completions":
                    counts["http_chat"] = s.value
                elif route == "/v1/completions":
                    counts["http_completions"] = s.value
    return counts


@pytest.mark.parametrize(
    ("client", "api", "levels"),
    [("openai", "chat", [1, 2]), ("httpx", "completions", [2])],
    ids=["openai-chat", "httpx-completions"],
)
def test_bench_http_measures_both_doors_on_the_same_requests(
    cluster: dict, tmp_path: Path, capsys, client: str, api: str, levels: list[int]
) -> None:
    """Every request of every round through both doors succeeds; each door's tokens/s is
    its tokens over its wall, the ratios are HTTP over gRPC of those figures and the
    verdicts follow from them; the requests and tokens it reports are what the gateway
    counted (so both doors were really used); the table prints the ratios."""
    adapters = cluster["adapters"][:2]
    out = tmp_path / "bench_http.json"
    before = _gateway_counts(cluster)
    code = cli.main(
        [
            "bench", "http", "--state-file", str(Path(cluster["root"]) / "cluster.json"),
            "--out", str(out), "--concurrency", ",".join(map(str, levels)),
            "--requests-per-stream", "1", "--min-requests", "2", "--rounds", "2",
            "--max-tokens", "4", "--adapters", ",".join(adapters),
            "--http-client", client, "--api", api,
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    after = _gateway_counts(cluster)
    report = json.loads(out.read_text())

    cfg = report["config"]
    assert cfg["models"] == adapters and cfg["concurrency"] == levels
    assert cfg["openai_base_url"] == cluster["openai_base_url"]
    assert cfg["gateway"] == cluster["gateway"]
    assert cfg["services_read"] == sorted(cluster["metrics"])
    assert cfg["http_client"].startswith("openai " if client == "openai" else "httpx2 ")
    assert report["targets"]["ttft_p50_ratio_max"] == TTFT_P50_RATIO_MAX
    assert report["targets"]["tokens_per_s_ratio_min"] == TOKENS_PER_S_RATIO_MIN
    assert [lv["concurrency"] for lv in report["levels"]] == levels

    total_requests = report["warmup"]["requests"]
    total_tokens = report["warmup"]["completion_tokens"]
    for lv in report["levels"]:
        n = lv["requests_per_round"]
        assert n == max(2, lv["concurrency"])
        assert lv["order"] == ["http", "grpc", "grpc", "http"]
        for door in DOORS:
            f = lv[door]
            assert set(f) == DOOR_KEYS
            assert f["requests"] == 2 * n and f["errors"] == 0 and f["first_error"] == ""
            assert 0 < f["completion_tokens"] <= 4 * f["requests"]
            assert 0 < f["ttft_s"]["p50"] <= f["ttft_s"]["p90"] <= f["ttft_s"]["p99"]
            assert f["wall_s"] > 0 and f["decode_tokens_per_s_per_stream"] > 0
            assert f["tokens_per_s"] == pytest.approx(f["completion_tokens"] / f["wall_s"])
            assert len(f["tokens_per_s_by_round"]) == 2
            assert all(r > 0 for r in f["tokens_per_s_by_round"])
            # what the services measured: the gateway's TTFT is within the client's
            assert 0 < f["gateway_ttft_s_mean"] <= f["ttft_s"]["mean"]
            assert f["worker_tpot_s_mean"] > 0
            assert set(f["cpu_ms_per_token"]) == {"client", *cluster["metrics"]}
            assert f["cpu_ms_per_token"]["client"] > 0
            assert sum(f["cpu_ms_per_token"][w] for w in cluster["workers"]) > 0
            total_requests += f["requests"]
            total_tokens += f["completion_tokens"]
        http, grpc_ = lv["http"], lv["grpc"]
        ttft = http["ttft_s"]["p50"] / grpc_["ttft_s"]["p50"]
        rate = http["tokens_per_s"] / grpc_["tokens_per_s"]
        assert lv["ratios"]["ttft_p50"] == pytest.approx(ttft)
        assert lv["ratios"]["tokens_per_s"] == pytest.approx(rate)
        assert lv["targets_met"] == {
            "ttft_p50": ttft <= TTFT_P50_RATIO_MAX,
            "tokens_per_s": rate >= TOKENS_PER_S_RATIO_MIN,
        }
        assert 0 <= lv["text_mismatches"] <= n
        assert f"{ttft:.3f}x (target <= {TTFT_P50_RATIO_MAX:.2f}x" in printed

    assert after["ok"] - before["ok"] == total_requests
    assert after["tokens"] - before["tokens"] == total_tokens
    route = "http_chat" if api == "chat" else "http_completions"
    assert after[route] - before[route] == total_requests / 2


def test_bench_http_sends_the_key_over_mutual_tls_through_both_doors(
    secure_cluster: dict, tmp_path: Path, capsys, monkeypatch
) -> None:
    """With API keys and mutual TLS, the bench reaches both doors with $PLORA_API_KEY and the
    $PLORA_TLS_* files (HTTPS for the OpenAI door), and every request succeeds; without the
    key, the first call is refused and the bench says so (exit 1)."""
    for name, value in secure_cluster["client_env"].items():
        monkeypatch.setenv(name, value)
    state = str(Path(secure_cluster["root"]) / "cluster.json")
    assert secure_cluster["openai_base_url"].startswith("https://")
    out = tmp_path / "bench_http.json"
    flags = ["bench", "http", "--state-file", state, "--out", str(out), "--concurrency", "1"]
    flags += ["--min-requests", "1", "--rounds", "1", "--max-tokens", "2"]
    code = cli.main(flags)
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["config"]["tls"] is True and report["config"]["api_key"] is True
    (level,) = report["levels"]
    assert level["http"]["errors"] == level["grpc"]["errors"] == 0
    assert level["http"]["completion_tokens"] > 0 and level["grpc"]["completion_tokens"] > 0

    monkeypatch.delenv("PLORA_API_KEY")
    assert cli.main(flags) == 1
    printed = capsys.readouterr().out
    assert "plora bench http: GET " in printed and "401" in printed, printed
    assert "(set PLORA_API_KEY to your API key)" in printed
