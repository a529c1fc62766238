"""The KV events the scheduler side hands vLLM for cache-aware routers (events.py: their form).

Scheduler side, one thread. Enabled when vLLM runs with KV cache events on: the token ids of
each chunk are remembered when its key is made (a stored event must carry them), and the
workers' per-tier store events become vLLM events, queued until vLLM takes them.

Primitives: `RouterEvents`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent
from kvtier.integrations.vllm.scheduler.events import ChunkInfo, ChunkTokens, kv_events

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request


class RouterEvents:
    """Chunk token ids and queued KV events (scheduler thread)."""

    def __init__(self, enabled: bool, tier_kinds: Mapping[str, str],
                 tokens_per_chunk: int) -> None:
        """`enabled`: vLLM publishes KV events (--kv-events-config); `tier_kinds`: tier
        name -> kind, for each event's medium and locality."""
        self.enabled = enabled
        self._tier_kinds = tier_kinds
        self._tokens_per_chunk = tokens_per_chunk
        self._chunk_tokens = ChunkTokens()
        self._queued: list[KVCacheEvent] = []

    def remember(self, request: Request, keys: list[ChunkKey], tokens: Sequence[int],
                 parent: ChunkKey | None) -> None:
        """Keep the token ids of new chunks (`keys`, after `parent`) of `request` for the
        events of their later stores."""
        tpc = self._tokens_per_chunk
        ids = np.asarray(tokens, dtype="<i4")
        lora = request.lora_request.lora_name if request.lora_request else None
        for i, key in enumerate(keys):
            self._chunk_tokens.remember(key, ChunkInfo(
                parent=parent, token_ids=ids[i * tpc:(i + 1) * tpc].tobytes(), lora_name=lora,
                cache_salt=request.cache_salt))
            parent = key

    def learn(self, store_events: Iterable[StoreEvent]) -> None:
        """Queue the events of what the workers' tiers stored and removed."""
        if self.enabled:
            self._queued.extend(kv_events(store_events, self._chunk_tokens, self._tier_kinds,
                                          self._tokens_per_chunk))

    def take(self) -> list[KVCacheEvent]:
        """The events queued since the last call (vLLM's connector take_events)."""
        events, self._queued = self._queued, []
        return events
