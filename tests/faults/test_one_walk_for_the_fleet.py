"""Fault drill: a new or corrupt quota ledger is walked by one process, not by every one.

A ledger that is not valid (new, torn, garbage) keeps no claim of a re-measure (an invalid
state is not written back), so every writer of every process claimed one at start-up and at
every put: N engines starting on one NFS directory each walked its millions of files, at
once. The walk is now also claimed by a flock of ROOT/.kvtier-quota-walk, held for the whole
walk: the others see it held and go on without walking (their puts dropped until the walker's
usage is in the ledger), and a walker killed mid-walk holds it no longer.

Real processes (spawned), each with its own ledger handle, on one directory; the walker's walk
is held on an event (a fault injected into its `scan_tree`) so that the others start while it
walks. Walks are counted by each tier (`SharedTier.remeasures`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, put_once_remeasured, tiny_layout

from kvtier.core.tier import Failure
from kvtier.tiers.files.quota import LEDGER_NAME, QuotaLedger

LAYOUT = tiny_layout()
CAPACITY_CHUNKS = 64
OTHERS = 3  # engines started while the walker walks
CONTEXT = multiprocessing.get_context("spawn")


def _walker(root: str, conn: Connection) -> None:
    """An engine whose start-up walk of the directory (claimed: the ledger is not valid) is
    held until the test says "release" on `conn`; then it reports its walks there."""
    import kvtier.tiers.files.shared as shared_module

    real_scan = shared_module.scan_tree

    def held_scan(*args: Any, **kwargs: Any) -> Any:
        conn.send("walking")
        conn.poll(timeout=120)
        return real_scan(*args, **kwargs)

    shared_module.scan_tree = held_scan  # type: ignore[assignment]
    tier: Any = make_tier("shared", Path(root), LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
    tier.close()
    conn.recv()
    conn.send(("walker", tier.remeasures, 0))


def _other(root: str, seed: int, conn: Connection) -> None:
    """An engine started while another walks: its walks and puts stored, on `conn`."""
    tier: Any = make_tier("shared", Path(root), LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    stored = sum(bool(tier.put(key((seed << 32) + i), data)) for i in range(5))
    tier.close()
    conn.send(("other", tier.remeasures, stored))


def corrupt_directory(root: Path) -> None:
    """Four chunks stored, then the ledger torn (10 bytes of junk: not a ledger)."""
    tier: Any = make_tier("shared", root, LAYOUT, CAPACITY_CHUNKS)
    for i in range(4):
        assert tier.put(key(i), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    tier.close()
    (root / "shared" / LEDGER_NAME).write_bytes(b"\xff" * 10)


@contextmanager
def held_walker(root: Path) -> Iterator[tuple[Any, Connection]]:
    """A walker process, walking (held) when the block starts; (process, its connection:
    send "release" to let it finish, then receive its report). Pipes, not semaphores: a
    walker killed while holding one left the resource tracker a name to complain about."""
    conn, child = CONTEXT.Pipe()
    walker = CONTEXT.Process(target=_walker, args=(str(root), child))
    walker.start()
    try:
        assert conn.poll(timeout=120) and conn.recv() == "walking", "the walker never walked"
        yield walker, conn
    finally:
        with contextlib.suppress(OSError):
            conn.send("release")
        walker.join(timeout=120)
        if walker.is_alive():
            walker.kill()
            walker.join()


def test_engines_started_on_a_corrupt_ledger_walk_it_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corrupt_directory(tmp_path)
    with held_walker(tmp_path) as (walker, conn):
        pipes = [CONTEXT.Pipe() for _ in range(OTHERS)]
        others = [CONTEXT.Process(target=_other, args=(str(tmp_path), seed, child))
                  for seed, (_, child) in enumerate(pipes, start=1)]
        for proc in others:
            proc.start()
        reports = [mine.recv() for mine, _ in pipes if mine.poll(timeout=120)]
        assert len(reports) == OTHERS
        assert [walks for _, walks, _ in reports] == [0] * OTHERS, "walked beside the walker"
        # and a tier of this process, its own ledger handle, built while the walk is held
        here: Any = make_tier("shared", tmp_path, LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
        assert here.remeasures == 0, "walked beside the walker"
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.files.shared"):
            assert not here.put(key(100), memoryview(bytes(LAYOUT.bytes_per_chunk)))
        # the put's drop says why: not a full quota (it was a quarter full)
        assert "being measured" in caplog.text and "quota full" not in caplog.text
        for proc in others:
            proc.join(timeout=60)
            assert proc.exitcode == 0
        conn.send("release")
        assert conn.poll(timeout=120)
        reports.append(conn.recv())
    assert walker.exitcode == 0
    walks = {role: 0 for role in ("walker", "other")}
    for role, remeasures, stored in reports:
        walks[role] += remeasures
        assert role == "walker" or stored == 0  # dropped until the walker's usage is in
    assert walks == {"walker": 1, "other": 0}, f"walked {walks} times"
    assert here.put(key(100), memoryview(bytes(LAYOUT.bytes_per_chunk)))  # measured now
    assert here.remeasures == 0
    here.close()
    with QuotaLedger(tmp_path / "shared", 0o600).locked() as ledger:
        assert ledger.valid and ledger.chunks == 5


def test_a_walker_killed_mid_walk_does_not_stop_re_measures(tmp_path: Path) -> None:
    corrupt_directory(tmp_path)
    with held_walker(tmp_path) as (walker, _):
        os.kill(walker.pid, signal.SIGKILL)
        walker.join(timeout=60)
    assert walker.exitcode == -signal.SIGKILL
    tier: Any = make_tier("shared", tmp_path, LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
    assert tier.remeasures == 1, "the dead walker's claim stopped every re-measure"
    assert put_once_remeasured(tier, key(100), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    tier.close()
    with QuotaLedger(tmp_path / "shared", 0o600).locked() as ledger:
        assert ledger.valid and ledger.chunks == 5


def test_one_claim_of_the_walk_per_process_whatever_the_handle(tmp_path: Path) -> None:
    """Two ledger handles of one process (two tiers on one directory) share one walk lock
    file: on NFS a flock is a POSIX lock, held by the process, so a second file description
    of this process would not exclude the first; the process's claim does."""
    first, second = QuotaLedger(tmp_path, 0o600), QuotaLedger(tmp_path, 0o600)
    assert first.try_walk()
    assert not second.try_walk() and not first.try_walk()
    first.end_walk()
    assert second.try_walk()
    second.end_walk()
    first.close()
    second.close()


def test_a_claim_whose_ledger_write_failed_holds_no_walk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put claims the due walk under the ledger's lock, and the ledger's write-back then
    fails (EIO: a dying mount). The put is a dropped write and walks nothing; its claim must
    not stay held, or no process anywhere re-measured the directory again while this one
    lived (the others see the walk lock held)."""
    tier: Any = make_tier("shared", tmp_path, LAYOUT, CAPACITY_CHUNKS, scan_interval_s=3600)
    with tier.ledger.locked() as ledger:
        ledger.claimed_ns = 0  # a re-measure is due: the next put claims it
    real_pwrite = os.pwrite

    def failing_pwrite(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.EIO, "injected: the ledger cannot be written")

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    assert tier.put(key(1), memoryview(bytes(LAYOUT.bytes_per_chunk))).failure \
        is Failure.IO_ERROR
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert tier.remeasures == 1  # its start-up walk only
    other = QuotaLedger(tmp_path / "shared", 0o600)
    assert other.try_walk(), "the failed claim still holds the walk"
    other.end_walk()
    other.close()
    tier.close()
