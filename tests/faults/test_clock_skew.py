"""Fault drill: a node whose clock runs minutes ahead of the shared filesystem's.

kvtier's temp files (writes in flight) are taken for a killed writer's when their mtime is
older than TEMP_STALE_S (120 s), and swept by the re-measure and evicted first by eviction.
An mtime is stamped by the filesystem's clock (on NFS the server's), and was compared with
the node's: a node 10 minutes ahead swept every write in flight in the directory, the whole
fleet's, at each of its re-measures (each such write then failed: a dropped write). A node
now reads the filesystem's clock off the files it creates (`ChunkFiles.fs_now`).

The node's clock is skewed by replacing `time` in the modules that read it (the fault
injected); the filesystem, the writer in flight and the files are real.
"""

from __future__ import annotations

import time
import types
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier

from kvtier.core.layout import KVLayout
from kvtier.tiers.files import chunkfiles, chunktree, filetree, victims
from kvtier.tiers.files import shared as shared_module

AHEAD_S = 600.0


def skewed_time() -> types.SimpleNamespace:
    """The `time` module as a node 10 minutes ahead sees it."""
    return types.SimpleNamespace(
        time=lambda: time.time() + AHEAD_S, time_ns=lambda: time.time_ns() + int(AHEAD_S * 1e9),
        monotonic=time.monotonic, monotonic_ns=time.monotonic_ns,
        perf_counter=time.perf_counter)


def test_a_node_ahead_of_the_filesystem_does_not_sweep_writes_in_flight(
        tmp_path: Path, layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    data = memoryview(bytes(layout.bytes_per_chunk))
    writer: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    in_flight = writer.files.prepare_write(key(1))  # another engine's write, being filled
    for module in (chunkfiles, chunktree, filetree, victims):
        monkeypatch.setattr(module, "time", skewed_time())
    ahead: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    for i in range(2, 14):  # a full quota: the skewed node evicts (stale temp files first)
        assert ahead.put(key(i), data)
    assert ahead.stats().evictions > 0
    ahead.enforce_quota()  # and re-measures (sweeping stale temp files)
    in_flight.fill(data)
    assert in_flight.complete(), "the write in flight was swept as a killed writer's"
    assert writer.contains(key(1))
    ahead.close()
    writer.close()


def test_a_node_ahead_of_the_filesystem_claims_re_measures_by_the_filesystems_clock(
        tmp_path: Path, layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger's `claimed_ns` was stamped with the claiming node's clock: a node 10
    minutes ahead put every other writer's next re-measure off by 10 minutes (or, past
    FUTURE_CLAIM_S, had its claims taken back: a walk at every put of its). Claims are
    stamped by the filesystem's clock, which every node reads alike."""
    data = memoryview(bytes(layout.bytes_per_chunk))
    writer: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    for module in (chunkfiles, chunktree, filetree, victims, shared_module):
        monkeypatch.setattr(module, "time", skewed_time())
    ahead: Any = make_tier("shared", tmp_path, layout, capacity_chunks=8)
    ahead.enforce_quota()
    monkeypatch.undo()
    with writer.ledger.locked() as ledger:
        assert ledger.claimed_ns <= time.time_ns()
    assert writer.put(key(1), data)
    assert writer.future_claims == 0
    ahead.close()
    writer.close()
