"""How the redis tier writes a chunk: all of it or nothing (see tiers/redis/names.py for the
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

In a Redis Cluster whose chunk's slot is migrating to another node (resharding), the slot's
node answers a chunk it does not hold (a new one) with an ASK redirection, and the
transaction with EXECABORT; redis-py does not follow it for a transaction. The transaction
is then sent to the node ASK names, after ASKING (which holds through MULTI..EXEC): the
chunk lands there, where the slot is going, instead of every new chunk of a migrating slot
being dropped for as long as the resharding lasts.

Primitives: `write_chunk`.
"""

from __future__ import annotations

from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import AskError

from kvtier.tiers.redis.names import HEADER_FIELD, part_field


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
    commands: list[tuple[Any, ...]] = [("DEL", name)]
    commands += [("HSET", name, part_field(i), payload[i * part_bytes : (i + 1) * part_bytes])
                 for i in range(parts)]
    commands.append(("HSET", name, HEADER_FIELD, header))
    if ttl_ms:
        commands.append(("PEXPIRE", name, ttl_ms))
    pipe = client.pipeline(transaction=True)
    for command in commands:
        pipe.execute_command(*command)
    try:
        pipe.execute()
    except AskError as exc:  # the slot is migrating: its new node takes the chunk
        node = (client.get_node(host=exc.host, port=exc.port)  # type: ignore[no-untyped-call]
                if isinstance(client, RedisCluster) else None)
        if node is None or node.redis_connection is None:
            raise
        _write_asking(node.redis_connection, commands)


def _write_asking(node: Any, commands: list[tuple[Any, ...]]) -> None:
    """ASKING, then `commands` in MULTI/EXEC, on one Cluster node (a redis.Redis), in one
    round trip. Raises as `write_chunk`."""
    pipe = node.pipeline(transaction=False)
    pipe.execute_command("ASKING")
    pipe.execute_command("MULTI")
    for command in commands:
        pipe.execute_command(*command)
    pipe.execute_command("EXEC")
    pipe.execute()
