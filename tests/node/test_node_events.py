"""The node publishes its tiers' KV events for routers, once for every engine on it: a chunk
that lands in a node tier is a `BlockStored` (with the token ids the engine's scheduler sent in
its step's `Describe`), one that leaves is a `BlockRemoved`, on the topic of llm-d's node
pseudo-pod `kv@node:<name>@<model>`, in vLLM's own wire format: a router's SUB socket here
decodes every message with vLLM's `msgspec.msgpack.Decoder(KVEventBatch)`; with
`--event-block-size` a chunk goes out as blocks NVIDIA Dynamo's router indexes. A chunk stored with
no known tokens is not announced; a tensor-parallel rank other than 0 announces nothing (rank
0 speaks for the chunk); a node with no endpoint publishes nothing; a bad endpoint is a
`ConfigError` naming the field.

Real `kvtier node serve` processes (`--events-endpoint`) where the option and a restart are
under test, `running_node` elsewhere; a real ZMQ subscriber on a thread of its own, as a
router's is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from dynamorules import DynamoIndexer
from eventsub import Subscriber
from nodekit import (
    LAYOUT,
    NodeProcess,
    connect,
    key,
    node_tiers,
    put_chunks,
    wait_for,
    write_config,
)

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError
from kvtier.node import cli
from kvtier.node.config import NodeConfig
from kvtier.node.eventwire import BlockRemoved, BlockStored, KVEventBatch
from kvtier.node.probe import NodeProbe
from kvtier.node.server import running_node
from kvtier.tiers.eventfacts import ChunkInfo
from kvtier.tiers.storeconfig import StoreConfig

kv_events = pytest.importorskip("vllm.distributed.kv_events")  # the decoder under test
pytestmark = pytest.mark.timeout(120)

TPC = LAYOUT.tokens_per_chunk
MODEL = "node-test-model"  # nodekit.INFO's: the model the test engines say Hello with
SALT = "tenant-a"
RANK_1 = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_chunk=TPC, tp_rank=1, tp_world_size=2)


@pytest.fixture
def subscriber() -> Iterator[Subscriber]:
    sub = Subscriber()
    yield sub
    sub.close()


def tokens(i: int) -> list[int]:
    """Chunk i's token ids (distinct for every chunk)."""
    return list(range(i * TPC, (i + 1) * TPC))


def describe(probe: NodeProbe, ids: list[int]) -> None:
    """What the engine's scheduler sends at a step: chunks `ids` of one prompt (each the
    previous one's child), salted."""
    probe.describe({key(i): ChunkInfo(key(i - 1) if i else None,
                                      np.asarray(tokens(i), dtype="<i4").tobytes(), None, SALT)
                    for i in ids})


def settle(node_status: Callable[[], dict[str, Any]], stored: int, removed: int = 0) -> None:
    """Wait until the node has published `stored` and `removed` events (its counters)."""
    wait_for(lambda: (c := node_status()["counters"])["events_stored"] >= stored
             and c["events_removed"] >= removed, 10, f"{stored} stored, {removed} removed")


def test_chunks_landing_in_and_leaving_the_node_are_announced_on_its_topic(
        tmp_path: Path, start_node: Callable[..., NodeProcess], subscriber: Subscriber):
    node = start_node(node_tiers(tmp_path, ram_chunks=4),
                      args=("--events-endpoint", subscriber.endpoint))
    subscriber.wait_connected()  # its first batch (AllBlocksCleared) must not be dropped
    client, engine = connect(node.socket_path)
    probe = NodeProbe([client])
    assert probe.publishes_events()  # the node's Welcome says so: the scheduler describes
    topic = f"kv@node:{node.name}@{MODEL}"

    # A step of four chunks of one prompt: described, then stored (RAM holds four).
    describe(probe, [0, 1, 2, 3])
    assert put_chunks(engine, [0, 1, 2, 3]) == [True] * 4
    wait_for(lambda: len(subscriber.stored()) == 4, 10, "four BlockStored")
    topics, first = {t for t, _ in subscriber.events()}, subscriber.events()[0][1]
    assert topics == {topic}
    assert isinstance(first, kv_events.AllBlocksCleared)  # a new node: routers forget the old
    for i in range(4):
        event = subscriber.stored()[key(i)]
        assert (event.token_ids, event.parent_block_hash) == (tokens(i), key(i - 1) if i else None)
        assert (event.block_size, event.medium, event.locality, event.ownership) == (
            TPC, "CPU", "LOCAL", "kvtier/memory")
        # vLLM's extra_keys: the salt in the prompt's first block only (vllm PR #33304).
        assert event.lora_name is None
        assert (event.extra_keys or [None])[0] == ((SALT,) if i == 0 else None)

    # A chunk no scheduler described is stored but not announced (its tokens are unknown);
    # it and a described one push two chunks out of RAM: each a BlockRemoved.
    assert put_chunks(engine, [9]) == [True]
    describe(probe, [4])
    assert put_chunks(engine, [4]) == [True]
    settle(node.status, stored=5, removed=2)
    wait_for(lambda: len(subscriber.removed()) == 2, 10, "two BlockRemoved")
    held = probe.contains_many([key(i) for i in (0, 1, 2, 3, 4, 9)])
    gone = {key(i) for i, h in zip((0, 1, 2, 3, 4, 9), held) if not h}
    assert set(subscriber.removed()) == gone and len(gone) == 2
    assert set(subscriber.stored()) == {key(i) for i in range(5)}
    removed = [e for _, e in subscriber.events() if isinstance(e, kv_events.BlockRemoved)]
    assert {(e.medium, e.locality, e.ownership) for e in removed} == {
        ("CPU", "LOCAL", "kvtier/memory")}

    # Rank 1 of a TP-2 engine of the model stores its shard: rank 0 speaks for the chunk.
    rank_1, rank_1_engine = connect(node.socket_path, RANK_1)
    describe(NodeProbe([rank_1]), [7])
    assert put_chunks(rank_1_engine, [7]) == [True]

    # Each topic's batches are numbered from 0, one after the other, as vLLM's publisher does.
    status = node.status()
    assert [seq for _, seq, _ in subscriber.batches] == list(range(len(subscriber.batches)))
    assert key(7) not in subscriber.stored()
    assert status["events_endpoint"] == subscriber.endpoint
    counters = status["counters"]
    assert (counters["events_stored"], counters["events_removed"]) == (5, 2)
    assert counters["stored_unannounced"] == 1  # chunk 9
    assert counters["described_chunks"] == 6


def test_a_node_restarted_with_its_ram_recovered_does_not_clear_the_routers(
        tmp_path: Path, start_node: Callable[..., NodeProcess]):
    """On ipc:// the node binds and the router connects (and reconnects to the new node)."""
    endpoint = f"ipc://{tmp_path}/events"
    subscriber = Subscriber(endpoint)
    try:
        config = node_tiers(tmp_path, ram_chunks=4)
        node = start_node(config, args=("--events-endpoint", endpoint))
        # The node binds: what it sends before the router has connected goes to no one.
        wait_for(lambda: subscriber.handshakes == 1, 10, "the router connected")
        client, engine = connect(node.socket_path)
        describe(NodeProbe([client]), [0, 1])
        assert put_chunks(engine, [0, 1]) == [True] * 2
        wait_for(lambda: len(subscriber.stored()) == 2, 10, "two BlockStored")
        assert node.stop() == 0  # a clean stop keeps the slab for the next node
        client.close()
        cleared_before = len(subscriber.events())

        node = start_node(config, args=("--events-endpoint", endpoint))
        wait_for(lambda: subscriber.handshakes == 2, 10, "the router connected again")
        client, engine = connect(node.socket_path)
        probe = NodeProbe([client])
        assert probe.publishes_events()  # its Hello: the layout's store, its RAM recovered
        wait_for(lambda: node.status()["counters"]["recovered_chunks"] == 2, 30,
                 "the RAM recovered")
        describe(probe, [2])
        assert put_chunks(engine, [2]) == [True]
        wait_for(lambda: key(2) in subscriber.stored(), 10, "chunk 2's BlockStored")
        later = [e for _, e in subscriber.events()[cleared_before:]]
        # What the last node announced is what this one holds: no AllBlocksCleared, and the
        # recovered chunks (whose tokens it never learnt) are not announced again.
        assert [type(e).__name__ for e in later] == ["BlockStored"]
        assert node.status()["counters"]["stored_unannounced"] == 2
    finally:
        subscriber.close()


def test_a_node_without_an_endpoint_publishes_nothing(
        tmp_path: Path, socket_path: Path, node_name: str, subscriber: Subscriber):
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=4)), socket_path,
                        name=node_name, keep_ram=False)
    with running_node(config) as node:
        client, engine = connect(socket_path)
        probe = NodeProbe([client])
        assert not probe.publishes_events()
        describe(probe, [0])  # an engine that describes anyway: ignored
        assert put_chunks(engine, [0, 1]) == [True] * 2
        time.sleep(0.5)
        assert subscriber.batches == []
        assert node.status()["events_endpoint"] is None
        assert node.events is None
        client.close()


def test_event_block_size_announces_a_chunk_as_blocks_dynamo_scores_for_their_salt(
        tmp_path: Path, start_node: Callable[..., NodeProcess], subscriber: Subscriber):
    """`--event-block-size 4`: each 16-token chunk goes out as 4 chained blocks of 4 tokens
    (the chunk's key the last one's hash), vLLM's extra_keys per block (the salt in the
    prompt's first block); NVIDIA Dynamo's router (tests/node/dynamorules.py) indexes them
    and scores a query of that salt only."""
    salt = "dynamo-cache-salt:tenant-a"
    node = start_node(node_tiers(tmp_path, ram_chunks=4),
                      args=("--events-endpoint", subscriber.endpoint, "--event-block-size", "4"))
    subscriber.wait_connected()
    client, engine = connect(node.socket_path)
    probe = NodeProbe([client])
    probe.describe({key(i): ChunkInfo(key(i - 1) if i else None,
                                      np.asarray(tokens(i), dtype="<i4").tobytes(), None, salt)
                    for i in (0, 1)})
    assert put_chunks(engine, [0, 1]) == [True] * 2
    wait_for(lambda: len(subscriber.stored()) == 8, 10, "eight 4-token blocks")
    assert node.status()["event_block_size"] == 4
    blocks = subscriber.stored()
    assert {e.block_size for e in blocks.values()} == {4}
    assert key(0) in blocks and key(1) in blocks  # a chunk's last block: its key
    assert blocks[key(1)].token_ids == tokens(1)[12:]
    batch = KVEventBatch(ts=0.0, events=[e for _, e in subscriber.events()])
    dynamo = DynamoIndexer(kv_block_size=4)
    dynamo.receive("node", msgspec.msgpack.encode(batch))
    prompt = tokens(0) + tokens(1)
    assert dynamo.score(prompt, namespace="tenant-a") == {"node": 8}
    assert dynamo.score(prompt) == {} and dynamo.score(prompt, namespace="tenant-b") == {}
    client.close()


@pytest.mark.parametrize(("block", "endpoint", "allowed"), [
    (0, "tcp://127.0.0.1:5557", "a positive integer"),
    (True, "tcp://127.0.0.1:5557", "a positive integer"),
    (16, None, "without an events endpoint")])
def test_a_bad_event_block_size_is_a_config_error_naming_the_field(
        tmp_path: Path, socket_path: Path, block: int, endpoint: str | None, allowed: str):
    with pytest.raises(ConfigError) as error:
        NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=4)), socket_path,
                   events_endpoint=endpoint, event_block_size=block)
    assert (error.value.field, error.value.value) == ("event_block_size", block)
    assert allowed in str(error.value)


def test_an_event_block_size_a_layout_cannot_take_announces_its_chunks_whole(
        tmp_path: Path, socket_path: Path, node_name: str, subscriber: Subscriber):
    config = NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=4)), socket_path,
                        name=node_name, keep_ram=False, events_endpoint=subscriber.endpoint,
                        event_block_size=5)  # does not divide the 16-token chunks
    with running_node(config):
        subscriber.wait_connected()  # in process, the first batch went out within ms
        client, engine = connect(socket_path)
        describe(NodeProbe([client]), [0])
        assert put_chunks(engine, [0]) == [True]
        wait_for(lambda: len(subscriber.stored()) == 1, 10, "the chunk as one block")
        assert subscriber.stored()[key(0)].block_size == TPC
        client.close()


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "http://127.0.0.1:80",
    "ipc://", "127.0.0.1:5557", "tcp://a b:1"])
def test_a_bad_endpoint_is_a_config_error_naming_the_field(
        tmp_path: Path, socket_path: Path, endpoint: str):
    with pytest.raises(ConfigError) as error:
        NodeConfig(StoreConfig.parse(node_tiers(tmp_path, ram_chunks=4)), socket_path,
                   events_endpoint=endpoint)
    assert (error.value.field, error.value.value) == ("events_endpoint", endpoint)
    assert "tcp://HOST:PORT" in str(error.value) and "ipc://PATH" in str(error.value)


def test_serve_refuses_a_bad_endpoint_with_exit_2(tmp_path: Path, socket_path: Path,
                                                   capsys: pytest.CaptureFixture[str]):
    config = write_config(tmp_path / "node.json", node_tiers(tmp_path, ram_chunks=4))
    assert cli.main(["serve", "--config", str(config), "--socket", str(socket_path),
                     "--events-endpoint", "udp://127.0.0.1:5557"]) == 2
    assert "events_endpoint" in capsys.readouterr().err
    assert not socket_path.exists()


def test_serve_says_why_it_cannot_publish_where_asked(tmp_path: Path, socket_path: Path,
                                                       capsys: pytest.CaptureFixture[str]):
    config = write_config(tmp_path / "node.json", node_tiers(tmp_path, ram_chunks=4))
    endpoint = f"ipc://{tmp_path}/no-such-directory/events"
    assert cli.main(["serve", "--config", str(config), "--socket", str(socket_path),
                     "--events-endpoint", endpoint]) == 2
    assert f"cannot publish KV events on {endpoint}" in capsys.readouterr().err
    assert not socket_path.exists()


def test_the_node_structs_encode_as_vllms_byte_for_byte():
    """The node never imports vLLM: its structs (eventwire.py) must be vLLM's on the wire."""
    k, parent = ChunkKey(bytes(range(16))), ChunkKey(bytes(16))
    ours = KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        BlockStored([k], parent, [1, 2], 16, None, "CPU", "lora", extra_keys=[("lora", "s")],
                    locality="LOCAL", ownership="kvtier/memory"),
        BlockRemoved([k], "STORAGE", locality="REMOTE", ownership="kvtier/shared")])
    theirs = kv_events.KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        kv_events.BlockStored(block_hashes=[k], parent_block_hash=parent, token_ids=[1, 2],
                              block_size=16, lora_id=None, medium="CPU", lora_name="lora",
                              extra_keys=[("lora", "s")], locality="LOCAL",
                              ownership="kvtier/memory"),
        kv_events.BlockRemoved(block_hashes=[k], medium="STORAGE", locality="REMOTE",
                               ownership="kvtier/shared")])
    assert msgspec.msgpack.encode(ours) == msgspec.msgpack.encode(theirs)
