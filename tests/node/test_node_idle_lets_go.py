"""An engine that asks the node nothing after the node's restart (idle: no request reaches it)
lets the dead node's slab go all the same, within a bounded time of the restart: the node's
hang-up of its idle connections is noticed (node/hangups.py), and its status asked until it
answers as a new generation. Before, only a call (the watch after a failed one, or a
Welcome) let it go: an idle engine kept the old slab mapped until its next request, and a
restarted node on a /dev/shm with room for one slab refused every engine meanwhile.
Real `kvtier node serve` processes on one name."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from nodekit import NodeProcess, connect, expected, key, lend, node_tiers, put_chunks, wait_for
from test_node_restart_lets_go import held, released, slab_inode

from kvtier.node import hangups

pytestmark = pytest.mark.timeout(120)


def test_an_idle_engine_lets_the_old_slab_go_once_the_restarted_node_answers(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    """Stores on one thread, reads in place on another (each with the slab mapped, the reader
    its own file), then nothing: the node restarts, and the old slab is let go with no
    call made by the engine."""
    config = node_tiers(tmp_path, ram_chunks=8)
    node = start_node(config)
    client, engine = connect(node.socket_path, timeout_s=2.0, retry_s=0.2)
    assert put_chunks(engine, range(3)) == [True] * 3
    keys = [key(i) for i in range(3)]
    with ThreadPoolExecutor(1) as load_thread:
        assert load_thread.submit(lend, engine, keys).result(60).chunks == expected(range(3))
        old = slab_inode(node.name)
        assert held(old)
        assert node.stop() == 0
        node = start_node(config)
        wait_for(lambda: released(old), 30, "the idle engine let the old slab go")
        assert client.failures == 0  # no call was made: nothing failed
        # Its threads' next calls go to the new node.
        assert put_chunks(engine, [5]) == [True]
        # The new node recovers the old slab's chunks on a thread of its own once the layout
        # is opened (by that put): a lend before it is done misses (a loaded CI-like run).
        wait_for(lambda: node.status()["counters"]["recovered_chunks"] == 3, 30,
                 "the restarted node to recover the old slab's chunks")
        assert load_thread.submit(lend, engine, keys).result(60).chunks == expected(range(3))
    engine.close()


def test_the_hangup_watch_ends_when_its_last_connection_closes(
        tmp_path: Path, start_node: Callable[..., NodeProcess],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread watches every client's connections of the process; it ends once none is
    left (a closed client's), so no thread outlives the clients. A watch of this test's own:
    other tests' clients, not all closed, keep the process's."""
    watch = hangups._Hangups()
    monkeypatch.setattr(hangups, "_HANGUPS", watch)
    node = start_node(node_tiers(tmp_path, ram_chunks=8))
    _client, engine = connect(node.socket_path)
    assert put_chunks(engine, [1]) == [True]
    thread = watch._thread
    assert thread is not None and thread.is_alive()
    engine.close()
    wait_for(lambda: not thread.is_alive(), 30, "the hang-up watch's end")
