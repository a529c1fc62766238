"""How the redis tier reads a chunk: one HMGET, verified before a byte is used.

A read is one HMGET of the header and parts (tiers/redis/names.py), verified (header, layout,
key, sizes, checksum) before a byte is used, never unpickled. A chunk another engine cut with
another `part_bytes` is read by its first part's size, its parts past this tier's fields and
its header again in one more round trip, a miss if the header changed meanwhile: engines may
differ, as in a rolling change. A chunk stored as is comes off the socket straight into the
reader's buffer (tiers/redis/replies.py: one copy, by the kernel, where redis-py makes five);
an encoded one (`codec`, encryption: tiers/encoding.py) is fetched with every part field a
chunk of this layout can have, and decoded into the caller's buffer.
Each value's length is judged before it is read: one longer than the chunk can hold is refused
unread (the connection dropped). A missing part (a hash another writer left short), a value of
the wrong size or kind (a foreign key at the chunk's name) or a checksum mismatch is found
here; the tier counts it a miss and deletes the chunk's hash.

The reader holds no connection: every round trip goes through the tier's circuit breaker, a
`Run` the tier hands to each read.

Primitives: `ChunkReader`, `Run`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import AskError

from kvtier.core.chunkformat import HEADER_BYTES, ChunkEncoder, read_header
from kvtier.core.keys import ChunkKey
from kvtier.errors import CorruptChunk, KeyNotHeld
from kvtier.tiers.redis.client import Client
from kvtier.tiers.redis.config import MIN_PART_BYTES
from kvtier.tiers.redis.names import HEADER_FIELD, ChunkNames
from kvtier.tiers.redis.replies import Place, read_into

# `call(client)` on the server holding the chunk, through its circuit breaker (the tier's
# `_run`): raises TierUnavailable, redis.RedisError, or the call's CorruptChunk.
Run = Callable[[Callable[[Client], list[Any]]], list[Any]]


class ChunkReader:
    """Reads and verifies chunks of one namespace (a layout, at one tier's settings).
    Stateless between reads: any thread may call it."""

    def __init__(self, names: ChunkNames, encoder: ChunkEncoder, chunk_bytes: int,
                 part_bytes: int, ttl_ms: int | None) -> None:
        self.names = names
        self.encoder = encoder
        self.chunk_bytes = chunk_bytes  # a chunk's payload, as the caller's buffer holds it
        self.part_bytes = part_bytes  # this tier's `part_bytes` (a writer's may differ)
        self.ttl_ms = ttl_ms  # refreshed by each read; None = none

    def read_values(self, run: Run, name: str, key: ChunkKey,
                    out: memoryview) -> list[Any] | None:
        """The chunk's header and parts (None each that is missing), read by one HMGET; for
        a chunk its writer cut finer than this tier's fields (another engine's part_bytes),
        its other parts by a second one, which asks for the header again: None when the
        header changed between the two (the chunk deleted or written again meanwhile: parts
        of two writes are neither joined nor judged corrupt, and the new chunk stays).

        Raises:
            as `run` and `fetch`.
        """
        values = run(lambda c: self.fetch(c, name, key, out))
        more = self._more_fields(key, values)
        if not more:
            return values
        again = run(lambda c: self._fetch(c, name, [HEADER_FIELD, *more],
                                          self._bounded(_as_bytes)))
        return values + again[1:] if again[0] == values[0] else None

    def fetch(self, client: Client, name: str, key: ChunkKey, out: memoryview) -> list[Any]:
        """One HMGET on `client` of `key`'s chunk, the hash `name`: its header and the parts
        this tier's fields name (None each that is missing), with no circuit breaker and no
        second round trip (`read_values` does both, and `verify_into` judges the values).
        The parts of a chunk stored as is come back as views of `out`, read into it off the
        socket; any other value as bytes. Any thread.

        Raises:
            as `_fetch`.
        """
        return self._fetch(client, name, self.names.fields(), self._placer(key, out))

    def _fetch(self, client: Client, name: str, fields: list[str], place: Place) -> list[Any]:
        """`fields` of the chunk's hash `name` (None: missing); parts `place` puts in the
        caller's buffer come back as views of it (tiers/redis/replies.py).

        Raises:
            CorruptChunk: a value longer than any of the chunk's (`_bounded`), left unread.
            redis.RedisError: as the client raises it (WRONGTYPE: `name` is not a hash).
        """
        values = None
        if not isinstance(client, RedisCluster):
            values = read_into(client, name, fields, place, self.ttl_ms)
        elif (node := client.get_node_from_key(name)) is not None:
            # The slot moved (AskError, or MovedError, one of them): redis-py follows, below,
            # and refreshes its slot map.
            with contextlib.suppress(AskError):
                values = read_into(client.get_redis_connection(node), name, fields, place,
                                   self.ttl_ms)
        if values is not None:
            return values
        # redis-py's own parser (hiredis, a slot that moved): no bound on a value's length.
        pipe = client.pipeline(transaction=False)
        pipe.hmget(name, fields)
        if self.ttl_ms:
            pipe.pexpire(name, self.ttl_ms)
        return pipe.execute()[0]  # type: ignore[no-any-return]

    def _bounded(self, place: Place) -> Place:
        """`place`, refusing unread a value longer than any of a chunk of this layout (the
        header's size, a body's largest): a foreign or corrupt value of any size is a
        counted miss at the cost of a socket buffer, not of its size in memory."""
        def bounded(index: int, length: int, earlier: list[Any]) -> memoryview | None:
            limit = HEADER_BYTES if index == 0 else self.encoder.max_body_bytes
            if length > limit:
                raise CorruptChunk(f"a value of {length} bytes where at most {limit} fit; "
                                   "not read")
            return place(index, length, earlier)

        return bounded

    def _placer(self, key: ChunkKey, out: memoryview) -> Place:
        """Where a read's values go (bounded: `_bounded`): a part of a chunk stored as is
        straight into its place in `out` (the header read first says so: valid, plain, the
        payload `out`'s size); anything else (the header, an encoded chunk's parts, a header
        in doubt) as bytes, for `verify_into` to judge."""
        plain: list[bool] = []  # the header's verdict, once
        cut: list[int] = []  # the writer's part size: its first part's (`_writer_part_bytes`)

        def place(index: int, length: int, earlier: list[Any]) -> memoryview | None:
            if index == 0:
                return None
            if not plain:
                plain.append(self._plain(key, earlier[0], len(out)))
            if index == 1 and length > 0:
                cut.append(length)
            part = cut[0] if cut else self.part_bytes
            offset = (index - 1) * part
            if not plain[0] or offset >= len(out) or length != min(part, len(out) - offset):
                return None
            return out[offset : offset + length]

        return self._bounded(place)

    def _plain(self, key: ChunkKey, header: bytes | None, payload_bytes: int) -> bool:
        """Whether `header` is a valid header of `key`'s chunk stored as is, of that size."""
        if header is None or len(header) != HEADER_BYTES:
            return False
        try:
            chunk = read_header(header, key, self.names.digest)
        except (CorruptChunk, KeyNotHeld):  # judged by verify_into (counted by the tier)
            return False
        return chunk.plain and chunk.body_bytes == chunk.payload_bytes == payload_bytes

    def _writer_part_bytes(self, parts: list[Any], body_bytes: int) -> int:
        """The part size a body of `body_bytes` was cut with: its first part's size when
        every part of `parts` that size implies has the size it implies (an engine with
        another `part_bytes` wrote it: a rolling change of the setting), else this tier's
        own (whose checks then find the chunk lost or corrupt). Parts the size implies
        beyond `parts` are not judged: `_more_fields` fetches them."""
        first = parts[0] if parts else None
        # No writer cuts finer than MIN_PART_BYTES: a shorter first part is damage (whose
        # size would otherwise ask for up to a name per byte of the body).
        if (first is None or not MIN_PART_BYTES <= len(first) <= body_bytes
                or len(first) == self.part_bytes):
            return self.part_bytes
        size = len(first)
        for i, part in enumerate(parts[: -(-body_bytes // size)]):
            if part is None or len(part) != min(size, body_bytes - i * size):
                return self.part_bytes
        return size

    def _more_fields(self, key: ChunkKey, values: list[Any]) -> list[str]:
        """The fields of a chunk's parts beyond those read (`values`: header and parts),
        when its writer cut it finer than this tier's `part_bytes` gives fields for; [] for
        any other chunk (its header unreadable included: `verify_into` judges)."""
        header = values[0]
        if header is None or len(header) != HEADER_BYTES:
            return []
        try:
            body_bytes = read_header(header, key, self.names.digest).body_bytes
        except CorruptChunk:  # KeyNotHeld too
            return []
        if body_bytes > self.encoder.max_body_bytes:  # a forged header's: judged corrupt
            return []  # unasked, not a field per byte of what it claims
        needed = -(-body_bytes // self._writer_part_bytes(values[1:], body_bytes))
        return self.names.fields(needed)[len(values):]

    def verify_into(self, key: ChunkKey, values: list[Any], out: memoryview,
                     tenant: str | None) -> bool:
        """Check the header and every part's size, decode the parts of a chunk of `tenant`
        into `out` (verifying checksums). False when a part the header needs is gone
        (evicted by the server).

        Raises:
            CorruptChunk (AuthFailure, CodecFailure): see ChunkEncoder.decode.
        """
        header = values[0]
        assert header is not None
        if len(header) != HEADER_BYTES:
            raise CorruptChunk(f"header value is {len(header)} bytes, expected {HEADER_BYTES}")
        chunk = read_header(header, key, self.names.digest)
        if chunk.payload_bytes != self.chunk_bytes:
            raise CorruptChunk(f"payload is {chunk.payload_bytes} bytes, expected "
                               f"{self.chunk_bytes}")
        if chunk.body_bytes > self.encoder.max_body_bytes:
            raise CorruptChunk(f"body of {chunk.body_bytes} bytes: more than a chunk of this "
                               f"layout's {self.encoder.max_body_bytes}")
        part_bytes = self._writer_part_bytes(values[1:], chunk.body_bytes)
        needed = max(1, -(-chunk.body_bytes // part_bytes))
        if needed > len(values) - 1:
            raise CorruptChunk(f"body of {chunk.body_bytes} bytes: more than this layout's "
                               f"{len(values) - 1} parts")
        parts = values[1 : 1 + needed]
        if None in parts:
            return False
        # A chunk stored as is is cut straight into `out`; an encoded one is joined first.
        body = out if chunk.plain and chunk.body_bytes == len(out) \
            else memoryview(bytearray(chunk.body_bytes))
        offset = 0
        for i, part in enumerate(parts):
            assert part is not None
            expected = min(part_bytes, chunk.body_bytes - offset)
            if len(part) != expected:
                raise CorruptChunk(f"part {i} is {len(part)} bytes, expected {expected}")
            if not (body is out and isinstance(part, memoryview)):  # placed already (_placer)
                body[offset : offset + expected] = part
            offset += expected
        self.encoder.decode(key, chunk, body, out, tenant)
        return True


def _as_bytes(index: int, length: int, earlier: list[Any]) -> memoryview | None:
    """A `Place` that places nothing: every value comes back as bytes."""
    return None
