"""The redis tier over TLS, against a real redis-server that speaks only TLS on 127.0.0.1,
with a throwaway CA and server certificate made for the test.

What must hold: a `rediss://` tier that trusts the CA round-trips chunks byte for byte; a tier
that cannot verify the server (no CA: the system CAs do not know ours), or that speaks plain
`redis://` to the TLS port, fails closed: every lookup and read misses, every write is dropped
and counted, nothing raises, and no byte of data comes back.
"""

from __future__ import annotations

import datetime
import logging
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis_server import REDIS_SERVER, SKIP_REASON, TlsRedisServer
from tierkit import key

from kvtier.core.layout import KVLayout
from kvtier.core.store import TieredStore
from kvtier.core.tier import UNAVAILABLE
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.redis
TIMEOUT_MS = 500  # socket and connect timeouts: a TLS handshake on a loaded CI machine


@dataclass(frozen=True, slots=True)
class Certs:
    ca: Path  # the CA's certificate (PEM)
    cert: Path  # the server's certificate for 127.0.0.1 and localhost, signed by the CA
    key: Path  # the server's private key (PEM, unencrypted)


def _make_certs_cryptography(directory: Path) -> Certs:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    server_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())

    def builder(subject: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name)
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    ca = (builder(ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    server = (builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]),
                      server_key.public_key())
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.SubjectAlternativeName([
                  x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                  critical=False)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                             critical=False)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()),
                             critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))
    certs = Certs(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    certs.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certs.cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    certs.key.write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption()))
    certs.key.chmod(0o600)
    return certs


def _make_certs_openssl(directory: Path, openssl: str) -> Certs:
    certs = Certs(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    ca_key, csr, ext = directory / "ca.key", directory / "server.csr", directory / "server.ext"
    ext.write_text("basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n"
                   "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    for argv in (
        ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", ca_key, "-out", certs.ca, "-days", "1", "-subj", "/CN=kvtier test CA"],
        ["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-keyout", certs.key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", certs.ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", certs.cert, "-days", "1", "-extfile", ext],
    ):
        subprocess.run([openssl, *map(str, argv)], check=True, capture_output=True, timeout=30)
    return certs


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost, made now."""
    directory = tmp_path / "certs"
    directory.mkdir()
    try:
        import cryptography  # noqa: F401
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("neither the `cryptography` package nor the `openssl` CLI is available "
                        "to make a test certificate")
        return _make_certs_openssl(directory, openssl)
    return _make_certs_cryptography(directory)


@pytest.fixture
def tls_server(tmp_path: Path, certs: Certs) -> Iterator[TlsRedisServer]:
    """A redis-server speaking only TLS (port 0: no plain port), killed after the test."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = TlsRedisServer(tmp_path / "redis-tls", certs.cert, certs.key, certs.ca)
    try:
        try:
            server.start()
        except RuntimeError:
            if "tls-port" in server.log_text():  # "Bad directive": built without TLS
                pytest.skip("this redis-server was built without TLS (it refuses --tls-port)")
            raise
        yield server
    finally:
        server.stop()


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


def test_doctor_pings_over_tls_with_the_tiers_ca(tls_server: TlsRedisServer,
                                                 certs: Certs) -> None:
    """`kvtier doctor` reaches Redis as the tier does (issue 12, item 8): over TLS, verified
    against the config's CA; a plain PING of the URL could not even speak to this server."""
    from kvtier.tools.ops.doctor import check_redis

    tier = {"kind": "redis", "capacity": 0, "url": tls_server.url, "tls_ca_file": str(certs.ca)}
    [check] = check_redis({"tiers": [tier]})
    assert check.status == "ok" and "TLS" in check.detail, check
    plain = {"kind": "redis", "capacity": 0, "url": tls_server.url.replace("rediss", "redis")}
    [check] = check_redis({"tiers": [plain]})
    assert check.status == "fail"
