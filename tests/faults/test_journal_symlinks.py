"""Fault drill: the disk tier's retention journal follows no symlink planted at its names.

Whoever can write in a disk tier's directory (one another user created before the tier did:
`path: /tmp/kv` made by someone else) can plant links in it. The chunk files were safe
(tests/faults/test_symlinks.py), the journal was not: a `retention.jsonl` linked to one of the
tier's user's files had a JSON line appended to it at each pinned store, and a link at the
temp name of the start-up compaction (`.retention.jsonl.<pid>.tmp`, predictable) had its
target truncated and overwritten. Each drill plants the link on a real filesystem and checks
the target is untouched and the tier keeps its chunks and pins.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tierkit import key, make_tier, tiny_layout

from kvtier.core.retention import ChunkMeta
from kvtier.tiers.files.disk import DiskTier
from kvtier.tiers.files.retention_journal import JOURNAL_NAME

LAYOUT = tiny_layout()
CHUNK = bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256)
VICTIM_TEXT = b"the tier's user's own file\n"


def disk(tmp_path: Path) -> DiskTier:
    tier = make_tier("disk", tmp_path, LAYOUT, 8)
    assert isinstance(tier, DiskTier)
    return tier


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "dotfile"
    path.parent.mkdir()
    path.write_bytes(VICTIM_TEXT)
    return path


def test_a_journal_linked_elsewhere_is_not_appended_to(tmp_path: Path) -> None:
    target = victim(tmp_path)
    tier = disk(tmp_path)
    journal = tier.files.directory / JOURNAL_NAME
    journal.unlink(missing_ok=True)
    journal.symlink_to(target)
    pin = ChunkMeta(tenant="t", retain_until=time.time() + 3600)
    assert tier.put(key(1), memoryview(CHUNK), pin)
    assert tier.contains(key(1))
    tier.close()
    assert target.read_bytes() == VICTIM_TEXT, "a journal line was appended through a link"


def test_a_link_at_the_compactions_temp_name_is_not_written_through(tmp_path: Path) -> None:
    target = victim(tmp_path)
    tier = disk(tmp_path)
    until = time.time() + 3600
    assert tier.put(key(1), memoryview(CHUNK), ChunkMeta(tenant="t", retain_until=until))
    directory = tier.files.directory
    tier.close()
    (directory / f".{JOURNAL_NAME}.{os.getpid()}.tmp").symlink_to(target)
    again = disk(tmp_path)  # its start-up compacts the journal through the temp name
    assert again.meta_of(key(1)) == ChunkMeta("t", until, None)
    again.close()
    assert target.read_bytes() == VICTIM_TEXT, "the compaction truncated a link's target"
    assert not (directory / JOURNAL_NAME).is_symlink()
