"""The gateway's OpenAI-compatible HTTP API on the real cluster from ``plora up``, driven by the
official ``openai`` package: the same greedy answers as gRPC ``Generate``, OpenAI's errors and
statuses, a closed stream cancelled on the worker, bad input refused with OpenAI's error
object, API keys and mutual TLS, and the README's examples run as written."""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from plora.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2
from tests.conftest import REPO, SECURE_KEYS
from tests.helpers import worker_stub

pytestmark = pytest.mark.slow

BASE_MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
RAW_PROMPT = "The capital of France is"
#: A prompt the model answers at length: 400 tokens of it outlast any test's wait.
LONG_PROMPT = "List the numbers from 1 to 1000, one per line:"

#: ``finish_reason`` as OpenAI names it, of each gRPC finish reason.
OPENAI_FINISH = {
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_EOS: "stop",
    gateway_pb2.FINISH_REASON_CONTEXT: "length",
}


@pytest.fixture(scope="module")
def client(cluster: dict) -> Iterator[OpenAI]:
    """The official client pointed at the cluster (no retries: a test sees each answer)."""
    with OpenAI(base_url=cluster["openai_base_url"], api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster: dict) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with grpc.insecure_channel(cluster["gateway"]) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture(scope="module")
def http(cluster: dict) -> Iterator[httpx2.Client]:
    """A plain HTTP client for what the ``openai`` package never sends (bad bodies)."""
    with httpx2.Client(base_url=cluster["openai_base_url"] + "/", timeout=120) as c:
        yield c


class Greedy:
    """One greedy gRPC ``Generate``: its text, completion and prompt tokens, and how it
    ended as OpenAI names it."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, **fields: object) -> None:
        messages = fields.pop("messages", None)
        request = gateway_pb2.GenerateRequest(temperature=0, **fields)
        for message in messages or []:
            request.messages.add(**message)
        chunks = list(stub.Generate(request, timeout=120))
        self.text = "".join(c.text for c in chunks)
        self.completion_tokens = chunks[-1].usage.completion_tokens
        self.prompt_tokens = chunks[-1].usage.prompt_tokens
        self.finish_reason = OPENAI_FINISH[chunks[-1].finish_reason]


def _streamed_chat(client: OpenAI, **kw: object) -> tuple[list[str], str | None, object]:
    """A streamed chat completion with usage: its text pieces, finish_reason and usage."""
    stream = client.chat.completions.create(
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        **kw,
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        assert usage is None, "a chunk after the usage chunk"
        if chunk.usage is not None:
            assert chunk.choices == [] and finish is not None  # last, on its own
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        assert finish is None, "a chunk after the one with finish_reason"
        if choice.delta.content:
            pieces.append(choice.delta.content)
        finish = choice.finish_reason
    return pieces, finish, usage


# -- models ----------------------------------------------------------------------------------


def test_plora_up_names_the_openai_base_url_when_ready(cluster: dict) -> None:
    """The ready banner tells a user where the OpenAI-compatible API is, as the state file
    does."""
    banner = Path(cluster["log"]).read_text()
    assert f"OpenAI-compatible API: {cluster['openai_base_url']}\n" in banner


def test_models_list_the_base_model_first_then_every_demo_adapter(
    client: OpenAI, cluster: dict
) -> None:
    models = client.models.list().data
    assert models[0].id == BASE_MODEL and models[0].parent is None
    adapters = {m.id: m for m in models[1:]}
    assert set(cluster["adapters"]) <= set(adapters)
    for adapter_id in cluster["adapters"]:
        assert adapters[adapter_id].parent == BASE_MODEL
        assert adapters[adapter_id].object == "model"
    one = client.models.retrieve(cluster["adapters"][0])
    assert one.id == cluster["adapters"][0] and one.parent == BASE_MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")


# -- the same answers as gRPC --------------------------------------------------------------


@pytest.mark.parametrize("which", [0, 3, None], ids=["adapter-r8", "adapter-r64", "base"])
def test_streamed_chat_equals_grpc_generate_token_for_token(
    client: OpenAI, stub: gateway_pb2_grpc.GatewayStub, cluster: dict, which: int | None
) -> None:
    model = BASE_MODEL if which is None else cluster["adapters"][which]
    adapter = "" if which is None else model
    grpc_answer = Greedy(stub, adapter_id=adapter, messages=MESSAGES, max_new_tokens=20)
    pieces, finish, usage = _streamed_chat(client, model=model, max_tokens=20)
    assert "".join(pieces) == grpc_answer.text
    assert len(pieces) > 3, "the answer must be streamed in pieces, not at once"
    assert usage is not None
    assert usage.completion_tokens == grpc_answer.completion_tokens
    assert usage.prompt_tokens == grpc_answer.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish == grpc_answer.finish_reason  # "length" at 20 tokens, "stop" at its end


def test_non_streamed_chat_equals_grpc_generate_and_ends_as_it_does(
    client: OpenAI, stub: gateway_pb2_grpc.GatewayStub, cluster: dict
) -> None:
    """64 tokens: the answer may end at its end-of-sequence token ("stop") or at the bound
    ("length"), as gRPC's does."""
    adapter = cluster["adapters"][1]
    grpc_answer = Greedy(stub, adapter_id=adapter, messages=MESSAGES, max_new_tokens=64)
    answer = client.chat.completions.create(
        model=adapter,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=64,
        extra_headers={"X-Request-Id": "oa-test-1"},
    )
    assert answer.object == "chat.completion" and answer.id == "chatcmpl-oa-test-1"
    assert answer.model == adapter
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == grpc_answer.text
    assert choice.finish_reason == grpc_answer.finish_reason
    assert answer.usage is not None
    assert answer.usage.completion_tokens == grpc_answer.completion_tokens
    assert answer.usage.prompt_tokens == grpc_answer.prompt_tokens


def test_completions_with_a_raw_prompt_equal_grpc_streamed_and_whole(
    client: OpenAI, stub: gateway_pb2_grpc.GatewayStub, cluster: dict
) -> None:
    adapter = cluster["adapters"][2]
    grpc_answer = Greedy(stub, adapter_id=adapter, prompt=RAW_PROMPT, max_new_tokens=16)
    whole = client.completions.create(
        model=adapter, prompt=RAW_PROMPT, max_tokens=16, temperature=0
    )
    assert whole.object == "text_completion"
    assert whole.choices[0].text == grpc_answer.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == grpc_answer.completion_tokens == 16
    assert whole.usage.prompt_tokens == grpc_answer.prompt_tokens
    stream = client.completions.create(
        model=adapter,
        prompt=RAW_PROMPT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason
    assert "".join(pieces) == grpc_answer.text
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 16


def test_a_stop_string_ends_the_answer_before_it_with_finish_reason_stop(
    client: OpenAI, stub: gateway_pb2_grpc.GatewayStub, cluster: dict
) -> None:
    adapter = cluster["adapters"][0]
    full = Greedy(stub, adapter_id=adapter, messages=MESSAGES, max_new_tokens=20).text
    stop = "Paris"
    assert stop in full, full  # the greedy answer names it; the stop must cut it there
    cut = Greedy(stub, adapter_id=adapter, messages=MESSAGES, max_new_tokens=20, stop=[stop])
    pieces, finish, usage = _streamed_chat(client, model=adapter, max_tokens=20, stop=stop)
    assert "".join(pieces) == cut.text == full[: full.index(stop)]
    assert finish == cut.finish_reason == "stop"
    assert usage is not None and usage.completion_tokens == cut.completion_tokens
    whole = client.chat.completions.create(
        model=adapter,
        messages=MESSAGES,
        temperature=0,
        max_tokens=20,
        stop=[stop, "never-seen"],
    )
    assert whole.choices[0].message.content == cut.text
    assert whole.choices[0].finish_reason == "stop"


# -- errors through the official client ------------------------------------------------------


def test_unknown_model_is_not_found_with_the_grpc_message(
    client: OpenAI, stub: gateway_pb2_grpc.GatewayStub
) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-adapter", messages=MESSAGES)
    assert err.value.status_code == 404
    body = err.value.body
    assert isinstance(body, dict)
    assert body["param"] == "model" and body["code"] == "model_not_found"
    request = gateway_pb2.GenerateRequest(adapter_id="no-such-adapter", prompt="hi")
    with pytest.raises(grpc.RpcError) as grpc_err:
        list(stub.Generate(request, timeout=30))
    assert grpc_err.value.code() == grpc.StatusCode.NOT_FOUND
    assert body["message"] == grpc_err.value.details()


def test_max_tokens_zero_and_n_two_are_bad_requests_naming_the_field(
    client: OpenAI, cluster: dict
) -> None:
    adapter = cluster["adapters"][0]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=adapter, messages=MESSAGES, max_tokens=0)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=adapter, prompt=RAW_PROMPT, max_tokens=0)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=adapter, messages=MESSAGES, n=2)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "n"
    assert "n=2" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # the core's check, as gRPC's
        client.chat.completions.create(model=adapter, messages=MESSAGES, temperature=-1)
    assert "temperature" in err.value.message


# -- a closed stream is cancelled ------------------------------------------------------------


def _sequences_on_workers(cluster: dict) -> int:
    """Running plus waiting sequences over every worker, as the workers say now."""
    total = 0
    for address in cluster["workers"].values():
        status = worker_stub(cluster, address).GetWorkerStatus(
            worker_pb2.GetWorkerStatusRequest(), timeout=5
        )
        total += status.running + status.queue_length
    return total


def _wait_for_no_sequences(cluster: dict, within_s: float, why: str) -> None:
    """Wait until no worker has a running or waiting sequence; fail after ``within_s``."""
    start = time.monotonic()
    while _sequences_on_workers(cluster):
        assert time.monotonic() - start < within_s, why
        time.sleep(0.05)


def _gateway_requests(cluster: dict, code: str) -> float:
    """``plora_gateway_requests_total{code=...}`` as the gateway exports it now."""
    with urllib.request.urlopen(cluster["metrics"]["gateway"], timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "plora_gateway_requests_total" and sample.labels["code"] == code:
                return sample.value
    return 0.0


def test_a_stream_closed_after_its_first_chunk_leaves_no_sequence_on_any_worker(
    client: OpenAI, cluster: dict
) -> None:
    _wait_for_no_sequences(cluster, 30.0, "an earlier request still runs")
    cancelled = _gateway_requests(cluster, "CANCELLED")
    stream = client.chat.completions.create(
        model=cluster["adapters"][4],
        messages=[{"role": "user", "content": LONG_PROMPT}],
        stream=True,
        temperature=0,
        max_tokens=400,
    )
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    assert _sequences_on_workers(cluster) == 1  # generating: the close below must stop it
    stream.close()
    closed = time.monotonic()
    _wait_for_no_sequences(cluster, 2.0, "the worker kept the sequence 2 s after the close")
    while _gateway_requests(cluster, "CANCELLED") < cancelled + 1:
        assert time.monotonic() - closed < 10.0, "the gateway did not count the cancellation"
        time.sleep(0.1)


def test_a_client_gone_before_a_whole_answer_leaves_no_sequence_on_any_worker(
    cluster: dict,
) -> None:
    """A non-streamed request whose client stops waiting (a read timeout closes the
    connection) is cancelled too."""
    _wait_for_no_sequences(cluster, 30.0, "an earlier request still runs")
    body = {
        "model": cluster["adapters"][5],
        "messages": [{"role": "user", "content": LONG_PROMPT}],
        "max_tokens": 400,
        "temperature": 0,
    }
    outcome: list[BaseException] = []

    def ask() -> None:
        with httpx2.Client(base_url=cluster["openai_base_url"] + "/", timeout=4.0) as http:
            try:
                http.post("chat/completions", json=body)
            except httpx2.ReadTimeout as exc:  # the client gives up and closes
                outcome.append(exc)

    client = threading.Thread(target=ask)
    client.start()
    start = time.monotonic()
    while _sequences_on_workers(cluster) != 1:  # generating while the client waits
        assert time.monotonic() - start < 4.0, "the request never reached a worker"
        time.sleep(0.05)
    client.join(30)
    assert outcome and isinstance(outcome[0], httpx2.ReadTimeout)
    _wait_for_no_sequences(cluster, 2.0, "the worker kept the sequence 2 s after the client left")


def test_health_is_200_while_workers_serve(cluster: dict, http: httpx2.Client) -> None:
    base = cluster["openai_base_url"].removesuffix("/v1")
    response = http.get(f"{base}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


# -- bad input over HTTP ---------------------------------------------------------------------

TWENTY_MB = 20 * 1024 * 1024


def _over_context_body() -> bytes:
    # 200,000 characters, well under the 4 MiB body limit; ~33,000 tokens, beyond 2,048
    return json.dumps({"model": BASE_MODEL, "prompt": "hello " * 33_334, "max_tokens": 4}).encode()


def _chunks(data: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _big_body() -> bytes:
    return json.dumps({"model": BASE_MODEL, "prompt": "x" * TWENTY_MB}).encode()


#: name -> (method, path, body (bytes, or a callable of bytes to send chunked), status, param,
#: a phrase the message must have)
BAD_INPUT: dict[str, tuple[str, str, object, int, str | None, str]] = {
    "invalid JSON": ("POST", "chat/completions", b'{"model": ', 400, None, "not valid JSON"),
    "not UTF-8": ("POST", "completions", b'{"model": "\xff\xfe"}', 400, None, "not valid JSON"),
    "a JSON array": ("POST", "completions", b"[1, 2]", 400, None, "JSON object"),
    "max_tokens a string": (
        "POST",
        "completions",
        {"model": BASE_MODEL, "prompt": "hi", "max_tokens": "5"},
        400,
        "max_tokens",
        "integer",
    ),
    "messages a string": (
        "POST",
        "chat/completions",
        {"model": BASE_MODEL, "messages": "hi"},
        400,
        "messages",
        "list",
    ),
    "temperature a string": (
        "POST",
        "chat/completions",
        {"model": BASE_MODEL, "messages": MESSAGES, "temperature": "hot"},
        400,
        "temperature",
        "number",
    ),
    "no model": ("POST", "completions", {"prompt": "hi"}, 400, "model", "required"),
    "a tool role": (
        "POST",
        "chat/completions",
        {"model": BASE_MODEL, "messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].role",
        "not supported",
    ),
    "a 20 MB body": ("POST", "completions", _big_body, 413, None, "limit of 4194304 bytes"),
    "a 20 MB chunked body": (
        "POST",
        "completions",
        lambda: _chunks(_big_body()),
        413,
        None,
        "limit of 4194304 bytes",
    ),
    "a prompt over the context": (
        "POST",
        "completions",
        _over_context_body,
        400,
        None,
        "context is 2048 tokens",
    ),
    "an unknown route": ("POST", "engines/x/completions", {}, 404, None, "no route"),
    "GET on a POST route": ("GET", "chat/completions", None, 405, None, "POST"),
}


def _send_bad(http: httpx2.Client, name: str) -> httpx2.Response:
    method, path, body, _, _, _ = BAD_INPUT[name]
    if callable(body):
        body = body()
    if isinstance(body, dict):
        return http.request(method, path, json=body)
    return http.request(method, path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_gets_a_4xx_openai_error_object(http: httpx2.Client, name: str) -> None:
    _, _, _, status, param, phrase = BAD_INPUT[name]
    response = _send_bad(http, name)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] != "server_error", error
    assert error["param"] == param
    assert phrase in error["message"], error["message"]
    assert "Traceback" not in response.text and 'File "' not in response.text
    if status == 405:
        assert response.headers["allow"] == "POST"


def test_after_every_bad_input_a_normal_request_still_succeeds(
    http: httpx2.Client, client: OpenAI, cluster: dict
) -> None:
    for name in BAD_INPUT:
        assert 400 <= _send_bad(http, name).status_code < 500, name
    answer = client.chat.completions.create(
        model=cluster["adapters"][0],
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
    )
    assert answer.choices[0].message.content
    _wait_for_no_sequences(cluster, 2.0, "a sequence left on a worker")


# -- the README's examples, as written -------------------------------------------------------


def _readme_section() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(r"^## OpenAI-compatible API\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, "README.md has no '## OpenAI-compatible API' section"
    return match.group(1)


def _readme_block(language: str, needle: str) -> str:
    blocks = re.findall(rf"^```{language}\n(.*?)^```", _readme_section(), re.M | re.S)
    found = [b for b in blocks if needle in b]
    assert len(found) == 1, f"README: one ```{language} block with {needle!r} expected"
    return found[0]


def test_readme_curl_example_streams_as_written(cluster: dict) -> None:
    script = _readme_block("bash", "curl -N")
    assert "$OPENAI_BASE_URL" in script
    env = {**os.environ, "OPENAI_BASE_URL": cluster["openai_base_url"]}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    events = [line for line in proc.stdout.splitlines() if line]
    assert events[-1] == "data: [DONE]", proc.stdout[-500:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.strip(), proc.stdout[-500:]


def test_readme_python_example_streams_as_written(cluster: dict) -> None:
    """The example takes its base URL from ``$OPENAI_BASE_URL``, as the README sets it."""
    script = _readme_block("python", "OpenAI(")
    assert "base_url" not in script
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env["OPENAI_BASE_URL"] = cluster["openai_base_url"]
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


# -- API keys and mutual TLS -----------------------------------------------------------------


def _tls_http(secure_cluster: dict, cert: bool = True) -> httpx2.Client:
    """An HTTPS client trusting the cluster's CA, presenting the client certificate."""
    tls = secure_cluster["tls"]
    context = ssl.create_default_context(cafile=tls["ca"])
    if cert:
        context.load_cert_chain(tls["client_cert"], tls["client_key"])
    return httpx2.Client(verify=context, timeout=120)


def _secure_client(secure_cluster: dict, key: str) -> OpenAI:
    return OpenAI(
        base_url=secure_cluster["openai_base_url"],
        api_key=key,
        http_client=_tls_http(secure_cluster),
        max_retries=0,
    )


def test_https_with_mutual_tls_serves_and_refuses_a_missing_or_unknown_key(
    secure_cluster: dict,
) -> None:
    base = secure_cluster["openai_base_url"]
    assert base.startswith("https://")
    adapter = secure_cluster["adapters"][0]
    with _secure_client(secure_cluster, SECURE_KEYS["operator"]) as operator:
        answer = operator.chat.completions.create(
            model=adapter,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
        )
        assert answer.choices[0].message.content
    with _secure_client(secure_cluster, "not-a-key") as stranger:
        with pytest.raises(openai.AuthenticationError) as err:
            stranger.models.list()
        assert err.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model=adapter, messages=MESSAGES)
    with _tls_http(secure_cluster) as http:
        response = http.post(f"{base}/chat/completions", json={"model": adapter})
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in response.json()["error"]["message"]
        health = http.get(base.removesuffix("/v1") + "/health")  # no key needed
        assert health.status_code == 200
    # plaintext, or TLS without the client certificate, does not reach the gateway at all
    plain = OpenAI(
        base_url=base.replace("https://", "http://"),
        api_key=SECURE_KEYS["operator"],
        max_retries=0,
    )
    with plain, pytest.raises(openai.APIConnectionError):
        plain.models.list()
    no_cert = OpenAI(
        base_url=base,
        api_key=SECURE_KEYS["operator"],
        http_client=_tls_http(secure_cluster, cert=False),
        max_retries=0,
    )
    with no_cert, pytest.raises(openai.APIConnectionError):
        no_cert.models.list()


@pytest.fixture()
def tenant_adapters(secure_cluster: dict) -> Iterator[dict[str, str]]:
    """acme and beta each register a copy of a demo adapter under their own directory (over
    gRPC, with their keys), deleted after the test; yields tenant -> adapter id."""
    from tests.integration.test_secure_cluster import _stub

    root = Path(secure_cluster["root"]) / "adapters"
    ids = {}
    for tenant, index in (("acme", 0), ("beta", 1)):
        source = root / tenant / f"{tenant}-oa"
        shutil.copytree(root / secure_cluster["adapters"][index], source, dirs_exist_ok=True)
        channel, gateway = _stub(secure_cluster, tenant)
        with channel:
            request = gateway_pb2.RegisterAdapterRequest(
                adapter_id=f"{tenant}-oa", source=str(source)
            )
            ids[tenant] = gateway.RegisterAdapter(request, timeout=60).adapter.adapter_id
    yield ids
    channel, operator = _stub(secure_cluster)
    with channel:
        for tenant, adapter_id in ids.items():
            operator.DeleteAdapter(
                gateway_pb2.DeleteAdapterRequest(adapter_id=adapter_id, tenant_id=tenant),
                timeout=30,
            )


def test_a_tenant_key_lists_and_serves_its_own_and_shared_adapters_only(
    secure_cluster: dict, tenant_adapters: dict[str, str]
) -> None:
    demo = secure_cluster["adapters"]
    with _secure_client(secure_cluster, SECURE_KEYS["acme"]) as acme:
        models = acme.models.list().data
        assert models[0].id == BASE_MODEL
        listed = {m.id: m for m in models[1:]}
        assert set(listed) == {tenant_adapters["acme"], *demo}
        assert listed[tenant_adapters["acme"]].owned_by == "acme"
        assert all(m.parent == BASE_MODEL for m in listed.values())
        pieces, finish, _ = _streamed_chat(acme, model=tenant_adapters["acme"], max_tokens=6)
        assert pieces and finish == "length"
        with pytest.raises(openai.PermissionDeniedError) as err:
            acme.chat.completions.create(
                model=tenant_adapters["beta"],
                messages=MESSAGES,
                max_tokens=4,
            )
        assert err.value.status_code == 403
        with pytest.raises(openai.NotFoundError):  # not listed to acme, so not found there
            acme.models.retrieve(tenant_adapters["beta"])
    with _secure_client(secure_cluster, SECURE_KEYS["operator"]) as operator:
        everything = {m.id for m in operator.models.list().data}
        assert {*tenant_adapters.values(), *demo} <= everything


# -- a gateway without a real worker ---------------------------------------------------------


@pytest.fixture()
def lone_gateway(redis_url: str) -> Iterator[tuple[str, str]]:
    """A gateway on the session's real Redis with no worker yet; yields (HTTP base URL,
    Redis URL)."""
    from services.gateway.config import GatewayConfig
    from services.gateway.server import GatewayService

    config = GatewayConfig(port=0, metrics_port=0, http_port=0, redis_url=redis_url)
    service = GatewayService(config).start()
    yield f"http://127.0.0.1:{service.http_port}", redis_url
    service.stop(0)


def test_without_a_worker_health_and_generation_are_503(lone_gateway: tuple[str, str]) -> None:
    base, _ = lone_gateway
    with httpx2.Client(base_url=base, timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "unavailable"}
        assert http.get("/v1/models").json() == {"object": "list", "data": []}
    with OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
        for model in (BASE_MODEL, "adapter-000-r8"):
            with pytest.raises(openai.InternalServerError) as err:
                client.chat.completions.create(model=model, messages=MESSAGES)
            assert err.value.status_code == 503
            assert "no healthy worker" in err.value.message


def test_a_worker_failing_mid_stream_ends_the_stream_with_an_error_event(
    lone_gateway: tuple[str, str],
) -> None:
    """After the first token the status is sent: the failure comes as an ``error`` event,
    then ``[DONE]``, which the ``openai`` package raises as an APIError."""
    from tests.integration.test_gateway_alone import SPEC, _start_token_streamer, _TokenStreamer

    class FailsAfterTwoTokens(_TokenStreamer):
        def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
            for i in range(2):
                yield gateway_pb2.GenerateResponse(text="x", token_ids=[i], worker_id="w0")
            context.abort(grpc.StatusCode.UNAVAILABLE, "the test's worker failed")

    base, redis_url = lone_gateway
    worker, _ = _start_token_streamer(redis_url, 0.0, FailsAfterTwoTokens(0.0))
    body = {"model": SPEC.name, "messages": MESSAGES, "stream": True}
    try:
        with httpx2.Client(base_url=base, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable"
        assert "the test's worker failed" in error["message"]
        assert "Traceback" not in error["message"]
        with OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
            stream = client.chat.completions.create(model=SPEC.name, messages=MESSAGES, stream=True)
            texts = []
            with pytest.raises(openai.APIError) as err:
                for chunk in stream:
                    texts.append(chunk.choices[0].delta.content)
            assert texts == ["", "x", "x"]
            assert "the test's worker failed" in err.value.message
    finally:
        worker.stop(0)
