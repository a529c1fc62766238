"""How the redis tier writes a chunk: all of it or nothing (see tiers/redis/tier.py for the
chunk's hash and its fields).

A chunk is one Redis hash, written by one MULTI/EXEC transaction in one round trip:
    MULTI; DEL <name>; HSET <name> 0 <part 0>; ... HSET <name> h <header>; [PEXPIRE]; EXEC
One HSET a field, so no single command carries the whole chunk (each stays under the server's
`proto-max-bulk-len`, as `part_bytes` does). The server runs the queued commands only at EXEC,
all together: a reader never sees a hash without its header or with a part missing, and a
write that fails changes nothing:
  - a full server (`maxmemory` with `noeviction`) refuses a queued HSET ("OOM command not
    allowed") and then the whole EXEC (EXECABORT);
  - a connection that drops before EXEC leaves the queued commands unrun (the server
    discards a client's MULTI state when it goes).
So nothing is ever left half-written (an older kvtier's separate values, which could be:
`RedisInventory.orphans`, swept by `kvtier gc --orphans`). The DEL makes the hash exactly the
fields written: a copy of the same chunk committed meanwhile by another writer (cut with
another `part_bytes`) is replaced whole, never mixed with this one.

Primitives: `HEADER_FIELD`, `part_field`, `write_chunk`.
"""

from __future__ import annotations

from typing import Any

HEADER_FIELD = "h"  # the hash field of kvtier's chunk header; parts are "0".."N-1"


def part_field(index: int) -> str:
    """The hash field of payload part `index`."""
    return str(index)


def write_chunk(client: Any, name: str, parts: int, header: bytes, payload: memoryview,
                part_bytes: int, ttl_ms: int | None) -> None:
    """Write a chunk's hash (its `parts` payload parts, then its header) atomically, in one
    round trip.

    Args:
        client: a redis.Redis or RedisCluster (one key: one Cluster slot).
        name: the chunk's hash (ChunkNames.chunk).
        header, payload: the header value and the payload (format "B"), cut in `part_bytes`.
        ttl_ms: the chunk's TTL; None = none.

    Raises:
        redis.ResponseError: the server refused a command (e.g. OutOfMemoryError, "OOM
            command not allowed"): nothing was written.
        redis.ConnectionError, redis.TimeoutError: as the client raises them (nothing was
            written unless the EXEC reached the server).
    """
    pipe = client.pipeline(transaction=True)
    pipe.delete(name)
    for i in range(parts):
        pipe.hset(name, part_field(i), payload[i * part_bytes : (i + 1) * part_bytes])
    pipe.hset(name, HEADER_FIELD, header)
    if ttl_ms:
        pipe.pexpire(name, ttl_ms)
    pipe.execute()
