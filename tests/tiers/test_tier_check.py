"""`Checkable.check`: a tier's books against its storage. The contract suite runs it after
every test (tests/tiers/test_tier_contract.py); here it is shown to see what it must see.
"""

from __future__ import annotations

from pathlib import Path

from tierkit import key, make_tier, tiny_layout

from kvtier.core.tier import OK


def filled(kind: str, tmp_path: Path, count: int = 3):  # type: ignore[no-untyped-def]
    layout = tiny_layout()
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    for i in range(count):
        assert tier.put(key(i), memoryview(bytes([i]) * layout.bytes_per_chunk)) == OK
    assert tier.check() == []
    return tier


def test_a_disk_tier_sees_files_removed_or_added_behind_its_back(tmp_path: Path) -> None:
    tier = filled("disk", tmp_path)
    files = sorted((tmp_path / "disk").rglob("*.kvc"))
    files[0].unlink()
    stray = files[1].with_name("ff" * 16 + ".kvc")
    stray.write_bytes(files[1].read_bytes())
    assert tier.check() == ["1 indexed chunks have no file", "1 chunk files are not indexed"]
    tier.close()


def test_a_disk_tier_sees_a_file_of_another_size_and_a_pin_without_a_chunk(
        tmp_path: Path) -> None:
    tier = filled("disk", tmp_path)
    path = sorted((tmp_path / "disk").rglob("*.kvc"))[0]
    path.write_bytes(path.read_bytes() + bytes(4096))
    tier._policy.remove(key(2))  # a fault: a chunk neither evictable nor pinned
    assert tier.check() == ["3 chunks held, 2 evictable and 0 pinned",
                            "1 chunk files differ from their indexed size"]
    tier.close()


def test_a_memory_tier_sees_a_lost_slot(tmp_path: Path) -> None:
    tier = filled("memory", tmp_path)
    tier._free.pop()  # a fault: a slot neither held nor free
    assert tier.check() == ["1 slots neither held, free nor being read"]
    tier.close()
