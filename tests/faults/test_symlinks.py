"""Fault drill: symlinks inside a tier's directory are never followed (issue 12, item 2).

Whoever can write to a shared (or group) cache directory can plant links in it. kvtier used to
follow them: a shard directory replaced by a symlink made it write into and delete from the
link's target, and one chunk-named symlink to a 10 GiB file made the quota scan evict every
real chunk (`kvtier gc --namespace` deleting through a symlinked directory:
tests/tools/test_gc_symlinks.py). Each drill plants the link on a real filesystem and checks
that the target is untouched and the tier goes on serving its real chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tierkit import key, make_tier, tier_settings

from kvtier.core.layout import KVLayout
from kvtier.tiers import build_probe
from kvtier.tiers.storeconfig import StoreConfig

PERSISTENT = ("disk", "shared")


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 11 + j) % 256 for j in range(layout.bytes_per_chunk))


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    return outside


@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_symlinked_shard_directory_is_neither_written_nor_deleted_through(
        kind: str, tmp_path: Path, layout: KVLayout) -> None:
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    assert tier.put(key(1), memoryview(payload(1, layout)))
    shard = tier.files.path_of(key(1)).parent  # type: ignore[attr-defined]
    outside = _outside(tmp_path)
    victim = outside / tier.files.path_of(key(1)).name  # type: ignore[attr-defined]
    victim.write_bytes(b"someone else's file")
    for child in shard.iterdir():
        child.unlink()
    shard.rmdir()
    shard.symlink_to(outside, target_is_directory=True)
    assert not tier.contains(key(1))
    assert not tier.get_into(key(1), memoryview(bytearray(layout.bytes_per_chunk)))
    tier.delete(key(1))
    assert tier.put(key(1), memoryview(payload(1, layout))).failure is not None
    assert victim.read_bytes() == b"someone else's file", "deleted or overwritten through a link"
    assert sorted(p.name for p in outside.iterdir()) == [victim.name], "wrote into the target"
    probe = build_probe(StoreConfig.parse({"tiers": [tier_settings(kind, tmp_path, layout, 8)]})
                        .tiers[0], [layout])
    assert probe is not None and not probe.contains(key(1))


def test_a_chunk_named_symlink_to_a_huge_file_does_not_evict_real_chunks(
        tmp_path: Path, layout: KVLayout) -> None:
    """A 10 GiB sparse file outside the tree, linked under a chunk's name: the quota scan
    counts only regular files of the layout, so the 6 real chunks (of 8) all stay."""
    tier = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    for i in range(6):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    huge = _outside(tmp_path) / "huge"
    with open(huge, "wb") as f:
        f.truncate(10 << 30)
    link = tier.files.path_of(key(99))  # type: ignore[attr-defined]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(huge)
    tier.enforce_quota()  # type: ignore[attr-defined]
    assert tier.stats().evictions == 0
    assert all(tier.contains(key(i)) for i in range(6))
    assert not tier.contains(key(99))
    assert huge.stat().st_size == 10 << 30
    # A restart (the old start-up sweep) does not evict either.
    assert make_tier("shared", tmp_path, layout, capacity_chunks=8).stats().evictions == 0
    assert all(tier.contains(key(i)) for i in range(6))
