"""A throwaway CA and server certificate for TLS servers in tests (redis-server over TLS),
made with the `cryptography` package, or the `openssl` CLI without it. (Not named
conftest.py: imported by name.)

Primitives: `Certs`, `make_certs`, `tls_redis_server`.
"""

from __future__ import annotations

import contextlib
import datetime
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis_server import REDIS_SERVER, SKIP_REASON, TlsRedisServer


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


def make_certs(directory: Path) -> Certs:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost under `directory`,
    made now; skips the test when neither `cryptography` nor `openssl` is there."""
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


@contextlib.contextmanager
def tls_redis_server(directory: Path, certs: Certs) -> Iterator[TlsRedisServer]:
    """A redis-server speaking only TLS (port 0: no plain port), killed at the exit; skips
    the test without redis-server or when it was built without TLS."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = TlsRedisServer(directory, certs.cert, certs.key, certs.ca)
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
