"""The s3 subjects of `kvtier bench storage --tier s3`: the s3 tier, and its ceiling, the raw
client's PUT/GET (boto3, the tier's client) of the same bytes (a stored chunk: header and
payload) as objects on the same server in the same round; plus the lookup time of a
512-chunk prefix (`lookup_figures`).

The raw subject is what any client pays to move the bytes; the tier adds the existence HEAD
before a put (put decides "held already?"), the join of header and body, the upload
checksum, and a verify-and-copy into the caller's buffer. The issue's target is tier >= 0.8x
raw, puts and gets alike.

Unless `KVTIER_BENCH_S3_ENDPOINT` (+ `_BUCKET`) names an endpoint, moto's S3 server (an
emulator: `pip install 'moto[server]'`) is started on 127.0.0.1 on a free port in a child
process with test credentials, and killed when the run ends: its figures measure kvtier's
overhead against the same server, not what a real S3 delivers.

Primitives: `local_s3` (context manager -> (endpoint URL, bucket)), `s3_subjects`,
`lookup_figures`, `LOOKUP_CHUNKS`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from kvtier.core.chunkformat import HEADER_BYTES
from kvtier.core.keys import ChunkKey
from kvtier.tiers import build_tier
from kvtier.tiers.s3.config import S3TierConfig
from kvtier.tiers.s3.tier import S3Tier
from kvtier.tools.bench.subjects import SizeBench, Subject, _timed, layout_for

START_TIMEOUT_S = 20.0
LOOKUP_CHUNKS = 512  # the prefix: 512 chunks (32k tokens of 64-token chunks)
BENCH_KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}


@contextmanager
def local_s3() -> Iterator[tuple[str, str]]:
    """(endpoint URL, bucket): KVTIER_BENCH_S3_ENDPOINT/_BUCKET, else a private moto server
    on 127.0.0.1, killed on exit.

    Raises:
        RuntimeError: moto is not installed or does not start.
    """
    url, bucket = os.environ.get("KVTIER_BENCH_S3_ENDPOINT"), os.environ.get(
        "KVTIER_BENCH_S3_BUCKET")
    if url and bucket:
        yield url, bucket
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    for name, value in BENCH_KEYS.items():
        os.environ.setdefault(name, value)
    # A session of its own: another machine's server, not a share of the caller's CPU group
    # (kvtier.tools.bench.node.BenchNode.start says why).
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url, bucket = f"http://127.0.0.1:{port}", "kvtier-bench"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                _client(url).create_bucket(Bucket=bucket)
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start (pip install "
                                       "'moto[server]')") from None
                time.sleep(0.1)
        yield url, bucket
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _client(url: str, threads: int = 1) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=Config(
        s3={"addressing_style": "path"}, max_pool_connections=max(10, threads),
        retries={"total_max_attempts": 1}, read_timeout=60))


def _config(url: str, bucket: str, prefix: str, **options: Any) -> S3TierConfig:
    # generous timeouts: the bench measures throughput, not failure handling
    return S3TierConfig.model_validate({
        "kind": "s3", "endpoint_url": url, "bucket": bucket, "key_prefix": prefix,
        "addressing_style": "path", "request_timeout_s": 60, "write_timeout_s": 60,
        "lookup_timeout_s": 60, **options})


def s3_subjects(bench: SizeBench, url: str, bucket: str, stack: ExitStack) -> list[Subject]:
    """[raw PUT/GET, the s3 tier] at `bench`'s chunk size, on the endpoint at `url`."""
    return [_raw(bench, url, bucket), _tier(bench, url, bucket, stack)]


def _raw(bench: SizeBench, url: str, bucket: str) -> Subject:
    client = _client(url, bench.threads)
    names = [f"bench-raw/{bench.size}/{i}" for i in range(bench.chunks)]
    header = bytes(HEADER_BYTES)

    def put(i: int) -> None:  # the same bytes the tier stores: a header and the payload
        client.put_object(Bucket=bucket, Key=names[i],
                          Body=b"".join((header, bench.view(bench.src, i))))

    def get(i: int) -> None:
        data = client.get_object(Bucket=bucket, Key=names[i])["Body"].read()
        if len(data) != HEADER_BYTES + bench.size:
            raise RuntimeError(f"raw GET lost a {bench.size} B object")

    def clean() -> None:
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": n} for n in names]})

    return Subject("s3_raw", _timed(lambda: bench.each(put)), _timed(lambda: bench.each(get)),
                   clean)


def _tier(bench: SizeBench, url: str, bucket: str, stack: ExitStack) -> Subject:
    tier = build_tier(_config(url, bucket, f"bench-{uuid.uuid4().hex[:8]}"), bench.layout)
    stack.callback(tier.close)

    def put(i: int) -> None:
        if not tier.put(bench.keys[i], bench.view(bench.src, i)):
            raise RuntimeError(f"s3 tier dropped a put of {bench.size} B")

    def get(i: int) -> None:
        if not tier.get_into(bench.keys[i], bench.view(bench.dst, i)):
            raise RuntimeError(f"s3 tier missed a chunk it holds ({bench.size} B)")

    def clean() -> None:
        for key in bench.keys:
            tier.delete(key)

    return Subject("s3", _timed(lambda: bench.each(put)), _timed(lambda: bench.each(get)),
                   clean)


def lookup_figures(url: str, bucket: str, chunks: int = LOOKUP_CHUNKS) -> dict[str, float]:
    """Seconds to look up a `chunks`-chunk prefix on the s3 tier: all held (parallel HEADs,
    the default `lookup_concurrency`), none held (cold), none held again (the negative
    cache, here kept for 60 s so that a slow emulator's first pass has not outlived it), and
    all held asked one HEAD after another (what a probe asked key by key costs).
    """
    layout = layout_for(64 * 1024)
    tier = build_tier(_config(url, bucket, f"bench-lookup-{uuid.uuid4().hex[:8]}",
                              negative_cache_s=60), layout)
    assert isinstance(tier, S3Tier)
    try:
        held = [ChunkKey(uuid.uuid4().bytes) for _ in range(chunks)]
        absent = [ChunkKey(uuid.uuid4().bytes) for _ in range(chunks)]
        data = memoryview(bytes(layout.bytes_per_chunk))
        for key in held:
            if not tier.put(key, data):
                raise RuntimeError("s3 tier dropped a put while filling the lookup prefix")

        def timed(keys: list[ChunkKey], expect: bool) -> float:
            start = time.perf_counter()
            found = tier.contains_many(keys)
            seconds = time.perf_counter() - start
            if found != [expect] * len(keys):
                raise RuntimeError("s3 tier's lookup answered wrongly")
            return seconds

        figures = {"chunks": float(chunks), "held_s": timed(held, True),
                   "absent_cold_s": timed(absent, False), "absent_cached_s": timed(absent, False)}
        start = time.perf_counter()
        if not all(tier.contains_many([key])[0] for key in held):
            raise RuntimeError("s3 tier's lookup answered wrongly")
        figures["held_one_by_one_s"] = time.perf_counter() - start
        figures["lookup_concurrency"] = float(tier._config.lookup_concurrency)
        for key in held:
            tier.delete(key)
        return figures
    finally:
        tier.close()
