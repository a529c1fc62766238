"""A disk tier refuses a directory another user could have put chunk files in. A disk tier's
directory is its own (0700, created by the tier), but one that already existed was used
whoever made it: a `path` such as /tmp/kvtier or /scratch/kv that another user of the host
made first (and owns: they may change it at any time) had its chunk files served as KV, forged
ones included (the chunk format's checksum is no secret). The layout directory must now be
this user's, else a ConfigError naming the tier's path; a root another user owns (but root) is
a warning: an engine run as root in a container on a volume its host's user owns is common.
Real directories handed to another user (root only: chown).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.errors import ConfigError
from kvtier.tiers.files.disk import DiskTier

LAYOUT = tiny_layout()
STRANGER = 65534  # nobody
FORGED = b"\x66" * LAYOUT.bytes_per_chunk

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another "
                                                          "user takes root")


def hand_over(path: Path) -> None:
    """`path` and everything under it, another user's."""
    for entry in [path, *path.rglob("*")]:
        os.chown(entry, STRANGER, STRANGER, follow_symlinks=False)


def test_a_layout_directory_another_user_made_is_refused(tmp_path: Path) -> None:
    forger = make_tier("disk", tmp_path, LAYOUT, 8)  # the other user's tier, their chunks
    assert isinstance(forger, DiskTier)
    assert forger.put(key(1), memoryview(FORGED))
    directory = forger.files.directory
    forger.close()
    hand_over(directory)
    with pytest.raises(ConfigError) as refused:
        tier = make_tier("disk", tmp_path, LAYOUT, 8)
        served = bytearray(LAYOUT.bytes_per_chunk)
        hit = tier.get_into(key(1), memoryview(served)).ok
        tier.close()
        assert not hit, "another user's chunk served as KV"
    assert refused.value.field.endswith("path") and str(directory) in refused.value.allowed


def test_a_root_another_user_owns_is_a_warning(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o777)
    hand_over(root)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.files.directories"):
        tier = make_tier("disk", root, LAYOUT, 8)
    assert tier.put(key(1), memoryview(FORGED))  # the tier runs, in its own layout directory
    tier.close()
    assert f"belongs to uid {STRANGER}" in caplog.text and str(root) in caplog.text
