"""Small shared test fixtures: a tiny Llama shape and a random transformers model of it, the
parsed flags of ``plora bench replay``, a service config built from its own flags, and a stub
of a cluster's worker that carries the cluster's internal token."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from services.common.types import ModelSpec

#: A tiny Llama-family shape (3 layers, GQA) for fast adapter and engine tests.
TINY = ModelSpec(
    name="tiny-llama",
    num_layers=3,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_llama(seed: int = 0):
    """A random ``LlamaForCausalLM`` with :data:`TINY`'s shapes (no download), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads,
        head_dim=TINY.head_dim,
        max_position_embeddings=TINY.max_position_embeddings,
        rms_norm_eps=TINY.rms_norm_eps,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def replay_args(flags: list[str]) -> argparse.Namespace:
    """``flags`` parsed exactly as ``plora bench replay`` parses them."""
    from plora.replay import bench

    parser = argparse.ArgumentParser(prog="plora bench replay")
    bench.add_arguments(parser)
    return parser.parse_args(flags)


def config_from_flags(config: Any, *argv: str) -> Any:
    """``config`` (a service's config class) built from ``argv`` exactly as the service's own
    command line builds it: its ``add_arguments`` parser, then ``from_args`` (flags, then
    ``PLORA_*`` environment, then defaults)."""
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_args(parser.parse_args(list(argv)))


def worker_stub(cluster: dict, address: str) -> Any:
    """A ``WorkerStub`` to ``address`` of the ``cluster`` fixture's cluster, sending its internal
    token (the worker refuses a call without it)."""
    from plora.v1 import worker_pb2_grpc  # noqa: PLC0415
    from services.common.internal_auth import internal_channel  # noqa: PLC0415

    return worker_pb2_grpc.WorkerStub(internal_channel(address, cluster["internal_token"]))
