"""``plora bench http``: the OpenAI HTTP door against gRPC ``Generate``, on the same requests
to one running cluster.

Each concurrency level (``--concurrency``, default ``1,16``) runs ``--rounds`` rounds; a
round sends the same list of requests through each door once, the doors' order alternating
from round to round (HTTP, gRPC, then gRPC, HTTP, ...) so that drift in the machine's load
hits both alike. A phase (one door, one round) is closed-loop: ``c`` streams, each sending
its next request when its last one ends. Requests are greedy (temperature 0) chat
completions (``--api completions``: raw prompts) of exactly ``--max-tokens`` tokens at most,
over a fixed list of prompts and ``--adapters`` in turn; request ``i`` is the same through
both doors. Before the first level every adapter is loaded by a short request through each
door, and each door opens its connections with a burst at the highest level.

Figures per level and door:

* TTFT: seconds from the client's send to the first chunk that carries text (HTTP: a
  ``delta.content`` / ``text`` that is not empty; gRPC: a ``GenerateResponse`` with ``text``;
  an answer without text: its end), as the client sees it: p50, p90, p99 and mean over every
  request of every round.
* tokens/s: completion tokens (the answers' ``usage``) of every round over the rounds' wall
  time (first send to last answer of each phase): the aggregate rate of the ``c`` streams.
* decode tokens/s per stream: the median over requests of ``(tokens - 1) / (end - first)``.

Ratios are HTTP / gRPC; the targets are those of the HTTP door: TTFT p50 at most
:data:`TTFT_P50_RATIO_MAX` times gRPC's, tokens/s at least :data:`TOKENS_PER_S_RATIO_MIN`
times gRPC's at 16 streams. The HTTP client is the official ``openai`` package (one
``OpenAI`` client shared by the streams, as an application runs it; ``--http-client httpx``
reads the server-sent events with ``httpx2`` alone, to tell the client's own cost apart).
The gRPC client is one channel shared by the streams. Both run in this process, one thread
per stream.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import ssl
import statistics
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.config import (
    DEFAULT_STATE_FILE,
    PORT_MAX,
    address_port_ok,
    checked_type,
    env_or,
)
from services.common.errors import MAX_ECHO_PATH, ConfigError, quoted

#: The HTTP door's targets (issue: TTFT p50 within 1.10x of gRPC's, tokens/s at least 0.95x
#: at 16 streams).
TTFT_P50_RATIO_MAX = 1.10
TOKENS_PER_S_RATIO_MIN = 0.95

#: The doors, in the order of the first round.
DOORS = ("http", "grpc")

#: The prompts, sent in turn (as the user's chat message, or raw with ``--api completions``).
PROMPTS: tuple[str, ...] = (
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give three tips for a job interview.",
    "Describe the water cycle.",
    "What is the capital of France, and why is it famous?",
    "Tell me a story about a lost dog.",
    "How does a bicycle stay upright?",
    "List some uses of a paperclip.",
)


@dataclass(frozen=True)
class BenchRequest:
    """One request, the same through both doors.

    Attributes:
        index: Position in the level's list.
        model: The HTTP ``model``: an adapter id, or the base model's id.
        adapter_id: The gRPC ``adapter_id`` ("" = the base model).
        prompt: The user's message (chat) or the raw prompt (completions).
        max_tokens: Most tokens to generate.
    """

    index: int
    model: str
    adapter_id: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Sample:
    """What one request gave.

    Attributes:
        index: The request's index.
        start: Monotonic time of the send, seconds.
        first: Monotonic time of the first chunk with text (None: none came).
        end: Monotonic time the answer ended.
        completion_tokens: Tokens generated, from the answer's usage.
        text: The whole answer.
        error: Why it failed ("" = it did not).
    """

    index: int
    start: float
    first: float | None
    end: float
    completion_tokens: int
    text: str
    error: str = ""


#: A door: sends one request and reports it (never raises for a failed request).
Door = Callable[[BenchRequest], Sample]


def build_requests(
    count: int, models: Sequence[tuple[str, str]], max_tokens: int
) -> list[BenchRequest]:
    """``count`` requests: prompt ``i mod len(PROMPTS)`` with model ``i mod len(models)``.

    Args:
        count: How many.
        models: ``(HTTP model, gRPC adapter_id)`` pairs to use in turn.
        max_tokens: Most tokens of each answer.
    """
    return [
        BenchRequest(
            index=i,
            model=models[i % len(models)][0],
            adapter_id=models[i % len(models)][1],
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=max_tokens,
        )
        for i in range(count)
    ]


def requests_at(concurrency: int, per_stream: int, minimum: int) -> int:
    """Requests of a phase at ``concurrency`` streams: ``per_stream`` each, at least
    ``minimum`` (so the percentiles of one stream have samples)."""
    return max(minimum, per_stream * concurrency)


def _answered(
    index: int, start: float, first: float | None, tokens: int, parts: list[str]
) -> Sample:
    """The sample of an answer that ended now; one without text (a first token that ends it,
    such as the end-of-sequence token) has its first token at its end."""
    end = time.monotonic()
    return Sample(index, start, end if first is None else first, end, tokens, "".join(parts))


# -- the doors --------------------------------------------------------------------------------


def grpc_door(stub: gateway_pb2_grpc.GatewayStub, chat: bool, timeout: float) -> Door:
    """The gRPC door: a streamed ``Generate`` with temperature 0 and ``max_new_tokens``."""

    def send(req: BenchRequest) -> Sample:
        message = gateway_pb2.GenerateRequest(
            adapter_id=req.adapter_id, temperature=0.0, max_new_tokens=req.max_tokens
        )
        if chat:
            message.messages.add(role="user", content=req.prompt)
        else:
            message.prompt = req.prompt
        first = None
        tokens = 0
        parts = []
        start = time.monotonic()
        try:
            for response in stub.Generate(message, timeout=timeout):
                if response.text:
                    if first is None:
                        first = time.monotonic()
                    parts.append(response.text)
                if response.finish_reason:
                    tokens = response.usage.completion_tokens
        except grpc.RpcError as exc:
            error = f"gRPC {exc.code().name}: {exc.details()}"
            return Sample(req.index, start, first, time.monotonic(), 0, "".join(parts), error)
        return _answered(req.index, start, first, tokens, parts)

    return send


def openai_door(client: Any, chat: bool) -> Door:
    """The HTTP door through the official ``openai`` client: a streamed chat completion
    (or completion) with ``temperature=0``, ``max_tokens`` and
    ``stream_options={"include_usage": True}`` (the completion tokens come from the usage
    chunk)."""
    import openai  # noqa: PLC0415 - only this bench needs the client

    def send(req: BenchRequest) -> Sample:
        first = None
        tokens = 0
        parts = []
        start = time.monotonic()
        try:
            if chat:
                stream = client.chat.completions.create(
                    model=req.model,
                    messages=[{"role": "user", "content": req.prompt}],
                    temperature=0,
                    max_tokens=req.max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            else:
                stream = client.completions.create(
                    model=req.model,
                    prompt=req.prompt,
                    temperature=0,
                    max_tokens=req.max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            with stream:
                for chunk in stream:
                    if chunk.choices:
                        choice = chunk.choices[0]
                        text = choice.delta.content if chat else choice.text
                        if text:
                            if first is None:
                                first = time.monotonic()
                            parts.append(text)
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
        except openai.OpenAIError as exc:
            error = f"HTTP {type(exc).__name__}: {exc}"
            return Sample(req.index, start, first, time.monotonic(), 0, "".join(parts), error)
        return _answered(req.index, start, first, tokens, parts)

    return send


def httpx_door(client: Any, base_url: str, api_key: str, chat: bool) -> Door:
    """The HTTP door read with ``httpx2`` alone: the same request body as :func:`openai_door`,
    the server-sent events parsed with ``json.loads`` (no client objects per chunk)."""
    import httpx2  # noqa: PLC0415

    url = f"{base_url.rstrip('/')}/{'chat/completions' if chat else 'completions'}"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def send(req: BenchRequest) -> Sample:
        body: dict[str, Any] = {
            "model": req.model,
            "temperature": 0,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        first = None
        tokens = 0
        parts = []
        error = ""
        start = time.monotonic()
        try:
            with client.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code != 200:
                    response.read()
                    error = f"HTTP {response.status_code}: {response.text[:500]}"
                else:
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            break
                        event = json.loads(data)
                        if "error" in event:
                            error = f"HTTP stream error: {event['error'].get('message')}"
                            break
                        if event.get("choices"):
                            choice = event["choices"][0]
                            text = choice["delta"].get("content") if chat else choice["text"]
                            if text:
                                if first is None:
                                    first = time.monotonic()
                                parts.append(text)
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
        except httpx2.HTTPError as exc:
            error = f"HTTP {type(exc).__name__}: {exc}"
        if error:
            return Sample(req.index, start, first, time.monotonic(), 0, "".join(parts), error)
        return _answered(req.index, start, first, tokens, parts)

    return send


# -- running and summing up ------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One door's run of a level's requests in one round.

    Attributes:
        door: ``"http"`` or ``"grpc"``.
        round: Round number, from 1.
        wall_s: Seconds from the first send to the last answer.
        samples: Every request's sample, in request order.
    """

    door: str
    round: int
    wall_s: float
    samples: list[Sample]


def run_phase(
    door: Door, name: str, round_no: int, requests: Sequence[BenchRequest], concurrency: int
) -> Phase:
    """Send ``requests`` through ``door`` with ``concurrency`` streams, closed loop (each
    stream sends the next request in the list when its last one ends)."""
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency, thread_name_prefix=f"bench-{name}") as pool:
        samples = list(pool.map(door, requests))
    return Phase(name, round_no, time.monotonic() - start, samples)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 (linear interpolation between the order statistics) and the mean of
    ``values``; every figure 0.0 when there are none."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float), [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(statistics.fmean(values))}


def summarize_door(phases: Sequence[Phase]) -> dict[str, Any]:
    """One door's figures over its phases (its rounds at one level).

    Returns:
        ``requests``, ``errors``, ``first_error`` ("" = none), ``ttft_s`` (p50/p90/p99/mean,
        seconds, over the successful requests), ``completion_tokens`` (sum, successful
        requests), ``wall_s`` (sum of the phases' walls), ``tokens_per_s``
        (``completion_tokens / wall_s``), ``decode_tokens_per_s_per_stream`` (median over
        requests of more than one token of ``(tokens - 1) / (end - first)``), and
        ``tokens_per_s_by_round``.
    """
    samples = [s for p in phases for s in p.samples]
    ok = [s for s in samples if not s.error]
    failed = [s for s in samples if s.error]
    ttfts = [s.first - s.start for s in ok if s.first is not None]
    tokens = sum(s.completion_tokens for s in ok)
    wall = sum(p.wall_s for p in phases)
    decode = [
        (s.completion_tokens - 1) / (s.end - s.first)
        for s in ok
        if s.first is not None and s.completion_tokens > 1 and s.end > s.first
    ]
    return {
        "requests": len(samples),
        "errors": len(failed),
        "first_error": failed[0].error if failed else "",
        "ttft_s": percentiles(ttfts),
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "decode_tokens_per_s_per_stream": statistics.median(decode) if decode else 0.0,
        "tokens_per_s_by_round": [
            sum(s.completion_tokens for s in p.samples if not s.error) / p.wall_s
            if p.wall_s > 0
            else 0.0
            for p in phases
        ],
    }


def compare(http: dict[str, Any], grpc_: dict[str, Any]) -> dict[str, Any]:
    """The HTTP / gRPC ratios of two :func:`summarize_door` results and whether they meet the
    targets (a ratio with a zero gRPC figure is None, and not met).

    Returns:
        ``ratios``: ``ttft_p50``, ``ttft_p90``, ``tokens_per_s``; ``targets_met``:
        ``ttft_p50`` (ratio <= :data:`TTFT_P50_RATIO_MAX`), ``tokens_per_s`` (ratio >=
        :data:`TOKENS_PER_S_RATIO_MIN`).
    """

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    ratios = {
        "ttft_p50": ratio(http["ttft_s"]["p50"], grpc_["ttft_s"]["p50"]),
        "ttft_p90": ratio(http["ttft_s"]["p90"], grpc_["ttft_s"]["p90"]),
        "tokens_per_s": ratio(http["tokens_per_s"], grpc_["tokens_per_s"]),
    }
    ttft, rate = ratios["ttft_p50"], ratios["tokens_per_s"]
    return {
        "ratios": ratios,
        "targets_met": {
            "ttft_p50": ttft is not None and ttft <= TTFT_P50_RATIO_MAX,
            "tokens_per_s": rate is not None and rate >= TOKENS_PER_S_RATIO_MIN,
        },
    }


def text_mismatches(phases: Sequence[Phase]) -> int:
    """Requests whose answers were not all the same text (over both doors and every round).

    Greedy decoding gives one answer per request; a difference means the doors' conversions
    differ, or a near tie between two tokens moved with the batch the request shared."""
    texts: dict[int, set[str]] = {}
    for phase in phases:
        for s in phase.samples:
            if not s.error:
                texts.setdefault(s.index, set()).add(s.text)
    return sum(1 for seen in texts.values() if len(seen) > 1)


#: A reading of counters: ``{service: {series: value}}``; service ``"client"`` is this
#: process.
Snapshot = dict[str, dict[str, float]]

#: The series read from each service's ``/metrics`` around every phase, each summed over its
#: label sets.
SERVICE_SERIES = (
    "process_cpu_seconds_total",
    "plora_gateway_ttft_seconds_sum",
    "plora_gateway_ttft_seconds_count",
    "plora_worker_time_per_output_token_seconds_sum",
    "plora_worker_time_per_output_token_seconds_count",
)


def client_snapshot() -> Snapshot:
    """This process's CPU seconds (user + system, every thread), as service ``"client"``."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"client": {"process_cpu_seconds_total": usage.ru_utime + usage.ru_stime}}


def scrape(urls: dict[str, str], timeout: float = 5.0) -> Snapshot:
    """:data:`SERVICE_SERIES` of each service's Prometheus endpoint (``urls``: service name
    -> ``http://HOST:PORT/metrics``, as in the state file's ``metrics``).

    Raises:
        OSError: an endpoint did not answer.
    """
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    out: Snapshot = {}
    for service, url in urls.items():
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
        values = dict.fromkeys(SERVICE_SERIES, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in values:
                    values[sample.name] += sample.value
        out[service] = values
    return out


def service_figures(spans: Sequence[tuple[Snapshot, Snapshot]], tokens: int) -> dict[str, Any]:
    """What the services themselves measured over a door's phases (``spans``: the readings
    before and after each phase; ``tokens``: the completion tokens of those phases).

    Returns:
        ``cpu_ms_per_token``: CPU milliseconds per completion token of each service read
        (``client`` = the bench process; services whose ``/metrics`` were read: ``gateway``,
        ``worker-0``, ...); ``gateway_ttft_s_mean``: the gateway's own mean TTFT (from its
        receipt of the request, in the core, to the first token it passed on; None when not
        read); ``worker_tpot_s_mean``: the workers' mean time per output token (None when
        not read).
    """

    def delta(series: str, keep: Callable[[str], bool]) -> float:
        return sum(
            after[svc].get(series, 0.0) - before[svc].get(series, 0.0)
            for before, after in spans
            for svc in after
            if keep(svc) and svc in before
        )

    services = sorted({svc for _, after in spans for svc in after})
    cpu = {
        svc: 1000 * delta("process_cpu_seconds_total", svc.__eq__) / tokens if tokens else 0.0
        for svc in services
    }

    def mean(stem: str, keep: Callable[[str], bool]) -> float | None:
        count = delta(f"{stem}_count", keep)
        return delta(f"{stem}_sum", keep) / count if count else None

    return {
        "cpu_ms_per_token": cpu,
        "gateway_ttft_s_mean": mean("plora_gateway_ttft_seconds", lambda x: x == "gateway"),
        "worker_tpot_s_mean": mean(
            "plora_worker_time_per_output_token_seconds", lambda x: x.startswith("worker")
        ),
    }


def run_level(
    doors: dict[str, Door],
    requests: Sequence[BenchRequest],
    concurrency: int,
    rounds: int,
    progress: Callable[[str], None] = lambda _line: None,
    snapshot: Callable[[], Snapshot] = client_snapshot,
) -> dict[str, Any]:
    """Every round of one level (the doors alternating first) and its figures.

    Args:
        snapshot: Reads the counters before and after each phase (:func:`service_figures`).

    Returns:
        ``concurrency``, ``requests_per_round``, ``http`` and ``grpc``
        (:func:`summarize_door` with :func:`service_figures` added), ``ratios`` and
        ``targets_met`` (:func:`compare`), ``text_mismatches``, ``order`` (the doors in the
        order they ran).
    """
    phases: list[Phase] = []
    spans: dict[str, list[tuple[Snapshot, Snapshot]]] = {name: [] for name in DOORS}
    for round_no in range(1, rounds + 1):
        order = DOORS if round_no % 2 else DOORS[::-1]
        for name in order:
            before = snapshot()
            phase = run_phase(doors[name], name, round_no, requests, concurrency)
            spans[name].append((before, snapshot()))
            phases.append(phase)
            progress(
                f"  {concurrency} streams, round {round_no}, {name}: {len(requests)} requests "
                f"in {phase.wall_s:.1f} s"
            )
    by_door = {name: summarize_door([p for p in phases if p.door == name]) for name in DOORS}
    for name, figures in by_door.items():
        figures.update(service_figures(spans[name], figures["completion_tokens"]))
    return {
        "concurrency": concurrency,
        "requests_per_round": len(requests),
        **by_door,
        **compare(by_door["http"], by_door["grpc"]),
        "text_mismatches": text_mismatches(phases),
        "order": [p.door for p in phases],
    }


def warm_up(
    doors: dict[str, Door], models: Sequence[tuple[str, str]], concurrency: int
) -> list[Sample]:
    """Load every adapter through each door (one 2-token request each, in turn), then open
    each door's connections with ``concurrency`` 2-token requests at once. Returns every
    request's sample (HTTP's first)."""
    short = build_requests(len(models), models, 2)
    burst = build_requests(concurrency, models, 2)
    samples = []
    for name in DOORS:
        samples += [doors[name](r) for r in short]
        samples += run_phase(doors[name], name, 0, burst, concurrency).samples
    return samples


# -- the command ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterAddresses:
    """Where the bench reaches the cluster.

    Attributes:
        gateway: The gateway's gRPC ``HOST:PORT``.
        base_url: Its OpenAI base URL, ``http(s)://HOST:PORT/v1``.
        metrics: Service name -> Prometheus URL, read around every phase (the state file's
            ``metrics`` when both addresses come from it; else empty: not read).
    """

    gateway: str
    base_url: str
    metrics: dict[str, str]


def cluster_addresses(
    state_file: str | None, gateway: str | None, base_url: str | None
) -> ClusterAddresses:
    """The cluster to measure: ``--gateway`` and ``--base-url`` when given, else the state
    file's ``gateway`` and ``openai_base_url`` (``--state-file``, else ``$PLORA_STATE_FILE``,
    else ``.plora/cluster.json``). Both come from one place so that the two doors are those
    of one gateway.

    Raises:
        ConfigError: the state file is needed and missing, not JSON, or lacks the address.
    """
    if gateway and base_url:
        return ClusterAddresses(gateway, base_url, {})
    path = Path(state_file or env_or("PLORA_STATE_FILE", None) or DEFAULT_STATE_FILE)
    if not path.is_file():
        raise ConfigError(
            f"{quoted(str(path), MAX_ECHO_PATH)}: no such state file: start the cluster with "
            "`plora up` (its state file is .plora/cluster.json, or --state-file), or give "
            "--gateway HOST:PORT and --base-url http://HOST:PORT/v1"
        )
    try:
        state = json.loads(path.read_text())
        found = ClusterAddresses(
            gateway or str(state["gateway"]),
            base_url or str(state["openai_base_url"]),
            {} if gateway or base_url else {str(k): str(v) for k, v in state["metrics"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{path}: not a state file of a `plora up` with the HTTP door ({exc!r}); give "
            "--gateway and --base-url"
        ) from None
    return found


def http_tls_context(base_url: str, tls_ca: str | None) -> ssl.SSLContext | None:
    """The TLS settings of the HTTP client for an ``https`` URL (None for ``http``): the CA
    of ``--tls-ca`` / ``$PLORA_TLS_CA`` (else the system's roots) and the client
    certificate of ``$PLORA_TLS_CLIENT_CERT`` / ``$PLORA_TLS_CLIENT_KEY``, as the gRPC
    client uses them.

    Raises:
        ConfigError: a file cannot be read or is not PEM, or only one of the certificate and
            its key is set.
    """
    if not base_url.startswith("https://"):
        return None
    ca = tls_ca or env_or("PLORA_TLS_CA", "") or ""
    cert = env_or("PLORA_TLS_CLIENT_CERT", "") or ""
    key = env_or("PLORA_TLS_CLIENT_KEY", "") or ""
    if bool(cert) != bool(key):
        raise ConfigError(
            "PLORA_TLS_CLIENT_CERT and PLORA_TLS_CLIENT_KEY go together: set both or neither"
        )
    try:
        context = ssl.create_default_context(cafile=ca or None)
        if cert:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS files for {base_url}: {exc}") from None
    return context


def _models(
    list_models: Callable[[], list[dict[str, Any]]], wanted: list[str]
) -> list[tuple[str, str]]:
    """``(HTTP model, gRPC adapter_id)`` of ``wanted`` (default: the first 4 adapters
    ``/v1/models`` lists, else the base model).

    Raises:
        ConfigError: a wanted model is not listed.
    """
    listed = list_models()
    base = next((m["id"] for m in listed if not m.get("parent")), "")
    adapters = [m["id"] for m in listed if m.get("parent")]
    ids = wanted or adapters[:4] or [base]
    unknown = [i for i in ids if i != base and i not in adapters]
    if unknown:
        raise ConfigError(
            f"--adapters: {', '.join(unknown)} not served by this cluster (GET /v1/models "
            f"lists {len(adapters)} adapters and the base model {base!r})"
        )
    return [(i, "" if i == base else i) for i in ids]


_positive = checked_type(int, lambda v: v > 0, "a whole number > 0")
_levels = checked_type(
    lambda text: [int(x) for x in text.split(",")],
    lambda v: bool(v) and all(x > 0 for x in v),
    "whole numbers > 0 separated by commas, e.g. 1,16",
)
_address = checked_type(str, address_port_ok, f"HOST:PORT with a port 1..{PORT_MAX}")
_url = checked_type(
    str, lambda v: v.startswith(("http://", "https://")), "a URL, http(s)://HOST:PORT/v1"
)
_seconds = checked_type(float, lambda v: 0 < v <= 86400, "seconds, > 0 and at most 86400")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``plora bench http``."""
    parser.add_argument("--out", required=True, help="write the JSON results here")
    parser.add_argument(
        "--state-file",
        metavar="PATH",
        help="the running `plora up`'s state file, read for `gateway` and `openai_base_url` "
        "(default: $PLORA_STATE_FILE, else .plora/cluster.json)",
    )
    parser.add_argument(
        "--gateway",
        type=_address,
        metavar="HOST:PORT",
        help="the gateway's gRPC address (default: the state file's)",
    )
    parser.add_argument(
        "--base-url",
        type=_url,
        metavar="URL",
        help="the gateway's OpenAI base URL, http(s)://HOST:PORT/v1 (default: the state file's)",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="CA bundle of the gateway's certificate, for both doors (default: $PLORA_TLS_CA); "
        "$PLORA_TLS_CLIENT_CERT / _KEY and $PLORA_API_KEY are sent through both",
    )
    parser.add_argument(
        "--concurrency",
        type=_levels,
        default=[1, 16],
        metavar="C,...",
        help="concurrent streams of each level (default 1,16)",
    )
    parser.add_argument(
        "--requests-per-stream",
        type=_positive,
        default=2,
        metavar="K",
        help="requests per stream in a phase (default 2): a phase at C streams sends "
        "max(K*C, --min-requests) requests",
    )
    parser.add_argument(
        "--min-requests",
        type=_positive,
        default=8,
        metavar="M",
        help="fewest requests of a phase (default 8)",
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=2,
        metavar="R",
        help="rounds per level; each sends the requests through both doors, the first door "
        "alternating (default 2)",
    )
    parser.add_argument(
        "--max-tokens",
        type=_positive,
        default=24,
        metavar="N",
        help="tokens per answer at most (default 24)",
    )
    parser.add_argument(
        "--adapters",
        default="",
        metavar="ID,...",
        help="models to send in turn: adapter ids, or the base model's id (default: the "
        "first 4 adapters GET /v1/models lists)",
    )
    parser.add_argument(
        "--api",
        choices=("chat", "completions"),
        default="chat",
        help="chat: /v1/chat/completions and gRPC messages; completions: /v1/completions "
        "and a raw gRPC prompt (default chat)",
    )
    parser.add_argument(
        "--http-client",
        choices=("openai", "httpx"),
        default="openai",
        help="openai: the official openai package; httpx: server-sent events read with "
        "httpx2 and json alone (default openai)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=300.0,
        metavar="S",
        help="seconds one request may take (default 300)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the bench; print a table; write JSON to ``--out``. Returns 0, 1 when a request
    failed (the figures are written still), 2 for a usage error."""
    from plora.cli import client_security  # noqa: PLC0415 - plora.cli imports this module

    try:
        cluster = cluster_addresses(args.state_file, args.gateway, args.base_url)
        gateway, base_url = cluster.gateway, cluster.base_url
        credentials, api_key = client_security(args.tls_ca)
        tls = http_tls_context(base_url, args.tls_ca)
    except ConfigError as exc:
        print(f"plora bench http: {exc}")
        return 2
    try:
        import httpx2  # noqa: PLC0415
        import openai  # noqa: PLC0415
    except ImportError:
        print(
            "plora bench http: needs the openai package (pip install openai==3.57.0, as in "
            "the `test` extra of pyproject.toml)"
        )
        return 2
    from services.common.grpc_util import client_channel  # noqa: PLC0415

    chat = args.api == "chat"
    levels = list(args.concurrency)
    top = max(levels)
    limits = httpx2.Limits(max_connections=top + 4, max_keepalive_connections=top + 4)
    http = httpx2.Client(
        verify=tls if tls is not None else True,
        timeout=httpx2.Timeout(args.timeout, connect=10.0),
        limits=limits,
        trust_env=False,
    )
    channel = client_channel(gateway, credentials, api_key)
    client = openai.OpenAI(
        base_url=base_url,
        api_key=api_key or "none",
        max_retries=0,  # a refused request counts as failed, not as a slower one
        http_client=http,
    )
    metrics = dict(cluster.metrics)
    try:
        scrape(metrics)
    except OSError as exc:
        print(f"services' /metrics not read ({exc}): no CPU or TTFT figures of the services")
        metrics = {}

    def snapshot() -> Snapshot:
        reading = client_snapshot()
        try:
            reading.update(scrape(metrics))
        except OSError:
            pass  # a phase without the services' figures: service_figures skips them
        return reading

    started = time.monotonic()
    try:
        models = _models(
            lambda: [m.model_dump() for m in client.models.list().data],
            [a for a in args.adapters.split(",") if a],
        )
        stub = gateway_pb2_grpc.GatewayStub(channel)
        doors: dict[str, Door] = {
            "grpc": grpc_door(stub, chat, args.timeout),
            "http": openai_door(client, chat)
            if args.http_client == "openai"
            else httpx_door(http, base_url, api_key, chat),
        }
        print(f"warming up: {len(models)} models, {top} streams per door")
        warm_start = time.monotonic()
        warm = warm_up(doors, models, top)
        warm_s = time.monotonic() - warm_start
        warm_errors = [s.error for s in warm if s.error]
        if warm_errors:
            print(f"plora bench http: warm-up failed: {warm_errors[0]}")
            return 1
        results_levels = []
        for c in levels:
            n = requests_at(c, args.requests_per_stream, args.min_requests)
            requests = build_requests(n, models, args.max_tokens)
            results_levels.append(
                run_level(doors, requests, c, args.rounds, progress=print, snapshot=snapshot)
            )
    except openai.OpenAIError as exc:
        unknown_key = isinstance(exc, openai.AuthenticationError)
        hint = " (set PLORA_API_KEY to your API key)" if unknown_key else ""
        print(f"plora bench http: GET {base_url}/models failed: {exc}{hint}")
        return 1
    except ConfigError as exc:
        print(f"plora bench http: {exc}")
        return 2
    finally:
        channel.close()
        http.close()
    client_name = (
        f"openai {openai.__version__}"
        if args.http_client == "openai"
        else f"httpx2 {httpx2.__version__} + json"
    )
    results = {
        "config": {
            "gateway": gateway,
            "openai_base_url": base_url,
            "api": args.api,
            "http_client": client_name,
            "grpc_client": f"grpcio {grpc.__version__}, one channel",
            "concurrency": levels,
            "rounds": args.rounds,
            "requests_per_stream": args.requests_per_stream,
            "min_requests": args.min_requests,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "models": [m for m, _ in models],
            "prompts": len(PROMPTS),
            "api_key": bool(api_key),
            "tls": tls is not None,
            "client_cpus": os.cpu_count(),
            "services_read": sorted(metrics),
        },
        "targets": {
            "ttft_p50_ratio_max": TTFT_P50_RATIO_MAX,
            "tokens_per_s_ratio_min": TOKENS_PER_S_RATIO_MIN,
            "tokens_per_s_at_concurrency": 16,
        },
        "warmup": {
            "requests": len(warm),
            "completion_tokens": sum(s.completion_tokens for s in warm),
            "wall_s": warm_s,
        },
        "levels": results_levels,
        "wall_seconds": time.monotonic() - started,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, sort_keys=True))
    print_table(results)
    failed = sum(lv[d]["errors"] for lv in results_levels for d in DOORS)
    if failed:
        first = next(
            lv[d]["first_error"] for lv in results_levels for d in DOORS if lv[d]["errors"]
        )
        print(f"{failed} requests failed; the first: {first}")
        return 1
    return 0


def _verdict(ratio: float | None, met: bool, bound: str) -> str:
    shown = "-" if ratio is None else f"{ratio:.3f}x"
    return f"{shown} (target {bound}: {'met' if met else 'NOT met'})"


def _service_line(figures: dict[str, Any]) -> str:
    """CPU per token by process, the gateway's TTFT beside the client's, the workers' TPOT."""
    cpu = figures["cpu_ms_per_token"]
    workers = [v for k, v in cpu.items() if k.startswith("worker")]
    parts = [f"{k} {v:.2f}" for k, v in cpu.items() if not k.startswith("worker")]
    if workers:
        parts.append(f"workers {sum(workers):.2f}")
    line = f"CPU ms/token {', '.join(parts)}"
    if figures["gateway_ttft_s_mean"] is not None:
        line += (
            f"; mean TTFT gateway {figures['gateway_ttft_s_mean'] * 1000:.0f} ms, "
            f"client {figures['ttft_s']['mean'] * 1000:.0f} ms"
        )
    if figures["worker_tpot_s_mean"] is not None:
        line += f"; worker TPOT {figures['worker_tpot_s_mean'] * 1000:.1f} ms"
    return line


def print_table(results: dict[str, Any]) -> None:
    """The figures of :func:`run`'s results, a row per level and door, and the ratios."""
    cfg = results["config"]
    print(
        f"HTTP: {cfg['http_client']}, {cfg['api']}, streamed; gRPC: Generate, streamed; "
        f"{len(cfg['models'])} models, max_tokens {cfg['max_tokens']}, greedy, "
        f"{cfg['rounds']} rounds"
    )
    cols = ("requests", "ttft_p50", "ttft_p90", "ttft_p99", "tok/s", "decode/stream", "errors")
    print(f"{'streams':>7} {'door':>5}" + "".join(f"{c:>14}" for c in cols))
    for lv in results["levels"]:
        for door in DOORS:
            f = lv[door]
            t = f["ttft_s"]
            vals = (
                str(f["requests"]),
                f"{t['p50'] * 1000:.0f} ms",
                f"{t['p90'] * 1000:.0f} ms",
                f"{t['p99'] * 1000:.0f} ms",
                f"{f['tokens_per_s']:.1f}",
                f"{f['decode_tokens_per_s_per_stream']:.1f}",
                str(f["errors"]),
            )
            print(f"{lv['concurrency']:>7} {door:>5}" + "".join(f"{v:>14}" for v in vals))
        for door in DOORS:
            print(f"{'':>7} {door:>5}: {_service_line(lv[door])}")
        r, met = lv["ratios"], lv["targets_met"]
        ttft = _verdict(r["ttft_p50"], met["ttft_p50"], f"<= {TTFT_P50_RATIO_MAX:.2f}x")
        rate = _verdict(r["tokens_per_s"], met["tokens_per_s"], f">= {TOKENS_PER_S_RATIO_MIN:.2f}x")
        print(
            f"{'':>7} http/grpc: TTFT p50 {ttft}; tokens/s {rate}; texts differing "
            f"{lv['text_mismatches']}/{lv['requests_per_round']}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (``python -m plora.bench.http``)."""
    parser = argparse.ArgumentParser(prog="plora bench http", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
