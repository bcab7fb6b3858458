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
