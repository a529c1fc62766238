"""The link measures of the shared-directory, disk and s3 tiers (`core.tier.LinkProbe`,
issue 45): the load-or-recompute rule's estimate of a tier's cost before its first timed load.

Against the real things: a directory on this machine's disk (tmp_path) and the session's S3
endpoint (moto's server, an emulator, or KVTIER_TEST_S3_*), a slow link emulated with
kvtier.testing.netem in front of moto. Faults a directory cannot be made to have (a read that
hangs, a failing fsync) are injected by patching the call that would fail.

Narrated: a measure leaves nothing behind (no probe file or object, the quota as it was); a
slow link measures slow; a measure that fails or passes its deadline gives no estimate, says
why in the log, never raises, and cleans up once its blocked call returns.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from s3_server import MotoServer, S3Endpoint
from tierkit import tiny_layout

import kvtier.tiers.files.linkfile as linkfile
from kvtier.core.tier import LinkProbe, LinkSpeed
from kvtier.testing.netem import delayed_proxy
from kvtier.tiers import build_tier
from kvtier.tiers.files.disk import DiskTier
from kvtier.tiers.files.linkfile import MIN_PROBE_BYTES
from kvtier.tiers.files.shared import SharedTier
from kvtier.tiers.s3.tier import S3Tier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()


def file_tier(kind: str, path: Path, capacity: str | int = "64MiB") -> SharedTier | DiskTier:
    tier = build_tier(StoreConfig.parse({"tiers": [
        {"kind": kind, "path": str(path), "capacity": capacity}]}).tiers[0], LAYOUT)
    assert isinstance(tier, SharedTier | DiskTier)
    return tier


def shared_tier(path: Path) -> SharedTier:
    tier = file_tier("shared", path)
    assert isinstance(tier, SharedTier)
    return tier


def s3_tier(endpoint: S3Endpoint, url: str | None = None) -> S3Tier:
    settings = {**endpoint.settings(), **({"endpoint_url": url} if url else {})}
    tier = build_tier(StoreConfig.parse({"tiers": [{"kind": "s3", **settings}]}).tiers[0],
                      LAYOUT)
    assert isinstance(tier, S3Tier)
    return tier


def files_under(path: Path) -> list[str]:
    return sorted(name for _, _, names in os.walk(path) for name in names)


def probe_objects(endpoint: S3Endpoint, tier: S3Tier) -> list[str]:
    listed = endpoint.client().list_objects_v2(Bucket=endpoint.bucket,
                                               Prefix=tier.names.namespace_prefix())
    return [item["Key"] for item in listed.get("Contents", []) if "link-probe" in item["Key"]]


def sane(speed: LinkSpeed | None) -> LinkSpeed:
    assert speed is not None
    assert 0 < speed.round_trip_s < 1 and speed.bytes_per_s > 0
    return speed


# -- a directory: shared, or a local disk ----------------------------------------------------

@pytest.mark.parametrize("kind", ["shared", "disk"])
def test_a_directorys_link_is_measured_with_a_probe_file_that_leaves_nothing(
        tmp_path: Path, kind: str) -> None:
    tier = file_tier(kind, tmp_path)
    assert isinstance(tier, LinkProbe)
    before = files_under(tmp_path)
    speed = sane(tier.measure_link())
    # A local disk: a 4 KiB read well under a millisecond or so, a 2 MiB read > 50 MB/s.
    assert speed.bytes_per_s > 50e6
    assert files_under(tmp_path) == before
    assert tier.stats().used_bytes == 0
    tier.close()


@pytest.mark.parametrize("o_direct", [True, False])
def test_both_ways_of_reading_from_the_medium_measure(tmp_path: Path, o_direct: bool) -> None:
    """O_DIRECT where the chunk files use it; else buffered, the file's pages dropped."""
    tier = shared_tier(tmp_path)
    if o_direct and not tier.files.o_direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    sane(linkfile.measure_directory(tmp_path, tier.files.layout_digest, o_direct, 0o600,
                                    time.monotonic() + 5, 1 << 20))
    tier.close()


@pytest.mark.parametrize("kind", ["shared", "disk"])
def test_a_capacity_without_room_gives_no_estimate_and_writes_nothing(
        tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = file_tier(kind, tmp_path, MIN_PROBE_BYTES - 4096)
    before = files_under(tmp_path)
    assert tier.measure_link() is None
    assert tier.measure_link() is None  # a minute later: the same reason, said once
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "room in the capacity" in warned[0]
    assert files_under(tmp_path) == before
    tier.close()


@pytest.mark.parametrize("kind", ["shared", "disk"])
def test_a_failing_write_gives_no_estimate_and_leaves_nothing(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tier = file_tier(kind, tmp_path)
    before = files_under(tmp_path)

    def fsync_fails(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(linkfile.os, "fsync", fsync_fails)
    assert tier.measure_link() is None
    assert "link measure failed (OSError" in caplog.text
    assert files_under(tmp_path) == before
    assert tier.stats().used_bytes == 0
    tier.close()


@contextmanager
def writes_hang(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event,
                                                                  threading.Event]]:
    """The probe file's fsync blocks until `release` is set (a hard-mounted NFS server
    gone); `entered` is set once it blocks."""
    entered, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def hanging_fsync(fd: int) -> None:
        entered.set()
        release.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(linkfile.os, "fsync", hanging_fsync)
    try:
        yield entered, release
    finally:
        release.set()


@pytest.mark.timing  # the deadline is a wall-clock bound
def test_a_measure_past_its_deadline_gives_no_estimate_and_cleans_up_once_unblocked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tier = shared_tier(tmp_path)
    tier._link.deadline_s = 0.5
    before = files_under(tmp_path)
    with writes_hang(monkeypatch) as (entered, release):
        started = time.monotonic()
        assert tier.measure_link() is None
        assert time.monotonic() - started < 2.0  # 0.5 s, and a loaded machine's wake-up
        assert "deadline" in caplog.text
        # Blocked in the medium: its probe file is there, its bytes held in the quota.
        assert entered.wait(10)
        assert any(name.startswith(".probe-") for name in files_under(tmp_path))
        assert tier.stats().used_bytes == linkfile.PROBE_BYTES
        # A measure asked meanwhile starts no second thread: no estimate at once.
        started = time.monotonic()
        assert tier.measure_link() is None
        assert time.monotonic() - started < 0.5
        assert "still blocked" in caplog.text
        release.set()
        assert tier._link.wait_idle(10)
    assert files_under(tmp_path) == before
    assert tier.stats().used_bytes == 0
    sane(tier.measure_link())  # the medium answers again: measured again
    tier.close()


# -- s3 -------------------------------------------------------------------------------------

@pytest.mark.s3
def test_an_endpoints_link_is_measured_with_a_probe_object_then_deleted(
        s3_session: S3Endpoint) -> None:
    tier = s3_tier(s3_session)
    assert isinstance(tier, LinkProbe)
    sane(tier.measure_link())
    assert probe_objects(s3_session, tier) == []
    tier.close()


def _delete_refused(**_: object) -> tuple[SimpleNamespace, dict[str, object]]:
    """AWS's answer to a DeleteObject without s3:DeleteObject (the object stays)."""
    return SimpleNamespace(status_code=403), {
        "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
        "ResponseMetadata": {"HTTPStatusCode": 403}}


@pytest.mark.s3
def test_without_delete_rights_the_link_is_measured_and_leaves_one_probe_object(
        s3_session: S3Endpoint) -> None:
    """s3.md's permissions give s3:DeleteObject only to a tier with a capacity. A measure
    whose delete was refused failed (no estimate), and each left a fresh 1 MiB object: one
    a worker a minute. Now the measure counts, and the next ones reuse the object left."""
    tier = s3_tier(s3_session)
    tier._client.meta.events.register("before-call.s3.DeleteObject", _delete_refused)
    for _ in range(3):
        sane(tier.measure_link())
    assert len(probe_objects(s3_session, tier)) == 1
    tier.close()
    s3_session.client().delete_object(Bucket=s3_session.bucket,
                                      Key=probe_objects(s3_session, tier)[0])


@pytest.mark.s3
def test_a_slow_link_to_the_endpoint_measures_slow(s3_server: MotoServer) -> None:
    """20 ms each way and 50 Mbit/s: a round trip of >= 40 ms, and at most ~6 MB/s."""
    with delayed_proxy("127.0.0.1", s3_server.port, 20, 0.05) as link:
        tier = s3_tier(s3_server.endpoint(), f"http://{link.host}:{link.port}")
        speed = sane(tier.measure_link())
        tier.close()
    assert speed.round_trip_s >= 0.04
    assert 1e6 < speed.bytes_per_s < 1.2 * 0.05e9 / 8
    assert probe_objects(s3_server.endpoint(), tier) == []


@pytest.mark.s3
@pytest.mark.timing  # the deadline is a wall-clock bound
def test_a_link_slower_than_the_deadline_gives_no_estimate_and_cleans_up(
        s3_server: MotoServer, caplog: pytest.LogCaptureFixture) -> None:
    """300 ms each way: the measure's ten calls take ~6 s; its deadline is 1 s."""
    with delayed_proxy("127.0.0.1", s3_server.port, 300, None) as link:
        tier = s3_tier(s3_server.endpoint(), f"http://{link.host}:{link.port}")
        tier._link.deadline_s = 1.0
        started = time.monotonic()
        assert tier.measure_link() is None
        assert time.monotonic() - started < 2.0
        assert "deadline" in caplog.text
        assert tier._link.wait_idle(15)  # the abandoned measure ends, deleting its object
        tier.close()
    assert probe_objects(s3_server.endpoint(), tier) == []


@pytest.mark.s3
def test_an_endpoint_that_is_down_gives_no_estimate(
        s3_server: MotoServer, caplog: pytest.LogCaptureFixture) -> None:
    tier = s3_tier(s3_server.endpoint())
    s3_server.stop()
    started = time.monotonic()
    assert tier.measure_link() is None
    assert time.monotonic() - started < 5.0
    assert "link measure failed (TierUnavailable" in caplog.text
    tier.close()
