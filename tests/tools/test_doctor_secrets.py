"""Credentials never leak from the operator tools (issue 12, item 8): no output of
`kvtier doctor` or `kvtier serve --dry-run` (stdout, stderr, log records at DEBUG) ever holds a
Redis password put in a URL, and `doctor` reaches Redis as the tier does: the password from
password_file (or the environment), the cluster nodes of the config. The tier's own refusals
and logs: tests/faults/test_redis_secrets.py.

Every test greps everything it captured for the secret.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis_server import RedisClusterNodes
from secretkit import SECRET, Captured

from kvtier.tools.cli.main import main
from kvtier.tools.ops.doctor import check_redis

pytestmark = pytest.mark.redis
CHEAP_MODULE = "kvtier.units"  # doctor's connector import probe, without importing vLLM


def _write(path: Path, tiers: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"tiers": tiers}))
    return path


URLS_WITH_SECRETS = [
    f"redis://:{SECRET}@127.0.0.1:6390/0",
    f"redis://kvcache:{SECRET}@127.0.0.1:6390/0",
    f"redis://127.0.0.1:6390/0?password={SECRET}",
    f"rediss://127.0.0.1:6390/0?db=0&auth={SECRET}",
    f"redis://127.0.0.1:6390/0?access_token={SECRET}",
    f"redis://127.0.0.1:6390/0#pass={SECRET}",
]


@pytest.mark.parametrize("url", URLS_WITH_SECRETS[:3])
def test_doctor_with_a_secret_in_the_redis_flag_prints_no_secret(
        url: str, captured: Captured) -> None:
    """`kvtier doctor --redis redis://:pw@host`: the flag is refused as bad input (status 2,
    one line naming the field), with the password masked."""
    code = main(["doctor", "--redis", url, "--connector-module", CHEAP_MODULE])
    text = captured.text()
    assert code == 2 and "redis.url=" in text
    assert SECRET not in text
    assert "***" in text and "password_file" in text


def test_doctor_json_from_a_config_file_prints_no_secret(tmp_path: Path,
                                                         captured: Captured) -> None:
    config = _write(tmp_path / "kvtier.yaml", [
        {"kind": "memory", "capacity": "64MiB"},
        {"kind": "redis", "capacity": 0, "url": f"redis://127.0.0.1:1/0?password={SECRET}"}])
    assert main(["doctor", str(config), "--json", "--connector-module", CHEAP_MODULE]) == 1
    text = captured.text()
    assert SECRET not in text
    report = json.loads(text[:text.index("\n}\n") + 2])
    redis_checks = [c for c in report["checks"] if c["name"].startswith("redis")]
    assert [c["status"] for c in redis_checks] == ["fail"]
    assert "password_file" in redis_checks[0]["detail"]
    assert report["kv_transfer_config"] is None


def test_doctor_pings_with_the_tiers_password_file(secured: Any, tmp_path: Path,
                                                   captured: Captured) -> None:
    """The server requires a password: doctor reads it from the tier's password_file, as the
    tier would (a bare PING of the URL got NOAUTH). A wrong one fails, naming no secret."""
    server, password_file = secured
    tier = {"kind": "redis", "capacity": 0, "url": server.url,
            "password_file": str(password_file)}
    [check] = check_redis({"tiers": [tier]})
    assert check.status == "ok" and "with a password" in check.detail, check
    [bare] = check_redis({"tiers": [{"kind": "redis", "capacity": 0, "url": server.url}]})
    assert bare.status == "fail"

    config = _write(tmp_path / "kvtier.yaml", [tier])
    main(["doctor", str(config), "--connector-module", CHEAP_MODULE])
    text = captured.text()
    assert "PING answered" in text and SECRET not in text

    wrong = tmp_path / "wrong-password"
    wrong.write_text(SECRET + "-but-wrong\n")
    [check] = check_redis({"tiers": [{**tier, "password_file": str(wrong)}]})
    assert check.status == "fail" and SECRET not in check.detail + check.name


def test_doctor_reaches_a_cluster_by_its_nodes(redis_cluster: RedisClusterNodes) -> None:
    """No url in the config: doctor used to PING the default 127.0.0.1:6379."""
    [check] = check_redis({"tiers": [{"kind": "redis", "capacity": 0,
                                      "cluster_nodes": redis_cluster.addresses}]})
    assert check.status == "ok" and "3 cluster node(s)" in check.detail
    assert redis_cluster.addresses[0] in check.name


def test_serve_dry_run_refuses_a_url_with_a_password_and_prints_no_secret(
        tmp_path: Path, captured: Captured) -> None:
    bad = _write(tmp_path / "bad.yaml", [
        {"kind": "memory", "capacity": "64MiB"},
        {"kind": "redis", "capacity": 0, "url": f"redis://127.0.0.1:6390/0?password={SECRET}"}])
    assert main(["serve", "some-model", "--config", str(bad), "--dry-run"]) == 2
    text = captured.text()
    assert SECRET not in text and "password_file" in text


def test_serve_dry_run_with_a_password_file_prints_no_secret(secured: Any, tmp_path: Path,
                                                             captured: Captured) -> None:
    server, password_file = secured
    good = _write(tmp_path / "good.yaml", [
        {"kind": "memory", "capacity": "64MiB"},
        {"kind": "redis", "capacity": 0, "url": server.url,
         "password_file": str(password_file)}])
    assert main(["serve", "some-model", "--config", str(good), "--dry-run"]) == 0
    text = captured.text()
    assert "--kv-transfer-config" in text and str(password_file) in text
    assert SECRET not in text
