"""The OpenAI HTTP door under a flood and a stop, on a real cluster (``plora up``: Redis, the
predictor, two workers with the real model, the gateway) whose gateway serves at most
:data:`LIMIT` streams at once: 200 SSE streams opened at once, then a SIGTERM to the gateway
while a stream runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plora.v1 import worker_pb2
from tests.conftest import _pid_alive, run_plora_up
from tests.helpers import worker_stub

pytestmark = pytest.mark.slow

#: The gateway's ``--max-concurrent-requests`` (``PLORA_MAX_CONCURRENT_REQUESTS``).
LIMIT = 150
#: Streams opened at once.
FLOOD = 200
#: Tokens per stream: the admitted streams last seconds (about three rounds of each worker's
#: batch of 32, on one CPU thread per worker), far longer than a refusal may take.
MAX_TOKENS = 8
#: ``plora serve gateway``'s grace period on SIGTERM (:meth:`GatewayService.stop`), seconds.
GRACE_S = 5.0
#: A prompt the model answers greedily at length (hundreds of tokens): a stream that is
#: still running when the gateway stops.
LONG_PROMPT = "List the numbers from 1 to 1000, one per line:"


@pytest.fixture(scope="module")
def limited_cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    """``plora up`` with two workers, two demo adapters, the HTTP door on a free port and the
    gateway's limit at :data:`LIMIT` streams."""
    yield from run_plora_up(
        tmp_path_factory.mktemp("openai-flood"),
        model_dir,
        ["--workers", "2", "--demo-adapters", "2", "--pool-bytes", "128MiB", "--http-port", "0"],
        {"PLORA_MAX_CONCURRENT_REQUESTS": str(LIMIT)},
    )


@dataclass
class Outcome:
    """One request of the flood: its HTTP status, seconds from its start to its end, and its
    SSE lines (200) or its error object (anything else)."""

    status: int
    seconds: float
    lines: list[str] = field(default_factory=list)
    error: object = None


async def _one(client: httpx2.AsyncClient, url: str, model: str) -> Outcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    began = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                error = json.loads(await response.aread())
                return Outcome(response.status_code, time.perf_counter() - began, error=error)
            lines = [line async for line in response.aiter_lines() if line]
    except httpx2.HTTPError as exc:  # reported as an outcome: the test names what failed
        return Outcome(-1, time.perf_counter() - began, error=repr(exc))
    return Outcome(200, time.perf_counter() - began, lines)


def _flood(base_url: str, models: list[str], n: int) -> tuple[list[Outcome], float]:
    """``n`` streamed chat completions opened at once (one connection each, from one event
    loop), taking turns over ``models``; their outcomes and the seconds the whole took."""

    async def run() -> list[Outcome]:
        limits = httpx2.Limits(max_connections=n, max_keepalive_connections=0)
        timeout = httpx2.Timeout(120.0, connect=30.0)
        async with httpx2.AsyncClient(limits=limits, timeout=timeout) as client:
            url = f"{base_url}/chat/completions"
            return await asyncio.gather(
                *(_one(client, url, models[i % len(models)]) for i in range(n))
            )

    began = time.perf_counter()
    outcomes = asyncio.run(run())
    return outcomes, time.perf_counter() - began


def _check_completed(outcome: Outcome) -> None:
    """A whole stream: chunks, the last with a finish_reason, then ``data: [DONE]``."""
    lines = outcome.lines
    assert lines and all(line.startswith("data: ") for line in lines), lines[:3]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert not [e for e in events if "error" in e], events
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop"), events[-1]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


def _metrics(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of a service's metrics page, by name and labels."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _eventually(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _workers_idle(cluster: dict) -> bool:
    """Whether no worker of ``cluster`` runs or queues a sequence (each asked directly)."""
    for address in cluster["workers"].values():
        status = worker_stub(cluster, address).GetWorkerStatus(
            worker_pb2.GetWorkerStatusRequest(), timeout=5
        )
        if status.running or status.queue_length:
            return False
    return True


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_200_sse_streams_against_a_limit_of_150(limited_cluster: dict) -> None:
    """Each stream either completes (chunks, a finish_reason, ``data: [DONE]``) or is refused
    429 with OpenAI's ``rate_limit_error`` naming the limit; nothing else. Every place was
    used (a refusal means :data:`LIMIT` streams were admitted), no refusal waited for one
    (each came before the first admitted stream ended), the counters agree with what the
    client saw, and afterwards no sequence runs on any worker, the in-flight gauge is 0 and a
    new request is served."""
    cluster = limited_cluster
    base_url = cluster["openai_base_url"]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    base_model = client.models.list().data[0].id  # listed first
    models = [cluster["adapters"][0], base_model]
    # one stream per model first: the first steps and the lazy imports are not the flood's
    warm, _ = _flood(base_url, models, 2)
    assert [o.status for o in warm] == [200, 200], warm
    before = _metrics(cluster["metrics"]["gateway"])

    outcomes, took = _flood(base_url, models, FLOOD)

    by_status: dict[int, list[Outcome]] = {}
    for o in outcomes:
        by_status.setdefault(o.status, []).append(o)
    summary = {status: len(os_) for status, os_ in by_status.items()}
    others = [o for o in outcomes if o.status not in (200, 429)]
    assert not others, f"{summary}; first other: {others[0]}"
    completed, refused = by_status.get(200, []), by_status.get(429, [])
    for o in completed:
        _check_completed(o)
    for o in refused:
        assert isinstance(o.error, dict)
        error = o.error["error"]
        assert error["type"] == "rate_limit_error", error
        assert f"limit of {LIMIT} concurrent" in error["message"], error
        assert "--max-concurrent-requests" in error["message"], error
    # a refusal happens only while LIMIT streams are admitted, and each admitted one completed
    assert refused and len(completed) >= LIMIT, summary
    assert len(refused) <= FLOOD - LIMIT, summary

    refusal_ms = [o.seconds * 1000 for o in refused]
    shortest = min(o.seconds for o in completed)
    figures = (
        f"{FLOOD} SSE streams at once, limit {LIMIT}: {len(completed)} completed, "
        f"{len(refused)} refused 429 in {took:.1f} s; 429 answers p50 "
        f"{_percentile(refusal_ms, 0.5):.0f} ms, p99 {_percentile(refusal_ms, 0.99):.0f} ms, "
        f"max {max(refusal_ms):.0f} ms; shortest completed stream {shortest:.1f} s"
    )
    print(figures)
    assert max(refusal_ms) / 1000 < shortest, figures  # no refusal waited for a place

    after = _metrics(cluster["metrics"]["gateway"])

    def grew(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    rejected = grew("plora_gateway_requests_rejected_total", reason="max_concurrent_requests")
    assert rejected == len(refused)
    http = "plora_gateway_http_requests_total"
    assert grew(http, route="/v1/chat/completions", code="429") == len(refused)
    assert grew(http, route="/v1/chat/completions", code="200") == len(completed)
    assert after[("plora_gateway_requests_in_flight", frozenset())] == 0
    _eventually(lambda: _workers_idle(cluster), "every worker to have no sequence", 5.0)

    chunks = list(
        client.chat.completions.create(
            model=cluster["adapters"][0],
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_sigterm_ends_a_running_sse_stream_with_an_error_event_and_the_gateway_exits(
    limited_cluster: dict,
) -> None:
    """SIGTERM to the gateway while an SSE stream runs: the stream ends a second before the
    grace period with an ``error`` event naming the shutdown (the official client raises
    ``openai.APIError`` with it), the worker drops the sequence, the process exits, and
    ``plora up`` starts the gateway again on the same HTTP port, which serves."""
    cluster = limited_cluster
    base_url = cluster["openai_base_url"]
    pid = cluster["pids"]["gateway"]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=cluster["adapters"][0],
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    text = ""
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        if text:
            break
    os.kill(pid, signal.SIGTERM)
    stopped_at = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            assert chunk.choices[0].finish_reason is None, "the stream was not cut"
    ended_s = time.monotonic() - stopped_at
    assert "the gateway is shutting down and ended this stream" in err.value.message
    assert isinstance(err.value.body, dict) and err.value.body["type"] == "service_unavailable"
    _eventually(lambda: _workers_idle(cluster), "the worker to drop the cut sequence", 2.0)
    _eventually(lambda: not _pid_alive(pid), "the gateway to exit", GRACE_S + 5.0)
    exited_s = time.monotonic() - stopped_at
    print(f"SIGTERM: stream ended after {ended_s:.2f} s, gateway exited after {exited_s:.2f} s")
    # the streams still running are cut a second before the grace period ends, at their next
    # token; the process then stops its servers and exits (about a second on 2 CPU cores)
    assert GRACE_S - 1.5 < ended_s < GRACE_S, ended_s
    assert exited_s < GRACE_S + 2.0, exited_s

    # plora up starts it again on the same ports; the state file names the new process
    state_file = Path(cluster["root"]) / "cluster.json"

    def restarted() -> bool:
        new_pid = json.loads(state_file.read_text())["pids"]["gateway"]
        if new_pid == pid:
            return False
        cluster["pids"]["gateway"] = new_pid  # the fixture's teardown checks it ended
        return True

    _eventually(restarted, "plora up to start the gateway again", 60.0)
    health = base_url.removesuffix("/v1") + "/health"

    def healthy() -> bool:
        try:
            return httpx2.get(health, timeout=5).status_code == 200
        except httpx2.TransportError:  # not listening yet
            return False

    _eventually(healthy, "/health to answer 200", 30.0)
    answer = client.completions.create(
        model=cluster["adapters"][0], prompt="Say hello.", max_tokens=4, temperature=0
    )
    assert answer.choices[0].text and answer.choices[0].finish_reason in ("length", "stop")
