"""Namespace manifests (issue 11): which model a storage namespace holds, written by each
persistent tier when a store opens it with a `NamespaceInfo` (what `kvtier inspect` shows and
`kvtier gc --fingerprint` / `--model` select by: tests/tools/test_namespace_manifest_commands.py).

What the tiers do with them: a manifest's content, rewritten only when different; one that
cannot be written is logged, never fatal; a restarted tier counts chunks only and sweeps a dead
writer's manifest temp file; the fingerprint is part of the layout's digest when set, and
computed once per process (again after an update).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from storekit import LEGACY, NEW, OLD, OLD_FP, OLD_INFO, fill, held, write_config
from tierkit import tiny_layout

from kvtier.core.fingerprint import cached_model_fingerprint
from kvtier.errors import ConfigError
from kvtier.tiers import build_tier
from kvtier.tiers.manifest import FILE_NAME, NamespaceInfo, new_manifest, parse_manifest
from kvtier.tiers.storeconfig import StoreConfig


def test_manifest_content_and_it_is_rewritten_only_when_different(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "d"),
                                     "capacity": "1MiB"})
    fill(config, OLD, OLD_INFO, range(1))
    path = tmp_path / "d" / OLD.digest() / FILE_NAME
    doc = json.loads(path.read_text())
    assert doc["kvtier_manifest"] == 1 and doc["namespace"] == OLD.digest()
    assert (doc["model"], doc["fingerprint"], doc["weight_files"]) == ("acme/tiny", OLD_FP, 2)
    assert doc["layout"] == dataclasses.asdict(OLD) and doc["kvtier_version"]
    assert abs(doc["created_s"] - time.time()) < 60
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # the tier's file mode

    # The same engine again: nothing rewritten (same inode, same bytes).
    before = (path.stat().st_ino, path.read_bytes())
    fill(config, OLD, OLD_INFO, range(1))
    assert (path.stat().st_ino, path.read_bytes()) == before
    # Another engine's name for the same checkpoint: rewritten, first time kept.
    fill(config, OLD, dataclasses.replace(OLD_INFO, model="/mnt/node-b/tiny"), range(1))
    again = json.loads(path.read_text())
    assert again["model"] == "/mnt/node-b/tiny" and again["created_s"] == doc["created_s"]
    assert list(path.parent.glob(".manifest-*")) == []  # no temp file left


def test_a_manifest_that_cannot_be_written_is_logged_never_fatal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A full filesystem at the rename (injected): the store opens and stores, the namespace
    shows as unknown, no temp file is left."""
    import kvtier.tiers.files.manifests as manifest_module

    real_replace = os.replace

    def full(src: Any, dst: Any, **kwargs: Any) -> None:
        if str(src).startswith(".manifest-"):  # the manifest's rename only
            raise OSError(28, "No space left on device")
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(manifest_module.os, "replace", full)
    config = write_config(tmp_path, {"kind": "disk", "path": str(tmp_path / "d"),
                                     "capacity": "1MiB"})
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.files.manifests"):
        fill(config, OLD, OLD_INFO, range(3))
    assert "namespace manifest not written" in caplog.text
    monkeypatch.undo()
    assert held(config, OLD, range(3)) == [0, 1, 2]
    assert not (tmp_path / "d" / OLD.digest() / FILE_NAME).exists()
    assert list((tmp_path / "d" / OLD.digest()).glob(".manifest-*")) == []


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_restarted_tier_counts_chunks_only_and_sweeps_a_dead_writers_manifest_temp(
        kind: str, tmp_path: Path) -> None:
    config = write_config(tmp_path, {"kind": kind, "path": str(tmp_path / kind),
                                     "capacity": "1MiB"})
    fill(config, OLD, OLD_INFO, range(3))
    layout_dir = tmp_path / kind / OLD.digest()
    stale = layout_dir / f".manifest-{'a' * 32}.tmp"  # a writer killed mid-write
    stale.write_bytes(b"{")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    tier = build_tier(StoreConfig.load(config).tiers[1], OLD)
    try:
        stats = tier.stats()
        if kind == "disk":  # the index rebuilt from the directory: 3 chunks, no manifest
            assert stats.chunks == 3
        assert stats.used_bytes == 3 * tier.file_bytes  # type: ignore[attr-defined]
    finally:
        tier.close()
    assert not stale.exists()  # swept as one of kvtier's temp files
    assert (layout_dir / FILE_NAME).exists()


def test_the_fingerprint_is_part_of_the_layout_digest_only_when_set() -> None:
    assert tiny_layout(16).digest() == "a9fdfd891846333e57813216f6271070"  # as before
    assert OLD.digest() != NEW.digest() != LEGACY.digest()
    for bad in ("0123", "G" * 32, OLD_FP.upper(), 7):
        with pytest.raises(ConfigError, match=r"layout\.model_fingerprint"):
            dataclasses.replace(LEGACY, model_fingerprint=bad)


def test_the_fingerprint_is_computed_once_per_process_and_again_after_an_update(
        tmp_path: Path) -> None:
    """The scheduler and every worker ask for it; a checkpoint overwritten in place (new
    size or mtime) is fingerprinted again."""
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"a" * 4096)
    computed = []
    args = {"config": {"model_type": "llama"}, "dtype": "bfloat16", "on_computed": computed.append}
    first = cached_model_fingerprint(tmp_path, **args)
    assert cached_model_fingerprint(tmp_path, **args) == first and len(computed) == 1
    weights.write_bytes(b"b" * 4096)
    os.utime(weights, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    second = cached_model_fingerprint(tmp_path, **args)
    assert second != first and len(computed) == 2 and second.weight_files == 1




@pytest.mark.parametrize("field, value", [("created_s", float("nan")), ("created_s", 1e300),
                                          ("created_s", -1), ("fingerprint", "not hex"),
                                          ("fingerprint", "AB" * 16)])
def test_a_manifest_with_a_value_no_kvtier_writes_is_not_one(field: str, value: Any) -> None:
    """NaN or 1e300 as its time, a fingerprint that is no digest: not a manifest (its
    namespace shows as unknown and the tier writes its own), never copied into the manifest
    a tier writes next ("created_s": NaN is not JSON)."""
    layout = tiny_layout()
    good = new_manifest(layout, NamespaceInfo("m", "ab" * 16, 1))
    assert parse_manifest(good.to_json(), layout.digest()) == good
    doc = json.loads(good.to_json()) | {field: value}
    assert parse_manifest(json.dumps(doc).encode(), layout.digest()) is None
