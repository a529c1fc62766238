"""Fault drills of the s3 tier against moto's S3 server (an emulator) on 127.0.0.1: the
server killed, a server that accepts and never answers, throttling (503 SlowDown from a
small proxy in front of moto), corrupt and truncated objects, foreign objects under the
prefix, credentials missing or refused. Each must cost hits or writes, counted, never a
hang, never wrong KV, and never show a secret.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from s3_server import TEST_KEYS, MotoServer, S3Endpoint, SilentServer
from tierkit import key, tiny_layout

from kvtier.core.chunkformat import HEADER_BYTES
from kvtier.core.layout import KVLayout
from kvtier.core.tier import MISSING, OK, Failure
from kvtier.errors import ConfigError
from kvtier.tiers import build_tier
from kvtier.tiers.s3.inventory import S3Inventory
from kvtier.tiers.s3.tier import S3Tier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.s3
SECRET = "s3cr3t-Value-That-Must-Never-Show"


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 29 + j * 13) % 253 for j in range(layout.bytes_per_chunk))


def s3_tier(url: str, layout: KVLayout, **options: Any) -> S3Tier:
    settings: dict[str, Any] = {
        "kind": "s3", "endpoint_url": url, "bucket": "kvtier-test", "key_prefix": "faults",
        "addressing_style": "path", "connect_timeout_s": 0.5, "request_timeout_s": 0.5,
        "lookup_timeout_s": 0.5, "write_timeout_s": 1.0, "retry_max_s": 0.5, **options}
    return _build(settings, layout)


def shared_tier(endpoint: S3Endpoint, layout: KVLayout) -> S3Tier:
    """A tier on the session's endpoint (moto, or KVTIER_TEST_S3_*) under a fresh prefix."""
    return _build({"kind": "s3", **endpoint.settings()}, layout)


def _build(settings: dict[str, Any], layout: KVLayout) -> S3Tier:
    tier = build_tier(StoreConfig.parse({"tiers": [settings]}).tiers[0], layout)
    assert isinstance(tier, S3Tier)
    return tier


@pytest.mark.timing
def test_a_killed_server_costs_misses_and_drops_then_the_tier_recovers(
        s3_server: MotoServer) -> None:
    """Stored, then the server is killed: reads miss, lookups say absent, writes drop, each
    in about one timeout at most and then (breaker open) without I/O; a new server on the
    same port is used again once the backoff has passed."""
    layout = tiny_layout()
    tier = s3_tier(s3_server.url, layout)
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    s3_server.stop()
    out = memoryview(bytearray(layout.bytes_per_chunk))
    started = time.monotonic()
    assert tier.get_into(key(1), out).failure is Failure.UNAVAILABLE
    assert tier.contains_many([key(1), key(2)]) == [False, False]
    assert not tier.put(key(3), memoryview(payload(3, layout)))
    assert time.monotonic() - started < 2.0
    fast = time.monotonic()
    for _ in range(50):  # the breaker is open: no connection attempts
        assert not tier.get_into(key(1), out)
    assert time.monotonic() - fast < 0.5
    stats = tier.stats()
    assert stats.misses >= 51 and stats.dropped_writes == 1 and stats.hits == 0
    s3_server.start()  # empty, same port
    deadline = time.monotonic() + 5
    while not tier.put(key(4), memoryview(payload(4, layout))):
        assert time.monotonic() < deadline, "the tier never used the server again"
        time.sleep(0.1)
    assert tier.get_into(key(4), out) == OK and bytes(out) == payload(4, layout)
    tier.close()


def test_lookups_alone_find_a_restarted_server_again(s3_server: MotoServer) -> None:
    """The endpoint goes down and comes back while only lookups run (a scheduler's probe
    does nothing else): once the backoff has passed, one HEAD probes it and lookups answer
    again (regression: a lookup claimed the breaker's probe and never reported back)."""
    layout = tiny_layout()
    tier = s3_tier(s3_server.url, layout)
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    s3_server.stop()
    for _ in range(3):
        assert tier.contains_many([key(1)]) == [False]
        time.sleep(0.3)
    s3_server.start()
    tier2 = s3_tier(s3_server.url, layout)
    assert tier2.put(key(1), memoryview(payload(1, layout))) == OK
    deadline = time.monotonic() + 5
    while tier.contains_many([key(1)]) != [True]:
        assert time.monotonic() < deadline, "lookups never used the server again"
        time.sleep(0.1)
    assert tier.available()
    tier.close()
    tier2.close()


def test_a_lookup_past_lookup_timeout_s_is_counted_as_a_lookup_timeout(
        s3_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """HEADs held back (the fault: each waits for a release) past `lookup_timeout_s`: the
    lookup misses and is counted in `lookup_timeouts`, as the redis tier counts its late
    lookups (exported as vllm:kvtier_tier_lookup_timeouts_total); one in time is not."""
    layout = tiny_layout()
    tier = s3_tier(s3_server.url, layout, lookup_timeout_s=0.2)
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    assert tier.contains_many([key(1), key(2)]) == [True, False]
    assert tier.stats().lookup_timeouts == 0
    release = threading.Event()
    head = tier._head

    def held_head(k: Any) -> bool:
        release.wait(10)
        return head(k)

    monkeypatch.setattr(tier, "_head", held_head)
    try:
        assert tier.contains_many([key(1), key(2)]) == [False, False]
        assert tier.stats().lookup_timeouts == 1
    finally:
        release.set()
        tier.close()


@pytest.mark.timing
def test_a_server_that_never_answers_never_hangs_the_tier(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket that accepts and never replies: start-up, lookups, reads and writes each
    return within their deadlines (the bucket check, lookup_timeout_s, request_timeout_s)."""
    for name, value in TEST_KEYS.items():
        monkeypatch.setenv(name, value)
    layout = tiny_layout()
    silent = SilentServer()
    try:
        started = time.monotonic()
        tier = s3_tier(silent.url, layout)  # starts unavailable: not an error
        assert time.monotonic() - started < 2.0
        time.sleep(0.6)  # let the breaker's backoff pass: the next call goes out again
        started = time.monotonic()
        assert tier.contains_many([key(i) for i in range(64)]) == [False] * 64
        assert time.monotonic() - started < 1.5
        time.sleep(0.6)
        started = time.monotonic()
        out = memoryview(bytearray(layout.bytes_per_chunk))
        assert not tier.get_into(key(1), out)
        assert not tier.put(key(2), memoryview(payload(2, layout)))
        assert time.monotonic() - started < 2.5
        assert not tier.available()
        tier.close()
    finally:
        silent.close()


def test_an_endpoint_that_is_not_an_s3_api_is_one_clear_error_at_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`endpoint_url` at a web server that answers 200 and a page to any GET or HEAD (an
    object store's web console: MinIO's on :9001, its S3 API on :9000). Found in an
    operator drill: the bucket check passed, then every lookup found every chunk and every
    load failed as corrupt (a warning each). Now start-up HEADs an object no one writes, which
    an S3 API answers 404, and refuses the endpoint naming `endpoint_url`."""
    for name, value in TEST_KEYS.items():
        monkeypatch.setenv(name, value)
    page = b"<!doctype html><html><body>Object store console</body></html>"

    class Console(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()

        def do_GET(self) -> None:
            self.do_HEAD()
            self.wfile.write(page)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Console)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ConfigError) as refused:
            s3_tier(url, tiny_layout())
        assert refused.value.field == "endpoint_url" and refused.value.value == url
        assert "an S3 API endpoint" in str(refused.value)
    finally:
        server.shutdown()
        server.server_close()


class ThrottlingProxy:
    """An HTTP proxy in front of moto that answers the next `throttle` PUTs of chunk
    objects with 503 SlowDown (as S3 does under load), and forwards everything else."""

    def __init__(self, upstream_port: int) -> None:
        self.throttle = 0
        self.throttled = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "PUT" and "/faults/" in self.path and proxy.throttle:
                    proxy.throttle -= 1
                    proxy.throttled += 1
                    reply = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown"
                             b"</Code><Message>Please reduce your request rate.</Message>"
                             b"</Error>")
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=10)
                upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection",
                                            "server", "date"):
                        self.send_header(name, value)
                self.send_header("Content-Length", answer.getheader("Content-Length", "0")
                                 if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def throttling(s3_server: MotoServer) -> Iterator[ThrottlingProxy]:
    proxy = ThrottlingProxy(s3_server.port)
    yield proxy
    proxy.close()


@pytest.mark.timing
def test_throttled_writes_back_off_then_succeed_or_drop_within_the_deadline(
        throttling: ThrottlingProxy, s3_server: MotoServer) -> None:
    """Two SlowDowns, then the PUT goes through: stored. Throttled past write_timeout_s:
    dropped in about that time, counted, and no object is left under its name."""
    layout = tiny_layout()
    tier = s3_tier(throttling.url, layout, write_timeout_s=1.0)
    throttling.throttle = 2
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    assert throttling.throttled == 2
    throttling.throttle = 10_000
    started = time.monotonic()
    result = tier.put(key(2), memoryview(payload(2, layout)))
    elapsed = time.monotonic() - started
    assert result.failure is Failure.TIMEOUT and 0.5 < elapsed < 1.6
    assert tier.throttled_writes == 1 and tier.stats().dropped_writes == 1
    raw = s3_server.endpoint().client()
    names = [o["Key"] for o in raw.list_objects_v2(Bucket="kvtier-test",
                                                   Prefix="faults/").get("Contents", [])]
    assert len(names) == 1 and names[0].endswith(key(1).hex())
    tier.close()


@pytest.mark.parametrize("damage", ["truncated", "bit flip", "header only", "empty"])
def test_a_damaged_object_is_a_counted_miss_and_removed(s3_session: S3Endpoint,
                                                        damage: str) -> None:
    """An object cut short (an upload tool that failed half way), a flipped payload bit,
    a header without a body, an empty object: a miss counted as corrupt, never wrong KV,
    and the object is gone afterwards."""
    layout = tiny_layout()
    tier = shared_tier(s3_session, layout)
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    raw, bucket = s3_session.client(), s3_session.bucket
    name = tier.names.chunk(key(1))
    stored = raw.get_object(Bucket=bucket, Key=name)["Body"].read()
    damaged = {"truncated": stored[: len(stored) - 100],
               "bit flip": stored[:-1] + bytes([stored[-1] ^ 1]),
               "header only": stored[:HEADER_BYTES], "empty": b""}[damage]
    raw.put_object(Bucket=bucket, Key=name, Body=damaged)
    out = bytearray(b"\xee" * layout.bytes_per_chunk)
    result = tier.get_into(key(1), memoryview(out))
    assert result.failure is Failure.CORRUPT
    assert tier.stats().corrupt_reads == 1 and tier.stats().hits == 0
    assert tier.get_into(key(1), memoryview(out)) == MISSING  # removed
    tier.close()


def test_foreign_objects_under_the_prefix_are_never_chunks(s3_session: S3Endpoint) -> None:
    """Objects of other writers under the prefix: the inventory lists none of them, gc
    removes none, and random bytes at a chunk's very name are a corrupt miss."""
    layout = tiny_layout()
    tier = shared_tier(s3_session, layout)
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK
    raw, bucket, prefix = s3_session.client(), s3_session.bucket, tier.names.prefix
    digest = layout.digest()
    foreign = [f"{prefix}/README.txt", f"{prefix}/{digest}/zz/not-a-key",
               f"{prefix}/{digest}/{key(5).hex()}", f"{prefix}/{digest}/ff/{key(6).hex()}"]
    for name in foreign:
        raw.put_object(Bucket=bucket, Key=name, Body=b"someone else's")
    raw.put_object(Bucket=bucket, Key=tier.names.chunk(key(7)), Body=b"x" * 9000)
    inventory = S3Inventory("s3", tier._config)
    chunks = list(inventory.chunks())
    assert sorted(c.key_hex for c in chunks) == sorted([key(1).hex(), key(7).hex()])
    assert inventory.remove(chunks) == 2
    left = {o["Key"] for o in raw.list_objects_v2(Bucket=bucket,
                                                  Prefix=prefix + "/").get("Contents", [])}
    assert left == set(foreign)
    raw.put_object(Bucket=bucket, Key=tier.names.chunk(key(7)), Body=b"x" * 9000)
    out = memoryview(bytearray(layout.bytes_per_chunk))
    assert tier.get_into(key(7), out).failure is Failure.CORRUPT
    inventory.close()
    tier.close()


def test_a_huge_foreign_object_at_a_chunks_name_is_not_read_into_memory(
        s3_session: S3Endpoint) -> None:
    """16 MiB of someone else's at a 4 KiB chunk's very name: a corrupt miss, removed, and
    its body never read (the tier read any object whole before checking its size: found by
    an operator drill, the read's peak memory was the object's size; one of gigabytes
    would have taken the engine's memory). Measured with tracemalloc, not timed."""
    layout = tiny_layout()
    tier = shared_tier(s3_session, layout)
    raw, name = s3_session.client(), tier.names.chunk(key(8))
    size = 16 << 20
    raw.put_object(Bucket=s3_session.bucket, Key=name, Body=bytes(size))
    out = memoryview(bytearray(layout.bytes_per_chunk))
    tracemalloc.start()
    try:
        result = tier.get_into(key(8), out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.failure is Failure.CORRUPT and tier.stats().corrupt_reads == 1
    assert peak < size // 4, f"{peak} bytes allocated to refuse a {size}-byte object"
    assert tier.get_into(key(8), out) == MISSING  # removed
    tier.close()


def _no_aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("ca", ["missing", "not a certificate"])
def test_a_ca_file_that_cannot_be_loaded_is_a_config_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ca: str) -> None:
    """`tls_ca_file` at a wrong path or at a file with no PEM certificate: a ConfigError
    naming the field when the tier is built, before any request (found in the drill that
    found the redis tier's: tests/faults/test_redis_tls.py)."""
    for name, value in TEST_KEYS.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / ("ca.pem" if ca == "not a certificate" else "missing.pem")
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError) as refused:
        s3_tier("https://127.0.0.1:9", tiny_layout(), tls_ca_file=str(path))
    assert refused.value.field == "tls_ca_file" and refused.value.value == str(path)


def test_missing_credentials_are_one_clear_error_at_start_up(
        s3_server: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    layout = tiny_layout()
    _no_aws_environment(monkeypatch, tmp_path)
    with pytest.raises(ConfigError) as nothing:
        s3_tier(s3_server.url, layout)
    assert nothing.value.field == "credentials" and "AWS_ACCESS_KEY_ID" in str(nothing.value)
    with pytest.raises(ConfigError) as unreadable:
        s3_tier(s3_server.url, layout, credentials_file=str(tmp_path / "missing"))
    assert unreadable.value.field == "credentials_file"
    good = tmp_path / "credentials"
    good.write_text(f"[kv]\naws_access_key_id = AKIATEST\naws_secret_access_key = {SECRET}\n")
    good.chmod(0o600)
    with pytest.raises(ConfigError) as profile:
        s3_tier(s3_server.url, layout, credentials_file=str(good), profile="other")
    assert profile.value.field == "profile"
    tier = s3_tier(s3_server.url, layout, credentials_file=str(good), profile="kv")
    assert tier.put(key(1), memoryview(payload(1, layout))) == OK  # moto accepts any key
    tier.close()


def test_refused_credentials_are_one_clear_error_naming_the_field_and_no_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """moto with authentication on (INITIAL_NO_AUTH_ACTION_COUNT=0) knows no access key:
    the tier refuses to start with a ConfigError naming `credentials_file`; neither the
    error, the log nor stdout/stderr holds the secret."""
    from s3_server import moto_available
    if not moto_available():
        pytest.skip("moto[server] is not installed")
    _no_aws_environment(monkeypatch, tmp_path)
    server = MotoServer(tmp_path / "auth", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    server.start(bucket="")
    try:
        creds = tmp_path / "credentials"
        creds.write_text(f"[default]\naws_access_key_id = AKIAUNKNOWN0000000000\n"
                         f"aws_secret_access_key = {SECRET}\n")
        creds.chmod(0o600)
        caplog.set_level(logging.DEBUG)
        with pytest.raises(ConfigError) as refused:
            s3_tier(server.url, tiny_layout(), credentials_file=str(creds),
                    request_timeout_s=5.0)
        assert refused.value.field == "credentials_file"
        assert "403" in str(refused.value)
        captured = capsys.readouterr()
        for text in (str(refused.value), caplog.text, captured.out, captured.err):
            assert SECRET not in text
    finally:
        server.stop()


@pytest.mark.parametrize("field", ["secret_access_key", "aws_secret_access_key",
                                   "session_token"])
def test_an_inline_key_is_refused_naming_the_field_without_echoing_it(field: str) -> None:
    settings = {"kind": "s3", "bucket": "kvtier-test", field: SECRET}
    with pytest.raises(ConfigError) as refused:
        StoreConfig.parse({"tiers": [settings]})
    assert refused.value.field.endswith(field) and SECRET not in str(refused.value)


def test_credentials_in_the_endpoint_url_are_refused_and_masked() -> None:
    settings = {"kind": "s3", "bucket": "kvtier-test",
                "endpoint_url": f"https://AKIA:{SECRET}@s3.example:9000"}
    with pytest.raises(ConfigError) as refused:
        StoreConfig.parse({"tiers": [settings]})
    assert refused.value.field.endswith("endpoint_url") and SECRET not in str(refused.value)
