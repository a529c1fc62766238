"""A node restarted on a /dev/shm with room for one slab, an engine reading in place from the
old one: run by tests/node/test_node_shm_full_restart.py inside a mount namespace of its own
(`unshare --mount`) whose /dev/shm is a small tmpfs, so that no other test or process sees it.

Prints one JSON line: the slab's and the tmpfs's sizes, whether the engine (the same
NodeClient, never restarted) stores into the restarted node within DEADLINE_S, and whether a
fresh engine is welcomed. With `idle` the engine asks nothing after the restart: the fresh
engine's stores must reach the node within DEADLINE_S all the same (the idle engine lets the
old slab go at the node's hang-up), the idle one's after them. Every node it started is
killed, its files removed, before it ends.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nodekit import (
    NodeProcess,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    put_chunks,
    shm_files,
    wait_for,
    write_config,
)

from kvtier.node.nodestore import NodeStore
from kvtier.tiers.shmslab import SHM_DIR

DEADLINE_S = 20.0  # the engine's retries (every 0.2 s) after the restart


def main(ram_chunks: int, idle: bool = False) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="kvn-shm-", dir="/tmp"))
    config = write_config(work / "node.json", node_tiers(work, ram_chunks=ram_chunks))
    nodes: list[NodeProcess] = []

    def start() -> NodeProcess:
        node = NodeProcess(config, work / "node.sock", "shmfull", work / "node.log")
        nodes.append(node)
        return node.start()

    try:
        node = start()
        _client, engine = connect(node.socket_path, timeout_s=2.0, retry_s=0.2)
        assert put_chunks(engine, range(3)) == [True] * 3
        [slab] = shm_files(node.name)
        keys = [key(i) for i in range(3)]
        with ThreadPoolExecutor(1) as load_thread:  # a worker's load thread: reads in place
            assert load_thread.submit(lend, engine, keys).result(60).chunks == \
                expected(range(3))
            assert node.stop() == 0
            node = start()
            started = time.monotonic()
            _fresh, other = connect(node.socket_path, timeout_s=2.0, retry_s=0.2,
                                    engine="fresh")
            first, then = (other, engine) if idle else (engine, other)
            stored = _stored_within(first, DEADLINE_S)
            welcome_s = time.monotonic() - started  # a figure, not asserted
            return {"slab_bytes": slab.stat().st_size if slab.exists() else None,
                    "shm_bytes": os.statvfs(SHM_DIR).f_blocks * os.statvfs(SHM_DIR).f_frsize,
                    "stored_after_restart": stored, "seconds_to_store": round(welcome_s, 2),
                    "other_engine_stored": put_chunks(then, [7]) == [True],
                    "refused": node.status()["counters"]["refused"]}
    finally:
        for started in nodes:
            started.kill()
        shutil.rmtree(work, ignore_errors=True)


def _stored_within(engine: NodeStore, timeout_s: float) -> bool:
    """Whether the engine's stores reach the node within `timeout_s` (each try a step's)."""
    try:
        wait_for(lambda: put_chunks(engine, [5]) == [True], timeout_s, "a store")
    except AssertionError:
        return False
    return True


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), idle=sys.argv[2:] == ["idle"])), flush=True)
