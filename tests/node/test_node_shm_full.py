"""Shared memory full: the node cannot create a layout's RAM slab (/dev/shm has no room, the
fault injected into `posix_fallocate`, as tmpfs reports it: ENOSPC). The engine's Hello is
refused with the reason, counted; its stores and loads are misses at once (nothing hangs);
no half-made slab is left in /dev/shm; the node serves on, and once there is room the same
engine's next try opens the layout and stores.

An in-process node (`running_node`), so that the fault can be injected into its process.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import LAYOUT, connect, expected, key, lend, node_tiers, put_chunks, wait_for

from kvtier.node.server import NodeServer
from kvtier.tiers.shmslab import SHM_DIR

pytestmark = pytest.mark.timeout(120)


def test_a_full_dev_shm_refuses_the_layout_and_the_node_serves_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node:
        monkeypatch.setattr(os, "posix_fallocate", no_room)
        client, engine = connect(node.config.socket_path, retry_s=0.2)
        assert put_chunks(engine, [1]) == [False]  # a miss: the layout was refused
        assert lend(engine, [key(1)]).chunks == []
        assert client.failures >= 1
        status = node.status()
        assert status["counters"]["refused"] >= 1 and status["layouts"] == {}
        assert list(SHM_DIR.glob(f"kvtier-{node.config.name}-*")) == []

        monkeypatch.undo()  # room again: the engine's next try (after its back-off) opens it
        wait_for(lambda: put_chunks(engine, [1]) == [True], 10, "the layout opened")
        assert lend(engine, [key(1)]).chunks == expected([1])
        assert len(node.status()["layouts"]) == 1


def test_a_full_dev_shm_names_the_slabs_of_earlier_layouts_no_engine_asks_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    """A model upgraded across restarts leaves its old layout's slab (kept for a successor to
    recover; its model may come back): when the new layout's slab finds no room, the error
    says which slabs hold /dev/shm (it named only the new one)."""
    config = node_tiers(tmp_path, ram_chunks=4)
    with in_process_node(config) as node:
        _client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [1]) == [True]
        [old_slab] = SHM_DIR.glob(f"kvtier-{node.config.name}-*")

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    upgraded = dataclasses.replace(LAYOUT, tokens_per_chunk=2 * LAYOUT.tokens_per_chunk)
    with in_process_node(config), caplog.at_level(logging.ERROR, "kvtier.node.layouts"):
        monkeypatch.setattr(os, "posix_fallocate", no_room)
        _client, engine = connect(node.config.socket_path, upgraded)
        assert put_chunks(engine, [1], upgraded.bytes_per_chunk) == [False]
    [error] = [r.getMessage() for r in caplog.records if "cannot open" in r.getMessage()]
    assert f"earlier layouts no engine asks for now hold /dev/shm: {old_slab}" in error


def test_a_full_dev_shm_is_logged_once_however_often_its_engines_ask(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    """Each engine of the refused layout asks again every retry_s (2 s): the node logged an
    error for each ask, as long as /dev/shm stayed full. The same error is said once."""
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with in_process_node(node_tiers(tmp_path, ram_chunks=4)) as node, \
            caplog.at_level(logging.ERROR, "kvtier.node.layouts"):
        monkeypatch.setattr(os, "posix_fallocate", no_room)
        _client, engine = connect(node.config.socket_path, retry_s=0.05)

        def refused_four_times() -> bool:
            assert put_chunks(engine, [1]) == [False]
            return int(node.status()["counters"]["refused"]) >= 4

        wait_for(refused_four_times, 30, "the layout refused 4 times")
        errors = [r.getMessage() for r in caplog.records if "cannot open" in r.getMessage()]
        assert len(errors) == 1, errors  # before: one per refusal
        monkeypatch.undo()
        wait_for(lambda: put_chunks(engine, [1]) == [True], 10, "the layout opened")
