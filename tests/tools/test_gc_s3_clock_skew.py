"""`kvtier gc --max-age` over an s3 tier, run on a host whose clock is not the server's.

An object's LastModified is stamped by the S3 server's clock; gc measured its age against
the clock of the host it ran on. From a host 10 minutes ahead every object older than the
age given less 10 minutes went (objects written a moment ago); from one behind, none did.
gc now reads the server's clock off the `Date` of the answers to its own listing
(tiers/s3/serverclock.py).

The host's clock is skewed by replacing `time.time` in this process (the fault injected);
the server (moto's, in a process of its own, or KVTIER_TEST_S3_*), its objects and their
LastModified are real. LastModified and Date count whole seconds: the test waits (polling
the server's clock, no fixed sleep) until its first object is AGED_S old by the server.
"""

from __future__ import annotations

import email.utils
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from s3_server import S3Endpoint
from tierkit import key, tiny_layout

from kvtier.tiers import build_tier
from kvtier.tiers.s3.config import S3TierConfig
from kvtier.tiers.s3.inventory import S3Inventory
from kvtier.tools.admin.gc import GcRequest, run_gc

pytestmark = pytest.mark.s3
LAYOUT = tiny_layout()
SKEW_S = 600.0
AGED_S = 5  # the old object's age by the server's clock when gc runs
MAX_AGE_S = 3.0  # the old object is older; the new one (written at once) younger
WAIT_S = 30.0


def server_age_s(client: Any, bucket: str, name: str) -> float:
    """How old the object `name` is by the server's clock (its answer's Date)."""
    reply = client.head_object(Bucket=bucket, Key=name)
    now = email.utils.parsedate_to_datetime(reply["ResponseMetadata"]["HTTPHeaders"]["date"])
    return (now - reply["LastModified"]).total_seconds()


def skew_host_clock(monkeypatch: pytest.MonkeyPatch, skew_s: float) -> None:
    real: Callable[[], float] = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)


def test_max_age_is_measured_by_the_servers_clock(
        s3_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    config = S3TierConfig(kind="s3", **s3_session.settings())
    tier: Any = build_tier(config, LAYOUT)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    client = s3_session.client()
    assert tier.put(key(0), data)
    deadline = time.monotonic() + WAIT_S
    while server_age_s(client, s3_session.bucket, tier.names.chunk(key(0))) < AGED_S:
        assert time.monotonic() < deadline, "the server's clock did not move"
        time.sleep(0.2)
    assert tier.put(key(1), data)
    inventory = S3Inventory("s3", config)
    try:
        for skew_s in (SKEW_S, -SKEW_S):
            skew_host_clock(monkeypatch, skew_s)
            [dry] = run_gc([inventory], GcRequest(max_age_s=MAX_AGE_S, dry_run=True))
            assert dry.removed_chunks == 1, \
                f"a gc host {skew_s:+.0f} s off the server's clock took ages by its own"
        [outcome] = run_gc([inventory], GcRequest(max_age_s=MAX_AGE_S))
        monkeypatch.undo()
        assert outcome.removed_chunks == 1
        assert [tier.contains(key(i)) for i in (0, 1)] == [False, True]
    finally:
        inventory.close()
        tier.close()


def test_answers_without_a_date_fall_back_to_the_hosts_clock(
        s3_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A server (or a proxy before it) whose answers carry no Date: ages by this host's
    clock, as before, said in the log, and nothing fails."""
    inventory = S3Inventory("s3", S3TierConfig(kind="s3", **s3_session.settings()))

    def drop_date(http_response: Any = None, **_kwargs: Any) -> None:
        http_response.headers.pop("Date", None)

    inventory.client.meta.events.register_first("after-call.s3", drop_date)
    skew_host_clock(monkeypatch, SKEW_S)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.s3.inventory"):
            assert abs(inventory.now_s() - time.time()) < 60
        assert "carry no Date" in caplog.text
        assert run_gc([inventory], GcRequest(max_age_s=MAX_AGE_S, dry_run=True)) == []
    finally:
        inventory.close()
