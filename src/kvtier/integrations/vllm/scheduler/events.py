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
registry; `ownership` names the kvtier tier.

Primitives: `ChunkTokens` (what the scheduler remembers of recent chunks), `kv_events`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent
from kvtier.tiers.registry import tier_class


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What a stored event needs beyond the key."""

    parent: ChunkKey | None  # the previous chunk's key (None for a prompt's first chunk)
    token_ids: bytes  # the chunk's token ids as little-endian int32
    lora_name: str | None
    cache_salt: str | None


class ChunkTokens:
    """The token ids of recently planned chunks, bounded (~1 KiB per 256-token chunk)."""

    def __init__(self, max_chunks: int = 16384) -> None:
        self._chunks: OrderedDict[ChunkKey, ChunkInfo] = OrderedDict()
        self._max = max_chunks

    def remember(self, key: ChunkKey, info: ChunkInfo) -> None:
        self._chunks[key] = info
        self._chunks.move_to_end(key)
        while len(self._chunks) > self._max:
            self._chunks.popitem(last=False)

    def get(self, key: ChunkKey) -> ChunkInfo | None:
        return self._chunks.get(key)


def kv_events(store_events: Iterable[StoreEvent], tokens: ChunkTokens,
              tier_kinds: Mapping[str, str], tokens_per_chunk: int) -> list[KVCacheEvent]:
    """vLLM KV events for the tier events (`tier_kinds`: tier name -> kind); a stored chunk
    whose tokens are unknown (planned too long ago) is skipped: a router cannot index it
    anyway. A tier missing from `tier_kinds` has no medium or locality (vLLM: unspecified)."""
    out: list[KVCacheEvent] = []
    places: dict[str, dict[str, Any]] = {}  # tier name -> the event fields that place it
    for event in store_events:
        where = places.get(event.tier)
        if where is None:
            where = places[event.tier] = _place(event.tier, tier_kinds.get(event.tier))
        if event.kind == "removed":
            out.append(BlockRemoved(block_hashes=[event.key], **where))
            continue
        info = tokens.get(event.key)
        if info is None:
            continue
        extra = tuple(x for x in (info.lora_name, info.cache_salt) if x)
        out.append(BlockStored(
            block_hashes=[event.key], parent_block_hash=info.parent,
            token_ids=np.frombuffer(info.token_ids, dtype="<i4").tolist(),
            block_size=tokens_per_chunk, lora_id=None, lora_name=info.lora_name,
            extra_keys=[extra] if extra else None, **where))
    return out


def _place(tier: str, kind: str | None) -> dict[str, Any]:
    """The medium, locality and ownership of tier `tier`'s events, from its kind's class."""
    if kind is None:
        return {"medium": None, "locality": None, "ownership": f"kvtier/{tier}"}
    cls = tier_class(kind)
    return {"medium": cls.medium.value, "locality": cls.locality.value,
            "ownership": f"kvtier/{tier}"}
