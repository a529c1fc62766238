"""An S3 endpoint for tests: moto's standalone server (an S3 *emulator*, speaking the S3
protocol over HTTP; no real S3 server installs from the package registries here) in a child
process on 127.0.0.1 on a free port, or a real endpoint named by the environment:

    KVTIER_TEST_S3_ENDPOINT   e.g. https://minio.local:9000 (unset: moto)
    KVTIER_TEST_S3_BUCKET     an existing bucket the tests may write under a fresh prefix
    KVTIER_TEST_S3_REGION     default us-east-1
    credentials: the standard AWS environment / shared credentials file

Tests that must stop or break the server (tests/faults) need the emulator and skip against a
real endpoint. (Not named conftest.py: imported by name.)

Primitives: `S3Endpoint`, `MotoServer`, `real_endpoint`, `MOTO_SKIP`, `moto_available`,
`without_list_bucket`.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.testing.ports import free_port

START_TIMEOUT_S = 20.0
MOTO_SKIP = "moto[server] is not installed (pip install -e '.[test]')"
TEST_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def moto_available() -> bool:
    """Whether moto's server is installed (it runs in a process of its own). Not imported
    here: it imports flask, whose module-level proxies break vLLM's start-up scan of every
    loaded module (`hasattr` raises "Working outside of application context") for an engine
    started in this process afterwards (tests/engine/vllm_harness.start_engine)."""
    try:
        return importlib.util.find_spec("moto.server") is not None and \
            importlib.util.find_spec("flask") is not None
    except ImportError:  # `moto` itself absent
        return False


@dataclass(frozen=True)
class S3Endpoint:
    """Where tests put objects: an endpoint, a bucket, a region."""

    url: str
    bucket: str
    region: str = "us-east-1"
    emulated: bool = True  # moto (may be stopped, throttled, ...) or a real endpoint

    def settings(self, prefix: str | None = None) -> dict[str, Any]:
        """The s3 tier fields reaching it, under a fresh key prefix (tests never share one)."""
        return {"endpoint_url": self.url, "bucket": self.bucket, "region": self.region,
                "key_prefix": prefix or f"t-{uuid.uuid4().hex[:12]}",
                "addressing_style": "path", "retry_max_s": 1.0}

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.url, region_name=self.region,
                            config=Config(s3={"addressing_style": "path"},
                                          retries={"total_max_attempts": 2}))


def real_endpoint() -> S3Endpoint | None:
    """The endpoint the environment names, or None (then tests use moto)."""
    url = os.environ.get("KVTIER_TEST_S3_ENDPOINT")
    bucket = os.environ.get("KVTIER_TEST_S3_BUCKET")
    if not url or not bucket:
        return None
    return S3Endpoint(url, bucket, os.environ.get("KVTIER_TEST_S3_REGION", "us-east-1"),
                      emulated=False)


class MotoServer:
    """moto's S3 server in a child process on 127.0.0.1:`port`; `stop` kills it (as a crash
    would), `start` brings it back on the same port (empty: moto keeps nothing)."""

    def __init__(self, directory: Path, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, bucket: str = "kvtier-test") -> MotoServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"moto-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        self._wait_ready()
        if bucket:
            self.endpoint(bucket).client().create_bucket(Bucket=bucket)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited: see {self.directory}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"GET /moto-api/ HTTP/1.0\r\n\r\n")
                    if s.recv(16).startswith(b"HTTP/"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto server on port {self.port} did not start")
            time.sleep(0.05)

    def endpoint(self, bucket: str = "kvtier-test") -> S3Endpoint:
        return S3Endpoint(self.url, bucket)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts connections and never answers a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def without_list_bucket(client: Any) -> Any:
    """`client`, its answers made AWS's to credentials without s3:ListBucket (moto answers
    404 whatever the policy): 403 to a HEAD of the bucket (HeadBucket needs s3:ListBucket)
    and to a HEAD or GET of an object that does not exist, in AWS's reply shape (a HEAD's
    error has no body: its code is its status)."""
    for operation in ("HeadBucket", "HeadObject", "GetObject"):
        client.meta.events.register(f"after-call.s3.{operation}", _answer_without_list_bucket)
    return client


def _answer_without_list_bucket(http_response: Any, parsed: dict[str, Any], model: Any,
                                **_: Any) -> None:
    if http_response.status_code == 404 or model.name == "HeadBucket":
        http_response.status_code = 403
        code = "AccessDenied" if model.name == "GetObject" else "403"
        parsed["Error"] = {"Code": code, "Message": "Forbidden"}
        parsed["ResponseMetadata"]["HTTPStatusCode"] = 403
