"""Shared tiers credited fleet-wide: with `pool_events`, the scheduler publishes its shared
tiers' events on kvtier's own ZMQ publisher, topic `kv@pool:<name>@<model>` (llm-d-router PR
#2586's pool pseudo-pod), medium `shared_storage`, and the rest on vLLM's stream as before.

A prompt engine A stored in the shared directory scores, by llm-d's rules (ported in
tests/node/llmdrules.py), for every endpoint, engine B among them, at the pool's weight; when
engine B's eviction takes a chunk out of the shared directory, B announces its removal on the
same topic and the prompt stops matching there for everyone. A real ZMQ subscriber, bound as
llm-d's EPP is; the publisher connects to it. A bad `pool_events` is a ConfigError naming the
field.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent
from kvtier.core.tier import EventKind
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig, PoolEvents

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "node"))  # the router's side
from eventsub import Subscriber
from llmdrules import Indexer, parse_topic
from nodekit import wait_for

routerevents = pytest.importorskip("kvtier.integrations.vllm.scheduler.routerevents")

TPC = 16
KINDS = {"memory": "memory", "shared": "shared"}
ENDPOINTS = {"10.0.0.1:8000": "n1", "10.0.0.2:8000": "n1", "10.0.0.3:8000": "n2"}  # A, B, C
WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "shared_storage": 0.4}  # PR #2586's defaults
REQUEST = SimpleNamespace(request_id="r", lora_request=None, cache_salt=None)  # what remember reads
KEYS = [ChunkKey(bytes([i + 1]) * 16) for i in range(4)]
TOKENS = list(range(4 * TPC))


def events(kind: EventKind, tier: str, keys: list[ChunkKey]) -> list[StoreEvent]:
    return [StoreEvent(kind, key, tier) for key in keys]


def test_a_prompt_engine_a_stored_in_a_shared_tier_scores_for_every_engine() -> None:
    subscriber = Subscriber()
    pool = PoolEvents(endpoint=subscriber.endpoint, pool="fleet", model="m")
    engine_a = routerevents.RouterEvents(True, KINDS, TPC, pool=pool)
    engine_b = routerevents.RouterEvents(True, KINDS, TPC, pool=pool)
    try:
        wait_for(lambda: subscriber.handshakes >= 2, 10, "both engines connected")
        time.sleep(0.3)  # the subscription reaches the publishers before anything is sent
        assert engine_a.enabled  # the tokens of chunks are remembered for the pool's events
        engine_a.remember(REQUEST, KEYS, TOKENS, None)
        engine_a.learn(events(EventKind.STORED, "shared", KEYS)
                       + events(EventKind.STORED, "memory", KEYS[:1]))
        # The memory tier's chunk goes to vLLM's stream, on A's own topic, as before.
        [own] = engine_a.take()
        assert (own.block_hashes, own.medium) == ([KEYS[0]], "CPU")
        wait_for(lambda: len(subscriber.stored()) == 4, 10, "the pool's four blocks")
        [(topic, stored)] = subscriber.events()
        assert parse_topic(topic) == ("pool:fleet", "m")
        assert (stored.medium, stored.locality, stored.ownership) == (
            "shared_storage", "REMOTE", "kvtier/shared")

        router = Indexer(block_size=8, weights=WEIGHTS)
        for frame in subscriber.frames:
            router.receive(*frame)
        # 4 chunks = 8 of the router's blocks at 0.4 each, for A, B and C alike.
        assert router.score(TOKENS, "m", ENDPOINTS) == pytest.approx(
            dict.fromkeys(ENDPOINTS, 3.2))

        # Engine B's eviction took chunk 3 out of the shared directory: B announces it.
        engine_b.learn(events(EventKind.REMOVED, "shared", KEYS[2:3]))
        wait_for(lambda: subscriber.removed(), 10, "B's BlockRemoved")
        for frame in subscriber.frames[1:]:
            router.receive(*frame)
        assert router.score(TOKENS, "m", ENDPOINTS) == pytest.approx(
            dict.fromkeys(ENDPOINTS, 1.6))
    finally:
        engine_a.close()
        engine_b.close()
        subscriber.close()


def test_without_a_pool_shared_tiers_go_out_with_the_others() -> None:
    engine = routerevents.RouterEvents(True, KINDS, TPC)
    engine.remember(REQUEST, KEYS, TOKENS, None)
    engine.learn(events(EventKind.STORED, "shared", KEYS))
    [event] = engine.take()
    assert (event.medium, event.locality, len(event.block_hashes)) == ("STORAGE", "REMOTE", 4)


@pytest.mark.parametrize(("value", "field"), [
    ("tcp://epp:5558", "pool_events"),
    ({"endpoint": "tcp://epp:5558", "pool": "fleet"}, "pool_events.model"),
    ({"endpoint": "tcp://epp:5558", "pool": "a@b", "model": "m"}, "pool_events.pool"),
    ({"endpoint": "udp://epp:5558", "pool": "fleet", "model": "m"}, "pool_events.endpoint"),
    ({"endpoint": "tcp://epp:5558", "pool": "fleet", "model": "m", "colour": 1}, "pool_events"),
])
def test_a_bad_pool_events_is_a_config_error_naming_the_field(value: Any, field: str) -> None:
    with pytest.raises(ConfigError) as error:
        ConnectorConfig.parse({"pool_events": value})
    assert error.value.field == f"kv_connector_extra_config.{field}"


def test_pool_events_are_parsed_with_their_topic_and_refused_in_node_mode() -> None:
    config = ConnectorConfig.parse({"pool_events": {
        "endpoint": "tcp://epp:5558", "pool": "fleet", "model": "m", "medium": "object_store"}})
    assert config.pool_events is not None
    assert (config.pool_events.topic, config.pool_events.medium) == (
        "kv@pool:fleet@m", "object_store")
    with pytest.raises(ConfigError, match="pool_events"):
        ConnectorConfig.parse({"node": "/run/kvtier.sock", "pool_events": {
            "endpoint": "tcp://epp:5558", "pool": "fleet", "model": "m"}})


@pytest.mark.parametrize("key, value", [("io_cores", "2,3"), ("write_queue_depth", 3)])
def test_store_settings_of_the_nodes_own_are_refused_in_node_mode(key: str, value: Any) -> None:
    """An engine of a node runs no write queue or I/O thread of a tier: the setting would be
    silently ignored."""
    with pytest.raises(ConfigError) as error:
        ConnectorConfig.parse({"node": "/run/kvtier.sock", key: value})
    assert error.value.field == f"kv_connector_extra_config.{key}"
    assert "none with node set" in error.value.allowed
    ConnectorConfig.parse({key: value})  # without a node: a setting of this engine's store


@pytest.mark.parametrize("cleared", [True, False])
def test_after_a_reset_removals_of_older_chunks_go_out_only_if_nothing_cleared_them(
        cleared: bool) -> None:
    """vLLM's AllBlocksCleared (its reset succeeded) told routers every chunk of before the
    reset is gone from this engine, whatever the tier: their removals on vLLM's stream are
    not announced again (llm-d would take a new copy of the same tokens off with them); a
    chunk keyed since is removed as ever. Without a clear, they all go out."""
    engine = routerevents.RouterEvents(True, KINDS, TPC)
    engine.remember(REQUEST, KEYS[:2], TOKENS[:2 * TPC], None)
    engine.learn(events(EventKind.STORED, "shared", KEYS[:2]))
    assert len(engine.take()) == 1
    engine.reset(cleared=cleared)
    engine.remember(REQUEST, KEYS[2:], TOKENS[2 * TPC:], KEYS[1])
    engine.learn(events(EventKind.STORED, "memory", KEYS[2:])
                 + events(EventKind.REMOVED, "shared", KEYS[:2])
                 + events(EventKind.REMOVED, "memory", KEYS[3:]))
    removed = [ChunkKey(h) for e in engine.take() if type(e).__name__ == "BlockRemoved"
               for h in e.block_hashes]
    assert removed == (KEYS[3:] if cleared else KEYS[:2] + KEYS[3:])


def test_the_keys_of_chunks_keyed_before_resets_kept_are_bounded() -> None:
    """`OLD_KEYS_PER_RECENT` x `recent_chunks` of them (never fewer than the last reset
    dropped): past that, the oldest are forgotten, and their removals go out again."""
    engine = routerevents.RouterEvents(True, KINDS, TPC, recent_chunks=1)
    bound = routerevents.OLD_KEYS_PER_RECENT
    batches = [[ChunkKey(bytes([100 + i, j]) * 8) for j in range(2)]
               for i in range(bound // 2 + 1)]
    for batch in batches:  # each reset clears, with the 2 chunks keyed since the one before
        engine.remember(REQUEST, batch, TOKENS[:2 * TPC], None)
        engine.reset(cleared=True)
    engine.learn([event for batch in batches
                  for event in events(EventKind.REMOVED, "memory", batch)])
    removed = [ChunkKey(h) for e in engine.take() for h in e.block_hashes]
    assert removed == batches[0]
