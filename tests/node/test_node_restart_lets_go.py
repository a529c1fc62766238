"""Once a restarted node answers (a new generation), an engine lets the dead node's slab go:
no thread's mapping of it, no reader's file of it, so that its pages are freed. Before, an
engine's threads that had read in place kept it (each reader's own file, each thread's
mapping) for as long as the engine lived: on a /dev/shm with room for one slab (the shipped
Kubernetes sizing), the restarted node could not create its slab and refused every engine
(tests/node/test_node_shm_full_restart.py runs that case on a small tmpfs). Real
`kvtier node serve` processes on one name. A GPU engine's registration of the old slab for
DMA ends with it (the last test: CUDA's calls recorded)."""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from nodekit import (
    LAYOUT,
    NodeProcess,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    put_chunks,
    shm_files,
    wait_for,
)

from kvtier.node import client as node_client
from kvtier.node.protocol import RAM_TIER
from kvtier.tiers.shmslab import SHM_DIR

pytestmark = pytest.mark.timeout(120)


def slab_inode(name: str) -> int:
    """The inode of node `name`'s one slab (its file, whatever name it goes by later)."""
    [slab] = shm_files(name)
    return slab.stat().st_ino


def held(inode: int) -> list[str]:
    """This process's mappings and fds of the file `inode` in /dev/shm (renamed aside by a
    restarted node, then removed once recovered: its pages freed when no one holds it)."""
    dev = os.stat(SHM_DIR).st_dev
    found = [line for line in Path("/proc/self/maps").read_text().splitlines()
             if len(fields := line.split()) >= 6 and int(fields[4]) == inode
             and fields[5].startswith(str(SHM_DIR))]
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            st = os.stat(fd)
            if (st.st_dev, st.st_ino) == (dev, inode):
                found.append(f"fd {fd.name} -> {os.readlink(fd)}")
    return found


def released(inode: int) -> bool:
    gc.collect()  # nothing left to the collector: refcounts alone must free it
    return not held(inode)


@contextlib.contextmanager
def restarted_under_a_load(tmp_path: Path, start_node: Callable[..., NodeProcess]
                           ) -> Iterator[tuple[int, list[Any], Any]]:
    """Three chunks stored and lent in place from the node's slab; the node restarted, and a
    store on another thread welcomed by the new node (which lets the old slab go) while the
    loans are held: (the old slab's inode, the loans, the engine's store), in the load."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    _client, engine = connect(node.socket_path)
    assert put_chunks(engine, range(3)) == [True] * 3
    keys = [key(i) for i in range(3)]
    old = slab_inode(node.name)
    spare = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    with engine.lend_as_landed(keys, [spare], in_order=True) as lending, \
            ThreadPoolExecutor(1) as store_thread:
        loans = list(lending)
        assert [loan.view.tier for loan in loans] == [RAM_TIER] * 3  # read in place
        assert node.stop() == 0
        start_node(config)
        assert store_thread.submit(put_chunks, engine, [5]).result(60) == [True]
        yield old, loans, engine
        del loans


def test_a_reader_on_another_thread_lets_go_when_a_new_generation_welcomes(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """A load thread read in place, then idles (no load for a while: it never looks again).
    Once the store thread is welcomed by the restarted node, the old slab is let go at
    once: the load thread's reader's file too."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    _client, engine = connect(node.socket_path)
    assert put_chunks(engine, range(3)) == [True] * 3
    keys = [key(i) for i in range(3)]
    with ThreadPoolExecutor(1) as load_thread:
        assert load_thread.submit(lend, engine, keys).result(60).chunks == expected(range(3))
        old = slab_inode(node.name)
        assert node.stop() == 0
        node = start_node(config)
        assert put_chunks(engine, [5]) == [True]  # welcomed by the new node: its slab mapped
        wait_for(lambda: released(old), 30, "the old slab let go")
        # The load thread reads on, from the new node (recovered: the restart kept its RAM).
        assert load_thread.submit(lend, engine, keys).result(60).chunks == expected(range(3))


def test_the_watch_lets_go_when_a_new_generation_answers_before_any_hello(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """The node died; the engine's watch asks its status until it answers. A restarted node's
    status names another generation: the old slab is let go then, before the engine's
    threads say Hello (a new node short of room creates the layout's slab at that Hello)."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    client, engine = connect(node.socket_path, timeout_s=2.0, retry_s=0.2)
    assert put_chunks(engine, range(3)) == [True] * 3
    keys = [key(i) for i in range(3)]
    with ThreadPoolExecutor(1) as load_thread:
        assert load_thread.submit(lend, engine, keys).result(60).chunks == expected(range(3))
        assert node.stop() == 0
        assert not engine.contains(keys[0])  # the node is gone: marked down, watched
        # Its chunks are still read in place, the node down (its slab is the newest).
        assert load_thread.submit(lend, engine, keys).result(60).chunks == expected(range(3))
        old = slab_inode(node.name)
        assert held(old)
        failures = client.failures
        node = start_node(config)
        wait_for(lambda: released(old), 30, "the old slab let go")
        assert client.failures == failures  # no call was made meanwhile
        assert put_chunks(engine, [5]) == [True]
        assert load_thread.submit(lend, engine, keys).result(60).chunks == expected(range(3))


def test_a_load_reading_the_old_slab_when_it_is_let_go_finishes_with_whole_chunks(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """A load lent its chunks in place from the old slab; the slab is let go meanwhile (the
    store thread welcomed by the restarted node). The load's views stay the old chunks'
    bytes, whole, until it ends (never unmapped memory); then the old slab is gone."""
    with restarted_under_a_load(tmp_path, start_node) as (old, loans, engine):
        assert lend(engine, [key(5)]).chunks == expected([5])  # this thread's next: new
        assert [bytes(loan.view.data) for loan in loans] == [c for _i, c in expected(range(3))]
        assert held(old)  # mapped while the load reads it
    del loans  # the load ended
    wait_for(lambda: released(old), 30, "the old slab let go once the load ended")


def test_loads_racing_the_let_go_lend_whole_chunks_or_miss(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """A load thread loads without pause while the node restarts and the old slab is let go:
    each load lends the chunks' bytes, whole, or misses (counted); none raises."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    _client, engine = connect(node.socket_path, timeout_s=2.0, retry_s=0.2)
    assert put_chunks(engine, range(3)) == [True] * 3
    keys = [key(i) for i in range(3)]
    old = slab_inode(node.name)
    stop = threading.Event()
    wrong: list[object] = []

    def load_without_pause() -> int:
        loads = 0
        while not stop.is_set():
            chunks = lend(engine, keys).chunks
            if chunks != expected(range(3))[:len(chunks)]:
                wrong.append(chunks)
            loads += 1
        return loads

    with ThreadPoolExecutor(1) as load_thread:
        loading = load_thread.submit(load_without_pause)
        assert node.stop() == 0
        node = start_node(config)
        wait_for(lambda: put_chunks(engine, [5]) == [True], 30, "a store to the new node")
        wait_for(lambda: released(old), 30, "the old slab let go")
        stop.set()
        assert loading.result(60) > 0
    assert wrong == []


def test_a_slab_registered_for_dma_is_unregistered_after_its_last_loan_while_mapped(
        tmp_path: Path, start_node: Callable[..., NodeProcess],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU engine's mapping of the slab is registered for DMA (node/dma.py; CUDA's calls
    recorded here, there is no GPU): when a restarted node's slab replaces it, the old one's
    registration ends once the last load copying from it ends, and before it is unmapped
    (CUDA would keep pages no longer mapped). The new slab is registered in its turn."""
    # The mappings' ids, not the mappings: a reference would keep one mapped.
    registered: list[int] = []
    unregistered: list[tuple[int, bool]] = []

    def unregister(mapping: mmap.mmap) -> None:
        unregistered.append((id(mapping), not mapping.closed and bool(held(old))))

    monkeypatch.setattr(node_client, "register_for_dma",
                        lambda mapping: registered.append(id(mapping)) is None)
    monkeypatch.setattr(node_client, "unregister_for_dma", unregister)
    with restarted_under_a_load(tmp_path, start_node) as (old, loans, _engine):
        assert len(registered) == 2  # the new slab's mapping too
        gc.collect()
        assert unregistered == []  # a load still copies from the old one
    del loans  # the load ended
    wait_for(lambda: released(old), 30, "the old slab let go once the load ended")
    assert unregistered == [(registered[0], True)]
