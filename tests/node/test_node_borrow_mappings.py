"""A Borrow of many keys costs the node one memory mapping for its spare buffers, not one a
key. Any user of the node's group may send a Borrow of as many keys as a frame holds (~1.8
million): the node mapped a spare per key and kept them for the connection's life, so one
connection of 20,000 keys held 20,000 mappings, and one of ~65,000 took the whole process's
`vm.max_map_count`: every other engine's next buffer (a connection's scratch, a lending's
spare) failed with ENOMEM and its connection was dropped. Raw frames on the node's socket,
the node in this process (its mappings are /proc/self/maps).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import INFO, LAYOUT, connect, expected, key, lend, node_tiers, put_chunks

from kvtier.node.protocol import Borrow, Hello, Lent, Meta, Welcome, receive_reply, send
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
KEYS = 20_000


def mappings() -> int:
    with open("/proc/self/maps", encoding="ascii") as maps:
        return sum(1 for _ in maps)


def test_a_borrow_of_many_keys_takes_one_mapping_not_one_a_key(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as node:
        _client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [0]) == [True]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(60)
            sock.connect(str(node.config.socket_path))
            send(sock, Hello(dataclasses.asdict(LAYOUT), INFO.model, INFO.fingerprint,
                             INFO.weight_files, "hostile"))
            assert isinstance(receive_reply(sock), Welcome)
            before = mappings()
            keys = [bytes(key(0)), *(bytes(key(i)) for i in range(10_000, 10_000 + KEYS))]
            send(sock, Borrow(keys, [Meta()] * len(keys)))
            lent = receive_reply(sock)
            assert isinstance(lent, Lent) and len(lent.offsets) == 1  # key 0, then a miss
            grown = mappings() - before  # the connection is open: its spares are held
            assert grown < 100, f"{grown} mappings for one Borrow of {len(keys)} keys"
        # The node serves its engines as before.
        assert lend(engine, [key(0)]).chunks == expected([0])
