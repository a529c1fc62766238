"""A Hello whose layout no chunk of could pass through the node is refused, its tiers never
built. Any user of the node's group can send one (a buggy client, a hostile one): a layout of
absurd sizes raised from its slab's header (a traceback, the connection dropped without a
Refused) and left its file in /dev/shm, and one just below that was welcomed, taking one of
`max_layouts` for a layout that stores nothing, so a real model's engines were refused.
Raw frames on the node's socket, as such a client sends them.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import INFO, LAYOUT, OTHER_LAYOUT, connect, put_chunks, shm_files

from kvtier.node.protocol import Hello, Refused, Reply, Welcome, receive_reply, send
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
RAM_BYTES = 64 << 10
ABSURD = {"num_layers": 2**40, "head_size": 2**30}  # a chunk of 2**80 B: past any header
TOO_BIG = {"num_layers": 16384}  # a chunk of 64 MiB: no RAM slot, past a frame's bound


def hello(node: NodeServer, **sizes: int) -> Reply:
    """The node's answer to a Hello of the test layout with `sizes` changed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(node.config.socket_path))
        send(sock, Hello(dict(dataclasses.asdict(LAYOUT), **sizes), INFO.model,
                         INFO.fingerprint, INFO.weight_files, "hostile"))
        return receive_reply(sock)


def test_a_layout_no_chunk_of_fits_is_refused_and_takes_no_layout(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    tiers = {"tiers": [{"kind": "memory", "capacity": RAM_BYTES}]}
    with in_process_node(tiers, max_layouts=2) as node:
        _client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [0]) == [True]
        slabs = shm_files(node.config.name)
        for sizes in (ABSURD, TOO_BIG, TOO_BIG):
            answer = hello(node, **sizes)
            assert isinstance(answer, Refused) and "tiers[0].capacity" in answer.reason
        assert shm_files(node.config.name) == slabs, "a refused layout left a slab"
        assert list(node.status()["layouts"]) == [LAYOUT.digest()]
        # A real model's engine still gets the node's second layout.
        _other_client, other = connect(node.config.socket_path, OTHER_LAYOUT)
        assert put_chunks(other, [1], OTHER_LAYOUT.bytes_per_chunk) == [True]
        assert isinstance(hello(node), Welcome)
