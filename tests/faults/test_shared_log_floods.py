"""Fault drill: a shared tier whose every put or read fails the same way logs a line now and
then, with how many it held back, not a line per chunk (`ThrottledWarning`, as its failed
writes already did). A quota full of nothing it can evict (drift a re-measure repairs only
after `scan_interval_s`, or a directory of young temp files), evictions refused (EACCES on
another user's directory) and reads failing (EIO on a dying mount) each logged a warning per
put or read: an engine storing thousands of chunks a second wrote thousands of lines a
second (up to EVICT_MISSES = 32 lines per put for refused evictions)."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier

import kvtier.tiers.files.shared as shared_module
from kvtier.core.layout import KVLayout

PUTS = 300
# Lines logged for PUTS failing puts: a throttled warning logs one every 10 s (and one when
# its interval has passed), so far fewer than one per put on any machine.
FEW_LINES = 10


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_puts_dropped_for_a_full_quota_log_a_line_now_and_then(
        tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture) -> None:
    tier: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    with tier.ledger.locked() as ledger:  # 8 chunks' worth deleted behind kvtier's back
        ledger.used_bytes = tier.capacity_bytes
    data = memoryview(bytes(layout.bytes_per_chunk))
    with caplog.at_level(logging.WARNING, "kvtier"):
        dropped = sum(not tier.put(key(i), data) for i in range(PUTS))
    assert dropped == PUTS == tier.stats().dropped_writes
    assert 1 <= len(_lines(caplog)) < FEW_LINES
    tier.close()


def test_refused_evictions_log_a_line_now_and_then(
        tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tier: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    data = memoryview(bytes(layout.bytes_per_chunk))
    for i in range(8):
        assert tier.put(key(i), data)

    def refused(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(shared_module, "unlink_file", refused)  # the fault injected
    with caplog.at_level(logging.WARNING, "kvtier"):
        assert not any(tier.put(key(100 + i), data) for i in range(PUTS // 10))
    assert 1 <= len(_lines(caplog)) < FEW_LINES
    tier.close()


def test_reads_failing_log_a_line_now_and_then(
        tmp_path: Path, layout: KVLayout, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tier: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    assert tier.put(key(1), memoryview(bytes(layout.bytes_per_chunk)))

    def failing(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(tier.files, "read_into", failing)  # the fault injected
    out = memoryview(bytearray(layout.bytes_per_chunk))
    with caplog.at_level(logging.WARNING, "kvtier"):
        assert not any(tier.get_into(key(1), out) for _ in range(PUTS))
    assert tier.stats().misses == PUTS
    assert 1 <= len(_lines(caplog)) < FEW_LINES
    tier.close()
