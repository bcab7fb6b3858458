"""Bounded adapter inspection on a live cluster (``plora up``): adapters built to hold a
gateway (a pathological ``target_modules`` regex, a 50 MB config, a header claiming 100 MB, a
rank of 65,536) are each refused INVALID_ARGUMENT within 10 s while a ``Generate`` stream on
the same gateway keeps receiving tokens, never more than 1 s apart."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from tests.adapter_builders import claim_header, copy_adapter, edit_config, pad_config

pytestmark = pytest.mark.slow

#: A prompt the base model answers at length (greedy), so the stream outlasts the
#: registrations.
LONG_PROMPT = "Count from 1 to 500, one number per line, with no other text."


def _bad_adapters(cluster: dict) -> dict[str, Path]:
    """The four adapters, each a copy of a demo adapter in the cluster's adapter directory."""
    demo = Path(cluster["root"]) / "adapters" / cluster["adapters"][0]
    base = Path(cluster["root"]) / "adapters" / f"bounds-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    return {
        "pathological target_modules": edit_config(
            copy_adapter(demo, base / "regex"), target_modules="(.|.|.)*Z"
        ),
        "50 MB adapter_config.json": pad_config(copy_adapter(demo, base / "config"), 50_000_000),
        "header claiming 100 MB": claim_header(copy_adapter(demo, base / "header"), 100_000_000),
        "rank 65536": edit_config(copy_adapter(demo, base / "rank"), r=65536),
    }


def test_bad_adapters_are_refused_fast_while_a_stream_keeps_flowing(cluster: dict) -> None:
    bad = _bad_adapters(cluster)
    channel = grpc.insecure_channel(cluster["gateway"])
    stub = gateway_pb2_grpc.GatewayStub(channel)
    request = gateway_pb2.GenerateRequest(max_new_tokens=400, temperature=0.0)
    request.messages.add(role="user", content=LONG_PROMPT)

    arrivals: list[float] = []
    errors: list[BaseException] = []
    first = threading.Event()

    def stream() -> None:
        try:
            for _chunk in stub.Generate(request, timeout=300):
                arrivals.append(time.monotonic())
                first.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            first.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first.wait(120), "the stream produced no token in 120 s"

    refusals: dict[str, tuple[grpc.StatusCode, float, str]] = {}
    for name, source in bad.items():
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterAdapter(
                gateway_pb2.RegisterAdapterRequest(
                    adapter_id=f"bounds/{source.name}", source=str(source)
                ),
                timeout=60,
            )
        refusals[name] = (err.value.code(), time.monotonic() - t0, err.value.details() or "")
    registrations_done = time.monotonic()
    reader.join(300)
    channel.close()

    assert not errors, f"the stream failed: {errors[0]!r}"
    for name, (code, seconds, details) in refusals.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {code} {details}"
        assert seconds < 10, f"{name}: refused after {seconds:.1f} s"
    assert "target_modules" in refusals["pathological target_modules"][2]
    assert "--max-adapter-config-bytes" in refusals["50 MB adapter_config.json"][2]
    assert "--max-safetensors-header-bytes" in refusals["header claiming 100 MB"][2]
    assert "--max-lora-rank" in refusals["rank 65536"][2]
    assert arrivals[-1] > registrations_done, (
        "the stream ended before the registrations did: nothing overlapped"
    )
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    print(  # the figures beside the bounds (10 s per refusal, 1 s between tokens)
        "refused in "
        + ", ".join(f"{name} {seconds:.2f} s" for name, (_, seconds, _) in refusals.items())
        + f"; longest gap between tokens {max(gaps):.2f} s over {len(arrivals)} tokens"
    )
    assert max(gaps) < 1.0, f"the stream waited {max(gaps):.2f} s between two tokens"
