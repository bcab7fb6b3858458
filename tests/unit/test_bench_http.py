"""``plora bench http`` without a cluster: the requests it sends, the figures it derives from
timed samples, the ratios against the targets, where it finds the cluster, and its usage
errors. The bench against a live cluster: tests/integration/test_bench_http_live.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plora import cli
from plora.bench import http as bench
from plora.bench.http import Phase, Sample
from services.common.errors import ConfigError


def test_requests_cycle_prompts_and_models_the_same_for_both_doors() -> None:
    models = [("adapter-a", "adapter-a"), ("Base-Model", "")]
    reqs = bench.build_requests(10, models, 7)
    assert [r.index for r in reqs] == list(range(10))
    assert [r.model for r in reqs[:3]] == ["adapter-a", "Base-Model", "adapter-a"]
    assert [r.adapter_id for r in reqs[:2]] == ["adapter-a", ""]
    assert reqs[8].prompt == reqs[0].prompt == bench.PROMPTS[0]
    assert reqs[9].prompt == bench.PROMPTS[1] != reqs[0].prompt
    assert {r.max_tokens for r in reqs} == {7}


@pytest.mark.parametrize(
    ("concurrency", "per_stream", "minimum", "expected"),
    [(1, 2, 8, 8), (16, 2, 8, 32), (4, 2, 8, 8), (5, 2, 8, 10), (3, 1, 1, 3)],
)
def test_requests_per_phase(concurrency: int, per_stream: int, minimum: int, expected: int):
    assert bench.requests_at(concurrency, per_stream, minimum) == expected


def test_an_answer_without_text_has_its_first_token_at_its_end() -> None:
    """A first token that ends the answer (end of sequence: no text) still gives a TTFT, so
    the client's TTFT covers the requests the gateway's does."""
    silent = bench._answered(3, 1.0, None, 1, [])
    assert silent.first == silent.end and silent.text == "" and silent.completion_tokens == 1
    spoken = bench._answered(4, 1.0, 1.5, 2, ["a", "b"])
    assert spoken.first == 1.5 < spoken.end and spoken.text == "ab"


def test_percentiles_interpolate_between_order_statistics() -> None:
    got = bench.percentiles([0.4, 0.1, 0.3, 0.2, 0.5])
    assert got["p50"] == pytest.approx(0.3)
    assert got["p90"] == pytest.approx(0.46)
    assert got["p99"] == pytest.approx(0.496)
    assert got["mean"] == pytest.approx(0.3)
    assert bench.percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


def _sample(index: int, start: float, first: float, end: float, tokens: int, **kw) -> Sample:
    return Sample(index, start, first, end, tokens, kw.pop("text", "x"), **kw)


def test_a_doors_figures_over_its_rounds() -> None:
    """TTFT from the send to the first text; tokens/s over the sum of the rounds' walls; the
    decode rate per stream counts the tokens after the first; a failed request counts as an
    error and adds neither tokens nor a TTFT."""
    one = Phase(
        "http",
        1,
        2.0,
        [_sample(0, 10.0, 10.5, 11.5, 11), _sample(1, 11.5, 11.7, 12.0, 4)],
    )
    two = Phase(
        "http",
        2,
        3.0,
        [
            _sample(0, 20.0, 20.1, 21.1, 21),
            Sample(1, 21.1, None, 21.2, 0, "", "HTTP RateLimitError: busy"),
        ],
    )
    got = bench.summarize_door([one, two])
    assert got["requests"] == 4 and got["errors"] == 1
    assert got["first_error"] == "HTTP RateLimitError: busy"
    assert got["ttft_s"]["p50"] == pytest.approx(0.2)
    assert got["ttft_s"]["mean"] == pytest.approx((0.5 + 0.2 + 0.1) / 3)
    assert got["completion_tokens"] == 36
    assert got["wall_s"] == pytest.approx(5.0)
    assert got["tokens_per_s"] == pytest.approx(36 / 5.0)
    assert got["tokens_per_s_by_round"] == pytest.approx([15 / 2.0, 21 / 3.0])
    # (11-1)/1.0 = 10, (4-1)/0.3 = 10, (21-1)/1.0 = 20
    assert got["decode_tokens_per_s_per_stream"] == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("http_ttft", "grpc_ttft", "http_rate", "grpc_rate", "ttft_met", "rate_met"),
    [
        (0.110, 0.100, 95.0, 100.0, True, True),  # both at their bounds
        (0.111, 0.100, 94.9, 100.0, False, False),  # both just past them
        (0.050, 0.100, 120.0, 100.0, True, True),
        (0.100, 0.0, 100.0, 0.0, False, False),  # no gRPC figure: no ratio, not met
    ],
)
def test_ratios_are_http_over_grpc_against_the_targets(
    http_ttft, grpc_ttft, http_rate, grpc_rate, ttft_met, rate_met
) -> None:
    def door(ttft: float, rate: float) -> dict:
        return {"ttft_s": {"p50": ttft, "p90": 2 * ttft}, "tokens_per_s": rate}

    got = bench.compare(door(http_ttft, http_rate), door(grpc_ttft, grpc_rate))
    assert got["targets_met"] == {"ttft_p50": ttft_met, "tokens_per_s": rate_met}
    if grpc_ttft:
        assert got["ratios"]["ttft_p50"] == pytest.approx(http_ttft / grpc_ttft)
        assert got["ratios"]["ttft_p90"] == pytest.approx(http_ttft / grpc_ttft)
        assert got["ratios"]["tokens_per_s"] == pytest.approx(http_rate / grpc_rate)
    else:
        assert got["ratios"] == {"ttft_p50": None, "ttft_p90": None, "tokens_per_s": None}


def test_text_mismatches_count_requests_whose_answers_differ() -> None:
    phases = [
        Phase("http", 1, 1.0, [_sample(0, 0, 0, 1, 2, text="a"), _sample(1, 0, 0, 1, 2, text="b")]),
        Phase("grpc", 1, 1.0, [_sample(0, 0, 0, 1, 2, text="a"), _sample(1, 0, 0, 1, 2, text="c")]),
        Phase("grpc", 2, 1.0, [Sample(0, 0, None, 1, 0, "", "gRPC UNAVAILABLE: down")]),
    ]
    assert bench.text_mismatches(phases) == 1


def test_the_doors_alternate_which_goes_first_and_get_the_same_requests() -> None:
    """Round 1 runs HTTP then gRPC, round 2 gRPC then HTTP; each door gets every request."""
    seen: list[tuple[str, int]] = []

    def door(name: str) -> bench.Door:
        def send(req: bench.BenchRequest) -> Sample:
            seen.append((name, req.index))
            return Sample(req.index, 0.0, 0.5, 1.0, req.max_tokens, req.prompt)

        return send

    reqs = bench.build_requests(3, [("m", "m")], 4)
    level = bench.run_level({"http": door("http"), "grpc": door("grpc")}, reqs, 2, 3)
    assert level["order"] == ["http", "grpc", "grpc", "http", "http", "grpc"]
    for name in ("http", "grpc"):
        assert sorted(i for n, i in seen if n == name) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert level[name]["requests"] == 9 and level[name]["completion_tokens"] == 36
    assert level["text_mismatches"] == 0 and level["requests_per_round"] == 3


def test_what_the_services_measured_over_a_doors_phases() -> None:
    """CPU per completion token by process over every phase; the gateway's mean TTFT and the
    workers' mean TPOT from their histograms' sums and counts; a service missing from one
    reading (its endpoint did not answer) adds nothing for that phase."""

    def reading(cpu: dict[str, float], ttft=(0.0, 0), tpot=(0.0, 0)) -> bench.Snapshot:
        out: bench.Snapshot = {}
        for svc, c in cpu.items():
            out[svc] = {"process_cpu_seconds_total": c}
        if "gateway" in out:
            out["gateway"]["plora_gateway_ttft_seconds_sum"] = ttft[0]
            out["gateway"]["plora_gateway_ttft_seconds_count"] = ttft[1]
        for svc in out:
            if svc.startswith("worker"):
                out[svc]["plora_worker_time_per_output_token_seconds_sum"] = tpot[0]
                out[svc]["plora_worker_time_per_output_token_seconds_count"] = tpot[1]
        return out

    spans = [
        (
            reading({"client": 1.0, "gateway": 10.0, "worker-0": 100.0}, (5.0, 10), (1.0, 4)),
            reading({"client": 1.5, "gateway": 11.0, "worker-0": 104.0}, (6.0, 14), (2.2, 8)),
        ),
        (
            reading({"client": 2.0, "gateway": 12.0, "worker-0": 110.0}, (7.0, 20), (3.0, 10)),
            reading({"client": 2.5}),  # the services did not answer after this phase
        ),
    ]
    got = bench.service_figures(spans, 100)
    assert got["cpu_ms_per_token"] == pytest.approx(
        {"client": 10.0, "gateway": 10.0, "worker-0": 40.0}
    )
    assert got["gateway_ttft_s_mean"] == pytest.approx(1.0 / 4)
    assert got["worker_tpot_s_mean"] == pytest.approx(1.2 / 4)
    only_client = bench.service_figures([(reading({"client": 0.0}), reading({"client": 0.2}))], 10)
    assert only_client == {
        "cpu_ms_per_token": {"client": pytest.approx(20.0)},
        "gateway_ttft_s_mean": None,
        "worker_tpot_s_mean": None,
    }


def test_the_cluster_comes_from_one_state_file(tmp_path: Path, monkeypatch) -> None:
    state = tmp_path / "cluster.json"
    state.write_text(
        json.dumps(
            {
                "gateway": "127.0.0.1:5",
                "openai_base_url": "http://127.0.0.1:6/v1",
                "metrics": {"gateway": "http://127.0.0.1:7/metrics"},
            }
        )
    )
    assert bench.cluster_addresses(str(state), None, None) == bench.ClusterAddresses(
        "127.0.0.1:5", "http://127.0.0.1:6/v1", {"gateway": "http://127.0.0.1:7/metrics"}
    )
    monkeypatch.setenv("PLORA_STATE_FILE", str(state))
    # an address given by flag: the state's metrics may be another cluster's, not read
    assert bench.cluster_addresses(None, "h:1", None) == bench.ClusterAddresses(
        "h:1", "http://127.0.0.1:6/v1", {}
    )
    # both flags given: no state file is read
    monkeypatch.setenv("PLORA_STATE_FILE", str(tmp_path / "missing.json"))
    assert bench.cluster_addresses(None, "h:1", "http://h:2/v1") == bench.ClusterAddresses(
        "h:1", "http://h:2/v1", {}
    )
    with pytest.raises(ConfigError, match="missing.json'?: no such state file: start the"):
        bench.cluster_addresses(None, None, None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"gateway": "127.0.0.1:5"}))
    with pytest.raises(ConfigError, match="not a state file of a `plora up` with the HTTP door"):
        bench.cluster_addresses(str(old), None, None)


def test_a_plain_http_url_needs_no_tls_and_half_a_client_pair_is_refused(monkeypatch) -> None:
    assert bench.http_tls_context("http://127.0.0.1:1/v1", None) is None
    monkeypatch.setenv("PLORA_TLS_CLIENT_CERT", "/nowhere/client.pem")
    monkeypatch.delenv("PLORA_TLS_CLIENT_KEY", raising=False)
    with pytest.raises(ConfigError, match="go together"):
        bench.http_tls_context("https://127.0.0.1:1/v1", None)
    monkeypatch.setenv("PLORA_TLS_CLIENT_KEY", "/nowhere/client.key")
    with pytest.raises(ConfigError, match="TLS files for https://127.0.0.1:1/v1"):
        bench.http_tls_context("https://127.0.0.1:1/v1", None)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--concurrency", "1,x"], "argument --concurrency: expected whole numbers > 0"),
        (["--concurrency", "0"], "argument --concurrency: expected whole numbers > 0"),
        (["--rounds", "0"], "argument --rounds: expected a whole number > 0"),
        (["--max-tokens", "-1"], "argument --max-tokens: expected a whole number > 0"),
        (["--timeout", "0"], "argument --timeout: expected seconds"),
        (["--gateway", "host:99999"], "argument --gateway: expected HOST:PORT"),
        (["--base-url", "127.0.0.1:8000"], "argument --base-url: expected a URL"),
        (["--api", "embeddings"], "argument --api: invalid choice"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)
def test_usage_errors(flags: list[str], needle: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "http", "--out", "/dev/null", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: plora bench http") and needle in err, err


def test_without_a_cluster_it_says_how_to_start_one(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("PLORA_STATE_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "http", "--out", str(out)]) == 2
    said = capsys.readouterr().out
    assert "'.plora/cluster.json': no such state file: start the cluster with `plora up`" in said
    assert not out.exists()
