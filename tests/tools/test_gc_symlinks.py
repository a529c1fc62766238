"""Fault drill: `kvtier gc --namespace` never follows a symlink inside a tier's directory
(issue 12, item 2): it deleted a file outside the tree through a symlinked directory. The
tiers' own drills: tests/faults/test_symlinks.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tierkit import key, make_tier, tier_settings

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.admin.gc import GcRequest, run_gc
from kvtier.tools.admin.inventory import open_inventories

PERSISTENT = ("disk", "shared")


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 11 + j) % 256 for j in range(layout.bytes_per_chunk))


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    return outside


@pytest.mark.parametrize("kind", PERSISTENT)
def test_gc_of_a_namespace_never_deletes_outside_the_tree(kind: str, tmp_path: Path,
                                                           layout: KVLayout) -> None:
    """A namespace directory that is a symlink to a tree of the same shape elsewhere, and a
    real namespace with one symlinked shard directory: `gc --namespace` of each removes the
    real chunks only."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    for i in range(3):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    root = tmp_path / kind
    real_ns = layout.digest()
    # A foreign tree shaped like a namespace, linked in under another digest.
    foreign = _outside(tmp_path) / "tree"
    elsewhere = ChunkKey(b"\xab" * 16)  # a shard directory none of keys 0-2 uses
    relative = tier.files.path_of(elsewhere).relative_to(root / real_ns)  # type: ignore[attr-defined]
    planted = foreign / relative
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"x" * 100)
    linked_ns = "f" * 32
    (root / linked_ns).symlink_to(foreign, target_is_directory=True)
    # A shard directory of the real namespace replaced by a link to the foreign tree's.
    shard_rel = tier.files.path_of(elsewhere).parent.relative_to(root)  # type: ignore[attr-defined]
    (root / shard_rel).parent.mkdir(parents=True, exist_ok=True)
    (root / shard_rel).symlink_to(planted.parent, target_is_directory=True)
    config = StoreConfig.parse({"tiers": [tier_settings(kind, tmp_path, layout, 8)]})
    for namespace in (linked_ns, real_ns):
        inventories = open_inventories(config)
        run_gc(inventories, GcRequest(namespace=namespace))
    assert planted.read_bytes() == b"x" * 100, "gc deleted a file outside the tier's tree"
    assert not any(tier.contains(key(i)) for i in range(3)), "the real namespace was not gc'd"
    assert os.path.islink(root / linked_ns)
