"""Small shared test fixtures: a tiny Llama shape and a random transformers model of it, the
parsed flags of ``plora bench replay``, a service config built from its own flags, and a stub
of a cluster's worker that carries the cluster's internal token."""

from __future__ import annotations

import argparse
import contextlib
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


def write_tls_files(directory: Any) -> dict[str, str]:
    """A test CA, a server certificate it signed for ``localhost`` and ``127.0.0.1``, and a
    client certificate it signed, written as PEM files under ``directory``, made now with
    ``cryptography`` (valid for a day).

    Returns:
        Paths by name: ``ca``, ``server_cert``, ``server_key``, ``client_cert``, ``client_key``
        and ``other_ca`` (a second CA that signed neither).
    """
    import datetime
    import ipaddress
    from pathlib import Path

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def build(subject: str, issuer: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def write(stem: str, cert: x509.Certificate, key: Any) -> None:
        (out / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (out / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    def ca(stem: str) -> tuple[x509.Certificate, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            build(f"plora test {stem}", name(f"plora test {stem}"), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        write(stem, cert, key)
        return cert, key

    ca_cert, ca_key = ca("ca")
    ca("other_ca")
    for stem, usage, sans in (
        (
            "server",
            ExtendedKeyUsageOID.SERVER_AUTH,
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        ),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("plora-client")]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            build(f"plora test {stem}", ca_cert.subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        write(stem, cert, key)
    return {
        "ca": str(out / "ca.pem"),
        "other_ca": str(out / "other_ca.pem"),
        "server_cert": str(out / "server.pem"),
        "server_key": str(out / "server.key"),
        "client_cert": str(out / "client.pem"),
        "client_key": str(out / "client.key"),
    }


def worker_stub(cluster: dict, address: str) -> Any:
    """A ``WorkerStub`` to ``address`` of the ``cluster`` fixture's cluster, sending its internal
    token (the worker refuses a call without it)."""
    from plora.v1 import worker_pb2_grpc  # noqa: PLC0415
    from services.common.internal_auth import internal_channel  # noqa: PLC0415

    return worker_pb2_grpc.WorkerStub(internal_channel(address, cluster["internal_token"]))


def randomize_lora(pm: Any, seed: int, b_std: float) -> None:
    """Redraw every LoRA factor of the PEFT model ``pm`` in place: ``A ~ N(0, 1/in)`` and
    ``B ~ N(0, b_std^2)`` (PEFT starts B at zero, which would make every adapter a no-op)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
            elif "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def peft_reference(
    pm: Any, adapter: str | None, ids: list[int], new_tokens: int, **generate: Any
) -> tuple[torch.Tensor, list[int]]:
    """transformers + PEFT with ``adapter`` alone (``None``: the base, adapters disabled):
    float32 last-position logits of ``ids`` and the greedy continuation of ``new_tokens``
    tokens (``generate`` adds ``eos_token_id`` / ``pad_token_id``)."""
    x = torch.tensor([ids])
    ctx = pm.disable_adapter() if adapter is None else contextlib.nullcontext()
    if adapter is not None:
        pm.set_adapter(adapter)
    with ctx, torch.no_grad():
        logits = pm(input_ids=x).logits[0, -1].float()
        out = pm.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            do_sample=False,
            **generate,
        )
    return logits, out[0, len(ids) :].tolist()


def mixed_prefill_logits(
    model: Any, rows: list[tuple[str | None, list[int]]], adapters: dict[str, Any]
) -> torch.Tensor:
    """One prefill step of every row in ONE flat batch through ``model`` (a
    :class:`~services.worker.model.DecoderModel`), rows in the order given (adapters
    interleaved, base rows among them): ``[len(rows), vocab]`` last-position logits.

    Args:
        model: The decoder.
        rows: ``(adapter name or None, prompt ids)`` per sequence.
        adapters: ``name -> (layer, projection) -> LoRAModuleWeights``.
    """
    from services.worker.lora_ops import NO_ADAPTER, LoRABatch
    from services.worker.model import SeqChunk, StepBatch

    names = list(adapters)
    kv = model.new_kv_cache(len(rows), max(len(p) for _, p in rows) + 1)
    ids: list[int] = []
    pos: list[int] = []
    row_adapter: list[int] = []
    chunks, last = [], []
    for slot, (a, p) in enumerate(rows):
        chunks.append(SeqChunk(slot=slot, row=len(ids), num_tokens=len(p), start_pos=0))
        ids += p
        pos += range(len(p))
        row_adapter += [NO_ADAPTER if a is None else names.index(a)] * len(p)
        last.append(len(ids) - 1)
    lora = LoRABatch(row_adapter, [adapters[n] for n in names])
    batch = StepBatch(torch.tensor(ids), torch.tensor(pos), chunks, last, lora)
    return model.forward(batch, kv)


def random_lora(
    spec: Any,
    name: str,
    rank: int,
    targets: list[str],
    gen: torch.Generator,
    b_std: float = 0.2,
) -> Any:
    """A random :class:`~services.common.types.LoRAWeights` of ``rank`` on ``targets`` in
    every layer of a model of ``spec`` (A ~ N(0, 1/in), B ~ N(0, b_std^2), scaling
    16/rank)."""
    from services.common.types import LoRAModuleWeights, LoRAWeights

    mods = {}
    for layer in range(spec.num_layers):
        for mod in targets:
            din, dout = spec.module_shape(mod)
            a = torch.randn(rank, din, generator=gen) / din**0.5
            b = torch.randn(dout, rank, generator=gen) * b_std
            mods[(layer, mod)] = LoRAModuleWeights(a, b, 16.0 / rank)
    return LoRAWeights(name, 1, mods)


def engine_generate(
    engine: Any,
    rows: list[tuple[str | None, list[int]]],
    new_tokens: int,
    prefix: str = "r",
    ignore_eos: bool = False,
) -> list[list[Any]]:
    """Submit every ``(adapter or None, prompt ids)`` row to a started
    :class:`~services.worker.engine.Engine` at once (adapter version 1) and return each row's
    events, in row order."""
    from services.worker.adapter_api import AdapterRef
    from services.worker.engine import EngineRequest

    streams = [
        engine.submit(
            EngineRequest(
                f"{prefix}{i}",
                ids,
                max_new_tokens=new_tokens,
                ignore_eos=ignore_eos,
                adapter=AdapterRef(a, 1, "") if a else None,
            )
        )
        for i, (a, ids) in enumerate(rows)
    ]
    return [list(s) for s in streams]


def password_redis_up(proc: Any, port: int, password: str) -> Any:
    """Wait (10 s at most) until the Redis that ``proc`` started on ``port`` answers ``password``;
    check that it refuses a client without it (``NOAUTH``) and keeps an append-only file.
    Returns the authenticated ``redis.Redis`` client."""
    import socket
    import time

    import redis

    authed = redis.Redis(host="127.0.0.1", port=port, password=password)
    deadline = time.monotonic() + 10
    while True:
        try:
            assert authed.ping()
            break
        except redis.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(100).startswith(b"-NOAUTH")
    assert authed.config_get("appendonly") == {"appendonly": "yes"}
    return authed
