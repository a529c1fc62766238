"""Fault drill: something that is not a regular file sits at a chunk path (issue 12, item 1).

A peer or a mistake leaves a named pipe, or a device node, where a chunk file goes. Opening a
FIFO for reading blocks until a writer appears, so a plain `open` hung `get_into` for ever:
inside vLLM a hung engine. Now a lookup does not report it, a read returns at once as a
counted CORRUPT miss (the entry is removed from kvtier's layout), and the tier keeps serving.
Each read runs on a daemon thread with a deadline, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier

from kvtier.core.layout import KVLayout
from kvtier.core.tier import CORRUPT, TierResult

PERSISTENT = ("disk", "shared")
DEADLINE_S = 5.0


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(layout.bytes_per_chunk))


def read_with_deadline(tier: Any, i: int, layout: KVLayout) -> TierResult:
    """tier.get_into(key(i)) on a daemon thread; fails the test if it has not returned
    within DEADLINE_S (the thread is abandoned, blocked in open)."""
    out = bytearray(layout.bytes_per_chunk)
    done: list[TierResult] = []
    reader = threading.Thread(target=lambda: done.append(tier.get_into(key(i), memoryview(out))),
                              daemon=True)
    reader.start()
    reader.join(DEADLINE_S)
    assert done, f"get_into still blocked after {DEADLINE_S} s"
    return done[0]


def _replace_with(path: Path, make: str) -> None:
    path.unlink()
    if make == "fifo":
        os.mkfifo(path, 0o600)
    else:  # a character device: /dev/zero's numbers (reads would never end without a bound)
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))


@pytest.mark.parametrize("make", ["fifo", "char_device"])
@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_special_file_at_a_chunk_path_is_a_prompt_counted_miss(
        kind: str, make: str, tmp_path: Path, layout: KVLayout) -> None:
    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    for i in range(3):
        assert tier.put(key(i), memoryview(payload(i, layout)))
    path = tier.files.path_of(key(1))  # type: ignore[attr-defined]
    try:
        _replace_with(path, make)
    except PermissionError:
        pytest.skip(f"cannot create a {make} here (needs root or CAP_MKNOD)")
    assert read_with_deadline(tier, 1, layout) == CORRUPT
    stats = tier.stats()
    assert stats.misses == 1 and stats.corrupt_reads == 1
    assert not os.path.lexists(path), "the special file is removed from kvtier's layout"
    assert not tier.contains(key(1))
    # The tier goes on: the other chunks read back, the key can be stored again.
    out = bytearray(layout.bytes_per_chunk)
    assert tier.get_into(key(2), memoryview(out)) and bytes(out) == payload(2, layout)
    assert tier.put(key(1), memoryview(payload(1, layout)))
    assert tier.get_into(key(1), memoryview(out)) and bytes(out) == payload(1, layout)


@pytest.mark.parametrize("kind", PERSISTENT)
def test_a_fifo_is_never_counted_by_the_probe_nor_the_scan(kind: str, tmp_path: Path,
                                                           layout: KVLayout) -> None:
    """The scheduler's probe (another process's view) and a restarted tier's scan see only
    regular files: a FIFO left at a chunk path before start-up is neither a hit nor a
    chunk held, and the start-up scan does not block on it."""
    from tierkit import tier_settings

    from kvtier.tiers import build_probe
    from kvtier.tiers.storeconfig import StoreConfig

    tier = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    assert tier.put(key(1), memoryview(payload(1, layout)))
    path = tier.files.path_of(key(2))  # type: ignore[attr-defined]
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path, 0o600)
    config = StoreConfig.parse({"tiers": [tier_settings(kind, tmp_path, layout, 8)]})
    probe = build_probe(config.tiers[0], [layout])
    assert probe is not None
    assert probe.contains(key(1)) and not probe.contains(key(2))
    tier.close()
    restarted = make_tier(kind, tmp_path, layout, capacity_chunks=8)
    assert restarted.stats().chunks == 1
    assert not restarted.contains(key(2))
    assert read_with_deadline(restarted, 2, layout).failure is not None
