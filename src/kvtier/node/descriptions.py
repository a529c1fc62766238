"""The token ids of one model's chunks, kept for the node's stored events (`NodeEvents`).

A stored event needs its chunk's token ids, which only the engine that plans to store it
sends (`Describe`). A chunk's events come long after its description: a write-behind to disk
queued behind others, a move back into RAM from disk an hour later. The node kept the last
16,384 descriptions of every engine of a model together: busy engines pushed a chunk's out
while its tiers still held it, and its later stores went out unannounced
(tests/node/test_node_descriptions_held.py). So a description is kept as long as some tier
of the node holds its chunk (its store events say which: `landed`, `left`), within the
node's capacity in chunks for the model (`add_room`: a tier whose removals the node does not
see, a Redis expiring keys, cannot grow it past that); a description of a chunk no tier holds
(planned, not yet stored; or gone from every tier) is among the last `max_recent` described.
Memory: a chunk's token ids are 4 B a token, against its KV's KiBs a token in the tiers.

A router keys a block by its tokens (llm-d), not by kvtier's key: two chunks of the same
tokens under two keys (a prompt an engine stored again after its cache reset, under its new
epoch; the same prompt from engines of two layouts of the model) are one entry of the node's
in a tier, and the removal of either took the other off too. So a held chunk has an identity
(its tokens, LoRA and salt, chained from its parent's identity), and the copies of each
identity a tier holds are counted: a removal while another copy stays (`copy_held`) is not
news to a router.

Primitives: `Descriptions`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from kvtier.core.keys import ChunkKey
from kvtier.tiers.eventfacts import ChunkInfo


class Descriptions:
    """Descriptions of one model's chunks: those its node's tiers hold, and the recent others.
    Not thread-safe: its owner (`NodeEvents`) locks."""

    def __init__(self, max_recent: int) -> None:
        """`max_recent`: descriptions kept of chunks no tier holds (planned stores)."""
        self._recent: OrderedDict[ChunkKey, ChunkInfo] = OrderedDict()
        self._max_recent = max_recent
        # key -> (its description, the tiers holding it: a bit each), least recent first
        self._held: OrderedDict[ChunkKey, tuple[ChunkInfo, int]] = OrderedDict()
        self._max_held = 0  # the node's capacity in chunks of the model (`add_room`)
        self._bits: dict[str, int] = {}  # tier name -> its bit
        self._identity: dict[ChunkKey, bytes] = {}  # held key -> what a router keys it by
        self._copies: dict[tuple[int, bytes], int] = {}  # (tier bit, identity) -> keys held

    def add_room(self, chunks: int) -> None:
        """A layout of the model holds up to `chunks` chunks in the node's tiers more."""
        self._max_held += max(0, chunks)

    def remember(self, key: ChunkKey, info: ChunkInfo) -> None:
        """An engine described chunk `key` (it plans to store it)."""
        if key in self._held:
            self._held[key] = (info, self._held[key][1])
            return
        self._remember_recent(key, info)

    def get(self, key: ChunkKey) -> ChunkInfo | None:
        held = self._held.get(key)
        return held[0] if held is not None else self._recent.get(key)

    def landed(self, key: ChunkKey, tier: str) -> None:
        """Chunk `key` was stored in `tier`: its description is kept while a tier holds it
        (a chunk never described has none to keep)."""
        bit = self._bits.setdefault(tier, 1 << len(self._bits))
        held = self._held.get(key)
        if held is not None:
            if not held[1] & bit:
                self._count(key, bit, 1)
            self._held[key] = (held[0], held[1] | bit)
            self._held.move_to_end(key)
            return
        info = self._recent.pop(key, None)
        if info is None:
            return
        self._held[key] = (info, bit)
        self._identity[key] = self._identify(info)
        self._count(key, bit, 1)
        while len(self._held) > self._max_held:
            old, (old_info, tiers) = self._held.popitem(last=False)
            for tier_bit in self._bits.values():  # no longer counted: its removal goes out
                if tiers & tier_bit:
                    self._count(old, tier_bit, -1)
            del self._identity[old]
            self._remember_recent(old, old_info)

    def left(self, key: ChunkKey, tier: str) -> bool:
        """Chunk `key` left `tier`; True: no tier holds it now (`release` it once its removal
        is published: the removal's blocks are counted from its tokens)."""
        held = self._held.get(key)
        if held is None:
            return False
        bit = self._bits.get(tier, 0)
        if held[1] & bit:
            self._count(key, bit, -1)
        tiers = held[1] & ~bit
        self._held[key] = (held[0], tiers)
        return tiers == 0

    def copy_held(self, key: ChunkKey, tier: str) -> bool:
        """Whether `tier` holds another chunk of the same tokens as `key` (which `left` it):
        a router, which keys blocks by their tokens, still has it there."""
        identity = self._identity.get(key)
        bit = self._bits.get(tier, 0)
        return identity is not None and self._copies.get((bit, identity), 0) > 0

    def release(self, key: ChunkKey) -> None:
        """Chunk `key` is in no tier (`left`): its description joins the recent ones, unless
        it landed in a tier again meanwhile."""
        held = self._held.get(key)
        if held is not None and held[1] == 0:
            del self._held[key]
            del self._identity[key]
            self._remember_recent(key, held[0])

    def _identify(self, info: ChunkInfo) -> bytes:
        """What a router keys the chunk by: its tokens, LoRA and salt after its parent's
        identity (the parent's key where the parent is not held: then no other copy shares
        it)."""
        parent = b"" if info.parent is None else self._identity.get(info.parent, info.parent)
        digest = hashlib.blake2b(parent, digest_size=16)
        for part in (info.lora_name or "", info.cache_salt or ""):
            data = part.encode()
            digest.update(len(data).to_bytes(4, "little") + data)
        digest.update(info.token_ids)
        return digest.digest()

    def _count(self, key: ChunkKey, bit: int, delta: int) -> None:
        """A held chunk's copy came into (1) or left (-1) the tier of `bit`."""
        slot = (bit, self._identity[key])
        copies = self._copies.get(slot, 0) + delta
        if copies > 0:
            self._copies[slot] = copies
        else:
            self._copies.pop(slot, None)

    def _remember_recent(self, key: ChunkKey, info: ChunkInfo) -> None:
        self._recent[key] = info
        self._recent.move_to_end(key)
        while len(self._recent) > self._max_recent:
            self._recent.popitem(last=False)
