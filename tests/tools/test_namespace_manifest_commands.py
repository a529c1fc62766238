"""Namespace manifests (issue 11) as the operator tools show and use them: `kvtier inspect`
names each namespace's model and fingerprint, `kvtier gc --fingerprint` / `--model` select by
them (split from tests/tiers/test_namespace_manifest.py, which keeps how the tiers write and
read manifests).

The story, on real directories and a real redis-server: two checkpoints of one model shape
(two fingerprints: two namespaces) and data of an older kvtier (a layout without a
fingerprint, no manifest) share each tier. `inspect` names the model and fingerprint of the
first two and "unknown" for the third; a manifest that is missing, garbage, another
namespace's, a link or a FIFO reads as unknown and never crashes a command; a dry run deletes
nothing; `gc --fingerprint OLD` removes the old checkpoint's chunks and manifest only; a
prefix too short is bad input; a prefix that matches nothing says so and exits 0. Manifests
are never taken for chunks by the redis inventory and orphan sweep.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from clikit import by_namespace, cli_json
from storekit import (
    KINDS,
    LEGACY,
    NEW,
    NEW_FP,
    NEW_INFO,
    OLD,
    OLD_FP,
    OLD_INFO,
    fill,
    held,
    tier_config,
    write_config,
)
from tierkit import tiny_layout

from kvtier.tiers import open_store
from kvtier.tiers.files.manifests import read_file_manifest
from kvtier.tiers.manifest import FILE_NAME, new_manifest, parse_manifest
from kvtier.tiers.redis.manifest import redis_manifest_name
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.admin.inventory import open_inventories, read_manifests
from kvtier.tools.cli.main import main


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_names_each_namespace_model_and_gc_by_fingerprint_removes_only_it(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, tier_config(kind, tmp_path, request))
    fill(config, OLD, OLD_INFO, range(0, 4))
    fill(config, NEW, NEW_INFO, range(10, 13))
    fill(config, LEGACY, None, range(20, 22))
    old, new, legacy = OLD.digest(), NEW.digest(), LEGACY.digest()
    assert len({old, new, legacy}) == 3  # the fingerprint names the namespace

    report = by_namespace(cli_json(capsys, "inspect", "--config", str(config)))
    assert set(report) == {old, new, legacy}
    assert (report[old]["model"], report[old]["fingerprint"], report[old]["weight_files"]) \
        == ("acme/tiny", OLD_FP, 2)
    assert (report[new]["fingerprint"], report[new]["chunks"]) == (NEW_FP, 3)
    assert (report[legacy]["model"], report[legacy]["fingerprint"]) == ("unknown", "unknown")
    assert report[old]["chunks"] == 4 and report[legacy]["chunks"] == 2  # no manifest counted

    # The table: model and the short fingerprint, unknown for the old data.
    capsys.readouterr()
    assert main(["inspect", "--config", str(config)]) == 0
    table = capsys.readouterr().out
    assert "acme/tiny" in table and OLD_FP[:12] in table and NEW_FP[:12] in table
    assert "unknown" in table and OLD_FP not in table

    # A dry run says what would go and deletes nothing, manifests included.
    dry = cli_json(capsys, "gc", "--config", str(config), "--fingerprint", OLD_FP[:8],
                   "--dry-run")
    assert [(o["namespace"], o["removed_chunks"], o["removed_manifest"], o["model"])
            for o in dry["outcomes"]] == [(old, 4, True, "acme/tiny")]
    assert held(config, OLD, range(4)) == list(range(4))
    assert set(by_namespace(cli_json(capsys, "inspect", "--config", str(config)))) \
        == {old, new, legacy}

    # gc by fingerprint: the old checkpoint's namespace goes whole, the others stay.
    out = cli_json(capsys, "gc", "--config", str(config), "--fingerprint", OLD_FP[:6].upper())
    assert [(o["namespace"], o["removed_chunks"], o["kept_chunks"], o["removed_manifest"])
            for o in out["outcomes"]] == [(old, 4, 0, True)]
    assert held(config, OLD, range(4)) == []
    assert held(config, NEW, range(10, 13)) == [10, 11, 12]
    assert held(config, LEGACY, range(20, 22)) == [20, 21]
    after = by_namespace(cli_json(capsys, "inspect", "--config", str(config)))
    assert set(after) == {new, legacy} and after[new]["model"] == "acme/tiny"

    # Nothing matches any more: said so, exit 0, nothing removed.
    capsys.readouterr()
    assert main(["gc", "--config", str(config), "--fingerprint", OLD_FP[:8]]) == 0
    assert "no namespace matches --fingerprint" in capsys.readouterr().out
    assert cli_json(capsys, "gc", "--config", str(config), "--model", "other/model")[
        "unmatched"].startswith("no namespace matches --model other/model")

    # By the model's name: the new checkpoint (the legacy data has no manifest: kept).
    out = cli_json(capsys, "gc", "--config", str(config), "--model", "acme/tiny")
    assert [(o["namespace"], o["removed_chunks"]) for o in out["outcomes"]] == [(new, 3)]
    assert set(by_namespace(cli_json(capsys, "inspect", "--config", str(config)))) == {legacy}


@pytest.mark.parametrize("prefix", ["01234", "0123456789abcdefg", "xyzxyz", "", "0" * 33])
def test_a_fingerprint_prefix_must_be_6_to_32_hex_digits(
        prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "d"),
                                     "capacity": "1MiB"})
    fill(config, OLD, OLD_INFO, range(2))
    assert main(["gc", "--config", str(config), "--fingerprint", prefix]) == 2
    err = capsys.readouterr().err
    assert "--fingerprint" in err and "6 to 32 lowercase hex digits" in err
    assert held(config, OLD, range(2)) == [0, 1]
    assert main(["gc", "--config", str(config), "--model", " "]) == 2
    assert main(["gc", "--config", str(config), "--orphans", "--quota", "0",
                 "--fingerprint", OLD_FP]) == 2


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_bad_manifest_file_is_unknown_never_a_crash(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Garbage, another namespace's manifest, truncated JSON, a huge file, a symlink to a
    valid one, a FIFO and a directory at the manifest's path: each namespace is listed as
    unknown, and gc --fingerprint selects none of them."""
    root = tmp_path / kind
    config = write_config(tmp_path, {"kind": kind, "path": str(root), "capacity": "64MiB"})
    fill(config, OLD, OLD_INFO, range(2))
    valid = root / OLD.digest() / FILE_NAME
    assert read_file_manifest(root, OLD.digest()) is not None
    layouts = [dataclasses.replace(tiny_layout(16), model_fingerprint=f"{i:032x}")
               for i in range(7)]
    for i, layout in enumerate(layouts):
        fill(config, layout, None, range(i, i + 1))
    bad = [root / layout.digest() / FILE_NAME for layout in layouts]
    bad[0].write_bytes(b"\x00\xffnot json")
    bad[1].write_bytes(valid.read_bytes())  # a valid manifest, of another namespace
    bad[2].write_bytes(valid.read_bytes()[:40])
    bad[3].write_bytes(b" " * (1 << 20))
    bad[4].symlink_to(valid)
    os.mkfifo(bad[5])
    bad[6].mkdir()

    report = by_namespace(cli_json(capsys, "inspect", "--config", str(config)))
    assert {n: r["model"] for n, r in report.items()} == {
        OLD.digest(): "acme/tiny", **{layout.digest(): "unknown" for layout in layouts}}
    out = cli_json(capsys, "gc", "--config", str(config), "--fingerprint", OLD_FP[:6])
    assert [o["namespace"] for o in out["outcomes"]] == [OLD.digest()]
    assert all(held(config, layout, range(i, i + 1)) == [i] for i, layout in enumerate(layouts))
    assert valid.exists() is False and bad[4].is_symlink()  # the link is left alone


@pytest.mark.redis
def test_redis_manifest_after_the_first_chunk_and_never_a_chunk_or_an_orphan(
        tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    import redis

    config = write_config(tmp_path, {"kind": "redis", "url": redis_url, "capacity": 0})
    client = redis.Redis.from_url(redis_url)
    name = redis_manifest_name("kvtier:", OLD.digest())
    with open_store(StoreConfig.load(config), OLD, OLD_INFO):
        pass  # opened, nothing stored: no manifest yet (no I/O at start-up)
    assert client.get(name) is None
    fill(config, OLD, OLD_INFO, range(2))
    stored = parse_manifest(client.get(name), OLD.digest())
    assert stored is not None and stored.same_as(new_manifest(OLD, OLD_INFO))
    assert client.ttl(name) == -1  # kept until gc removes the namespace

    [inventory] = open_inventories(StoreConfig.load(config))
    try:
        assert {c.namespace for c in inventory.chunks()} == {OLD.digest()}
        assert sum(1 for _ in inventory.chunks()) == 2
        assert inventory.orphans() == []  # type: ignore[attr-defined]
        assert set(read_manifests(inventory)) == {OLD.digest()}
    finally:
        inventory.close()
    cli_json(capsys, "gc", "--config", str(config), "--orphans")
    assert client.get(name) is not None

    client.set(name, b"\x00garbage")  # a corrupt value: unknown, and rewritten by the next
    report = by_namespace(cli_json(capsys, "inspect", "--config", str(config)))
    assert report[OLD.digest()]["model"] == "unknown"
    fill(config, OLD, OLD_INFO, range(5, 6))  # engine's next start and store
    assert parse_manifest(client.get(name), OLD.digest()) is not None


def test_a_fingerprint_with_a_quota_trims_only_that_checkpoint_and_keeps_its_manifest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--fingerprint restricts --quota (and --max-age) to the checkpoint's namespaces; not a
    whole-namespace eviction, so its manifest stays."""
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "d"),
                                     "capacity": "1MiB"})
    fill(config, OLD, OLD_INFO, range(4))
    fill(config, NEW, NEW_INFO, range(10, 14))
    out = cli_json(capsys, "gc", "--config", str(config), "--fingerprint", OLD_FP[:10],
                   "--quota", "0")
    assert [(o["namespace"], o["removed_chunks"], o["removed_manifest"])
            for o in out["outcomes"]] == [(OLD.digest(), 4, False)]
    assert held(config, NEW, range(10, 14)) == [10, 11, 12, 13]
    report = by_namespace(cli_json(capsys, "inspect", "--config", str(config)))
    assert (report[OLD.digest()]["chunks"], report[OLD.digest()]["model"]) == (0, "acme/tiny")
    assert report[OLD.digest()]["oldest_s"] is None
    # A namespace selection that names a namespace and a fingerprint: both must match.
    out = cli_json(capsys, "gc", "--config", str(config), "--fingerprint", OLD_FP[:10],
                   "--namespace", NEW.digest())
    assert out["outcomes"] == [] and out["unmatched"]
    assert held(config, NEW, range(10, 14)) == [10, 11, 12, 13]
