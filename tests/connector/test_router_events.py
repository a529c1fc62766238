"""The scheduler's KV events at a router's block size, with vLLM's per-block extra_keys, read
by the routers' own rules: NVIDIA Dynamo's KV router (tests/node/dynamorules.py) and llm-d's
precise prefix-cache scorer (tests/node/llmdrules.py), each ported with the file and commit it
comes from.

A salted prompt of three 64-token chunks, announced at Dynamo's block size of 16, is one
event of twelve chained blocks, the salt in the first block only: Dynamo scores it for a query
of the same salt and for no other; at kvtier's chunk size Dynamo publishes none of it; a
chunk's removal removes its four blocks. Chunks stored in reverse order still go out parents
first. A prompt stored over two steps keeps its salt only in the first event (as vLLM's own
events): Dynamo matches the first step's chunks. The same events give llm-d the salted score.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent
from kvtier.core.tier import EventKind
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.tiers.eventblocks import ParentsFirst, block_hashes
from kvtier.tiers.eventfacts import ChunkInfo, ChunkTokens

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # the routers' rules
pytest.importorskip("xxhash")  # Dynamo's block hash
from dynamorules import DynamoIndexer
from llmdrules import Indexer

kv = pytest.importorskip("vllm.distributed.kv_events")
events_mod = pytest.importorskip("kvtier.integrations.vllm.scheduler.events")

TPC, BLOCK = 64, 16
SALT = "dynamo-cache-salt:tenant-a"  # as Dynamo's vLLM handler hands vLLM the request's salt
KINDS = {"memory": "memory"}


def prompt_chunks(n: int, salt: str | None = SALT) -> tuple[list[ChunkKey], ChunkTokens]:
    """The keys of a prompt's `n` chunks (tokens 0..n*TPC) and their remembered infos."""
    tokens = ChunkTokens()
    keys = [ChunkKey(bytes([i + 1]) * 16) for i in range(n)]
    for i, key in enumerate(keys):
        ids = np.arange(i * TPC, (i + 1) * TPC, dtype="<i4").tobytes()
        tokens.remember(key, ChunkInfo(keys[i - 1] if i else None, ids, None, salt))
    return keys, tokens


def stored(keys: list[ChunkKey]) -> list[StoreEvent]:
    return [StoreEvent(EventKind.STORED, key, "memory") for key in keys]


def payload(events: list[Any]) -> bytes:
    return msgspec.msgpack.encode(kv.KVEventBatch(ts=0.0, events=events, data_parallel_rank=0))


PROMPT = list(range(3 * TPC)) + [7] * 5


def test_dynamo_scores_a_salted_prompt_at_its_block_size_and_only_with_its_salt() -> None:
    keys, tokens = prompt_chunks(3)
    [event] = events_mod.kv_events(stored(keys), tokens, KINDS, TPC, BLOCK)
    assert (event.block_size, len(event.block_hashes), event.parent_block_hash) == (BLOCK, 12, None)
    assert event.block_hashes[3::4] == keys  # a chunk's last block is its key
    assert event.block_hashes[:4] == block_hashes(keys[0], 4)
    assert event.extra_keys == [(SALT,)] + [None] * 11  # vLLM's: the salt in block 0 only
    assert event.token_ids == list(range(3 * TPC))

    dynamo = DynamoIndexer(kv_block_size=BLOCK)
    dynamo.receive("A", payload([event]))
    assert dynamo.score(PROMPT, namespace="tenant-a") == {"A": 12}
    assert dynamo.score(PROMPT) == {} and dynamo.score(PROMPT, namespace="tenant-b") == {}

    # A chunk that leaves the tier leaves as its four blocks: the prompt matches up to it.
    removal = events_mod.kv_events([StoreEvent(EventKind.REMOVED, keys[2], "memory")],
                                   tokens, KINDS, TPC, BLOCK)
    assert [len(e.block_hashes) for e in removal] == [4]
    dynamo.receive("A", payload(removal))
    assert dynamo.score(PROMPT, namespace="tenant-a") == {"A": 8}

    # llm-d at its block size 16 scores the same events for the same salt (cpu: 0.8 a block).
    llmd = Indexer(block_size=BLOCK)
    llmd.receive("kv@10.0.0.1:8000@m", payload([event]))
    endpoints = {"10.0.0.1:8000": "n1"}
    assert llmd.score(PROMPT, "m", endpoints, cache_salt=SALT) == {
        "10.0.0.1:8000": pytest.approx(9.6)}
    assert llmd.score(PROMPT, "m", endpoints) == {}


def test_at_kvtiers_chunk_size_dynamo_publishes_none_of_it() -> None:
    keys, tokens = prompt_chunks(3)
    [event] = events_mod.kv_events(stored(keys), tokens, KINDS, TPC)  # the default: a chunk
    assert (event.block_size, event.block_hashes) == (TPC, keys)
    dynamo = DynamoIndexer(kv_block_size=BLOCK)
    dynamo.receive("A", payload([event]))
    assert dynamo.wrong_size == 3 and dynamo.score(PROMPT, namespace="tenant-a") == {}


def test_chunks_stored_in_reverse_go_out_parents_first_in_one_event() -> None:
    keys, tokens = prompt_chunks(3)
    events = events_mod.kv_events(stored(keys[::-1]), tokens, KINDS, TPC, BLOCK)
    assert [e.block_hashes[3::4] for e in events] == [keys]
    dynamo = DynamoIndexer(kv_block_size=BLOCK)
    dynamo.receive("A", payload(events))
    assert dynamo.orphans == 0 and dynamo.score(PROMPT, namespace="tenant-a") == {"A": 12}


def test_a_prompt_stored_over_two_steps_keeps_its_salt_in_the_first_event_only() -> None:
    keys, tokens = prompt_chunks(3)
    first = events_mod.kv_events(stored(keys[:2]), tokens, KINDS, TPC, BLOCK)
    second = events_mod.kv_events(stored(keys[2:]), tokens, KINDS, TPC, BLOCK)
    assert second[0].parent_block_hash == keys[1] and second[0].extra_keys is None
    dynamo = DynamoIndexer(kv_block_size=BLOCK)
    dynamo.receive("A", payload(first + second))
    # Dynamo takes each event's namespace from its first block, as with vLLM's own later
    # events: the second step's chunk is hashed unsalted, and a salted query stops before it.
    assert dynamo.score(PROMPT, namespace="tenant-a") == {"A": 8}


@pytest.mark.parametrize(("extra", "field"), [
    ({"event_block_size": 48}, "event_block_size"),  # does not divide 256
    ({"tokens_per_chunk": 64, "event_block_size": 128}, "event_block_size"),
    ({"event_block_size": 0}, "event_block_size"),
    ({"event_block_size": "16"}, "event_block_size")])
def test_an_event_block_size_that_does_not_divide_the_chunk_is_a_config_error(
        extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as error:
        ConnectorConfig.parse(extra)
    assert error.value.field == f"kv_connector_extra_config.{field}"


def test_an_event_block_size_is_kept_when_it_divides_the_chunk() -> None:
    assert ConnectorConfig.parse({"event_block_size": 16}).event_block_size == 16
    assert ConnectorConfig.parse({}).event_block_size is None
    with pytest.raises(ConfigError):  # vLLM's block 96 makes the chunk 288: 64 no divisor
        ConnectorConfig.parse({"event_block_size": 64}).for_block_size(96)


def test_stores_completing_out_of_order_across_steps_go_out_parents_first() -> None:
    """A write-behind tier's writers race: chunk 2 lands a step before chunk 1, chunk 1 before
    chunk 0. Each is held until its parent is announced; one whose parent never comes goes out
    after hold_s (its parent may be announced already, by another engine)."""
    keys, tokens = prompt_chunks(3)
    order = ParentsFirst(hold_s=2.0)
    assert order.order(stored(keys[2:]), tokens.get, now_s=0.0) == []
    assert order.order(stored(keys[1:2]), tokens.get, now_s=0.1) == []
    assert order.holding
    out = order.order(stored(keys[:1]), tokens.get, now_s=0.2)
    assert [e.key for e in out] == keys  # parents first
    events = events_mod.kv_events(out, tokens, KINDS, TPC, BLOCK)
    dynamo = DynamoIndexer(kv_block_size=BLOCK)
    dynamo.receive("A", payload(events))
    assert dynamo.orphans == 0 and dynamo.score(PROMPT, namespace="tenant-a") == {"A": 12}

    lone = ChunkKey(b"\x09" * 16)
    tokens.remember(lone, ChunkInfo(ChunkKey(b"\x08" * 16), bytes(4 * TPC), None, None))
    assert order.order(stored([lone]), tokens.get, now_s=1.0) == []
    assert [e.key for e in order.order([], tokens.get, now_s=3.0)] == [lone]
    # A removal goes out at once and drops a held store of its chunk.
    assert order.order(stored([lone]), tokens.get, now_s=4.0) == []
    removal = StoreEvent(EventKind.REMOVED, lone, "memory")
    assert order.order([removal], tokens.get, now_s=4.1) == [removal]
    assert not order.holding


def test_a_chunks_tail_goes_out_as_its_blocks_and_dynamo_scores_through_it() -> None:
    """A prompt's tail (keys.tail_key: 2 blocks of 16 past its 3 chunks) follows its parent
    chunk in the run, as its 2 blocks; at kvtier's chunk size it is not announced."""
    keys, tokens = prompt_chunks(3)
    tail = ChunkKey(b"\xee" * 16)
    ids = np.arange(3 * TPC, 3 * TPC + 2 * BLOCK, dtype="<i4").tobytes()
    tokens.remember(tail, ChunkInfo(keys[2], ids, None, SALT))
    [event] = events_mod.kv_events(stored([*keys, tail]), tokens, KINDS, TPC, BLOCK)
    assert len(event.block_hashes) == 14 and event.block_hashes[-1] == tail
    assert event.token_ids == list(range(3 * TPC + 2 * BLOCK))
    dynamo = DynamoIndexer(kv_block_size=BLOCK)
    dynamo.receive("A", payload([event]))
    longer = list(range(3 * TPC + 2 * BLOCK)) + [7] * 5
    assert dynamo.score(longer, namespace="tenant-a") == {"A": 14}
    removal = events_mod.kv_events([StoreEvent(EventKind.REMOVED, tail, "memory")],
                                   tokens, KINDS, TPC, BLOCK)
    assert [len(e.block_hashes) for e in removal] == [2]
    [chunks_only] = events_mod.kv_events(stored([*keys, tail]), tokens, KINDS, TPC)
    assert chunks_only.block_hashes == keys


def test_a_tail_never_announced_is_never_removed() -> None:
    keys, tokens = prompt_chunks(1)
    tail = ChunkKey(b"\xee" * 16)
    tokens.remember(tail, ChunkInfo(keys[0], np.arange(TPC, TPC + BLOCK, dtype="<i4").tobytes(),
                                    None, SALT))
    gone = [StoreEvent(EventKind.REMOVED, key, "memory") for key in (tail, keys[0])]
    assert [e.block_hashes for e in events_mod.kv_events(gone, tokens, KINDS, TPC)] == [keys]
