"""A node stops within its `stop_flush_s` whatever its tiers do: the writes queued behind RAM
are flushed until then, and a write stuck in a tier that stopped answering (a disk tier on a
dead mount) is not waited for, neither by the close nor by the process's exit, so SIGTERM ends
the node before the pod's grace period turns it into a SIGKILL (which leaves the socket
behind). In-process (`running_node`) and as `kvtier node serve`, its disk tier's `put` hung
(injected). The setting is checked where it is given.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from nodekit import (
    LAYOUT,
    NodeProcess,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    put_chunks,
    wait_for,
    write_config,
)

from kvtier.core.keys import ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.tier import TierResult
from kvtier.errors import ConfigError
from kvtier.node.config import NodeConfig
from kvtier.node.server import running_node
from kvtier.tiers.files.disk import DiskTier
from kvtier.tiers.storeconfig import StoreConfig

STOP_FLUSH_S = 0.5


@pytest.mark.timing
def test_a_stop_does_not_wait_for_a_tier_that_stopped_answering(
        tmp_path: Path, socket_path: Path, node_name: str, monkeypatch: pytest.MonkeyPatch):
    answer, writing = threading.Event(), threading.Event()
    real_put = DiskTier.put

    def hung_put(self: DiskTier, key: ChunkKey, data: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        writing.set()
        answer.wait(60)  # a dead mount: the write returns when the tier answers again
        return real_put(self, key, data, meta)

    monkeypatch.setattr(DiskTier, "put", hung_put)
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=8, disk_chunks=16)),
                        socket_path, name=node_name, stop_flush_s=STOP_FLUSH_S)
    try:
        with running_node(config) as node:
            _, engine = connect(node.config.socket_path)
            assert put_chunks(engine, range(4)) == [True] * 4  # in RAM; behind it, queued
            wait_for(writing.is_set, 10, "a write behind RAM in the disk tier")
            engine.close()
            start = time.monotonic()
        stopped_s = time.monotonic() - start  # running_node's exit: the node's shutdown
    finally:
        answer.set()
    assert stopped_s < STOP_FLUSH_S + 10.0, stopped_s  # 60 s before: the hung write's
    assert not socket_path.exists()


@pytest.mark.timeout(60)  # a stop that waits for the opening fails here
def test_a_layout_whose_tiers_hang_opening_holds_up_no_other_engine_nor_the_stop(
        tmp_path: Path, socket_path: Path, node_name: str, monkeypatch: pytest.MonkeyPatch):
    """A second model's first engine, its layout's disk tier opening on a dead mount: the
    first model's engines load and store, the node's status answers and its stop ends. Before:
    the opening held the node's lock, and every lease, status and the stop waited for it."""
    answer, opening = threading.Event(), threading.Event()
    real_init = DiskTier.__init__
    opened: list[DiskTier] = []

    def hung_init(self: DiskTier, *args: object, **kwargs: object) -> None:
        if opened:  # the second layout's
            opening.set()
            answer.wait(60)
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(self)

    monkeypatch.setattr(DiskTier, "__init__", hung_init)
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=8, disk_chunks=16)),
                        socket_path, name=node_name, stop_flush_s=STOP_FLUSH_S)
    try:
        with running_node(config) as node:
            _, first = connect(socket_path)
            assert put_chunks(first, [0]) == [True]
            other = dataclasses.replace(LAYOUT, tokens_per_chunk=2 * LAYOUT.tokens_per_chunk)
            second_client, second = connect(socket_path, other, timeout_s=60)
            waiting = threading.Thread(target=put_chunks, args=(second, [1],
                                                                other.bytes_per_chunk))
            waiting.start()
            wait_for(opening.is_set, 10, "the second layout's disk tier opening")
            _, borrower_engine = connect(socket_path, engine="borrower")
            assert lend(borrower_engine, [key(0)]).chunks == expected([0])
            assert put_chunks(first, [2]) == [True]
            assert node.status()["connections"] >= 2
        waiting.join(10)  # its first call ended with the stop: a miss
        assert not waiting.is_alive() and second_client.failures == 1
    finally:
        answer.set()
    assert not socket_path.exists()


@pytest.mark.parametrize("seconds", [-1.0, float("inf"), float("nan")])
def test_a_bad_stop_flush_is_refused_naming_the_field(tmp_path: Path, seconds: float):
    with pytest.raises(ConfigError) as raised:
        NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=8)),
                   tmp_path / "node.sock", stop_flush_s=seconds)
    assert raised.value.field == "stop_flush_s" and "stop_flush_s" in str(raised.value)


# `python3 -m kvtier.node` with its disk tier's writes hung (a dead mount), for good: a write
# that started marks `WRITING`.
HUNG_NODE = """
import os, sys, threading
from kvtier.tiers.files.disk import DiskTier

def hung_put(self, *args, **kwargs):
    open(os.environ["WRITING"], "w").close()
    threading.Event().wait(600)

DiskTier.put = hung_put
from kvtier.node.cli import main
sys.exit(main())
"""


@pytest.mark.timing
def test_kvtier_node_serve_exits_on_sigterm_past_a_hung_write(
        tmp_path: Path, socket_path: Path, node_name: str, monkeypatch: pytest.MonkeyPatch):
    writing = tmp_path / "WRITING"
    monkeypatch.setenv("WRITING", str(writing))
    config = write_config(tmp_path / "node.json",
                          node_tiers(tmp_path, ram_chunks=8, disk_chunks=16))
    node = NodeProcess(config, socket_path, node_name, tmp_path / "node.log",
                       args=("--stop-flush-s", str(STOP_FLUSH_S)), entry=("-c", HUNG_NODE))
    try:
        node.start()
        _, engine = connect(socket_path)
        assert put_chunks(engine, range(4)) == [True] * 4
        wait_for(writing.exists, 10, "a write behind RAM in the disk tier")
        engine.close()
        start = time.monotonic()
        assert node.stop(timeout_s=90) == 0
        stopped_s = time.monotonic() - start
    finally:
        node.kill()
    log = (tmp_path / "node.log").read_text()
    assert stopped_s < STOP_FLUSH_S + 15.0, (stopped_s, log)  # 1.7 s here; never before
    assert "exiting without them" in log and "kvtier-write-disk" in log
    assert not socket_path.exists()


def test_a_stop_is_logged_with_its_signal_and_its_end(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    """The pod's log says why the node went and that it finished (it said nothing: a node
    killed at the grace period's end and one that stopped cleanly read the same)."""
    node = start_node(node_tiers(tmp_path, ram_chunks=4))
    assert node.stop() == 0
    log = node.log_path.read_text()
    assert f"kvtier node {node.name!r}: SIGTERM: stopping" in log
    assert f"kvtier node {node.name!r}: stopped (RAM slabs kept for the next node)" in log
