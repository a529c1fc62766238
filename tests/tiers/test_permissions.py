"""Security defaults of the file tiers: every directory kvtier creates is 0700 and every
chunk file 0600 (owner only), whatever the process umask; `group_shared` opts into 0770 /
0660 for a cache shared by a group. Checked on a real filesystem, under the common umask 022
(which would otherwise leave directories 0755: key names listable by every user) and a
strict 077.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierkit import make_tier

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def modes_below(top: Path) -> tuple[set[int], set[int]]:
    """(directory modes, file modes) of `top` and everything below it."""
    dirs, files = {stat.S_IMODE(top.stat().st_mode)}, set()
    for path in top.rglob("*"):
        (dirs if path.is_dir() else files).add(stat.S_IMODE(path.stat().st_mode))
    return dirs, files


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_cache_directories_are_0700_and_files_0600(kind: str, tmp_path: Path,
                                                   layout: KVLayout, umask: int) -> None:
    """The tier creates its directory (and a missing parent) itself, then stores chunks."""
    tier = make_tier(kind, tmp_path / "new-parent", layout, capacity_chunks=4)
    for i in range(3):
        assert tier.put(ChunkKey(i.to_bytes(16, "big")), memoryview(bytes(layout.bytes_per_chunk)))
    dirs, files = modes_below(tmp_path / "new-parent" / kind)
    assert dirs == {0o700} and files == {0o600}


def test_group_shared_directory_is_0770_and_files_0660(tmp_path: Path, layout: KVLayout,
                                                       umask: int) -> None:
    tier = make_tier("shared", tmp_path, layout, capacity_chunks=4, group_shared=True)
    assert tier.put(ChunkKey(b"g" * 16), memoryview(bytes(layout.bytes_per_chunk)))
    dirs, files = modes_below(tmp_path / "shared")
    assert dirs == {0o770} and files == {0o660}
