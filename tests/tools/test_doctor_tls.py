"""`kvtier doctor` reaches a redis tier over TLS as the tier does (issue 12, item 8), against
a real redis-server that speaks only TLS on 127.0.0.1, with a throwaway CA and server
certificate made for the test (tests/tls_certs.py). The tier over TLS:
tests/faults/test_redis_tls.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import TlsRedisServer
from tls_certs import Certs, make_certs, tls_redis_server

from kvtier.tools.ops.doctor import check_redis

pytestmark = pytest.mark.redis


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost, made now."""
    return make_certs(tmp_path / "certs")


@pytest.fixture
def tls_server(tmp_path: Path, certs: Certs) -> Iterator[TlsRedisServer]:
    """A redis-server speaking only TLS (port 0: no plain port), killed after the test."""
    with tls_redis_server(tmp_path / "redis-tls", certs) as server:
        yield server


def test_doctor_pings_over_tls_with_the_tiers_ca(tls_server: TlsRedisServer,
                                                 certs: Certs) -> None:
    """`kvtier doctor` reaches Redis as the tier does (issue 12, item 8): over TLS, verified
    against the config's CA; a plain PING of the URL could not even speak to this server."""
    tier = {"kind": "redis", "capacity": 0, "url": tls_server.url, "tls_ca_file": str(certs.ca)}
    [check] = check_redis({"tiers": [tier]})
    assert check.status == "ok" and "TLS" in check.detail, check
    plain = {"kind": "redis", "capacity": 0, "url": tls_server.url.replace("rediss", "redis")}
    [check] = check_redis({"tiers": [plain]})
    assert check.status == "fail"
