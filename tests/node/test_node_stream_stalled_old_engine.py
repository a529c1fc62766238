"""An engine of an older kvtier (its Hello says no `stamps`: it never reads a lent slot's stamp
again after its copy) frozen in the middle of a streamed load: the node sent the load's first
parts (RAM offsets the engine will copy when it wakes), and a later part's send gives up
after `lease_timeout_s` without progress. Before, the node freed that load's lent chunks at
once: their slots went to the next stores, and the engine, waking, would have copied another
chunk's bytes as its own (it checks no stamp). Now the load is the connection's lease,
quarantined with the rest until the engine's process is gone.

An in-process node (its disk's read of one chunk hung by fault injection, so that the
stream stops there and a large part is on its way), and a raw client speaking the protocol
as an older engine, reading nothing (frozen).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from pathlib import Path

import pytest
from nodekit import INFO, LAYOUT, connect, key, node_tiers, put_chunks, wait_for

from kvtier.core.keys import ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.tier import TierResult
from kvtier.node.config import NodeConfig
from kvtier.node.protocol import Borrow, Hello, Meta, Welcome, receive_reply, send
from kvtier.node.server import running_node
from kvtier.tiers.files.disk import DiskTier
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)
RAM, DISK, LOADED = 8, 400, 300  # chunks
HUNG = 250  # the chunk whose read below RAM hangs: the stream's parts before it go out


def test_a_later_part_not_taken_keeps_an_old_engines_load_lent(
        tmp_path: Path, socket_path: Path, node_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    answer = threading.Event()
    real_get_into = DiskTier.get_into

    def hung_get_into(self: DiskTier, k: ChunkKey, out: memoryview,
                      meta: ChunkMeta = DEFAULT_META) -> TierResult:
        if k == key(HUNG):
            answer.wait(60)
        return real_get_into(self, k, out, meta)

    monkeypatch.setattr(DiskTier, "get_into", hung_get_into)
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, RAM, DISK)), socket_path,
                        name=node_name, lease_timeout_s=1.0)
    with running_node(config) as node:
        neighbour_client, neighbour = connect(socket_path, engine="neighbour")
        old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # The load's chunks: RAM's first (lent in place), the rest on disk (RAM has no
            # slot for them while its own are lent: their bytes go in the reply's parts).
            assert sum(put_chunks(neighbour, range(LOADED))) == RAM
            assert neighbour.flush(30)
            old.connect(str(socket_path))
            send(old, Hello(dataclasses.asdict(LAYOUT), INFO.model, INFO.fingerprint,
                            INFO.weight_files, "old"))  # no stamps
            assert isinstance(receive_reply(old), Welcome)
            send(old, Borrow([key(i) for i in range(LOADED)],
                             [Meta.of(DEFAULT_META)] * LOADED, stream=True))  # never read
            wait_for(lambda: node.status()["counters"].get("send_timeouts") == 1, 30,
                     "the node to give up a part of its reply to the frozen engine")
            wait_for(lambda: "old" not in node.status()["engines"], 10,
                     "the frozen engine's connection closed")
            # Its load is still lent to it: RAM's slots, whose offsets went in the first
            # part, are none of the neighbour's next stores' (they go to disk).
            held = node.status()["held"]
            assert set(held) == {"old"} and held["old"]["leases"] == 1
            assert held["old"]["chunks"] >= RAM
            assert put_chunks(neighbour, range(1000, 1000 + RAM)) == [False] * RAM
        finally:
            answer.set()
            old.close()
            neighbour_client.close()
