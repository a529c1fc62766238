"""kvtier's tier events as vLLM KV cache events, for cache-aware routers.

The workers report what their tiers stored and removed (`kvtier.core.store.StoreEvent`); the
scheduler turns them into vLLM's own `BlockStored` / `BlockRemoved` (msgpack, as
`vllm/distributed/kv_events.py` defines), which vLLM's publisher sends over ZMQ when the engine
runs with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`.
A chunk is one event block (`block_size` = tokens_per_chunk; `block_hashes` = the 16-byte
chunk key, `parent_block_hash` = the previous chunk's key), or `event_block_size` blocks of
a router's size (Dynamo's), with its token ids and vLLM's per-block `extra_keys` so that a
router (llm-d's KV-cache indexer, Dynamo's KV router) can index it
(`kvtier.tiers.eventblocks`). `medium` and `locality` are the facts of the tier's class
(`kvtier.core.tier.Tier`: CPU for host RAM, STORAGE otherwise; REMOTE for a store every engine
shares), found by its kind through the tier registry (`event_place`); `ownership` names the
kvtier tier.

Primitives: `kv_events` (what it reads of a chunk and of a tier, shared with `kvtier node`,
which publishes its tiers' events without vLLM: `kvtier.tiers.eventfacts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvtier.core.store import StoreEvent
from kvtier.tiers.eventblocks import router_blocks
from kvtier.tiers.eventfacts import ChunkLookup, EventPlace, event_place


def kv_events(store_events: Iterable[StoreEvent], tokens: ChunkLookup,
              tier_kinds: Mapping[str, str], tokens_per_chunk: int,
              block_size: int | None = None) -> list[KVCacheEvent]:
    """vLLM KV events for the tier events (`tier_kinds`: tier name -> kind), each chunk as
    blocks of `block_size` tokens (None: one block a chunk), consecutive chunks of a prompt in
    one event, parents first (`kvtier.tiers.eventblocks`); a stored chunk whose tokens are
    unknown (planned too long ago) is skipped: a router cannot index it anyway. A tier missing
    from `tier_kinds` has no medium or locality (vLLM: unspecified)."""
    size = block_size or tokens_per_chunk
    blocks, _unknown = router_blocks(store_events, tokens.get, tokens_per_chunk, size)
    out: list[KVCacheEvent] = []
    places: dict[str, EventPlace] = {}  # tier name -> where its events say it is
    for b in blocks:
        where = places.get(b.tier)
        if where is None:
            where = places[b.tier] = event_place(b.tier, tier_kinds.get(b.tier))
        if not b.stored:
            out.append(BlockRemoved(block_hashes=list(b.block_hashes), medium=where.medium,
                                    locality=where.locality, ownership=where.ownership))
            continue
        out.append(BlockStored(
            block_hashes=list(b.block_hashes), parent_block_hash=b.parent,
            token_ids=b.token_ids or [], block_size=size, lora_id=None, lora_name=b.lora_name,
            extra_keys=b.extra_keys, medium=where.medium, locality=where.locality,
            ownership=where.ownership))
    return out
