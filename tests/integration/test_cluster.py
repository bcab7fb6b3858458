"""End-to-end: the real cluster from ``plora up`` answers through the real gRPC API."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from plora import cli
from plora.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.internal_auth import internal_channel
from services.common.lifecycle import BACKGROUND_NICE
from tests.conftest import REPO, shared_data
from tests.helpers import worker_stub

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def stub(cluster: dict) -> gateway_pb2_grpc.GatewayStub:
    channel = grpc.insecure_channel(cluster["gateway"])
    return gateway_pb2_grpc.GatewayStub(channel)


def chat(question: str = QUESTION, **kw: object) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(**kw)
    req.messages.add(role="user", content=question)
    return req


def collect(stub: gateway_pb2_grpc.GatewayStub, req: gateway_pb2.GenerateRequest):
    chunks = list(stub.Generate(req, timeout=120))
    text = "".join(c.text for c in chunks)
    return text, chunks


def test_base_model_answers_paris_streamed(stub: gateway_pb2_grpc.GatewayStub) -> None:
    text, chunks = collect(stub, chat(max_new_tokens=24))
    assert "Paris" in text
    assert len(chunks) > 3, "tokens must be streamed as they are produced, not in one message"
    last = chunks[-1]
    assert last.finish_reason in (gateway_pb2.FINISH_REASON_EOS, gateway_pb2.FINISH_REASON_LENGTH)
    assert last.usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
    assert last.usage.prompt_tokens > 5
    assert last.worker_id.startswith("worker-")
    assert not last.adapter_cold


def test_cli_generate_streams_paris(cluster: dict) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "plora.cli",
            "generate",
            "--gateway",
            cluster["gateway"],
            "--max-new-tokens",
            "24",
            QUESTION,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "Paris" in out.stdout
    assert "worker=worker-" in out.stderr


def test_cli_output_into_a_closed_pipe_stops_quietly(cluster: dict) -> None:
    """`plora adapters list | head -1`: the reader leaves early; no traceback, SIGPIPE status."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "plora.cli", "adapters", "list", "--gateway", cluster["gateway"]],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err


# `python -m plora.cli` with Ctrl-C working as in a terminal whatever started the suite: a
# shell without job control starts background jobs with SIGINT ignored, children inherit
# that, and Python then installs no KeyboardInterrupt handler. (Not a preexec_fn: Python code
# between fork and exec in this process, which has gRPC's threads, aborted the child in CI.)
_CLI_WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'plora'; runpy.run_module('plora.cli', run_name='__main__')"
)


def _cli(cluster: dict, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _CLI_WITH_CTRL_C, *args, "--gateway", cluster["gateway"]],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _workers_running(cluster: dict) -> int:
    total = 0
    for address in cluster["workers"].values():
        with internal_channel(address, cluster["internal_token"]) as channel:
            total += (
                worker_pb2_grpc.WorkerStub(channel)
                .GetWorkerStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5)
                .running
            )
    return total


def test_cli_deadline_ends_the_streamed_line_and_names_the_timeout(cluster: dict) -> None:
    """`plora generate --timeout 1.5 ...` on a long generation: the error goes to stderr on
    its own line (stdout's partial text is ended first) and names --timeout and its value."""
    proc = _cli(
        cluster, "generate", "--timeout", "1.5", "--max-new-tokens", "400", "Write a long story."
    )
    out, err = (b.decode() for b in proc.communicate(timeout=120))
    assert proc.returncode == 1, err
    assert not out or out.endswith("\n"), repr(out)  # the partial text's line is ended
    assert err.startswith("plora: DEADLINE_EXCEEDED: "), err
    assert "--timeout 1.5 s" in err and len(err.splitlines()) == 1, err


def test_cli_ctrl_c_cancels_generation_and_exits_130(cluster: dict) -> None:
    """Ctrl-C during `plora generate`: no traceback, exit 130, and the worker drops the
    request (the CLI cancels the call)."""
    proc = _cli(
        cluster, "generate", "--max-new-tokens", "400", "Tell me a very long story about dragons."
    )
    assert proc.stdout is not None
    first = proc.stdout.read1(64)  # type: ignore[attr-defined]
    assert first, "nothing streamed"
    proc.send_signal(signal.SIGINT)
    out, err = (b.decode() for b in proc.communicate(timeout=60))
    assert proc.returncode == 130, err
    assert err == "plora: interrupted; the request was cancelled\n", err
    assert (first.decode(errors="replace") + out).endswith("\n"), repr(out)
    deadline = time.monotonic() + 10
    while _workers_running(cluster):
        assert time.monotonic() < deadline, "worker kept generating after Ctrl-C"
        time.sleep(0.1)


def test_cli_status_says_how_old_each_workers_figures_are(cluster: dict) -> None:
    proc = _cli(cluster, "status")
    out, err = (b.decode() for b in proc.communicate(timeout=60))
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if line.startswith("worker-")]
    assert len(lines) == 2, out
    for line in lines:
        assert re.search(r" as of heartbeat \d+\.\ds ago: queue=\d+ running=\d+ ", line), line


def test_cli_generate_leaves_max_new_tokens_to_the_gateway(cluster: dict) -> None:
    """Without --max-new-tokens, `plora generate` leaves the field unset, so the gateway's
    default applies: 64, or the gateway's limit when lower (a limit of 16 used to refuse a
    plain `plora generate` with "max_new_tokens=64 is out of range: use 1..16")."""
    from services.gateway.config import GatewayConfig
    from services.gateway.server import GatewayService

    parser, _ = cli.build_parser()
    unset = cli.generate_request(parser.parse_args(["generate", "hi"]))
    assert not unset.HasField("max_new_tokens")
    given = cli.generate_request(parser.parse_args(["generate", "--max-new-tokens", "5", "hi"]))
    assert given.HasField("max_new_tokens") and given.max_new_tokens == 5
    prompt = "Tell me a very long story about dragons."
    # the cluster's gateway (limit 512): its default, 64
    proc = _cli(cluster, "generate", prompt)
    _out, err = (b.decode() for b in proc.communicate(timeout=120))
    assert proc.returncode == 0, err
    assert "[length]" in err and " completion_tokens=64 " in err, err
    # a second gateway on the same cluster with a limit of 16: its default is 16
    low = GatewayService(
        GatewayConfig(
            port=0,
            metrics_port=0,
            http_port=0,
            redis_url=cluster["redis_url"],
            internal_token=cluster["internal_token"],
            max_new_tokens_limit=16,
        )
    ).start()
    try:
        proc = _cli({"gateway": f"127.0.0.1:{low.port}"}, "generate", prompt)
        _out, err = (b.decode() for b in proc.communicate(timeout=120))
        assert proc.returncode == 0, err
        assert "[length]" in err and " completion_tokens=16 " in err, err
    finally:
        low.stop(0)


def test_empty_prompt_is_named_in_the_refusal(stub, cluster: dict) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, gateway_pb2.GenerateRequest(prompt="", max_new_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the prompt is empty" in err.value.details()
    proc = _cli(cluster, "generate", "--raw", "")
    _out, stderr = (b.decode() for b in proc.communicate(timeout=60))
    assert proc.returncode == 2 and "the prompt is empty" in stderr, stderr


def test_adapter_changes_output_deterministically_and_is_resident(
    stub: gateway_pb2_grpc.GatewayStub, cluster: dict
) -> None:
    adapter = cluster["adapters"][0]
    base, _ = collect(stub, chat(max_new_tokens=24))
    first, chunks = collect(stub, chat(adapter_id=adapter, max_new_tokens=24))
    second, _ = collect(stub, chat(adapter_id=adapter, max_new_tokens=24))
    assert first != base, "a demo adapter must change the greedy answer"
    assert first == second, "greedy decoding with an adapter must be deterministic"
    served_by = chunks[-1].worker_id
    status = stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=10)
    deadline = time.monotonic() + 5
    while adapter not in {
        a for w in status.workers if w.worker_id == served_by for a in w.resident_adapters
    }:
        assert time.monotonic() < deadline, f"{adapter} not reported resident on {served_by}"
        time.sleep(0.2)
        status = stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=10)
    assert len(status.workers) == 2 and all(w.healthy for w in status.workers)
    assert status.base_model == "SmolLM2-135M-Instruct"
    assert status.adapters_registered >= 8


def test_seeded_sampling_is_reproducible(stub: gateway_pb2_grpc.GatewayStub) -> None:
    req = chat(
        "Write a short poem about the sea.",
        max_new_tokens=16,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        seed=1234,
    )
    a, _ = collect(stub, req)
    b, _ = collect(stub, req)
    assert a == b and a


def test_stop_string_ends_generation(stub: gateway_pb2_grpc.GatewayStub) -> None:
    text, chunks = collect(stub, chat(max_new_tokens=24, stop=["Paris"]))
    assert "Paris" not in text
    assert chunks[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP


def test_adapter_lifecycle_register_get_list_delete(
    stub: gateway_pb2_grpc.GatewayStub, cluster: dict
) -> None:
    source = Path(cluster["root"]) / "adapters" / cluster["adapters"][1]
    info = stub.RegisterAdapter(
        gateway_pb2.RegisterAdapterRequest(
            adapter_id="tenant-a/copy", source=str(source), tenant_id="tenant-a"
        ),
        timeout=60,
    ).adapter
    assert info.version >= 1 and info.rank > 0 and info.size_bytes > 0 and len(info.sha256) == 64
    again = stub.RegisterAdapter(
        gateway_pb2.RegisterAdapterRequest(
            adapter_id="tenant-a/copy", source=str(source), tenant_id="tenant-a"
        ),
        timeout=60,
    ).adapter
    assert again.version > info.version
    got = stub.GetAdapter(
        gateway_pb2.GetAdapterRequest(adapter_id="tenant-a/copy", tenant_id="tenant-a"), timeout=10
    )
    assert got.adapter.version == again.version
    listed = stub.ListAdapters(gateway_pb2.ListAdaptersRequest(tenant_id="tenant-a"), timeout=10)
    assert "tenant-a/copy" in {a.adapter_id for a in listed.adapters}
    with pytest.raises(grpc.RpcError) as err:
        stub.GetAdapter(
            gateway_pb2.GetAdapterRequest(adapter_id="tenant-a/copy", tenant_id="tenant-b"),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, chat(adapter_id="tenant-a/copy", tenant_id="tenant-b", max_new_tokens=2))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stub.DeleteAdapter(
        gateway_pb2.DeleteAdapterRequest(adapter_id="tenant-a/copy", tenant_id="tenant-a"),
        timeout=10,
    )
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, chat(adapter_id="tenant-a/copy", tenant_id="tenant-a", max_new_tokens=2))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_adapter_registered_again_after_redis_lost_it_is_served(
    stub: gateway_pb2_grpc.GatewayStub, cluster: dict
) -> None:
    """An external Redis restarted empty restarts version numbers at 1; a worker still
    holding version 2 used to refuse the new version 1 as superseded (NOT_FOUND) until it
    restarted. The first version's registration makes every worker forget its old copy."""
    import redis

    source = Path(cluster["root"]) / "adapters" / cluster["adapters"][2]
    request = gateway_pb2.RegisterAdapterRequest(adapter_id="reset/copy", source=str(source))
    stub.RegisterAdapter(request, timeout=60)
    assert stub.RegisterAdapter(request, timeout=60).adapter.version == 2
    _, chunks = collect(stub, chat(adapter_id="reset/copy", max_new_tokens=2))
    assert chunks[-1].finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED
    # what an emptied Redis holds for it: nothing (the rest of the registry stays, for the
    # other tests)
    client = redis.Redis.from_url(cluster["redis_url"])
    client.delete("plora:adapter:reset/copy", "plora:adapter_version:reset/copy")
    client.srem("plora:adapters", "reset/copy")
    time.sleep(1.1)  # the gateway reuses an adapter record for 1 s
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, chat(adapter_id="reset/copy", max_new_tokens=2))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.RegisterAdapter(request, timeout=60).adapter.version == 1
    for _ in range(2):  # wherever it is routed
        _, chunks = collect(stub, chat(adapter_id="reset/copy", max_new_tokens=2))
        assert chunks[-1].finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"adapter_id": "no-such-adapter"}, "not registered"),
    ],
)
def test_unknown_adapter_is_not_found(stub, kwargs, needle) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, chat(max_new_tokens=4, **kwargs))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert needle in err.value.details()


def _invalid_requests() -> list[tuple[str, gateway_pb2.GenerateRequest]]:
    cases = [
        ("empty prompt and no messages", gateway_pb2.GenerateRequest()),
        ("whitespace-only prompt", gateway_pb2.GenerateRequest(prompt=" \n", max_new_tokens=4)),
        ("whitespace-only message", chat(" ", max_new_tokens=4)),
        ("max_new_tokens 0", chat(max_new_tokens=0)),
        ("max_new_tokens negative", chat(max_new_tokens=-3)),
        ("max_new_tokens above limit", chat(max_new_tokens=100_000)),
        ("temperature negative", chat(temperature=-0.5)),
        ("top_p zero", chat(top_p=0.0)),
        ("top_p above one", chat(top_p=1.5)),
        (
            "prompt longer than the context",
            gateway_pb2.GenerateRequest(prompt="hello " * 9000, max_new_tokens=4),
        ),
    ]
    return cases


@pytest.mark.parametrize(
    ("name", "request_"), _invalid_requests(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_bad_generate_requests_are_invalid_argument(stub, name, request_) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    assert "Traceback" not in err.value.details()


def test_a_prompt_far_over_the_context_is_refused_before_it_is_encoded(stub) -> None:
    """A new user's 15 MB prompt was encoded whole before the context check: 29 s holding the
    worker (other requests' first tokens waited 36 s) and 5 GB of ids. A prompt whose length
    alone rules it out is now refused at once, naming its characters (encoding would have
    counted tokens); a request after it is served."""
    huge = gateway_pb2.GenerateRequest(prompt="x " * 1_000_000, max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub, huge)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the prompt has 2000000 characters, more than this worker's context of" in (
        err.value.details()
    )
    _, chunks = collect(stub, chat(max_new_tokens=2))
    assert chunks[-1].finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED


@pytest.mark.parametrize(
    ("make_source", "code"),
    [
        (lambda tmp: tmp / "missing", grpc.StatusCode.INVALID_ARGUMENT),
        (lambda tmp: tmp, grpc.StatusCode.INVALID_ARGUMENT),  # no adapter_config.json
        (
            lambda tmp: shared_data("adapters", "llama32_1b_desmason"),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
    ],
    ids=["missing-dir", "no-config", "shapes-do-not-fit"],
)
def test_bad_adapter_registration_leaves_nothing_behind(stub, tmp_path, make_source, code):
    before = {
        a.adapter_id
        for a in stub.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=10).adapters
    }
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterAdapter(
            gateway_pb2.RegisterAdapterRequest(
                adapter_id="bad-one", source=str(make_source(tmp_path))
            ),
            timeout=60,
        )
    assert err.value.code() == code
    assert err.value.details() and "Traceback" not in err.value.details()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        # the served model is named as the one the adapter does not fit, not as its origin
        assert "does not fit the served model 'SmolLM2-135M-Instruct'" in err.value.details()
    after = {
        a.adapter_id
        for a in stub.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=10).adapters
    }
    assert after == before
    with pytest.raises(grpc.RpcError) as err:
        stub.GetAdapter(gateway_pb2.GetAdapterRequest(adapter_id="bad-one"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_adapter_holding_nan_is_refused_at_registration(stub, tmp_path, model_dir) -> None:
    """A new user's adapter with one NaN registered (only the header was read) and then failed
    every request naming it, as a FAILED_PRECONDITION telling them to restore its files.
    Registration now scans the values and refuses it; nothing is registered."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    from plora.make_adapters import write_peft_adapter  # noqa: PLC0415
    from services.worker.model_loader import spec_from_dir  # noqa: PLC0415

    d = write_peft_adapter(
        tmp_path / "nan", spec_from_dir(model_dir), rank=8, alpha=16, seed=0,
        target_modules=("q_proj",),
    )  # fmt: skip
    weights = d / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights)
    request = gateway_pb2.RegisterAdapterRequest(adapter_id="nan-one", source=str(d))
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterAdapter(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_B holds NaN or Inf values" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.GetAdapter(gateway_pb2.GetAdapterRequest(adapter_id="nan-one"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_same_request_id_in_flight_from_two_tenants_is_served_for_both(stub) -> None:
    """A new user sent 6 requests with ``request_id="same-id"`` from 6 tenants at once: 4 got
    INVALID_ARGUMENT 'already in flight' from a worker, so one tenant could fail another's
    requests by reusing its ids. Ids are for tracing: all are served, each echoing its id."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    def one(i: int) -> list[gateway_pb2.GenerateResponse]:
        req = chat(max_new_tokens=12, request_id="same-id", tenant_id=f"tenant-{i}")
        return collect(stub, req)[1]

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    for chunks in results:
        assert chunks[-1].finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED
        assert {c.request_id for c in chunks} == {"same-id"}


def _gateway_ttft_count(cluster: dict) -> float:
    """``plora_gateway_ttft_seconds_count`` summed over its ``adapter_cold`` label."""
    text = urllib.request.urlopen(cluster["metrics"]["gateway"], timeout=10).read().decode()
    line = "plora_gateway_ttft_seconds_count{"
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def test_client_cancel_stops_generation_on_the_worker(stub, cluster: dict) -> None:
    before = _gateway_ttft_count(cluster)
    call = stub.Generate(
        chat("Tell me a very long story about dragons.", max_new_tokens=400), timeout=120
    )
    first = next(call)
    assert first.token_ids
    call.cancel()
    # its first token counts in the gateway's TTFT (it was observed only for finished streams)
    assert _gateway_ttft_count(cluster) == before + 1
    # The worker must drop the sequence (free its KV slot and adapter lease) promptly.
    deadline = time.monotonic() + 10
    workers = [worker_stub(cluster, a) for a in cluster["workers"].values()]
    while True:
        running = sum(
            w.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5).running
            for w in workers
        )
        if running == 0:
            break
        assert time.monotonic() < deadline, "worker kept generating after the client cancelled"
        time.sleep(0.1)
    # The cluster keeps serving.
    text, _ = collect(stub, chat(max_new_tokens=12))
    assert "Paris" in text
    wait_for_request_codes(cluster, "CANCELLED")


def wait_for_request_codes(cluster: dict, code: str, timeout: float = 10.0) -> None:
    """Wait until the gateway and some worker have counted a request ended with ``code``."""
    deadline = time.monotonic() + timeout
    while True:
        texts = {
            name: urllib.request.urlopen(url, timeout=10).read().decode()
            for name, url in cluster["metrics"].items()
        }
        gateway = f'plora_gateway_requests_total{{code="{code}"}}' in texts["gateway"]
        worker = any(
            f'plora_worker_requests_total{{code="{code}"}}' in t
            for name, t in texts.items()
            if name.startswith("worker")
        )
        if gateway and worker:
            return
        assert time.monotonic() < deadline, (
            f"{code} not counted (gateway {gateway}, worker {worker})"
        )
        time.sleep(0.2)


def test_client_deadline_is_counted_as_deadline_exceeded(stub, cluster: dict) -> None:
    """A stream ended by the client's deadline is counted ``DEADLINE_EXCEEDED`` by the gateway
    and the worker, the code the client saw (both counted it ``CANCELLED`` before)."""
    call = stub.Generate(
        chat("Tell me a very long story about dragons.", max_new_tokens=400), timeout=2.0
    )
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for_request_codes(cluster, "DEADLINE_EXCEEDED")
    text, _ = collect(stub, chat(max_new_tokens=12))
    assert "Paris" in text


def _worker_request_counts(cluster: dict, code: str) -> float:
    """Sum over the workers of ``plora_worker_requests_total{code=...}``."""
    line = f'plora_worker_requests_total{{code="{code}"}} '
    total = 0.0
    for name, url in cluster["metrics"].items():
        if name.startswith("worker"):
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            total += sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))
    return total


def test_a_short_deadline_is_counted_as_deadline_exceeded_by_the_workers(
    stub, cluster: dict
) -> None:
    """With deadlines of 50-100 ms the gateway cancels its call to the worker as its client's
    deadline passes, a moment before the worker's own clock passes the same deadline; the
    worker counted those ``CANCELLED`` (new-user trials), not the code the client saw."""
    cancelled = _worker_request_counts(cluster, "CANCELLED")
    for timeout in (0.05, 0.05, 0.05, 0.1, 0.1, 0.1):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(chat("Tell me a long story.", max_new_tokens=64), timeout=timeout))
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(1.0)  # the workers count a stream as it ends
    assert _worker_request_counts(cluster, "CANCELLED") == cancelled


def test_every_service_exports_prometheus_metrics(stub, cluster: dict) -> None:
    collect(stub, chat(max_new_tokens=4))
    texts = {
        name: urllib.request.urlopen(url, timeout=10).read().decode()
        for name, url in cluster["metrics"].items()
    }
    assert 'plora_gateway_requests_total{code="OK"}' in texts["gateway"]
    assert "plora_gateway_ttft_seconds_bucket" in texts["gateway"]
    assert "plora_gateway_worker_heartbeat_age_seconds" in texts["gateway"]
    worker_text = texts["worker-0"] + texts["worker-1"]
    for name in (
        "plora_worker_generated_tokens_total",
        "plora_worker_queue_length",
        "plora_worker_resident_adapters",
        "plora_worker_heartbeat_age_seconds",
        "plora_worker_pool_utilization_ratio",
        'plora_worker_pool_bytes{kind="room"}',
        "plora_worker_adapter_loads_waiting_for_room",
        'plora_worker_service_estimate_seconds{figure="decode_row"}',
    ):
        assert name in worker_text
    # the 4-token request's decode inter-token time, on the worker that served it
    tpot = re.findall(
        r"^plora_worker_time_per_output_token_seconds_count (\S+)$", worker_text, re.M
    )
    assert len(tpot) == 2 and sum(float(v) for v in tpot) >= 1
    assert "plora_predictor_events_received_total" in texts["predictor"]
    # the Prometheus file_sd targets name the same endpoints, one group per service
    groups = json.loads(Path(cluster["prometheus_targets"]).read_text())
    by_service = {g["labels"].get("worker", g["labels"]["service"]): g for g in groups}
    assert set(by_service) == set(cluster["metrics"])
    for name, url in cluster["metrics"].items():
        assert f"http://{by_service[name]['targets'][0]}/metrics" == url


def test_workers_stage_registered_adapters_in_host_memory(stub, cluster: dict) -> None:
    """plora (the launcher's default policy) reads every registered adapter into each worker's
    host cache ahead of demand: each one was read from the source on every worker, by a
    staging read or by a device load that came first."""
    from prometheus_client.parser import text_string_to_metric_families

    registered = stub.GetClusterStatus(
        gateway_pb2.GetClusterStatusRequest(), timeout=10
    ).adapters_registered

    def figures(url: str) -> dict[str, float]:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name + "".join(f"/{v}" for v in sample.labels.values())
                out[key] = sample.value
        return out

    deadline = time.monotonic() + 60
    for name in ("worker-0", "worker-1"):
        while True:
            f = figures(cluster["metrics"][name])
            read = f["plora_worker_host_stages_total"] + f.get(
                "plora_worker_adapter_loads_total/source", 0.0
            )
            if read >= registered and f["plora_worker_host_stages_queued"] == 0:
                break
            assert time.monotonic() < deadline, f"{name}: {read} of {registered} read: {f}"
            time.sleep(0.5)
        assert f["plora_worker_host_stages_total"] >= 1
        assert f["plora_worker_host_cache_bytes/used"] > 0
    # each heartbeat lists what its host cache holds, for the gateway's routing (step "host")
    from services.common.registry import Registry, connect

    time.sleep(1.5)  # a heartbeat after the last read
    adapters = {r.adapter_id for r in Registry(connect(cluster["redis_url"])).list_adapters()}
    for record in Registry(connect(cluster["redis_url"])).list_workers():
        assert set(record.host_cached) & adapters, record


def test_health_and_reflection_on_every_server(cluster: dict) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    addresses = [cluster["gateway"], cluster["predictor"], *cluster["workers"].values()]
    for address in addresses:
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
            responses = reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert any(n.startswith("plora.v1.") for n in names), (address, names)


def test_a_burst_is_spread_over_the_workers(stub) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: collect(stub, chat(max_new_tokens=16))[1][-1], range(4)))
    assert {r.worker_id for r in results} == {"worker-0", "worker-1"}


def test_pending_counts_return_to_zero(stub, cluster: dict) -> None:
    """The gateway's per-worker count of requests awaiting their first token (what routing
    balances first) goes back to 0 after served, cancelled and failed requests."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: collect(stub, chat(max_new_tokens=4)), range(3)))
    call = stub.Generate(chat("Tell me a long story.", max_new_tokens=200), timeout=120)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        collect(stub, chat(adapter_id="no-such-adapter"))
    deadline = time.monotonic() + 10
    while True:
        text = urllib.request.urlopen(cluster["metrics"]["gateway"], timeout=10).read().decode()
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("plora_gateway_worker_pending_requests{")
        ]
        if values and all(v == 0 for v in values):
            break
        assert time.monotonic() < deadline, f"pending counts stuck at {values}"
        time.sleep(0.1)


def test_generate_without_a_client_deadline(stub) -> None:
    """A client that sets no deadline (the README's Python example, grpcurl) is served."""
    chunks = list(stub.Generate(chat(max_new_tokens=12)))
    assert "Paris" in "".join(c.text for c in chunks)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_speculative_work_runs_at_background_priority(cluster: dict) -> None:
    """The predictor's tick (forecast, training, placement) and each worker's host-staging
    thread run at nice BACKGROUND_NICE, so on a shared CPU host they take idle time rather
    than the decode steps' cores; every other thread (serving, engine, demand loads) keeps
    the process's priority."""

    def nices(pid: int) -> list[int]:
        out = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            # /proc/<pid>/task/<tid>/stat: "tid (comm) state ..."; nice is field 19
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out.append(int(fields[16]))
        return out

    # the pids of now, not of start-up: another test may have had a child restarted
    pids = json.loads((Path(cluster["root"]) / "cluster.json").read_text())["pids"]
    for name, pid in pids.items():
        base = os.getpriority(os.PRIO_PROCESS, pid)  # the process's main thread
        background = max(base, BACKGROUND_NICE)
        if name == "gateway" or background == base:
            assert set(nices(pid)) == {base}, name
            continue
        deadline = time.monotonic() + 30
        while background not in nices(pid):
            assert time.monotonic() < deadline, f"{name}: no thread at background priority"
            time.sleep(0.2)
        values = nices(pid)
        assert values.count(background) == 1 and set(values) == {base, background}, name
