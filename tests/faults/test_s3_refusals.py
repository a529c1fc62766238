"""Credentials revoked mid-run, against moto's S3 server (an emulator) with authentication
on after its first requests (INITIAL_NO_AUTH_ACTION_COUNT: the bucket's creation, the
tier's start-up check and one put pass; every request after is refused, 403, as a revoked
key or an expired session token is).

The endpoint answers, so the tier stays up: puts are dropped and reads miss, counted.
Found by an operator drill: before the fix reads and lookups refused this way logged
nothing at all, and each refused put one line at info: an engine whose key was revoked said
nothing at the default log level. Now the first refusal of each error code is a warning
that says credentials were refused; the next ones are at debug (no log flood).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from s3_server import MotoServer, moto_available
from tierkit import key, tiny_layout

from kvtier.core.tier import IO_ERROR, OK
from kvtier.tiers import build_tier
from kvtier.tiers.s3.tier import S3Tier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.s3
LOGGER = "kvtier.tiers.s3.tier"


def test_credentials_revoked_mid_run_are_a_warning_not_silence(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    if not moto_available():
        pytest.skip("moto[server] is not installed")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAREVOKED000000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "revoked-secret")
    server = MotoServer(tmp_path / "moto", env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"}).start()
    layout = tiny_layout()
    try:
        tier = build_tier(StoreConfig.parse({"tiers": [{
            "kind": "s3", "endpoint_url": server.url, "bucket": "kvtier-test",
            "addressing_style": "path", "request_timeout_s": 5.0}]}).tiers[0], layout)
        assert isinstance(tier, S3Tier)
        data = memoryview(bytes(layout.bytes_per_chunk))
        out = memoryview(bytearray(layout.bytes_per_chunk))
        assert tier.put(key(1), data) == OK  # the last request let through
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            assert tier.get_into(key(1), out) == IO_ERROR
            assert tier.contains_many([key(1)]) == [False]
            first = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            for i in range(2, 5):
                assert tier.put(key(i), data) == IO_ERROR
                assert tier.get_into(key(1), out) == IO_ERROR
                assert tier.contains_many([key(1)]) == [False]
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert first and all("credentials refused" in w for w in first), first
        assert len(warnings) <= 3, warnings  # once per code: the GET's, the HEAD's, the PUT's
        assert "revoked-secret" not in caplog.text
        stats = tier.stats()
        assert (stats.misses, stats.dropped_writes) == (4, 3) and tier.available()
        tier.close()
    finally:
        server.stop()
