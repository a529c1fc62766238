"""A node answers only well-formed requests about a connection's own leases: a request whose
keys are not chunk keys or whose metas do not match its keys is refused as it decodes (the
connection ends, nothing is reserved, no traceback), and a connection cannot end or commit
another connection's lease (lease numbers count up: any engine of the node's group could guess
one). Raw frames on a socket, as a buggy or hostile client sends them (found by trying: a
Borrow of 8 keys with 2 metas printed a traceback, 3-byte keys were stored, any connection
released others' loans).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import msgspec
import pytest
from nodekit import INFO, LAYOUT, connect, key, node_tiers, put_chunks, wait_for

from kvtier.node.protocol import (
    Borrow,
    Commit,
    Hello,
    Lent,
    Meta,
    Refused,
    Release,
    Reserve,
    Reserved,
    Welcome,
    receive_reply,
    send,
)
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def node(tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]
         ) -> Iterator[NodeServer]:
    with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as running:
        _client, engine = connect(running.config.socket_path)
        assert put_chunks(engine, range(4)) == [True] * 4
        yield running


def raw(node: NodeServer) -> socket.socket:
    """A connection that said Hello for the test layout."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(node.config.socket_path))
    send(sock, Hello(dataclasses.asdict(LAYOUT), INFO.model, INFO.fingerprint,
                     INFO.weight_files, "raw"))
    assert isinstance(receive_reply(sock), Welcome)
    return sock


def frame(message: msgspec.Struct) -> bytes:
    """`message` framed as `send` frames it, without the checks its constructor runs."""
    body = msgspec.msgpack.encode(message)
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("bad", [
    "keys of 3 bytes", "keys of 40 bytes", "fewer metas than keys", "more metas than keys"])
def test_a_malformed_request_is_refused_and_reserves_nothing(node: NodeServer, bad: str):
    keys = [bytes(key(i)) for i in range(100, 108)]
    request = Reserve(keys, [Meta()] * len(keys))
    if bad == "keys of 3 bytes":
        request.keys = [k[:3] for k in keys]
    elif bad == "keys of 40 bytes":
        request.keys = [k + bytes(24) for k in keys]
    elif bad == "fewer metas than keys":
        request.metas = request.metas[:2]
    else:
        request.metas = request.metas * 2
    reserved = node.status()["counters"]["reserved_chunks"]
    sock = raw(node)
    sock.sendall(frame(request))
    answer = receive_reply(sock)
    assert isinstance(answer, Refused) and "bad message" in answer.reason
    sock.close()
    assert node.status()["counters"]["reserved_chunks"] == reserved
    # The same with a Borrow: refused, no lease.
    borrow = Borrow([k[:3] for k in keys[:2]], [Meta()] * 2)
    sock = raw(node)
    sock.sendall(frame(borrow))
    assert isinstance(receive_reply(sock), Refused)
    sock.close()
    assert node.status()["leases"] == 0


def test_a_connection_cannot_end_or_commit_another_ones_lease(node: NodeServer):
    lender = raw(node)
    send(lender, Borrow([bytes(key(0))], [Meta()]))
    lent = receive_reply(lender)
    assert isinstance(lent, Lent) and lent.lease > 0
    storer = raw(node)
    send(storer, Reserve([bytes(key(50))], [Meta()]))
    reserved = receive_reply(storer)
    assert isinstance(reserved, Reserved) and reserved.offsets[0] >= 0

    committed = node.status()["counters"]["committed_chunks"]
    other = raw(node)
    send(other, Release(lent.lease))
    send(other, Commit(reserved.lease, 0, True, reply=True))  # its slot never filled
    receive_reply(other)  # the commit's answer: every message before it was taken
    assert node.status()["leases"] == 2  # neither ended by a stranger
    assert node.status()["counters"]["committed_chunks"] == committed

    send(lender, Release(lent.lease))
    send(storer, Commit(reserved.lease, 0, False, reply=True))
    receive_reply(storer)
    wait_for(lambda: node.status()["leases"] == 0, 10, "the owners ended their leases")
    for sock in (lender, storer, other):
        sock.close()
