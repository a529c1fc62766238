"""kvtier's tier events as vLLM KV cache events, for cache-aware routers.

The workers report what their tiers stored and removed (`kvtier.core.store.StoreEvent`); the
scheduler turns them into vLLM's own `BlockStored` / `BlockRemoved` (msgpack, as
`vllm/distributed/kv_events.py` defines), which vLLM's publisher sends over ZMQ when the engine
runs with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`.
One kvtier chunk is one event block (`block_size` = tokens_per_chunk; `block_hashes` = the
16-byte chunk key, `parent_block_hash` = the previous chunk's key), with its token ids so that
a router (llm-d's KV-cache indexer, production-stack's router) can index it. `medium` and
`locality` are the facts of the tier's class (`kvtier.core.tier.Tier`: CPU for host RAM,
STORAGE otherwise; REMOTE for a store every engine shares), found by its kind through the tier
registry (`event_place`); `ownership` names the kvtier tier.

Primitives: `kv_events` (what it reads of a chunk and of a tier, shared with `kvtier node`,
which publishes its tiers' events without vLLM: `kvtier.tiers.eventfacts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvtier.core.store import StoreEvent
from kvtier.tiers.eventfacts import ChunkTokens, EventPlace, event_place


def kv_events(store_events: Iterable[StoreEvent], tokens: ChunkTokens,
              tier_kinds: Mapping[str, str], tokens_per_chunk: int) -> list[KVCacheEvent]:
    """vLLM KV events for the tier events (`tier_kinds`: tier name -> kind); a stored chunk
    whose tokens are unknown (planned too long ago) is skipped: a router cannot index it
    anyway. A tier missing from `tier_kinds` has no medium or locality (vLLM: unspecified)."""
    out: list[KVCacheEvent] = []
    places: dict[str, EventPlace] = {}  # tier name -> where its events say it is
    for event in store_events:
        where = places.get(event.tier)
        if where is None:
            where = places[event.tier] = event_place(event.tier, tier_kinds.get(event.tier))
        if event.kind == "removed":
            out.append(BlockRemoved(block_hashes=[event.key], medium=where.medium,
                                    locality=where.locality, ownership=where.ownership))
            continue
        info = tokens.get(event.key)
        if info is None:
            continue
        extra = tuple(x for x in (info.lora_name, info.cache_salt) if x)
        out.append(BlockStored(
            block_hashes=[event.key], parent_block_hash=info.parent,
            token_ids=np.frombuffer(info.token_ids, dtype="<i4").tolist(),
            block_size=tokens_per_chunk, lora_id=None, lora_name=info.lora_name,
            extra_keys=[extra] if extra else None, medium=where.medium,
            locality=where.locality, ownership=where.ownership))
    return out

