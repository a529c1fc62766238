"""Fault drill: the shared tier's quota ledger (ROOT/.kvtier-quota) and its open file.

A ledger used after it was closed (a re-measure still walking when its tier's close() gave up
waiting for it, CLOSE_WAIT_S; a put racing close) locked, read and wrote whatever file the
process had opened since under the ledger's old descriptor number: 56 bytes of an unrelated
file overwritten. A closed ledger refuses (OSError EBADF, a dropped write for a put).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvtier.tiers.files.quota import QuotaLedger


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
