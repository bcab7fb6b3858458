"""``plora up --model DIR`` serves every family's small model and a PEFT adapter for it.

For each family in :data:`tests.tiny_models.FAMILIES` (quirks on: biases, sliding windows
shorter than the prompt, soft-capping, Phi-3's fused projections, scaled RoPE), the tiny model
is saved as an HF directory with its word-level tokenizer, a PEFT adapter is made for it
(Phi-3's on the fused ``qkv_proj`` / ``gate_up_proj``), and a one-worker cluster from
``plora up`` registers the adapter through the gateway and answers greedily, with the adapter
and without: the token ids equal ``transformers`` + PEFT's greedy ``generate``. The demo
adapter ``plora up`` writes for the family (on its own projections) serves exactly too. One
family (:data:`FROM_HUB_CACHE`) is served as ``--model org/name`` from a local Hugging Face
cache instead of a directory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from tests import tiny_models
from tests.conftest import run_plora_up

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

#: Prompt as text and as the word-level tokenizer's ids (``w<i>`` is id ``i``); longer than
#: the tiny models' sliding window.
PROMPT_IDS = [5, 9, 17, 33, 60, 100, 7, 250, 31, 12, 44, 90]
PROMPT = " ".join(f"w{i}" for i in PROMPT_IDS)
NEW_TOKENS = 8
ADAPTER_ID = "tiny-lora"
#: The family whose cluster gets ``--model acme/tiny-<family>`` from ``$HF_HUB_CACHE``.
FROM_HUB_CACHE = "qwen3"


def _adapter(family: str, model, out: Path):  # type: ignore[no-untyped-def]
    """A rank-8 PEFT adapter on every projection of ``family`` (random non-zero ``B``) saved
    at ``out``; returns the ``PeftModel``."""
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=tiny_models.projections(family), lora_dropout=0.0
    )
    pm = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: make the adapter matter
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pm.save_pretrained(str(out))
    return pm


def _greedy(pm, with_adapter: bool = True) -> list[int]:  # type: ignore[no-untyped-def]
    x = torch.tensor([PROMPT_IDS])
    ctx = contextlib.nullcontext() if with_adapter else pm.disable_adapter()
    with ctx, torch.no_grad():
        out = pm.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=tiny_models.EOS,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(PROMPT_IDS) :]]


@pytest.fixture(params=list(tiny_models.FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict, dict]]:
    """``(family, cluster state, reference tokens)``: a one-worker cluster on the tiny
    ``family`` model with the adapter's source at ``<root>/lora``; the reference is
    ``{"base": [...], "adapter": [...]}`` from transformers + PEFT."""
    family = str(request.param)
    hf = tiny_models.save(family, tmp_path / "model")
    pm = _adapter(family, hf, tmp_path / "lora")
    reference = {"base": _greedy(pm, False), "adapter": _greedy(pm, True)}
    assert reference["base"] != reference["adapter"], "the adapter must change the answer"
    flags = ["--workers", "1", "--demo-adapters", "1", "--demo-ranks", "4", "--pool-bytes", "16MiB"]
    model: Path | str = tmp_path / "model"
    env = {}
    if family == FROM_HUB_CACHE:
        cache = tmp_path / "hf-hub"
        tiny_models.put_in_hub_cache(tmp_path / "model", cache, f"acme/tiny-{family}")
        model, env = f"acme/tiny-{family}", {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    for state in run_plora_up(tmp_path, model, flags, env):  # type: ignore[arg-type]
        yield family, state, reference


def _generate(stub: gateway_pb2_grpc.GatewayStub, adapter_id: str) -> list[int]:
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT, adapter_id=adapter_id, max_new_tokens=NEW_TOKENS, temperature=0.0
    )
    return [int(t) for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids]


def test_plora_up_serves_the_family_and_its_adapter_exactly(
    served: tuple[str, dict, dict], tmp_path: Path
) -> None:
    family, state, reference = served
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(state["gateway"]))
    info = stub.RegisterAdapter(
        gateway_pb2.RegisterAdapterRequest(adapter_id=ADAPTER_ID, source=str(tmp_path / "lora")),
        timeout=60,
    ).adapter
    assert info.rank == 8
    status = stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), timeout=10)
    model_name = f"tiny-{family}" if family == FROM_HUB_CACHE else "model"
    assert status.base_model == model_name  # the Hub cache's snapshot shows as the repo's name
    assert _generate(stub, "") == reference["base"], family
    assert _generate(stub, ADAPTER_ID) == reference["adapter"], family

    (demo,) = state["adapters"]
    demo_model = peft.PeftModel.from_pretrained(
        tiny_models.build(family), str(Path(state["root"]) / "adapters" / demo)
    )
    assert _generate(stub, demo) == _greedy(demo_model), family
