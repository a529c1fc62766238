"""What a node's first loads would pay for, paid before them: the node's read threads run before
its first Borrow (`TieredStore.start_reads`), and the slab's pages are mapped into the
engine's process in the background as it maps the slab (tiers/prefault.py; the node's own
mapping: tests/cache/test_memory_prefault.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import SLOT_BYTES, NodeProcess, connect, node_tiers, wait_for

from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
RAM_SLOTS = 4096  # 16 MiB of 4 KiB slots


def rss_shmem_kib() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("RssShmem:")).split()[1])


def test_the_nodes_read_threads_run_before_its_first_borrow(
        tmp_path: Path,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    """ThreadPoolExecutor starts a thread per read as reads come, each start waiting for the
    thread to run: on a busy machine the first Borrow after a node's start read its first
    chunks one after another while the pool grew (docs/performance.md, "A node's first
    load"). The node starts them as it builds a layout's store."""
    before = set(threading.enumerate())
    config = {**node_tiers(tmp_path, ram_chunks=8, disk_chunks=16), "io_threads": 3}
    with in_process_node(config) as node:
        client, _ = connect(node.config.socket_path)
        assert client.welcomed() is not None  # the layout's store is built
        wait_for(lambda: len([t for t in set(threading.enumerate()) - before
                              if t.name.startswith("kvtier-read")]) == 3, 10,
                 "the node's 3 read threads")


def test_an_engine_maps_the_slabs_pages_before_its_first_copy(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """A copy into or out of a page of the slab this process has not touched yet faults
    (7x slower than into a mapped one here); the client maps them all in the background."""
    node = start_node(node_tiers(tmp_path, ram_chunks=RAM_SLOTS))
    before = rss_shmem_kib()
    client, _ = connect(node.socket_path)
    assert client.welcomed() is not None
    wait_for(lambda: rss_shmem_kib() - before >= RAM_SLOTS * SLOT_BYTES // 1024 * 0.9, 30,
             "the slab's pages mapped in this process")
