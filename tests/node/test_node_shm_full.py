"""Shared memory full: the node cannot create a layout's RAM slab (/dev/shm has no room, the
fault injected into `posix_fallocate`, as tmpfs reports it: ENOSPC). The engine's Hello is
refused with the reason, counted; its stores and loads are misses at once (nothing hangs);
no half-made slab is left in /dev/shm; the node serves on, and once there is room the same
engine's next try opens the layout and stores.

An in-process node (`running_node`), so that the fault can be injected into its process.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import connect, expected, key, lend, node_tiers, put_chunks, wait_for

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
