"""A shared directory's re-measure that cannot read part of the tree.

Engines of different users share the directory (`group_shared`); where its root is not
setgid to their common group, a shard directory one user made falls into that user's primary
group, and the other users cannot list it (EACCES). The re-measure walked past it and set
the ledger's usage to what it could read: the files there counted as nothing, the usage fell
below what the directory held, and the writers stored past the quota by them (measured with
a real second user: 6 chunk files counted as 5). A walk that cannot read a directory now
leaves the usage no lower than the ledger's, and says which directory it could not read.

EACCES is injected into the walk's open of one shard directory (as root, which this test
may run as, nothing is refused); the tier, the files and the ledger are real.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.tiers.files import filetree

LAYOUT = tiny_layout()
CHUNKS = 6


def spread_key(i: int) -> Any:
    """Chunk i's key, in shard directory <layout>/0<i+1>/1<i>: no name shared by two levels."""
    return key((i + 1) << 120 | (0x10 + i) << 112)


def test_a_remeasure_that_cannot_read_a_directory_does_not_lower_the_usage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tier: Any = make_tier("shared", tmp_path, LAYOUT, capacity_chunks=CHUNKS)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    for i in range(CHUNKS):  # one chunk in each of 6 shard directories
        assert tier.put(spread_key(i), data)
    hidden = spread_key(0).hex()[:2]  # another user's shard directory: <layout>/01
    real_open = os.open

    def refused(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == hidden and kwargs.get("dir_fd") is not None:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(filetree.os, "open", refused)
    with caplog.at_level(logging.WARNING):
        tier.enforce_quota()
    with tier.ledger.locked() as ledger:
        assert ledger.used_bytes >= CHUNKS * tier.file_bytes, \
            "a file the re-measure could not read was taken off the usage"
    assert any(hidden in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    # The quota holds: a put makes room first, whatever the walk could not see.
    assert tier.put(key(99), data)
    monkeypatch.undo()
    files = [p for p in (tmp_path / "shared").rglob("*.kvc") if p.is_file()]
    assert len(files) * tier.file_bytes <= CHUNKS * tier.file_bytes
    tier.close()
