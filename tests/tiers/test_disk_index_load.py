"""The disk tier serves hits while its start-up index fills (issue 28).

At 2 million chunks the walk that rebuilds the index takes tens of seconds; start-up must not
wait for it. The walk is held back here (a gate in front of `walk_chunks`: a slow disk, not a
change of what the tier does) so that the index stays empty for as long as the test needs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierkit import key, make_tier

from kvtier.core.layout import KVLayout
from kvtier.core.tier import OK, Failure
from kvtier.tiers.files import chunktree, disk, diskscan


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(layout.bytes_per_chunk))


@pytest.mark.timing
def test_hits_are_served_while_the_index_loads(tmp_path: Path, layout: KVLayout,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted tier whose walk has not started yet: the constructor returns within
    INDEX_WAIT_S; the 20 chunks on disk are found and read byte for byte; an absent key is a
    miss; once the walk runs, the index holds all 20 and nothing was counted twice."""
    first = make_tier("disk", tmp_path, layout, capacity_chunks=32)
    for i in range(20):
        assert first.put(key(i), memoryview(payload(i, layout)))
    first.close()

    gate = threading.Event()
    real_walk = chunktree.walk_chunks

    def held_back(files: chunktree.ChunkFilesLike,
                  owned: bool = False) -> Iterator[chunktree.FoundChunk]:
        gate.wait(30)
        yield from real_walk(files, owned)

    monkeypatch.setattr(diskscan, "walk_chunks", held_back)
    began = time.monotonic()
    tier = make_tier("disk", tmp_path, layout, capacity_chunks=32)
    assert time.monotonic() - began < disk.INDEX_WAIT_S + 1.0
    assert not tier.index_loaded  # type: ignore[attr-defined]
    out = bytearray(layout.bytes_per_chunk)
    for i in range(20):
        assert tier.contains(key(i))
        assert tier.get_into(key(i), memoryview(out)) == OK
        assert bytes(out) == payload(i, layout)
    assert not tier.contains(key(99))
    assert tier.get_into(key(99), memoryview(out)).failure == Failure.MISSING
    assert tier.stats().hits == 20 and tier.stats().misses == 1

    gate.set()
    assert tier.wait_loaded(30)  # type: ignore[attr-defined]
    stats = tier.stats()
    assert stats.chunks == 20 and stats.used_bytes == 20 * tier.file_bytes  # type: ignore[attr-defined]
    assert tier.put(key(20), memoryview(payload(20, layout))) == OK
    assert tier.stats().chunks == 21


def test_a_chunk_deleted_while_the_index_loads_is_not_indexed(
        tmp_path: Path, layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    first = make_tier("disk", tmp_path, layout, capacity_chunks=8)
    for i in range(3):
        assert first.put(key(i), memoryview(payload(i, layout)))
    first.close()
    gate, real_walk = threading.Event(), chunktree.walk_chunks

    def held_back(files: chunktree.ChunkFilesLike,
                  owned: bool = False) -> Iterator[chunktree.FoundChunk]:
        found = list(real_walk(files, owned))  # the walk saw all three ...
        gate.wait(30)  # ... before the delete below
        yield from found

    monkeypatch.setattr(diskscan, "walk_chunks", held_back)
    tier = make_tier("disk", tmp_path, layout, capacity_chunks=8)
    assert tier.delete(key(1))  # not indexed yet, but held on disk: removed
    gate.set()
    assert tier.wait_loaded(30)  # type: ignore[attr-defined]
    assert tier.stats().chunks == 2 and not tier.contains(key(1))
