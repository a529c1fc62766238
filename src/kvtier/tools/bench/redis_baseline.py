"""The redis subjects of `kvtier bench storage --tier redis`: the redis tier, and its ceiling,
raw SET/GET of values of the same size through redis-py pipelines on the same server in the
same round (what `redis-benchmark -t set,get -d SIZE -P N` measures, minus its C client).

The raw subject is what any client pays to move the bytes; the tier adds its header value,
the split into parts, a verify-and-copy into the caller's buffer and the existence check
before a put. The issue's target is tier >= 0.7x raw, puts and gets alike.

Unless `url` is given, a private redis-server is started on 127.0.0.1 on a free port, with
persistence off, and killed when the run ends.

Primitives: `local_redis` (context manager -> URL), `redis_subjects`, `PIPELINE_DEPTH`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import redis

from kvtier.tiers import build_tier
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tools.bench.subjects import SizeBench, Subject, _timed

PIPELINE_DEPTH = 4  # commands in flight per thread for the raw subject (redis-benchmark -P)
START_TIMEOUT_S = 10.0


@contextmanager
def local_redis(directory: Path | None = None) -> Iterator[str]:
    """A private redis-server on 127.0.0.1, killed on exit; yields its URL.

    Raises:
        RuntimeError: redis-server is not installed or does not start.
    """
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    work = Path(tempfile.mkdtemp(prefix=".kvtier-redis-", dir=directory))
    # A session of its own: another machine's server, not a share of the caller's CPU group
    # (kvtier.tools.bench.node.BenchNode.start says why).
    proc = subprocess.Popen([server, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(work)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def redis_subjects(bench: SizeBench, url: str, stack: ExitStack) -> list[Subject]:
    """[raw SET/GET, the redis tier] at `bench`'s chunk size, on the server at `url`."""
    return [_raw(bench, url, stack), _tier(bench, url, stack)]


def _raw(bench: SizeBench, url: str, stack: ExitStack) -> Subject:
    client = redis.Redis.from_url(url, socket_timeout=60)
    stack.callback(client.close)
    names = [f"bench-raw:{bench.size}:{i}" for i in range(bench.chunks)]

    def batches(first: int) -> Iterator[list[int]]:
        mine = list(range(first, bench.chunks, bench.threads))
        for start in range(0, len(mine), PIPELINE_DEPTH):
            yield mine[start : start + PIPELINE_DEPTH]

    def put_thread(first: int) -> None:
        for batch in batches(first):
            pipe = client.pipeline(transaction=False)
            for i in batch:
                pipe.set(names[i], bench.view(bench.src, i))
            pipe.execute()

    def get_thread(first: int) -> None:
        for batch in batches(first):
            pipe = client.pipeline(transaction=False)
            for i in batch:
                pipe.get(names[i])
            for value in pipe.execute():
                if value is None or len(value) != bench.size:
                    raise RuntimeError(f"raw GET lost a {bench.size} B value")

    def per_thread(body: Callable[[int], None]) -> None:
        # One body per thread (not per chunk, as SizeBench.each), each pipelining its stride.
        with ThreadPoolExecutor(bench.threads) as pool:
            list(pool.map(body, range(bench.threads)))

    def clean() -> None:
        client.delete(*names)

    return Subject("redis_raw", _timed(lambda: per_thread(put_thread)),
                   _timed(lambda: per_thread(get_thread)), clean)


def _tier(bench: SizeBench, url: str, stack: ExitStack) -> Subject:
    # capacity 0: no LRU index (the server bounds memory), as on a dedicated cache server;
    # generous timeouts: the bench measures throughput, not failure handling.
    config = RedisTierConfig.model_validate({
        "kind": "redis", "url": url, "capacity": 0, "socket_timeout_ms": 60_000,
        "connect_timeout_ms": 5_000})
    tier = build_tier(config, bench.layout)
    stack.callback(tier.close)

    def put(i: int) -> None:
        if not tier.put(bench.keys[i], bench.view(bench.src, i)):
            raise RuntimeError(f"redis tier dropped a put of {bench.size} B")

    def get(i: int) -> None:
        if not tier.get_into(bench.keys[i], bench.view(bench.dst, i)):
            raise RuntimeError(f"redis tier missed a chunk it holds ({bench.size} B)")

    def clean() -> None:
        for key in bench.keys:
            tier.delete(key)

    return Subject("redis", _timed(lambda: bench.each(put)), _timed(lambda: bench.each(get)),
                   clean)
