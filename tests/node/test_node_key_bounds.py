"""A message naming more chunks than `MAX_KEYS` is refused as it decodes, counted and logged,
and its connection closed; the node serves its other engines on. Any user of the node's group
may send one: a frame's 64 MiB holds 3 million keys, and a Borrow of 2 million kept a thread of
the node busy for 85 s submitting reads (a Reserve, 24 s); every Lookup was answered, however
long. An engine never sends more (`NodeStore` cuts its lists at `MAX_KEYS`: the chunks past it
miss). A real node (in this process), raw frames on its socket, and a real engine's store.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest
from nodekit import (
    INFO,
    LAYOUT,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    put_chunks,
)

from kvtier.node.probe import NodeProbe
from kvtier.node.protocol import (
    MAX_KEYS,
    Borrow,
    Describe,
    Described,
    Hello,
    Lookup,
    Meta,
    Refused,
    Request,
    Reserve,
    Touch,
    Welcome,
    receive_reply,
    send,
)
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(300)
TOO_MANY = MAX_KEYS + 1
KEYS = [bytes(key(i)) for i in range(TOO_MANY)]
TOKENS = np.arange(LAYOUT.tokens_per_chunk, dtype="<i4").tobytes()
HOSTILE = {
    "lookup": Lookup(KEYS, ram_only=True),
    "lookup below RAM": Lookup(KEYS),
    "borrow": Borrow(KEYS, [Meta()] * TOO_MANY),
    "reserve": Reserve(KEYS, [Meta()] * TOO_MANY),
    "touch": Touch(KEYS),
    "describe": Describe([Described(k, None, TOKENS) for k in KEYS]),
}


@pytest.fixture
def node(tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]
         ) -> Iterator[NodeServer]:
    with in_process_node(node_tiers(tmp_path, ram_chunks=8)) as running:
        yield running


def hello(node: NodeServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(node.config.socket_path))
    send(sock, Hello(dataclasses.asdict(LAYOUT), INFO.model, INFO.fingerprint,
                     INFO.weight_files, "hostile"))
    assert isinstance(receive_reply(sock), Welcome)
    return sock


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_list_past_max_keys_is_refused_counted_and_logged(
        node: NodeServer, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    request: Request = HOSTILE[kind]
    _, engine = connect(node.config.socket_path, engine="neighbour")
    assert put_chunks(engine, [0, 1]) == [True, True]
    with hello(node) as sock, caplog.at_level(logging.WARNING, "kvtier.node.connection"):
        send(sock, request)
        answer = receive_reply(sock)
        assert isinstance(answer, Refused) and f"length <= {MAX_KEYS}" in answer.reason, \
            answer if not isinstance(answer, Refused) else answer.reason
        assert sock.recv(1) == b"", "the connection is closed"
    assert node.status()["counters"]["refused_messages"] == 1
    assert any("refused" in r.getMessage() and "hostile" in r.getMessage()
               for r in caplog.records)
    # The neighbour is served on, its chunks whole.
    assert lend(engine, [key(0), key(1)]).chunks == expected([0, 1])
    assert put_chunks(engine, [2]) == [True]


def test_an_engine_cuts_its_lists_at_max_keys_rather_than_be_refused(node: NodeServer) -> None:
    # A deadline a busy machine meets: the node starts a read of each of the 65,534 chunks
    # it lacks before the first misses (3-6 s on 2 shared cores), as for any load this long.
    client, engine = connect(node.config.socket_path, timeout_s=120.0)
    assert put_chunks(engine, [0, 1]) == [True, True]
    keys = [key(i) for i in range(TOO_MANY)]
    found = NodeProbe([client]).contains_many(keys)
    assert len(found) == TOO_MANY and found[:3] == [True, True, False] and not any(found[2:])
    assert lend(engine, keys).chunks == expected([0, 1])
    assert node.status()["counters"]["refused_messages"] == 0
