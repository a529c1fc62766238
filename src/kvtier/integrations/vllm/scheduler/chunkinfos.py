"""The token ids of chunks that router events will need, held while their requests live.

A stored event must carry its chunk's token ids (`ChunkInfo`), known on the scheduler side
only when the chunk's key is made: at a lookup, often long before the chunk is computed and
stored. A bound on recent chunks alone (`ChunkTokens`, 16,384) lost them under load: 80
waiting 64k-token prompts looked up made 20,400 chunks, and the first request, scheduled
after, kept none of its 255, so its stores published no stored events (a router never
learned that they were cached). So each live request holds its chunks' infos (memory in
proportion to the live requests' tokens, ~5 bytes a token, its ids and their record), and
an ended request's go to the bounded recent ones: for its stores still in flight.

Nothing is kept for the chunks the tiers hold (a disk may hold millions): a chunk read back
into RAM from a tier below long after its store (a promotion, with its own stored event) is
read for a request whose lookup made its key from its own tokens, full chunk or hit tail, so
that request holds its info again (tests/connector/test_events_of_promoted_chunks.py). A
removal needs none (its blocks: a chunk's, or a tail's known tokens' blocks).

Scheduler side, one thread. Primitives: `LiveChunkInfos`.
"""

from __future__ import annotations

from kvtier.core.keys import ChunkKey
from kvtier.tiers.eventfacts import ChunkInfo, ChunkTokens

RECENT_CHUNKS = 16384  # the chunks of ended requests kept (~1.25 KiB per 256-token chunk)


class LiveChunkInfos:
    """Chunk infos by key: those of live requests all, those of ended ones the most recent."""

    def __init__(self, recent_chunks: int = RECENT_CHUNKS) -> None:
        self._live: dict[ChunkKey, ChunkInfo] = {}
        self._holders: dict[ChunkKey, int] = {}  # key -> live requests holding it
        self._held: dict[str, dict[ChunkKey, None]] = {}  # request id -> its keys, in order
        self._recent = ChunkTokens(recent_chunks)

    def __len__(self) -> int:
        """The chunks live requests hold."""
        return len(self._live)

    def remember(self, request_id: str, key: ChunkKey, info: ChunkInfo) -> None:
        """Hold `key`'s info until request `request_id` ends (`forget`)."""
        held = self._held.setdefault(request_id, {})
        if key not in held:
            held[key] = None
            self._holders[key] = self._holders.get(key, 0) + 1
        self._live[key] = info

    def forget(self, request_id: str) -> None:
        """Request `request_id` ended: the chunks no other live request holds go to the
        recent ones (the oldest of those dropped past their bound)."""
        for key in self._held.pop(request_id, {}):
            holders = self._holders[key] - 1
            if holders:
                self._holders[key] = holders
                continue
            del self._holders[key]
            self._recent.remember(key, self._live.pop(key))

    def keys(self) -> frozenset[ChunkKey]:
        """The chunks whose infos are held: the live requests', and the recent ones."""
        return frozenset(self._live.keys() | self._recent.keys())

    def get(self, key: ChunkKey) -> ChunkInfo | None:
        """`key`'s info, if a live request holds it or it is among the recent ones."""
        info = self._live.get(key)
        return info if info is not None else self._recent.get(key)
