"""The tools know the s3 tier: `kvtier doctor` checks its endpoint and credentials the way
the tier connects (never showing a key), and `kvtier simulate` has it as a shared preset.
`kvtier inspect` / `kvtier gc` over it: tests/tools/test_inspect_gc.py (storekit.KINDS).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from s3_server import MotoServer, S3Endpoint, free_port, without_list_bucket

from kvtier.tools.ops.doctor import check_redis
from kvtier.tools.sim.tiers import parse_tier

SECRET = "d0ct0r-Secret-Never-Shown"


@pytest.mark.s3
def test_doctor_says_the_bucket_answered_and_where_the_credentials_came_from(
        s3_session: S3Endpoint) -> None:
    [check] = check_redis({"tiers": [{"kind": "s3", **s3_session.settings()}]})
    assert check.status == "ok" and "credentials from" in check.detail, check


@pytest.mark.s3
def test_doctor_fails_an_unknown_bucket_and_an_unreachable_endpoint(
        s3_session: S3Endpoint) -> None:
    missing = {**s3_session.settings(), "bucket": "no-such-bucket-kvtier"}
    [check] = check_redis({"tiers": [{"kind": "s3", **missing}]})
    assert check.status == "fail" and "404" in check.detail
    dead = {**s3_session.settings(), "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    [check] = check_redis({"tiers": [{"kind": "s3", **dead}]})
    assert check.status == "fail" and "unreachable" in check.detail


def test_doctor_refuses_an_inline_key_without_showing_it(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    [check] = check_redis({"tiers": [{"kind": "s3", "bucket": "kvtier-test",
                                      "secret_access_key": SECRET}]})
    assert check.status == "fail" and "secret_access_key" in check.detail
    assert SECRET not in check.detail and SECRET not in check.name


@pytest.mark.s3
def test_doctor_reports_refused_credentials(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from s3_server import moto_available
    if not moto_available():
        pytest.skip("moto[server] is not installed")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN0000000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    server = MotoServer(tmp_path / "auth", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    server.start(bucket="")
    try:
        tier = {"kind": "s3", **server.endpoint().settings()}
        [check] = check_redis({"tiers": [tier]})
    finally:
        server.stop()
    assert check.status == "fail" and "403" in check.detail
    assert SECRET not in check.detail


@pytest.mark.s3
def test_doctor_passes_credentials_without_list_bucket_unless_a_capacity_lists(
        s3_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS answers a HEAD of the bucket 403 to credentials without s3:ListBucket, which the
    tier needs only to list for a capacity: the doctor reported them refused."""
    import kvtier.tiers.s3.client as s3_client
    connect = s3_client.connect
    monkeypatch.setattr(s3_client, "connect",
                        lambda *args, **kwargs: without_list_bucket(connect(*args, **kwargs)))
    [check] = check_redis({"tiers": [{"kind": "s3", **s3_session.settings()}]})
    assert check.status == "ok" and "no s3:ListBucket" in check.detail, check
    [check] = check_redis({"tiers": [{"kind": "s3", **s3_session.settings(), "capacity": "1GiB"}]})
    assert check.status == "fail" and "s3:ListBucket" in check.detail, check


def test_the_simulator_has_an_s3_preset_shared_by_the_fleet() -> None:
    spec = parse_tier("s3=1TB")
    assert spec.shared and spec.latency_s > 0.001 and spec.capacity_bytes == 10**12


@pytest.mark.timing
@pytest.mark.s3
def test_the_storage_bench_subjects_and_the_lookup_figures(s3_session: S3Endpoint,
                                                           tmp_path: Path) -> None:
    """`kvtier bench storage --tier s3`'s pieces on the session's endpoint: the tier and the
    raw client move the same chunks (a put then a get each), and the prefix lookup figures
    come back for a short prefix."""
    from contextlib import ExitStack

    from kvtier.tools.bench.s3_baseline import lookup_figures, s3_subjects
    from kvtier.tools.bench.subjects import SizeBench

    with ExitStack() as stack:
        bench = SizeBench(tmp_path, 64 * 1024, 3, 1, stack)
        for subject in s3_subjects(bench, s3_session.url, s3_session.bucket, stack):
            assert subject.put() > 0 and subject.get() > 0
            subject.clean()
    figures = lookup_figures(s3_session.url, s3_session.bucket, chunks=8)
    assert figures["chunks"] == 8 and figures["held_s"] > 0
    assert figures["absent_cached_s"] < figures["absent_cold_s"] + 1.0
