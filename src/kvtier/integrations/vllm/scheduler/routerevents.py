"""The KV events the scheduler side hands vLLM for cache-aware routers (events.py: their form).

Scheduler side, one thread. Enabled when vLLM runs with KV cache events on: the token ids of
each chunk are remembered when its key is made (a stored event must carry them), held while
its request lives and for a while after (chunkinfos.py), dropped at a cache reset (`reset`:
its old chunks are never announced stored again, nor, once vLLM's AllBlocksCleared announced
them gone, removed again), and the
workers' per-tier store events become vLLM events, queued until vLLM takes them. In node mode
the node publishes its tiers' events itself (kvtier.node.events), and knows no token ids:
when it says it publishes, the chunks are remembered here too and each step's planned stores
described to it (`describe`). With `pool_events`, the events of the shared tiers (REMOTE:
every engine hits their chunks) go out on kvtier's own publisher instead, once for the fleet,
on the pool pseudo-pod's topic `kv@pool:<name>@<model>` (config.PoolEvents), so that a router
credits every engine with them, and their removals (a chunk any engine's eviction took out of
the shared directory is announced by that engine) take them off for all.

Primitives: `RouterEvents`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent
from kvtier.integrations.vllm.config import PoolEvents
from kvtier.integrations.vllm.scheduler.chunkinfos import RECENT_CHUNKS, LiveChunkInfos
from kvtier.integrations.vllm.scheduler.events import kv_events
from kvtier.node.eventpub import EventPublisher
from kvtier.node.eventwire import BlockRemoved, BlockStored
from kvtier.tiers.eventblocks import ParentsFirst, router_blocks
from kvtier.tiers.eventfacts import ChunkInfo, event_place

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

    from kvtier.node.probe import NodeProbe

# The keys of chunks keyed before a reset kept (`RouterEvents.reset`), per recent chunk kept:
# a few resets' worth of recent chunks (~100 bytes a key).
OLD_KEYS_PER_RECENT = 4


class RouterEvents:
    """Chunk token ids and queued KV events (scheduler thread)."""

    def __init__(self, enabled: bool, tier_kinds: Mapping[str, str],
                 tokens_per_chunk: int, node: NodeProbe | None = None,
                 block_size: int | None = None, pool: PoolEvents | None = None,
                 recent_chunks: int = RECENT_CHUNKS) -> None:
        """`enabled`: vLLM publishes KV events (--kv-events-config); `tier_kinds`: tier
        name -> kind, for each event's medium and locality; `node`: the node of node mode,
        told the chunks of each step's stores when it publishes events; `block_size`: the
        events' block size (ConnectorConfig.event_block_size; None: one block a chunk);
        `pool`: publish the shared tiers' events on the pool's topic instead;
        `recent_chunks`: the chunks of ended requests whose token ids are kept (chunkinfos.py).

        Raises:
            OSError: the pool's endpoint cannot be bound.
        """
        self._vllm_events = enabled
        self._node = node
        self._tier_kinds = tier_kinds
        self._tokens_per_chunk = tokens_per_chunk
        self._block_size = block_size
        self._pool = pool
        self._order = ParentsFirst()  # stores that complete out of order, parents first
        self._pool_publisher = None if pool is None else EventPublisher(
            pool.endpoint, "kv_connector_extra_config.pool_events.endpoint")
        # The tiers every engine hits (their class: REMOTE), announced on the pool's topic.
        self._shared = {name for name, kind in tier_kinds.items()
                        if event_place(name, kind).locality == "REMOTE"} if pool else set()
        self._recent_chunks = recent_chunks
        self._chunk_tokens = LiveChunkInfos(recent_chunks)
        self._queued: list[KVCacheEvent] = []
        # The removals on vLLM's stream of chunks keyed before the last reset that cleared
        # (its AllBlocksCleared went out) are not announced (`reset`). Those chunks: the ones
        # known keyed before it (`_cleared_keys`: dropped at it, or at a failed reset before
        # it, the oldest forgotten past `_max_old_keys`: a write-behind that lands later, a
        # chunk pinned then, in any tier), and, while no reset failed since it, every one a
        # tier retired (StoreEvent.retired: all were retired at a reset up to it).
        self._cleared_keys: dict[ChunkKey, None] = {}
        self._uncleared_keys: dict[ChunkKey, None] = {}  # dropped at failed resets since
        self._retired_cleared = False
        self._max_old_keys = OLD_KEYS_PER_RECENT * recent_chunks

    @property
    def enabled(self) -> bool:
        """Whether chunks' token ids are remembered: vLLM publishes events, or the node."""
        return (self._vllm_events or self._pool is not None
                or (self._node is not None and self._node.publishes_events()))

    def remember(self, request: Request, keys: list[ChunkKey], tokens: Sequence[int],
                 parent: ChunkKey | None) -> None:
        """Keep the token ids of new chunks (`keys`, after `parent`) of `request` for the
        events of their later stores: while the request lives, then among the recent."""
        tpc = self._tokens_per_chunk
        ids = np.asarray(tokens, dtype="<i4")
        lora = request.lora_request.lora_name if request.lora_request else None
        for i, key in enumerate(keys):
            self._chunk_tokens.remember(request.request_id, key, ChunkInfo(
                parent=parent, token_ids=ids[i * tpc:(i + 1) * tpc].tobytes(), lora_name=lora,
                cache_salt=request.cache_salt))
            parent = key

    def forget(self, request_id: str) -> None:
        """The request ended: its chunks' token ids are kept among the recent only."""
        self._chunk_tokens.forget(request_id)

    def reset(self, cleared: bool) -> None:
        """A cache reset (`ConnectorScheduler.reset_cache`): the chunks keyed before it are
        never offered to this engine again. Their token ids are dropped, and the stored
        events not yet taken: a store of one of them reported later (a write-behind landing
        on disk) is not announced, as for a chunk whose ids are gone; the chunks keyed from
        now on are remembered as before.

        `cleared`: vLLM's own reset succeeded, so it tells routers that every block of the
        engine is gone (AllBlocksCleared, published before this step's events), and no chunk
        keyed before is announced stored after it: their removals on vLLM's stream are no
        news. They are not announced: llm-d keys a block by its tokens, and the removal of an
        old copy took the new copy of the same prompt off its index
        (tests/connector/test_router_view_after_reset.py). Those chunks are the ones the
        engine's tiers retire then (RAM, a local disk: flagged by the tier), and those whose
        ids are dropped now (the live and recent ones: a write-behind landing later, a
        shared tier's copy). Not `cleared` (vLLM's reset failed: a request held blocks, and
        no clear went out), the router still credits them, and their removals are
        announced, until a reset that clears; those of chunks of before an earlier reset
        that cleared are not (a failed reset clears nothing, nor makes the router credit
        again what it forgot), except a retired chunk not known keyed before that reset (the
        flag does not say which reset retired it, and the failed one's are credited).
        Removals queued now go out either way, and on the pool's topic (never cleared)
        always. The keys known keyed before a reset: the live and recent ones at it (or at
        a failed reset before it), at most `OLD_KEYS_PER_RECENT` x `recent_chunks` kept (the
        oldest forgotten first, those dropped at the last reset never)."""
        dropped = self._chunk_tokens.keys()
        self._chunk_tokens = LiveChunkInfos(self._recent_chunks)
        self._queued = [e for e in self._queued if isinstance(e, VllmBlockRemoved)]
        self._uncleared_keys.update(dict.fromkeys(dropped))
        _keep_newest(self._uncleared_keys, max(self._max_old_keys, len(dropped)))
        if cleared:
            self._cleared_keys.update(self._uncleared_keys)
            _keep_newest(self._cleared_keys, max(self._max_old_keys, len(self._uncleared_keys)))
            self._uncleared_keys = {}
        self._retired_cleared = cleared

    def learn(self, store_events: Iterable[StoreEvent]) -> None:
        """Queue the events of what the workers' tiers stored and removed; those of shared
        tiers, with a pool, published on its topic at once. After a reset that cleared, the
        removals of chunks of before it are dropped from vLLM's stream (`reset`)."""
        if self._cleared_keys or self._retired_cleared:
            store_events = [e for e in store_events if not self._cleared_already(e)]
        events = self._order.order(store_events, self._chunk_tokens.get, time.monotonic())
        if self._shared:
            self._publish_pool([e for e in events if e.tier in self._shared])
            events = [e for e in events if e.tier not in self._shared]
        if self._vllm_events:
            self._queued.extend(kv_events(events, self._chunk_tokens, self._tier_kinds,
                                          self._tokens_per_chunk, self._block_size))

    def _cleared_already(self, event: StoreEvent) -> bool:
        """Whether `event` removes, on vLLM's stream, a chunk of before the last reset that
        cleared: the router has nothing of it there."""
        return event.kind == "removed" and event.tier not in self._shared and (
            event.key in self._cleared_keys or (event.retired and self._retired_cleared))

    def _publish_pool(self, events: list[StoreEvent]) -> None:
        """One batch on the pool's topic: medium the pool's, locality REMOTE."""
        if not events or self._pool is None or self._pool_publisher is None:
            return
        size = self._block_size or self._tokens_per_chunk
        blocks, _ = router_blocks(events, self._chunk_tokens.get, self._tokens_per_chunk, size)
        medium = self._pool.medium
        wire: list[BlockStored | BlockRemoved] = [
            BlockStored(list(b.block_hashes), b.parent, b.token_ids or [], size, None, medium,
                        b.lora_name, extra_keys=b.extra_keys, locality="REMOTE",
                        ownership=f"kvtier/{b.tier}") if b.stored else
            BlockRemoved(list(b.block_hashes), medium, locality="REMOTE",
                         ownership=f"kvtier/{b.tier}")
            for b in blocks]
        self._pool_publisher.publish(self._pool.topic, wire)

    def close(self) -> None:
        """Close the pool's socket, if any (its last batches go out within half a second)."""
        if self._pool_publisher is not None:
            self._pool_publisher.close()
            self._pool_publisher = None

    def describe(self, stores: Iterable[ChunkKey]) -> None:
        """Tell the node (node mode, when it publishes) the chunks of a step's planned stores
        whose tokens are remembered: one message, no reply."""
        if self._node is None or not self._node.publishes_events():
            return
        chunks = {key: info for key in stores if (info := self._chunk_tokens.get(key))}
        self._node.describe(chunks)

    def take(self) -> list[KVCacheEvent]:
        """The events queued since the last call (vLLM's connector take_events)."""
        events, self._queued = self._queued, []
        return events


def _keep_newest(keys: dict[ChunkKey, None], count: int) -> None:
    """Drop the oldest of `keys` (insertion order) past the `count` newest."""
    for key in list(itertools.islice(keys, max(0, len(keys) - count))):
        del keys[key]
