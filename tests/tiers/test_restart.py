"""Restart: a new process (here: a new store) on the same disk or shared directory finds
what the old one wrote, with the disk tier's LRU order intact."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from tierkit import key, make_tier, tier_settings, tiny_layout

from kvtier.core.layout import KVLayout
from kvtier.core.store import TieredStore
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i + j) % 256 for j in range(layout.bytes_per_chunk))


def _store(root: Path, layout: KVLayout) -> TieredStore:
    tiers = [tier_settings("memory", root, layout, 4),
             tier_settings("disk", root, layout, 8),
             tier_settings("shared", root, layout, 16)]
    return open_store(StoreConfig.parse({"tiers": tiers}), layout)


def test_a_new_store_finds_what_the_old_one_wrote(tmp_path: Path, layout: KVLayout) -> None:
    """An engine stores 6 chunks and exits; its successor looks the prompt up and gets all
    6 from the disk tier (its RAM tier starts empty), byte for byte, and counts the hits."""
    with _store(tmp_path, layout) as old:
        for i in range(6):
            old.put(key(i), memoryview(payload(i, layout)))
    new = _store(tmp_path, layout)
    with new:
        found = new.lookup([key(i) for i in range(7)])
        assert found.num_chunks == 6 and set(found.tiers) == {"disk"}
        out = bytearray(layout.bytes_per_chunk)
        for i in range(6):
            assert new.get_into(key(i), memoryview(out)) == "disk"
            assert bytes(out) == payload(i, layout)
        disk = new.stats().tiers[1]
        assert disk.hits == 6 and disk.chunks == 6 and disk.corrupt_reads == 0


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_each_persistent_tier_alone_survives_a_restart(kind: str, tmp_path: Path,
                                                       layout: KVLayout) -> None:
    first = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    for i in range(5):
        first.put(key(i), memoryview(payload(i, layout)))
    first.close()
    second = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    assert second.stats().chunks == 5
    assert second.stats().used_bytes == 5 * second.file_bytes  # type: ignore[attr-defined]
    out = bytearray(layout.bytes_per_chunk)
    for i in range(5):
        assert second.get_into(key(i), memoryview(out)) and bytes(out) == payload(i, layout)


def test_the_disk_tiers_lru_order_survives_a_restart(tmp_path: Path, layout: KVLayout) -> None:
    """Chunks 0..3 are written, then 0 and 1 are read again. After a restart the next
    eviction must take 2 (the least recently used), not 0 (the oldest written). The order
    lives in file mtimes, whose clock ticks coarsely on Linux (a few ms): pause between
    steps so each step has its own tick."""
    tier = make_tier("disk", tmp_path, layout, capacity_chunks=4)
    out = memoryview(bytearray(layout.bytes_per_chunk))
    for i in range(4):
        tier.put(key(i), memoryview(payload(i, layout)))
        time.sleep(0.02)
    for i in (0, 1):
        assert tier.get_into(key(i), out)
        time.sleep(0.02)
    tier.close()
    restarted = make_tier("disk", tmp_path, layout, capacity_chunks=4)
    restarted.put(key(10), memoryview(payload(10, layout)))
    assert not restarted.contains(key(2))
    assert all(restarted.contains(key(i)) for i in (0, 1, 3, 10))
    restarted.put(key(11), memoryview(payload(11, layout)))
    assert not restarted.contains(key(3)) and restarted.contains(key(0))


def test_a_restart_with_a_smaller_capacity_keeps_the_most_recent_chunks(
    tmp_path: Path, layout: KVLayout,
) -> None:
    """An operator halves the disk budget: at start-up the tier evicts down to it, oldest
    first, and counts the evictions."""
    tier = make_tier("disk", tmp_path, layout, capacity_chunks=6)
    for i in range(6):
        tier.put(key(i), memoryview(payload(i, layout)))
        time.sleep(0.02)
    tier.close()
    smaller = make_tier("disk", tmp_path, layout, capacity_chunks=3)
    assert [i for i in range(6) if smaller.contains(key(i))] == [3, 4, 5]
    assert smaller.stats().evictions == 3
    assert len(list(tmp_path.rglob("*.kvc"))) == 3


def test_another_layout_in_the_same_directory_is_invisible(tmp_path: Path) -> None:
    """The same directory serves a fp16 and a bf16 model: neither sees the other's chunks,
    even under the same key."""
    fp16 = tiny_layout()
    bf16 = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="bfloat16",
                    tokens_per_chunk=16)
    writer = make_tier("shared", tmp_path, fp16, capacity_chunks=8)
    writer.put(key(1), memoryview(payload(1, fp16)))
    reader = make_tier("shared", tmp_path, bf16, capacity_chunks=8)
    assert not reader.contains(key(1))
    assert not reader.get_into(key(1), memoryview(bytearray(bf16.bytes_per_chunk)))
    assert os.path.exists(writer.files.path_of(key(1)))  # type: ignore[attr-defined]
