"""The KV events of the node's tiers, published once for every engine on the node.

In process, each engine's scheduler turns its tiers' events into vLLM KV events
(`kvtier.integrations.vllm.scheduler.events`); in node mode the tiers are the node's, so the
node publishes them itself, on a ZMQ PUB socket of its own (`NodeConfig.events_endpoint`),
in vLLM's wire format (`eventwire.py`), for cache-aware routers:

  - topic `kv@node:<node name>@<model>`: llm-d's pseudo-pod identity for a cache every pod on
    a node shares (llm-d-router #2586: the router credits a `node:<name>` entry to every
    endpoint on that Kubernetes node), one topic per model (`Hello.model`);
  - `BlockStored` when a chunk lands in a tier of the node, `BlockRemoved` when it leaves one,
    `medium`/`locality`/`ownership` as in process (`kvtier.tiers.eventfacts.event_place`),
    `block_size` the layout's tokens_per_chunk, or `event_block_size` (`NodeConfig`: a chunk
    as that many chained blocks, each with vLLM's extra_keys, as in process:
    `kvtier.tiers.eventblocks`) where it divides the layout's chunk;
  - the events of the layouts at tensor-parallel rank 0 only: every rank of an engine stores
    and evicts its shard of the same chunks, in the same steps, under the same policy and
    per-rank capacity, and a key is one chunk for every rank, so rank 0 speaks for them;
  - a topic's first batch starts with `AllBlocksCleared` (routers drop what a dead node on
    this name announced), unless its layout's RAM is recovered from a predecessor's slab:
    then what the predecessor announced is what the node holds (what leaves it is removed).

A stored event needs the chunk's token ids, which the node never sees: the engines' schedulers
send them (`Describe`, one message per step, of the chunks it plans to store), kept here per
model (`Descriptions`: as long as a tier of the node holds the chunk, within the node's
capacity; the recent others); a chunk stored with no known tokens is not announced
(counted), as in process. A chunk's removal is not announced while the tier holds another
chunk of the same tokens (a reset engine's new epoch beside the old copy: a router keys blocks
by their tokens; `Descriptions.copy_held`). A thread drains every layout's store events every
`interval_s`, and at once after a step's last commit (`wake`).

Primitives: `events_topic`, `NodeEvents` (its socket: `kvtier.node.eventpub`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent, TieredStore
from kvtier.node.descriptions import Descriptions
from kvtier.node.eventpub import EventPublisher
from kvtier.node.eventwire import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.node.protocol import Described
from kvtier.tiers.eventblocks import ParentsFirst, router_blocks
from kvtier.tiers.eventfacts import ChunkInfo, EventPlace, event_place

log = logging.getLogger(__name__)
TOKEN_BYTES = 4  # a token id in a description (`Described.token_ids`: little-endian int32)
# The longest cache salt or LoRA name a description keeps (vLLM bounds neither; a longer one
# only costs routers the hint of that chunk).
MAX_NAME_CHARS = 4096
Event = BlockStored | BlockRemoved | AllBlocksCleared


def events_topic(node: str, model: str) -> str:
    """The ZMQ topic of the node's events of `model`: llm-d's node pseudo-pod."""
    return f"kv@node:{node}@{model}"


@dataclass
class _Source:
    """A layout's store whose events the node drains."""

    store: TieredStore
    model: str
    topic: str
    tokens_per_chunk: int
    block_size: int  # tokens a router's block: tokens_per_chunk, or a divisor of it
    announce: bool  # its events are published (tensor-parallel rank 0)
    order: ParentsFirst = field(default_factory=ParentsFirst)  # parents before children


class NodeEvents:
    """The node's PUB socket and the thread that publishes on it. Thread-safe."""

    def __init__(self, endpoint: str, node: str, tier_kinds: Mapping[str, str],
                 count: Callable[[str, int], None], *, block_size: int | None = None,
                 interval_s: float = 0.05, max_chunks: int = 16384) -> None:
        """`tier_kinds`: the node's tier name -> kind; `count(name, n)`: the node's counters
        (`described_chunks`, `events_stored`, `events_removed`, `stored_unannounced`);
        `block_size`: tokens a router's block (None: a chunk); `max_chunks`: descriptions
        kept per model of chunks no tier holds (planned stores; those held are kept while
        held: `Descriptions`).

        Raises:
            ConfigError: a bad `endpoint`.
            OSError: it cannot be bound (a port in use, a directory missing).
        """
        # An ipc:// file as the node's socket: its group's (a router in it), nobody else's
        # (the events carry the prompts' token ids).
        self._publisher = EventPublisher(endpoint, ipc_mode=0o660)
        self.endpoint = self._publisher.endpoint
        self._node = node
        self._block_size = block_size
        self._places = {name: event_place(name, kind) for name, kind in tier_kinds.items()}
        self._count = count
        self._interval_s = interval_s
        self._max_chunks = max_chunks
        self._lock = threading.Lock()
        self._sources: list[_Source] = []
        self._tokens: dict[str, Descriptions] = {}  # model -> its chunks' tokens
        # model -> the most tokens a chunk of its layouts holds: what a description may carry
        self._chunk_tokens: dict[str, int] = {}
        self._topics: set[str] = set()  # the topics announced
        self._clear: set[str] = set()  # topics whose next batch starts with AllBlocksCleared
        log.info("kvtier node: KV events on %s (topics %s)", endpoint,
                 events_topic(node, "<model>"))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-node-events",
                                        daemon=True)
        self._thread.start()

    def add_layout(self, store: TieredStore, model: str, tokens_per_chunk: int, *,
                   announce: bool, clear: bool, chunk_bytes: int = 0) -> None:
        """Drain `store`'s events from now on; publish them if `announce`. `clear`: a topic
        new to this node starts with AllBlocksCleared (False: its RAM is recovered).
        `chunk_bytes`: a chunk's bytes, to count the chunks its tiers hold (descriptions
        kept while held: a tier without a bound, or 0 here, counts as `max_chunks`)."""
        topic = events_topic(self._node, model)
        block = self._block_size or tokens_per_chunk
        if tokens_per_chunk % block:
            log.warning("kvtier node: event_block_size %d does not divide the %d-token chunks "
                        "of a layout of %s: its chunks are announced a block each", block,
                        tokens_per_chunk, model)
            block = tokens_per_chunk
        room = sum(t.capacity_bytes // chunk_bytes if t.capacity_bytes and chunk_bytes > 0
                   else self._max_chunks for t in store.stats().tiers)  # chunks it holds
        with self._lock:
            self._sources.append(_Source(store, model, topic, tokens_per_chunk, block,
                                         announce))
            tokens = self._tokens.setdefault(model, Descriptions(self._max_chunks))
            if announce:
                tokens.add_room(room)
            self._chunk_tokens[model] = max(self._chunk_tokens.get(model, 0), tokens_per_chunk)
            if announce and topic not in self._topics:
                self._topics.add(topic)
                if clear:
                    self._clear.add(topic)

    def describe(self, model: str, chunks: Iterable[Described]) -> None:
        """Remember the token ids of chunks an engine of `model` plans to store (any
        connection's thread). A description larger than a chunk of the model's holds (token
        ids past its tokens, a salt or LoRA name past `MAX_NAME_CHARS`) is not kept: the
        count of descriptions is bounded, and such ones, from any user of the node's group,
        held a frame's bytes each (16,384 of 64 MiB: the node's memory many times over;
        tests/node/test_node_describe_bounds.py)."""
        described = 0
        with self._lock:
            tokens = self._tokens.get(model)
            if tokens is None:
                return
            most = self._chunk_tokens[model] * TOKEN_BYTES
            for chunk in chunks:
                if len(chunk.token_ids) > most or len(chunk.token_ids) % TOKEN_BYTES \
                        or len(chunk.cache_salt or "") > MAX_NAME_CHARS \
                        or len(chunk.lora_name or "") > MAX_NAME_CHARS:
                    continue
                tokens.remember(ChunkKey(chunk.key), ChunkInfo(
                    None if chunk.parent is None else ChunkKey(chunk.parent), chunk.token_ids,
                    chunk.lora_name, chunk.cache_salt))
                described += 1
        self._count("described_chunks", described)

    def wake(self) -> None:
        """Publish soon (a step's last commit: its chunks are stored)."""
        self._wake.set()

    def close(self) -> None:
        """Publish what is left (the stores are closed first) and close the socket."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        try:
            self.publish_round()
        finally:
            self._publisher.close(linger_ms=500)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.publish_round()
            except Exception:  # a batch lost costs routers a hint, never the node its stores
                log.exception("kvtier node: publishing KV events failed")

    def publish_round(self) -> int:
        """Drain every layout's store events and publish one batch per topic that has some;
        the events published. The events thread only (and `close`, after it ended)."""
        with self._lock:
            sources = list(self._sources)
        batches: dict[str, list[Event]] = {}
        for source in sources:
            events = source.store.take_events()
            if source.announce and (events or source.order.holding):
                batches.setdefault(source.topic, []).extend(self._convert(source, events))
        with self._lock:
            cleared, self._clear = self._clear, set()
        published = 0
        for topic in sorted(cleared | set(batches)):
            batch: list[Event] = [AllBlocksCleared()] if topic in cleared else []
            batch += batches.get(topic, [])
            if not batch:
                continue
            self._publisher.publish(topic, batch)  # this thread only (or close's, after it)
            published += len(batch)
        return published

    def _convert(self, source: _Source, events: list[StoreEvent]) -> list[Event]:
        """The wire events of one layout's store events (as the scheduler's `kv_events`: the
        blocks of `kvtier.tiers.eventblocks`, one a chunk)."""
        tokens = self._tokens[source.model]

        def info_of(key: ChunkKey) -> ChunkInfo | None:
            with self._lock:
                return tokens.get(key)

        gone: list[ChunkKey] = []  # in no tier now: their descriptions kept for the removal
        kept: list[StoreEvent] = []  # less removals of chunks whose tokens the tier holds still
        with self._lock:
            for event in events:
                if event.kind == "removed":
                    if tokens.left(event.key, event.tier):
                        gone.append(event.key)
                    if tokens.copy_held(event.key, event.tier):
                        continue  # a router keys blocks by their tokens: it has them there
                else:
                    tokens.landed(event.key, event.tier)
                kept.append(event)
        events = kept
        size = source.block_size
        ordered = source.order.order(events, info_of, time.monotonic())
        blocks, unknown = router_blocks(ordered, info_of, source.tokens_per_chunk, size)
        with self._lock:
            for key in gone:
                tokens.release(key)
        out: list[Event] = []
        stored = removed = 0
        for b in blocks:
            where = self._places.get(b.tier) or EventPlace(None, None, f"kvtier/{b.tier}")
            if not b.stored:
                out.append(BlockRemoved(list(b.block_hashes), where.medium,
                                        locality=where.locality, ownership=where.ownership))
                removed += len(b.block_hashes)
                continue
            out.append(BlockStored(
                list(b.block_hashes), b.parent, b.token_ids or [], size, None, where.medium,
                b.lora_name, extra_keys=b.extra_keys, locality=where.locality,
                ownership=where.ownership))
            stored += len(b.block_hashes)
        self._count("events_stored", stored)
        self._count("events_removed", removed)
        self._count("stored_unannounced", unknown)
        return out
