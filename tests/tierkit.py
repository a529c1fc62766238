"""Test helpers shared by tests/cache, tests/tiers, tests/faults, tests/connector and
tests/tools: chunk keys (`key`), a tiny layout, one way to configure any tier by kind, and
`until` (a condition polled to a deadline: a tier back after its backoff).
(Not named conftest.py, so that `from tierkit import` never picks up another folder's
conftest module.)

`tier_settings(kind, ...)` is the single place that knows how each tier kind is configured;
the contract suite, the store's property tests and the fault drills all build tiers through
it. To run all of them against a new tier, add its kind to TIER_KINDS and a branch here. The
redis tier takes its server from REDIS_URL, which tests/conftest.py sets for tests
parametrized with kind="redis" (and marks them `redis`); the s3 tier its endpoint from
S3_ENDPOINT (moto's server, or KVTIER_TEST_S3_*: tests/s3_server.py).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.core.chunkformat import ALIGN_BYTES, HEADER_BYTES, stored_size
from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.tier import Tier
from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig

if TYPE_CHECKING:
    import pytest

TIER_KINDS = ("memory", "disk", "shared", "redis", "s3", "example")
REDIS_URL: str | None = None  # the redis-server of the running test (tests/conftest.py)
S3_ENDPOINT: Any = None  # the s3_server.S3Endpoint of the running test (tests/conftest.py)
# Kinds whose capacity is enforced by a periodic listing, not on every put (the s3 tier:
# tests/tiers/test_s3_tier.py checks its bound): the suite's exact-capacity tests skip them.
PERIODIC_CAPACITY = frozenset({"s3"})


def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether `condition()` held within `timeout_s`, asked every 50 ms."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def key(i: int) -> ChunkKey:
    """The i-th test key: `i` big-endian in KEY_BYTES bytes (distinct, and sorted like i)."""
    return ChunkKey(i.to_bytes(KEY_BYTES, "big"))


def tiny_layout(tokens_per_chunk: int = 16) -> KVLayout:
    """1 layer x 1 KV head x 64 fp16 elements, K and V: 256 B a token (4 KiB a 16-token chunk)."""
    return KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                    tokens_per_chunk=tokens_per_chunk)


def footprint_bytes(kind: str, layout: KVLayout) -> int:
    """Bytes one chunk takes against a tier's capacity (slot or file, headers included)."""
    if kind == "memory":
        return -(-layout.bytes_per_chunk // ALIGN_BYTES) * ALIGN_BYTES
    if kind == "redis":  # a header value and the unpadded payload
        return HEADER_BYTES + layout.bytes_per_chunk
    if kind == "s3":  # one object: the header and the payload
        return HEADER_BYTES + layout.bytes_per_chunk
    if kind == "example":  # the payload, as a bytes value
        return layout.bytes_per_chunk
    return stored_size(layout.bytes_per_chunk)


def tier_settings(kind: str, root: Path, layout: KVLayout, capacity_chunks: int,
                  **options: Any) -> dict[str, Any]:
    """The config dict of a `kind` tier holding `capacity_chunks` chunks of `layout`."""
    settings: dict[str, Any] = {"kind": kind,
                                "capacity": capacity_chunks * footprint_bytes(kind, layout)}
    if kind in ("disk", "shared"):
        settings["path"] = str(root / kind)
    if kind == "memory":
        settings["pin"] = "off"
    if kind == "redis":  # parts of 1.5 KiB: a 4 KiB chunk is stored as 3 parts
        assert REDIS_URL, "use the redis_url fixture (tests/conftest.py sets REDIS_URL)"
        settings.update(url=REDIS_URL, part_bytes=1536, retry_max_s=1.0)
    if kind == "s3":  # a key prefix of `root`'s in the session's bucket (root: the test's)
        assert S3_ENDPOINT is not None, "use the s3_session fixture (tests/conftest.py)"
        root_hash = hashlib.blake2b(str(root).encode(), digest_size=8).hexdigest()
        settings.update(S3_ENDPOINT.settings(f"t-{root_hash}"))
    settings.update(options)
    return settings


def s3_object(tier: Tier, k: ChunkKey) -> bytes:
    """The s3 tier's object of chunk `k`, as stored (read with a client of its own)."""
    name = tier.names.chunk(k)  # type: ignore[attr-defined]
    client = S3_ENDPOINT.client()
    return bytes(client.get_object(Bucket=S3_ENDPOINT.bucket, Key=name)["Body"].read())


def s3_write(tier: Tier, k: ChunkKey, data: bytes) -> None:
    """Overwrite the s3 tier's object of chunk `k` (damage, forgery)."""
    name = tier.names.chunk(k)  # type: ignore[attr-defined]
    S3_ENDPOINT.client().put_object(Bucket=S3_ENDPOINT.bucket, Key=name, Body=data)


def make_tier(kind: str, root: Path, layout: KVLayout, capacity_chunks: int,
              **options: Any) -> Tier:
    """A real tier of `kind`, built through the registry as a store would build it."""
    config = StoreConfig.parse({"tiers": [tier_settings(kind, root, layout, capacity_chunks,
                                                        **options)]})
    return build_tier(config.tiers[0], layout)


def put_once_remeasured(tier: Any, k: ChunkKey, data: memoryview, attempts: int = 100) -> bool:
    """Put `k` into a shared tier whose quota only a re-measure can repair: after each put
    refused, wait for the re-measure it claimed (its thread) to end, and for a moment (a
    `scan_interval_s` of a few ms) before the next. Bounded by attempts, not by a clock: on a
    loaded machine the walk takes what it takes."""
    for _ in range(attempts):
        if tier.put(k, data):
            return True
        walk = tier._remeasuring
        if walk is not None:
            walk.join()
        time.sleep(min(tier.scan_interval_s, 0.01))
    return False


@contextmanager
def write_in_flight(tier: Any, monkeypatch: pytest.MonkeyPatch,
                    put: Callable[[], object]) -> Iterator[None]:
    """`put()` on a thread of its own, its file write held (a file tier's `files.write`)
    while the block runs: a write in flight, as the write-behind's other threads see it.
    Other writes go through; the held one finishes when the block ends."""
    writing, finish = threading.Event(), threading.Event()
    real_write = tier.files.write

    def held_write(*args: object) -> None:
        writing.set()
        finish.wait(30)
        real_write(*args)

    monkeypatch.setattr(tier.files, "write", held_write)
    in_flight = threading.Thread(target=put)
    in_flight.start()
    try:
        assert writing.wait(30), "the put did not reach its write"
        monkeypatch.setattr(tier.files, "write", real_write)
        yield
    finally:
        finish.set()
        in_flight.join(60)


# -- the border between the cache and the tools (tests/cache, tests/connector) ---------------
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def tools_dependencies() -> list[str]:
    """The distributions of pyproject's `tools` extra, by their import names."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    names = [dep.split(">")[0].split("=")[0].split("[")[0]
             for dep in project["optional-dependencies"]["tools"]]
    assert names, "pyproject names no tools extra"
    return names


def run_probe(probe: str) -> list[str]:
    """The JSON list that the Python code `probe` prints, run in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                            text=True)
    return list(json.loads(result.stdout))
