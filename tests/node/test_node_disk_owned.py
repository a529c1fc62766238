"""The node's disk tier finds its layout directory owned by another open disk tier (an engine
on this host with the same disk path, outside the node: tiers/files/owner.py). The engine's
Hello is refused with the reason, which names the directory and the remedy; its stores are
misses at once; the node serves on, and once the owner has closed, the engine's next try
opens the layout and stores. Before, the node opened the directory beside its owner, each
evicting the other's chunks behind its index.

An in-process node (`running_node`), so that the owner can be a tier of this process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from nodekit import INFO, LAYOUT, connect, expected, key, lend, node_tiers, put_chunks, wait_for
from tierkit import make_tier

from kvtier.node.protocol import Hello, Refused, receive_reply, send
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
STRANGER = 65534  # nobody


def test_a_disk_directory_owned_elsewhere_refuses_the_layout_until_its_owner_closes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    owner = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=4)  # the node's disk path
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=4)) as node, \
            caplog.at_level(logging.ERROR, "kvtier.node.layouts"):
        client, engine = connect(node.config.socket_path, retry_s=0.2)
        assert put_chunks(engine, [1]) == [False]  # a miss: the layout was refused
        assert client.failures >= 1
        status = node.status()
        assert status["counters"]["refused"] >= 1 and status["layouts"] == {}
        [error] = [r.getMessage() for r in caplog.records if "cannot open" in r.getMessage()]
        assert str(tmp_path / "disk" / LAYOUT.digest()) in error and "kind: shared" in error

        owner.close()  # the engine's next try (after its back-off) opens the layout
        wait_for(lambda: put_chunks(engine, [1]) == [True], 10, "the layout opened")
        assert lend(engine, [key(1)]).chunks == expected([1])


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user takes root")
def test_a_layout_directory_another_user_made_refuses_its_engines_naming_the_field(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]) -> None:
    foreign = tmp_path / "disk" / LAYOUT.digest()  # made by another user before the node ran
    foreign.mkdir(parents=True)
    os.chown(foreign, STRANGER, STRANGER)
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=4)) as node, \
            caplog.at_level(logging.DEBUG, "kvtier.node.layouts"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(node.config.socket_path))
            hello = Hello(dataclasses.asdict(LAYOUT), INFO.model, INFO.fingerprint,
                          INFO.weight_files, "raw")
            for _ in range(2):  # refused, and the connection stays (the engine asks again)
                send(sock, hello)
                answer = receive_reply(sock)
                assert isinstance(answer, Refused), answer
                assert "disk.path" in answer.reason and str(foreign) in answer.reason
        status = node.status()
        assert status["counters"]["refused"] == 2 and status["layouts"] == {}
        errors = [r for r in caplog.records if "cannot open" in r.getMessage()]
        assert [r.levelno for r in errors] == [logging.ERROR, logging.DEBUG]  # said once
