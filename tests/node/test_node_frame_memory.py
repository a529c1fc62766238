"""A frame's length costs the node nothing until its bytes come. The node read a frame into a
buffer of the length its 4-byte header announced (up to `MAX_FRAME`, 64 MiB), allocated and
zeroed at once: any user of the node's group could open connections that each announce 64 MiB
and send nothing more, each holding 64 MiB of the node's memory for as long as it liked. Real
connections to a node in this process; its memory is this process's resident set.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import pytest
from nodekit import INFO, LAYOUT, connect, expected, key, lend, node_tiers, put_chunks

from kvtier.node.protocol import MAX_FRAME, Hello, Status, Welcome, receive_reply, send
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
CONNECTIONS = 8


def resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * 4096


def test_an_announced_frame_holds_no_memory_until_its_bytes_come(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as node, ExitStack() as stack:
        _client, engine = connect(node.config.socket_path)
        assert put_chunks(engine, [0]) == [True]
        before = resident_bytes()
        for _ in range(CONNECTIONS):
            sock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            sock.settimeout(30)
            sock.connect(str(node.config.socket_path))
            send(sock, Hello(dataclasses.asdict(LAYOUT), INFO.model, INFO.fingerprint,
                             INFO.weight_files, "hostile"))
            assert isinstance(receive_reply(sock), Welcome)
            sock.sendall(MAX_FRAME.to_bytes(4, "big") + b"\x81")  # and nothing more
        # A round trip on a connection of its own: the node has accepted the others and
        # their threads had the time to read their headers (the old code's 512 MiB showed).
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(30)
            probe.connect(str(node.config.socket_path))
            send(probe, Status())
            assert receive_reply(probe)
        grown = resident_bytes() - before
        assert grown < MAX_FRAME, f"{grown >> 20} MiB held for {CONNECTIONS} empty frames"
        assert lend(engine, [key(0)]).chunks == expected([0])
