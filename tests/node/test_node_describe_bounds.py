"""A chunk description (`Describe`, kept for the node's KV events) larger than a chunk of its
model holds is not kept. The node keeps a bounded count of descriptions (16,384 a model), but
bounded nothing of each one: any user of the node's group could describe chunks of a frame's
64 MiB of token ids (or cache salt) each, no reply asked, and the node held them all: the
node's memory many times over. A real node (in this process) with an events endpoint, and raw
frames on its socket.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from nodekit import INFO, LAYOUT, key, node_tiers, wait_for

from kvtier.node.config import NodeConfig
from kvtier.node.events import MAX_NAME_CHARS
from kvtier.node.protocol import (
    Describe,
    Described,
    Hello,
    Status,
    Welcome,
    receive_reply,
    send,
)
from kvtier.node.server import NodeServer, running_node
from kvtier.tiers.storeconfig import StoreConfig

pytestmark = pytest.mark.timeout(120)
TPC = LAYOUT.tokens_per_chunk


@pytest.fixture
def node(tmp_path: Path, socket_path: Path, node_name: str) -> Iterator[NodeServer]:
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=4)), socket_path,
                        name=node_name, events_endpoint=f"ipc://{tmp_path}/events")
    with running_node(config) as running:
        yield running


def tokens(count: int) -> bytes:
    return np.arange(count, dtype="<i4").tobytes()


def test_a_description_larger_than_a_chunk_is_not_kept(node: NodeServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(node.config.socket_path))
        send(sock, Hello(dataclasses.asdict(LAYOUT), INFO.model, INFO.fingerprint,
                         INFO.weight_files, "hostile"))
        assert isinstance(receive_reply(sock), Welcome)
        send(sock, Describe([
            Described(bytes(key(0)), None, tokens(TPC)),  # a chunk: kept
            Described(bytes(key(1)), bytes(key(0)), tokens(TPC // 2)),  # a tail: kept
            Described(bytes(key(2)), None, tokens(1 << 20)),  # 4 MiB of token ids
            Described(bytes(key(3)), None, tokens(TPC)[:-1]),  # not whole token ids
            Described(bytes(key(4)), None, tokens(TPC), "l" * (MAX_NAME_CHARS + 1)),
            Described(bytes(key(5)), None, tokens(TPC), None, "s" * (1 << 20)),
        ]))
        send(sock, Status())  # answered once the Describe before it is taken
        receive_reply(sock)
    wait_for(lambda: node.status()["counters"]["described_chunks"] >= 2, 10, "descriptions")
    assert node.status()["counters"]["described_chunks"] == 2
