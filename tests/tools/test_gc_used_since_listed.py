"""`kvtier gc --quota/--max-age` beside running engines on a shared directory: a victim an
engine reads (or writes again) between gc's listing and its deletion is hot now, and stays.

gc listed the tree, chose the least recently used files, then deleted them whatever had
happened since: a chunk an engine had just read (its mtime touched: the tier's LRU order)
went, and the engine's next request for it missed and recomputed. The deletion now checks
each file's mtime against the listing's, just before the unlink (as the tier's own sampled
eviction does), and reports what it kept (`GcOutcome.kept_used`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tierkit import key, tiny_layout

from kvtier.core.tier import StoredChunk
from kvtier.tiers import build_tier
from kvtier.tiers.files.chunktree import FileInventory
from kvtier.tiers.files.shared import SharedTier, SharedTierConfig
from kvtier.tools.admin.gc import GcRequest, run_gc

LAYOUT = tiny_layout()


class RacedInventory(FileInventory):
    """The shared tier's inventory, with an engine's use of the tier injected between gc's
    listing and its deletion (the race, made certain)."""

    def __init__(self, root: Path, meanwhile: Callable[[], None]) -> None:
        super().__init__("shared", "shared", root, 0o600)
        self._meanwhile = meanwhile

    def chunks(self) -> Iterator[StoredChunk]:
        yield from super().chunks()
        self._meanwhile()


def engine_with_aged_chunks(root: Path, count: int) -> Any:
    """A running shared tier holding `count` chunks, chunk i last used 1000 - i s ago."""
    config = SharedTierConfig(kind="shared", path=root, capacity=64 * 8192)
    engine: Any = build_tier(config, LAYOUT)
    assert isinstance(engine, SharedTier)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    now = time.time()
    for i in range(count):
        assert engine.put(key(i), data)
        os.utime(engine.files.path_of(key(i)), (now - 1000 + i, now - 1000 + i))
    return engine


def test_gc_keeps_a_victim_an_engine_read_after_the_listing(tmp_path: Path) -> None:
    engine = engine_with_aged_chunks(tmp_path / "shared", 6)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))

    def engine_reads_the_oldest() -> None:
        assert engine.get_into(key(0), out)  # a hit: touches its mtime, as every hit does

    inventory = RacedInventory(tmp_path / "shared", engine_reads_the_oldest)
    request = GcRequest(quota_bytes=3 * engine.file_bytes)
    [outcome] = run_gc([inventory], request)
    assert engine.contains(key(0)), "gc deleted a chunk read after it listed it"
    assert [engine.contains(key(i)) for i in range(6)] == [True, False, False, True, True, True]
    assert (outcome.removed_chunks, outcome.kept_used, outcome.kept_chunks) == (2, 1, 4)
    with engine.ledger.locked() as ledger:  # only what went is taken off the ledger
        assert ledger.used_bytes == 4 * engine.file_bytes and ledger.chunks == 4
    engine.close()


def test_gc_keeps_a_victim_written_again_after_the_listing(tmp_path: Path) -> None:
    """Deleted (an engine's eviction) and stored again by an engine after gc listed it: a
    new file, not the old one gc chose."""
    engine = engine_with_aged_chunks(tmp_path / "shared", 4)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))

    def engine_writes_the_oldest_again() -> None:
        assert engine.delete(key(0))
        assert engine.put(key(0), data)

    inventory = RacedInventory(tmp_path / "shared", engine_writes_the_oldest_again)
    [outcome] = run_gc([inventory], GcRequest(max_age_s=500))
    assert engine.contains(key(0))
    assert not any(engine.contains(key(i)) for i in range(1, 4))
    assert (outcome.removed_chunks, outcome.kept_used) == (3, 1)
    engine.close()


def test_a_whole_namespace_goes_whatever_its_use(tmp_path: Path) -> None:
    """`--namespace` (or `--fingerprint`) alone evicts a namespace whole: a chunk's use
    since the listing was no reason it was chosen, and keeps nothing."""
    engine = engine_with_aged_chunks(tmp_path / "shared", 3)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    inventory = RacedInventory(tmp_path / "shared", lambda: engine.get_into(key(0), out))
    [outcome] = run_gc([inventory], GcRequest(namespace=LAYOUT.digest()))
    assert not any(engine.contains(key(i)) for i in range(3))
    assert (outcome.removed_chunks, outcome.kept_used) == (3, 0)
    engine.close()
