"""`kvtier inspect` and `kvtier gc` end to end, over a store config file whose tiers were
filled by a real TieredStore: a disk tier and a shared tier on tmp_path, and a redis tier on a
real redis-server (those cases are marked `redis`).

The story: two layouts (two namespaces) write chunks; inspect reports them per tier and
namespace; a dry run deletes nothing; gc to a quota keeps the most recently used; gc by age
drops what was not used since; gc of a namespace empties it and leaves the other alone; and
the tiers, rebuilt afterwards, serve exactly what gc kept.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from clikit import by_namespace, cli_json
from storekit import KINDS, held, tier_config, write_config
from tierkit import key, tiny_layout

from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError
from kvtier.tiers import build_tier
from kvtier.tiers.files.manifests import write_file_manifest
from kvtier.tiers.manifest import NamespaceInfo, new_manifest
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.admin.gc import GcRequest, parse_duration, select_victims
from kvtier.tools.admin.inventory import StoredChunk
from kvtier.tools.cli.main import main

LAYOUT_A, LAYOUT_B = tiny_layout(16), tiny_layout(32)






def fill(config_path: Path, layout: KVLayout, keys: range) -> None:
    """Store chunks `keys` of `layout` in the config's persistent tier, one by one, so their
    last-use times are ordered (file mtimes: 10 ms apart)."""
    tier = build_tier(StoreConfig.load(config_path).tiers[1], layout)
    for i in keys:
        assert tier.put(key(i), memoryview(bytes([i % 256]) * layout.bytes_per_chunk))
        time.sleep(0.01)
    tier.close()








@pytest.mark.parametrize("kind", KINDS)
def test_inspect_then_gc_by_quota_age_and_namespace(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, tier_config(kind, tmp_path, request))
    fill(config, LAYOUT_A, range(0, 6))
    fill(config, LAYOUT_B, range(100, 103))
    a, b = LAYOUT_A.digest(), LAYOUT_B.digest()

    report = by_namespace(cli_json(capsys, "inspect", "--config", str(config)))
    assert set(report) == {a, b}
    assert (report[a]["chunks"], report[b]["chunks"]) == (6, 3)
    assert report[a]["size_bytes"] >= 6 * LAYOUT_A.bytes_per_chunk
    assert report[a]["oldest_s"] <= report[a]["newest_s"] <= time.time() + 1
    assert report[a]["tier"] == kind and report[a]["kind"] == kind

    # The table form prints every namespace too.
    capsys.readouterr()
    assert main(["inspect", "--config", str(config)]) == 0
    assert a in capsys.readouterr().out

    # Dry run: says what would go, removes nothing.
    chunk_a = report[a]["size_bytes"] // 6
    quota = str(3 * chunk_a)
    dry = cli_json(capsys, "gc", "--config", str(config), "--namespace", a, "--quota", quota,
                   "--dry-run")
    assert [o["removed_chunks"] for o in dry["outcomes"]] == [3]
    assert held(config, LAYOUT_A, range(6)) == list(range(6))

    # Quota: the 3 most recently used of namespace a stay (file tiers order by mtime; redis
    # without an LRU index by idle time, which has 1 s resolution: any 3).
    cli_json(capsys, "gc", "--config", str(config), "--namespace", a, "--quota", quota)
    kept = held(config, LAYOUT_A, range(6))
    assert len(kept) == 3
    if kind != "redis":
        assert kept == [3, 4, 5]
    assert held(config, LAYOUT_B, range(100, 103)) == [100, 101, 102]

    # Age: nothing of b is older than an hour; everything is older than "0s".
    out = cli_json(capsys, "gc", "--config", str(config), "--max-age", "1h")
    assert sum(o["removed_chunks"] for o in out["outcomes"]) == 0
    # A whole namespace: b goes, a stays.
    out = cli_json(capsys, "gc", "--config", str(config), "--namespace", b)
    assert [(o["namespace"], o["removed_chunks"], o["kept_chunks"]) for o in out["outcomes"]] \
        == [(b, 3, 0)]
    assert held(config, LAYOUT_B, range(100, 103)) == []
    assert held(config, LAYOUT_A, range(6)) == kept
    assert set(by_namespace(cli_json(capsys, "inspect", "--config", str(config)))) == {a}


def test_gc_by_age_removes_only_what_was_not_used_since(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "d"),
                                     "capacity": "1MiB"})
    fill(config, LAYOUT_A, range(4))
    files = sorted((tmp_path / "d").rglob("*.kvc"))
    two_days_ago = time.time() - 2 * 86400
    for path in files[:2]:
        os.utime(path, (two_days_ago, two_days_ago))
    out = cli_json(capsys, "gc", "--config", str(config), "--max-age", "1d")
    assert [(o["removed_chunks"], o["kept_chunks"]) for o in out["outcomes"]] == [(2, 2)]
    assert sorted((tmp_path / "d").rglob("*.kvc")) == files[2:]


@pytest.mark.parametrize("model", ["[/]", "llama-3[fp8]", "[bold]m", "evil\x1b[31mred"])
def test_a_model_name_is_shown_as_it_is_never_as_markup(
        model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest's model name (written from the served model name, or by anyone who can
    write the directory) is text: "[/]" crashed inspect and gc (after gc had deleted),
    "llama-3[fp8]" showed as "llama-3", an ANSI sequence reached the terminal raw."""
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "d"),
                                     "capacity": "1MiB"})
    fill(config, LAYOUT_A, range(2))
    manifest = new_manifest(LAYOUT_A, NamespaceInfo(model, "", 0))
    assert write_file_manifest(tmp_path / "d", manifest, 0o644)
    shown = model.replace("\x1b", "\\x1b")

    assert main(["inspect", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert shown in out and "\x1b" not in out
    assert main(["gc", "--config", str(config), "--max-age", "1d"]) == 0
    out = capsys.readouterr().out
    assert shown in out and "\x1b" not in out
    assert main(["gc", "--config", str(config), "--model", model, "--quota", "0"]) == 0
    out = capsys.readouterr().out
    assert shown in out and "\x1b" not in out
    assert not list((tmp_path / "d").rglob("*.kvc")), "--model matched the name shown"


def test_gc_needs_a_rule_and_a_known_tier(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "d"),
                                     "capacity": "1MiB"})
    assert main(["gc", "--config", str(config)]) == 2
    assert "at least one of --quota, --max-age, --namespace" in capsys.readouterr().err
    assert main(["gc", "--config", str(config), "--tier", "memory", "--quota", "0"]) == 2
    assert main(["gc", "--config", str(config), "--max-age", "soon"]) == 2
    assert main(["inspect", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_an_unreachable_redis_tier_is_reported_not_raised(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens on the port: inspect lists the other tiers and exits 1."""
    from redis_server import free_port

    path = tmp_path / "store.json"
    path.write_text(json.dumps({"tiers": [
        {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "1MiB"},
        {"kind": "redis", "url": f"redis://127.0.0.1:{free_port()}/0",
         "connect_timeout_ms": 100, "socket_timeout_ms": 100}]}))
    assert main(["inspect", "--config", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "redis" in report["errors"] and report["namespaces"] == []


@pytest.mark.timing
def test_a_tier_on_a_dead_mount_is_reported_not_waited_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared directory on a dead hard-mounted NFS server blocks every call into it for
    ever: inspect and gc (a cron job) report it after the directory check's deadline, list or
    collect the other tiers, and exit 1, rather than hang."""
    import threading

    from kvtier.tiers.files import directories

    dead, answer = tmp_path / "nfs", threading.Event()

    def hung(real: Any) -> Any:
        def call(path: object = ".", *args: object, **kwargs: object) -> Any:
            if str(path).startswith(str(dead)):
                answer.wait(30)
            return real(path, *args, **kwargs)
        return call

    path = tmp_path / "store.json"
    path.write_text(json.dumps({"tiers": [
        {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "1MiB"},
        {"kind": "shared", "path": str(dead / "kv"), "capacity": "1MiB"}]}))
    (tmp_path / "d").mkdir()  # the disk tier has started: only the dead mount is reported
    monkeypatch.setattr(directories, "CHECK_TIMEOUT_S", 0.3)
    for name in ("stat", "lstat", "scandir", "listdir", "open"):
        monkeypatch.setattr(os, name, hung(getattr(os, name)))
    try:
        start = time.monotonic()
        assert main(["inspect", "--config", str(path), "--json"]) == 1
        report = json.loads(capsys.readouterr().out)
        assert main(["gc", "--config", str(path), "--quota", "0", "--json"]) == 1
        collected = json.loads(capsys.readouterr().out)
        took_s = time.monotonic() - start
    finally:
        answer.set()
    for errors in (report["errors"], collected["errors"]):
        assert list(errors) == ["shared"] and "did not answer within 0.3 s" in errors["shared"]
    assert took_s < 15.0, took_s  # two commands of 0.3 s waits each (1.5 s); 60 s before


def test_a_tier_directory_that_does_not_exist_is_reported_and_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tier creates its directory when it starts: a missing one is a wrong path, an
    unmounted volume, or a tier never started on this machine. It was listed as an empty
    tier with status 0; a cron job running gc saw success while gc never reached it. It is
    reported, the other tiers still listed or collected, and the status is 1."""
    missing = tmp_path / "typo" / "kv"
    tiers = [{"kind": "disk", "name": "local", "path": str(tmp_path / "d"), "capacity": "1MiB"},
             {"kind": "shared", "name": "fleet", "path": str(missing), "capacity": "1MiB"}]
    config = tmp_path / "store.json"
    config.write_text(json.dumps({"tiers": tiers}))
    tier = build_tier(StoreConfig.parse({"tiers": tiers}).tiers[0], LAYOUT_A)
    tier.put(key(1), memoryview(bytes(LAYOUT_A.bytes_per_chunk)))
    tier.close()

    assert main(["inspect", "--config", str(config), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [r["tier"] for r in report["namespaces"]] == ["local"]
    assert list(report["errors"]) == ["fleet"]
    assert f"{missing} does not exist" in report["errors"]["fleet"]
    assert main(["gc", "--config", str(config), "--quota", "0", "--dry-run", "--json"]) == 1
    collected = json.loads(capsys.readouterr().out)
    assert [o["tier"] for o in collected["outcomes"]] == ["local"]
    assert list(collected["errors"]) == ["fleet"]
    assert main(["inspect", "--config", str(config)]) == 1
    assert f"tier fleet: not readable: {missing} does not exist" in \
        " ".join(capsys.readouterr().out.split())
    assert not missing.exists()  # reported, not created


def test_a_config_without_a_persistent_tier_is_refused_naming_what_is_needed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A memory tier lives in its engine's process: inspect listed an empty table and gc did
    nothing, both with status 0."""
    config = tmp_path / "store.json"
    config.write_text(json.dumps({"tiers": [{"kind": "memory", "capacity": "1MiB"}]}))
    for argv in (["inspect"], ["gc", "--quota", "0"]):
        assert main([*argv, "--config", str(config)]) == 2
        err = capsys.readouterr().err.strip()
        assert "invalid config tiers=['memory']: at least one persistent tier (disk, " in err
        assert "\n" not in err


def test_select_victims_rules() -> None:
    """The pure selection: namespace filter, then age, then quota (oldest first)."""
    chunks = [StoredChunk("ns1", f"{i:032x}", 10, float(i), ()) for i in range(10)]
    chunks += [StoredChunk("ns2", f"{i:032x}", 10, float(i), ()) for i in range(3)]
    hexes = lambda cs: sorted(int(c.key_hex, 16) for c in cs)  # noqa: E731
    assert len(select_victims(chunks, GcRequest(namespace="ns2"), now_s=100)) == 3
    assert hexes(select_victims(chunks, GcRequest(max_age_s=95, namespace="ns1"), 100)) \
        == [0, 1, 2, 3, 4]
    assert hexes(select_victims(chunks, GcRequest(quota_bytes=30, namespace="ns1"), 100)) \
        == list(range(7))
    assert len(select_victims(chunks, GcRequest(quota_bytes=1000), 100)) == 0
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90
    with pytest.raises(ConfigError):
        GcRequest().validate()


def test_inspect_says_how_each_tier_stores_chunks_at_rest_and_names_no_secret(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 48)
    secret.chmod(0o600)
    tiers = [{"kind": "disk", "name": "zstd-sealed", "path": str(tmp_path / "a"),
              "capacity": "64MiB", "codec": "zstd", "encryption_secret_file": str(secret)},
             {"kind": "disk", "name": "lossy", "path": str(tmp_path / "b"),
              "capacity": "64MiB", "codec": "fp8"},
             {"kind": "disk", "name": "plain", "path": str(tmp_path / "c"), "capacity": "64MiB"}]
    config = tmp_path / "kvtier.yaml"
    config.write_text(yaml.safe_dump({"tiers": tiers}))
    layout = tiny_layout(4)
    for tier in StoreConfig.parse({"tiers": tiers}).tiers:
        built = build_tier(tier, layout)
        built.put(key(1), memoryview(bytes(layout.bytes_per_chunk)))
        built.close()
    report = cli_json(capsys, "inspect", "--config", str(config))
    assert {r["tier"]: r["at_rest"] for r in report["namespaces"]} == {
        "zstd-sealed": "zstd, encrypted: salted chunks", "lossy": "fp8 (LOSSY)", "plain": "none"}
    assert main(["inspect", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "fp8 (LOSSY)" in out and str(secret) not in out and "s" * 48 not in out


def test_a_dry_runs_table_reads_would_remove_in_every_column(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its last column read "manifest would remove"."""
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "disk"),
                                     "capacity": "64MiB"})
    fill(config, LAYOUT_A, range(0, 2))
    capsys.readouterr()
    assert main(["gc", "--config", str(config), "--quota", "0", "--dry-run"]) == 0
    header = " ".join(capsys.readouterr().out.split())
    assert "would remove orphans" in header and "would remove manifest" in header
    assert "manifest would remove" not in header
