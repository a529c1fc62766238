"""Fault drills on stored chunk files: whatever happened to a file, a read is a counted,
logged miss that removes the bad file, never an exception and never wrong data; and the
tier goes on serving.

Each drill damages a real file on a real filesystem the way it happens in the field: a
crash mid-copy (truncated), a bit flip, a file of another format version or layout, a
file moved under another key's name, a file deleted by another process.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from tierkit import key, make_tier, tier_settings

from kvtier.core.chunkformat import HEADER_BYTES
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.store import TieredStore
from kvtier.core.tier import CORRUPT, MISSING
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

PERSISTENT = ("disk", "shared")


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 3 + j) % 256 for j in range(layout.bytes_per_chunk))


def _rewrite_field(path: Path, offset: int, fmt: str, value: object) -> None:
    """Replace one header field and re-seal the header checksum: a well-formed header
    that describes something else."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<" + fmt, data, offset, value)
    struct.pack_into("<Q", data, 60, xxhash.xxh3_64_intdigest(bytes(data[:60])))
    path.write_bytes(bytes(data))


def truncate(path: Path, other: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def truncate_to_header(path: Path, other: Path) -> None:
    os.truncate(path, HEADER_BYTES)


def empty_file(path: Path, other: Path) -> None:
    os.truncate(path, 0)


def flip_payload_byte(path: Path, other: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)[0]
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte ^ 0x01]))


def flip_header_byte(path: Path, other: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(30)
        byte = f.read(1)[0]
        f.seek(30)
        f.write(bytes([byte ^ 0x40]))


def wrong_magic(path: Path, other: Path) -> None:
    _rewrite_field(path, 0, "8s", b"NOTKVTR\x00")


def wrong_version(path: Path, other: Path) -> None:
    _rewrite_field(path, 8, "H", 99)


def wrong_layout(path: Path, other: Path) -> None:
    _rewrite_field(path, 12, "16s", b"\x11" * 16)


def wrong_payload_size(path: Path, other: Path) -> None:
    _rewrite_field(path, 44, "Q", 12)


def another_keys_file(path: Path, other: Path) -> None:
    """A whole, valid chunk file of another key lands under this key's name."""
    shutil.copyfile(other, path)


DAMAGE: dict[str, Callable[[Path, Path], None]] = {
    f.__name__: f for f in (truncate, truncate_to_header, empty_file, flip_payload_byte,
                            flip_header_byte, wrong_magic, wrong_version, wrong_layout,
                            wrong_payload_size, another_keys_file)
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_damaged_file_is_a_counted_logged_miss_and_the_tier_keeps_working(
    kind: str, damage: str, tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture,
) -> None:
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    for i in (1, 2):
        tier.put(key(i), memoryview(payload(i, layout)))
    path = tier.files.path_of(key(1))  # type: ignore[attr-defined]
    DAMAGE[damage](path, tier.files.path_of(key(2)))  # type: ignore[attr-defined]

    out = bytearray(b"\xee" * layout.bytes_per_chunk)
    with caplog.at_level(logging.WARNING):
        assert tier.get_into(key(1), memoryview(out)) == CORRUPT
    stats = tier.stats()
    assert (stats.misses, stats.hits, stats.corrupt_reads) == (1, 0, 1)
    assert key(1).hex() in caplog.text
    assert not path.exists(), "a corrupt file must be removed"
    assert not tier.contains(key(1))
    # The tier keeps working: the other chunk, a re-put of the damaged one, a new one.
    assert tier.get_into(key(2), memoryview(out)) and bytes(out) == payload(2, layout)
    assert tier.put(key(1), memoryview(payload(1, layout)))
    assert tier.get_into(key(1), memoryview(out)) and bytes(out) == payload(1, layout)
    assert tier.put(key(3), memoryview(payload(3, layout)))
    assert tier.stats().chunks == 3


def test_a_damaged_file_on_disk_at_start_up_is_dropped_from_the_index(
    tmp_path: Path, layout: KVLayout,
) -> None:
    """The machine crashed while a chunk file was being copied in by hand: at restart the
    short file is removed and counted, the others are served."""
    tier = make_tier("disk", tmp_path, layout, capacity_chunks=8)
    for i in (1, 2):
        tier.put(key(i), memoryview(payload(i, layout)))
    truncate(tier.files.path_of(key(1)), Path())  # type: ignore[attr-defined]
    tier.close()
    restarted = make_tier("disk", tmp_path, layout, capacity_chunks=8)
    assert not restarted.contains(key(1)) and restarted.contains(key(2))
    assert restarted.stats().corrupt_reads == 1 and restarted.stats().chunks == 1


def _store(root: Path, layout: KVLayout) -> TieredStore:
    tiers = [tier_settings(kind, root, layout, 8) for kind in ("memory", "disk", "shared")]
    return open_store(StoreConfig.parse({"tiers": tiers}), layout)


def test_the_store_serves_a_good_copy_from_a_lower_tier_when_one_copy_is_corrupt(
    tmp_path: Path, layout: KVLayout,
) -> None:
    """The RAM copy was evicted and the disk copy has a flipped bit: the store returns the
    shared directory's intact copy and repairs the tiers above it."""
    with _store(tmp_path, layout) as store:
        store.put(key(1), memoryview(payload(1, layout)))
        assert store.flush(timeout_s=10)
        memory, disk, _shared = store.tiers
        memory.delete(key(1))
        flip_payload_byte(disk.files.path_of(key(1)), Path())  # type: ignore[attr-defined]
        out = bytearray(layout.bytes_per_chunk)
        assert store.get_into(key(1), memoryview(out)) == "shared"
        assert bytes(out) == payload(1, layout)
        assert disk.stats().corrupt_reads == 1
        assert store.flush(timeout_s=10)
        assert memory.contains(key(1)) and disk.contains(key(1))
        assert disk.get_into(key(1), memoryview(out)) and bytes(out) == payload(1, layout)


@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_file_deleted_between_lookup_and_read_is_a_plain_miss(
    kind: str, tmp_path: Path, layout: KVLayout,
) -> None:
    """Another process (or the shared quota's evictor) deletes a chunk right after this
    engine's lookup promised it: the read is a miss - not an exception, not a stale buffer
    handed back as data - and the next lookup no longer promises it."""
    tiers = [tier_settings("memory", tmp_path, layout, 8), tier_settings(kind, tmp_path, layout, 8)]
    with open_store(StoreConfig.parse({"tiers": tiers}), layout) as store:
        store.put(key(1), memoryview(payload(1, layout)))
        store.put(key(2), memoryview(payload(2, layout)))
        assert store.flush(timeout_s=10)
        memory, lower = store.tiers
        memory.delete(key(1))
        assert store.lookup([key(1), key(2)]).tiers == (kind, "memory")
        lower.files.path_of(key(1)).unlink()  # type: ignore[attr-defined]
        out = bytearray(layout.bytes_per_chunk)
        assert store.get_into(key(1), memoryview(out)) is None
        assert lower.stats().corrupt_reads == 0
        assert store.lookup([key(1), key(2)]).num_chunks == 0
        assert store.get_into(key(2), memoryview(out)) == "memory"
        assert store.put(key(1), memoryview(payload(1, layout)))
        assert store.get_into(key(1), memoryview(out)) and bytes(out) == payload(1, layout)


@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_file_deleted_between_the_tiers_own_check_and_its_read_is_a_counted_miss(
    kind: str, tmp_path: Path, layout: KVLayout,
) -> None:
    """The narrowest window: the tier itself said it holds the chunk, then the file went."""
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    tier.put(key(1), memoryview(payload(1, layout)))
    assert tier.contains(key(1))
    tier.files.path_of(key(1)).unlink()  # type: ignore[attr-defined]
    out = bytearray(layout.bytes_per_chunk)
    assert tier.get_into(key(1), memoryview(out)) == MISSING
    stats = tier.stats()
    assert (stats.misses, stats.hits, stats.corrupt_reads) == (1, 0, 0)
    assert not tier.contains(key(1))
    assert tier.put(key(1), memoryview(payload(1, layout)))
    assert tier.get_into(key(1), memoryview(out)) and bytes(out) == payload(1, layout)


def test_a_chunk_file_deleted_behind_the_disk_tiers_back_is_stored_again(tmp_path: Path) -> None:
    """Someone deletes a chunk file under a running disk tier: the tier stops claiming it
    (a removal event, a miss) and the next put writes it again instead of skipping it."""
    from kvtier.core.layout import KVLayout
    from kvtier.tiers.storeconfig import StoreConfig

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                      tokens_per_chunk=16)
    key, data = ChunkKey(b"k" * 16), memoryview(bytes(range(256)) * 16)
    config = StoreConfig.parse(
        {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "1MiB"}]})
    with open_store(config, layout) as store:
        assert store.put(key, data)
        disk = store.tiers[0]
        disk.files.path_of(key).unlink()  # type: ignore[attr-defined]
        assert not store.contains(key)
        assert store.put(key, data)
        out = memoryview(bytearray(len(data)))
        assert store.get_into(key, out) == "disk" and bytes(out) == bytes(data)
        assert [e.kind for e in store.take_events()] == ["stored", "removed", "stored"]
