"""What a KV event for cache-aware routers says of a chunk and of its tier, without vLLM.

Two publishers turn kvtier's tier events (`kvtier.core.store.StoreEvent`) into vLLM's KV
events: the connector's scheduler, for the tiers in its engine
(`kvtier.integrations.vllm.scheduler.events`), and `kvtier node`, for the node's tiers
(`kvtier.node.events`, which must not import vLLM). Both read here what a stored event needs
beyond the key (the chunk's token ids, parent, LoRA and salt: `ChunkInfo`, remembered for a
while in `ChunkTokens`) and where a tier's chunks are (`event_place`: the `medium` and
`locality` facts of the tier's class, found by its kind in the registry; `ownership`
`kvtier/<tier>`).

Primitives: `ChunkInfo`, `ChunkTokens`, `ChunkLookup`, `EventPlace`, `event_place`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import KeysView
from dataclasses import dataclass
from typing import Protocol

from kvtier.core.keys import ChunkKey
from kvtier.tiers.registry import tier_class


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What a stored event needs beyond the key."""

    parent: ChunkKey | None  # the previous chunk's key (None for a prompt's first chunk)
    token_ids: bytes  # the chunk's token ids as little-endian int32
    lora_name: str | None
    cache_salt: str | None


class ChunkTokens:
    """The token ids of recently planned chunks, bounded (~1 KiB per 256-token chunk). Not
    thread-safe: its owner locks."""

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

    def keys(self) -> KeysView[ChunkKey]:
        return self._chunks.keys()


class ChunkLookup(Protocol):
    """Where a publisher finds a chunk's info: `ChunkTokens`, or the scheduler's
    `LiveChunkInfos` (those of its live requests, then the recent)."""

    def get(self, key: ChunkKey) -> ChunkInfo | None: ...


@dataclass(frozen=True, slots=True)
class EventPlace:
    """Where a tier's chunks are, in the fields of vLLM's BlockStored / BlockRemoved."""

    medium: str | None  # "CPU", "STORAGE"; None: unspecified (an unknown tier)
    locality: str | None  # "LOCAL", "REMOTE"; None: unspecified
    ownership: str  # "kvtier/<tier name>"


def event_place(tier: str, kind: str | None) -> EventPlace:
    """The place of tier `tier`'s events, from the class of its kind (None: unknown tier).

    Raises:
        KeyError: `kind` is no registered kind (configs are validated before).
    """
    if kind is None:
        return EventPlace(None, None, f"kvtier/{tier}")
    cls = tier_class(kind)
    return EventPlace(cls.medium.value, cls.locality.value, f"kvtier/{tier}")
