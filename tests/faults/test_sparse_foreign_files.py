"""Fault drill: a huge sparse file kvtier did not write sits at a chunk's path of a shared
directory (`truncate -s 100G` under a chunk's name: an operator's test, a broken copy tool).

It takes no room on the disk, but its size (st_size) is 100 GiB. Counted at that size, the
re-measure found the directory 10^6 times over its quota and evicted every real chunk, and an
eviction that met the file subtracted 100 GiB from the ledger (a usage of 0: the quota then
overshot until the next re-measure). A chunk file with less than half of its size allocated
that does not begin with a chunk header counts what it allocates, as `du` does
(`filetree.counted_bytes`); a real chunk counts its size, exactly, wherever it is measured.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tierkit import key, make_tier

from kvtier.core.chunkformat import MAGIC
from kvtier.core.layout import KVLayout

HUGE_BYTES = 100 << 30


def sparse_file(path: Path, size_bytes: int, head: bytes = b"") -> None:
    """A file of `size_bytes` at `path` that allocates (almost) nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size_bytes)


def real_usage(root: Path) -> int:
    """The sizes of the chunk files below `root` that begin with a chunk header."""
    total = 0
    for path in root.rglob("*.kvc"):
        with open(path, "rb") as f:
            total += path.stat().st_size if f.read(len(MAGIC)) == MAGIC else 0
    return total


def test_a_sparse_foreign_file_neither_evicts_real_chunks_nor_empties_the_ledger(
        tmp_path: Path, layout: KVLayout) -> None:
    tier: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    data = memoryview(bytes(layout.bytes_per_chunk))
    for i in range(6):
        assert tier.put(key(i), data)
    foreign = tier.files.path_of(key(99))
    sparse_file(foreign, HUGE_BYTES)
    tier.enforce_quota()  # the re-measure meets it
    assert tier.stats().evictions == 0
    assert all(tier.contains(key(i)) for i in range(6))
    assert tier.stats().used_bytes == 6 * tier.file_bytes == real_usage(tmp_path)

    # The oldest file in the directory: the first victim when the quota fills.
    day_ago = time.time() - 86400
    os.utime(foreign, (day_ago, day_ago))
    for i in range(6, 12):
        assert tier.put(key(i), data)
    assert not foreign.exists()
    with tier.ledger.locked() as ledger:
        assert ledger.used_bytes == real_usage(tmp_path) > 0
    assert sum(tier.contains(key(i)) for i in range(12)) == 8  # 12 put into room for 8
    tier.close()


def test_a_real_chunk_whose_blocks_are_not_reported_yet_still_counts_its_size(
        tmp_path: Path, layout: KVLayout) -> None:
    """A filesystem that compresses, or reports a file's blocks late (ZFS, until its
    transaction group commits) or never (some FUSE mounts): a chunk file that begins with a
    chunk header counts its size, whatever it allocates."""
    tier: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    assert tier.put(key(0), memoryview(bytes(layout.bytes_per_chunk)))
    sparse_file(tier.files.path_of(key(1)), tier.file_bytes, MAGIC)  # allocates 4 KiB of 8
    sparse_file(tier.files.path_of(key(2)), 4 * tier.file_bytes, MAGIC)  # 4 KiB of 32
    tier.enforce_quota()
    assert tier.stats().used_bytes == 6 * tier.file_bytes
    assert tier.delete(key(2))
    with tier.ledger.locked() as ledger:
        assert ledger.used_bytes == 2 * tier.file_bytes
    tier.close()
