"""Fault drill: the shared tier's quota ledger (ROOT/.kvtier-quota) and its open file.

A ledger used after it was closed (a re-measure still walking when its tier's close() gave up
waiting for it, CLOSE_WAIT_S; a put racing close) locked, read and wrote whatever file the
process had opened since under the ledger's old descriptor number: 56 bytes of an unrelated
file overwritten. A closed ledger refuses (OSError EBADF, a dropped write for a put). And a
ledger file removed or replaced under a running writer is opened again at its path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, put_once_remeasured, tiny_layout

from kvtier.core.tier import Failure
from kvtier.tiers.files.quota import LEDGER_NAME, QuotaLedger


def _fd_of(path: Path) -> int:
    """The number of this process's descriptor open on `path`."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == str(path):
                return int(name)
        except OSError:  # the listing's own descriptor, closed meanwhile
            continue
    raise AssertionError(f"{path} is not open")


def test_a_closed_ledger_never_touches_the_file_its_descriptor_number_now_names(
        tmp_path: Path) -> None:
    ledger = QuotaLedger(tmp_path, 0o600)
    with ledger.locked() as state:
        state.valid = True  # measured: written back
    number = _fd_of(ledger.path)
    ledger.close()
    other = tmp_path / "someone-elses.db"
    other.write_bytes(b"precious" * 16)
    fd = os.open(other, os.O_RDWR)
    try:
        if fd != number:  # the next open takes the lowest free number: make sure it is this one
            os.dup2(fd, number)
        with pytest.raises(OSError) as refused, ledger.locked() as state:
            state.used_bytes += 4096
        assert refused.value.errno == errno.EBADF
    finally:
        os.close(fd)
        if fd != number:
            os.close(number)
    assert other.read_bytes() == b"precious" * 16


def test_a_directory_emptied_under_a_writer_gets_one_ledger_again(tmp_path: Path) -> None:
    """An operator empties the shared directory under running engines (`rm -rf`, `mkdir`;
    a volume replaced). A running engine kept its quota in the deleted ledger's file, which
    no one else sees: an engine started since keeps another at the path, and each fills the
    quota on its own (on NFS the deleted file's handle goes stale: every put failed ESTALE).
    A ledger removed or replaced is opened again at its path: a new ledger, re-measured."""
    layout = tiny_layout()
    data = memoryview(bytes(layout.bytes_per_chunk))
    tier: Any = make_tier("shared", tmp_path, layout, 8)
    for i in range(4):
        assert tier.put(key(i), data)
    root = tmp_path / "shared"
    shutil.rmtree(root)
    assert tier.put(key(10), data).failure is Failure.IO_ERROR  # gone: dropped, not made
    root.mkdir(mode=0o700)
    stored = put_once_remeasured(tier, key(10), data)  # a new ledger: dropped until re-measured
    tier.close()
    assert stored
    assert (root / LEDGER_NAME).exists(), "the writer kept a ledger that no one else sees"
    with QuotaLedger(root, 0o600).locked() as ledger:
        assert ledger.valid and ledger.used_bytes == tier.file_bytes


def test_a_forked_child_locks_the_ledger_against_its_parent(tmp_path: Path) -> None:
    """A process that opened a shared tier and then forked (multiprocessing's default start
    method on Linux) used the parent's ledger fd in the child: flock locks an open file
    description, which the fork shares, so parent and child each took "the" lock while the
    other held it (lost updates of the ledger, the quota's bound gone). A child opens the
    ledger again: its lock excludes the parent's."""
    ledger = QuotaLedger(tmp_path, 0o600)
    parent_fd = _fd_of(ledger.path)
    held_r, held_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hold the ledger until the parent says go
        code = 1
        try:
            with ledger.locked():
                os.write(held_w, b"1")
                os.read(go_r, 1)
            code = 0
        finally:
            os._exit(code)
    # The child's ends only: a child that dies before it holds the lock ends the read (b"",
    # a failure) instead of leaving the parent waiting on its own write end for ever.
    os.close(held_w)
    os.close(go_r)
    try:
        assert os.read(held_r, 1) == b"1", "the child could not lock the ledger"
        with pytest.raises(BlockingIOError):
            fcntl.flock(parent_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        with contextlib.suppress(BrokenPipeError):  # the child gone already
            os.write(go_w, b"1")
        _, status = os.waitpid(pid, 0)
        for fd in (held_r, go_w):
            os.close(fd)
        ledger.close()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_ledger_moved_away_is_opened_again_by_the_next_re_measure(tmp_path: Path) -> None:
    """A ledger renamed away (or, on NFS, deleted on this node while open: renamed to
    .nfsXXXX) keeps a link: a hold's fstat does not see it, a re-measure's stat of the path
    does (two stats per re-measure, none per put: on NFS each is a round trip)."""
    layout = tiny_layout()
    tier: Any = make_tier("shared", tmp_path, layout, 8)
    assert tier.put(key(1), memoryview(bytes(layout.bytes_per_chunk)))
    root = tmp_path / "shared"
    os.rename(root / LEDGER_NAME, root / "ledger-moved-away")
    tier.enforce_quota()
    tier.close()
    with QuotaLedger(root, 0o600).locked() as ledger:
        assert ledger.valid and ledger.used_bytes == tier.file_bytes and ledger.chunks == 1
