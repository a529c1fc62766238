"""The redis tier over TLS, against a real redis-server that speaks only TLS on 127.0.0.1,
with a throwaway CA and server certificate made for the test.

What must hold: a `rediss://` tier that trusts the CA round-trips chunks byte for byte; a tier
that cannot verify the server (no CA: the system CAs do not know ours), or that speaks plain
`redis://` to the TLS port, fails closed: every lookup and read misses, every write is dropped
and counted, nothing raises, and no byte of data comes back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_server import TlsRedisServer
from tierkit import key
from tls_certs import Certs, make_certs, tls_redis_server

from kvtier.core.layout import KVLayout
from kvtier.core.store import TieredStore
from kvtier.core.tier import UNAVAILABLE
from kvtier.errors import ConfigError
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis
TIMEOUT_MS = 500  # socket and connect timeouts: a TLS handshake on a loaded CI machine


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost, made now."""
    return make_certs(tmp_path / "certs")


@pytest.fixture
def tls_server(tmp_path: Path, certs: Certs) -> Iterator[TlsRedisServer]:
    """A redis-server speaking only TLS (port 0: no plain port), killed after the test."""
    with tls_redis_server(tmp_path / "redis-tls", certs) as server:
        yield server


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 13 + j) % 251 for j in range(layout.bytes_per_chunk))


def redis_store(layout: KVLayout, **settings: Any) -> TieredStore:
    """A store whose only tier is redis (so puts and reads go to it directly)."""
    return open_store(StoreConfig.parse({"tiers": [{
        "kind": "redis", "socket_timeout_ms": TIMEOUT_MS, "connect_timeout_ms": TIMEOUT_MS,
        "retry_max_s": 0.3, "part_bytes": 1536, **settings}]}), layout)


@pytest.mark.parametrize("tls_flag", [False, True], ids=["rediss-url", "tls-true-redis-url"])
def test_tls_with_the_ca_round_trips_chunks(tls_server: TlsRedisServer, layout: KVLayout,
                                            tls_flag: bool) -> None:
    """rediss:// (or `tls: true` with a redis:// url) + tls_ca_file: chunks (split in parts)
    come back byte for byte, and they are really on the server (a second store, on a new
    connection, finds them)."""
    keys = [key(i) for i in range(5)]
    url = tls_server.url.replace("rediss://", "redis://") if tls_flag else tls_server.url
    settings = {"url": url, "tls": tls_flag, "tls_ca_file": str(tls_server.ca)}
    with redis_store(layout, **settings) as store:
        assert all(store.put(k, memoryview(payload(i, layout))) for i, k in enumerate(keys))
        assert store.stats().tiers[0].puts == 5
    with redis_store(layout, **settings) as store:
        assert store.lookup(keys).tiers == ("redis",) * 5
        for i, k in enumerate(keys):
            out = bytearray(layout.bytes_per_chunk)
            assert store.get_into(k, memoryview(out)) == "redis"
            assert bytes(out) == payload(i, layout)
        stats = store.stats().tiers[0]
        assert stats.hits == 5 and stats.misses == 0 and stats.corrupt_reads == 0


@pytest.mark.parametrize(("settings", "why"), [
    pytest.param({}, "CERTIFICATE_VERIFY_FAILED", id="rediss-without-ca"),
    pytest.param({"url": "redis://127.0.0.1:{port}/0"}, "", id="plain-redis-url"),
])
def test_a_tier_that_cannot_verify_or_speak_tls_fails_closed(
        tls_server: TlsRedisServer, layout: KVLayout, settings: dict[str, Any], why: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Without the CA (verification on, against the system CAs) the handshake fails; plain
    redis:// to the TLS port gets no answer. Either way: misses and dropped writes, counted,
    no exception, and never a byte of data; the data the server holds stays out of reach."""
    with redis_store(layout, url=tls_server.url, tls_ca_file=str(tls_server.ca)) as trusted:
        assert trusted.put(key(0), memoryview(payload(0, layout)))  # held by the server
    url = settings.get("url", tls_server.url).format(port=tls_server.port)
    caplog.set_level(logging.DEBUG, logger="kvtier")
    with redis_store(layout, **{**settings, "url": url}) as store:
        for _attempt in range(3):  # the first fails on the handshake, the rest fail fast
            assert not store.put(key(1), memoryview(payload(1, layout)))
            assert store.lookup([key(0), key(1)]).num_chunks == 0
            out = bytearray(layout.bytes_per_chunk)
            assert store.get_into(key(0), memoryview(out)) is None
            assert out == bytearray(layout.bytes_per_chunk), "a miss wrote into the buffer"
            tier = store.tiers[0]
            out2 = bytearray(layout.bytes_per_chunk)
            assert tier.get_into(key(0), memoryview(out2)) == UNAVAILABLE  # the tier, too
            assert out2 == bytearray(layout.bytes_per_chunk)
        stats = store.stats().tiers[0]
        assert stats.puts == 0 and stats.hits == 0 and stats.bytes_read == 0
        assert stats.dropped_writes == 3 and stats.misses == 3
    assert why in caplog.text  # failed for the reason meant, not some other one
    with redis_store(layout, url=tls_server.url, tls_ca_file=str(tls_server.ca)) as trusted:
        assert trusted.lookup([key(0), key(1)]).tiers == ("redis",)  # key 1 never reached it


@pytest.mark.parametrize("ca", ["missing", "not a certificate", "a directory"])
def test_a_ca_file_that_cannot_be_loaded_is_a_config_error_naming_it(
        tmp_path: Path, layout: KVLayout, ca: str) -> None:
    """`tls_ca_file` at a wrong path (a secret mounted elsewhere), or at a file with no PEM
    certificate: one ConfigError naming the field when the store opens. Found in an operator
    drill: the TLS library read the file only when a connection opened, and the tier logged
    "Error 2 connecting to 127.0.0.1:<port>. No such file or directory." as the server being
    unavailable, retried for ever."""
    path = {"missing": tmp_path / "missing.pem", "a directory": tmp_path,
            "not a certificate": tmp_path / "ca.pem"}[ca]
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError) as refused:
        redis_store(layout, url="rediss://127.0.0.1:6390/0", tls_ca_file=str(path))
    assert refused.value.field.endswith("tls_ca_file") and refused.value.value == str(path)
