"""Where the redis tier keeps a chunk: the name of its hash and the fields in it.

A chunk is ONE Redis hash, whose fields are its header and its payload parts:
    <prefix><layout digest>:{<key hex>}:c   the chunk's hash (":c": this layout of values)
        field "h"                            kvtier's chunk header (core/chunkformat), verbatim
        fields "0".."N-1"                    the payload, cut into `part_bytes` slices
One header for the whole chunk (payload size and xxh3 checksum of the whole payload), in a field
of its own so the payload goes to the socket straight from the caller's buffer (no copy to glue a
header on). The payload is not padded: the 4 KiB alignment of the format is for O_DIRECT files.
An encoded chunk (`codec`, encryption: tiers/encoding.py) has a version 2 header and as many
parts as its body needs (a compressed chunk: fewer bytes and parts).

Why one hash, not a value per part (older kvtier versions: names ending ":h", ":0"...):
the server's `maxmemory` eviction (allkeys-lru/-lfu, volatile-* with `ttl_s`) and its TTLs take
keys, so a chunk now lives or dies whole; with values per part the server evicted a chunk's
later parts alone, and lookups called "held" chunks that could not be read (a drill: 7 of 16).
A chunk is held when its hash has its header field (one HEXISTS), and held means loadable: a
hash without one (a field deleted behind the tier's back: no writer of today leaves one) or a
value of another type at the name is not held, and the next put replaces it. Cheaper fixes were
not correct: counting every part in the lookup does not know how many a compressed chunk has,
and still leaves the parts' memory to the LRU one by one. Values of the older form are never
read (a miss) and are listed as orphans, deleted by `kvtier gc --orphans` (or the server's
eviction, as nothing touches them). The `{key hex}` hash tag keeps a chunk's hash, and the
older values, in the slot of its key in a Redis Cluster, while distinct chunks spread over every
node.

Primitives: `ChunkNames`, `CHUNK_SUFFIX`, `HEADER_FIELD`, `part_field`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.keys import ChunkKey

CHUNK_SUFFIX = "c"  # a chunk's hash: <prefix><digest>:{<key hex>}:c
HEADER_FIELD = "h"  # the hash field of kvtier's chunk header; parts are "0".."N-1"


def part_field(index: int) -> str:
    """The hash field of payload part `index`."""
    return str(index)


@dataclass(frozen=True, slots=True)
class ChunkNames:
    """Where a namespace's chunks live: a hash each (see the module docstring)."""

    prefix: str  # config.key_prefix
    digest: str  # the layout digest
    parts: int  # payload parts per chunk (at this tier's part_bytes, uncompressed)

    def chunk(self, key: ChunkKey) -> str:
        """The name of `key`'s hash."""
        return f"{self.prefix}{self.digest}:{{{key.hex()}}}:{CHUNK_SUFFIX}"

    def fields(self, parts: int | None = None) -> list[str]:
        """Header first, then the payload parts in order (`parts` of them; default all a
        chunk of the layout can have)."""
        count = self.parts if parts is None else parts
        return [HEADER_FIELD, *(part_field(i) for i in range(count))]

    @property
    def index(self) -> str:
        return f"{self.prefix}{{{self.digest}}}:lru"
