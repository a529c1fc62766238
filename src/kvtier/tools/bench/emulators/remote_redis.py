"""A redis-server across an emulated network, for benches whose loads should not ride on bare
loopback (`kvtier bench interference --tier redis`, issue 13): a private server
(`kvtier.tools.bench.redis_baseline.local_redis`) behind the delaying, bandwidth-capped proxy of
`kvtier.testing.netem`.

Primitives: `RemoteRedis`, `remote_redis`, `stored_chunks`, `PING_SAMPLES`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import redis

from kvtier.testing.netem import delayed_proxy
from kvtier.tools.bench.redis_baseline import local_redis

PING_SAMPLES = 21  # PINGs through the proxy whose median is reported


@dataclass(frozen=True, slots=True)
class RemoteRedis:
    """A private redis-server and the emulated network in front of it."""

    url: str  # the server itself, on loopback (for the bench's own bookkeeping)
    proxy_url: str  # the same server through the emulated network (for the engine)
    ping_ms: float  # median PING round trip through the proxy, idle, measured at the start


@contextmanager
def remote_redis(directory: Path, delay_ms: float,
                 bandwidth_gbps: float | None) -> Iterator[RemoteRedis]:
    """A redis-server (files under `directory`) behind a proxy adding `delay_ms` each way
    and capping each direction at `bandwidth_gbps`; both stopped on exit.

    Raises:
        ConfigError: a bad delay or cap (kvtier.testing.netem.delayed_proxy).
        RuntimeError: redis-server or the proxy did not start.
    """
    with local_redis(directory) as url:
        port = urlsplit(url).port
        assert port is not None  # local_redis's URL names one
        with delayed_proxy("127.0.0.1", port, delay_ms, bandwidth_gbps) as proxy:
            client = redis.Redis(host=proxy.host, port=proxy.port)
            try:
                samples = []
                for _ in range(PING_SAMPLES):
                    started = time.perf_counter()
                    client.ping()
                    samples.append(time.perf_counter() - started)
            finally:
                client.close()
            yield RemoteRedis(url, f"redis://{proxy.host}:{proxy.port}/0",
                              statistics.median(samples) * 1e3)


def stored_chunks(url: str, key_prefix: str = "kvtier:") -> int:
    """Chunks of every namespace on the server at `url`: the redis tier's chunk hashes,
    `<key_prefix><digest>:{<key hex>}:c` (kvtier.tiers.redis.names); LRU sets and manifests are
    not counted."""
    client = redis.Redis.from_url(url)
    try:
        return sum(1 for _ in client.scan_iter(match=f"{key_prefix}*}}:c", count=1000))
    finally:
        client.close()
