"""The redis tier: chunks in a Redis or Valkey server, or a Redis Cluster, shared by every
engine that points at it.

Stored values. A chunk is ONE Redis hash, whose fields are its header and its payload parts:
    <prefix><layout digest>:{<key hex>}:c   the chunk's hash (":c": this layout of values)
        field "h"                            kvtier's chunk header (core/chunkformat), verbatim
        fields "0".."N-1"                    the payload, cut into `part_bytes` slices
One header for the whole chunk (payload size and xxh3 checksum of the whole payload), in a field
of its own so the payload goes to the socket straight from the caller's buffer (no copy to glue a
header on). The payload is not padded: the 4 KiB alignment of the format is for O_DIRECT files.
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
node. A put is one MULTI/EXEC transaction, an HSET per field so no command carries the whole
chunk, in one round trip: all of it or nothing, even on a full server (tiers/redis/write.py). A read
is one HMGET of the header and parts, verified (header, layout, key, sizes, checksum) before a
byte is used, never unpickled (a chunk another engine cut with another `part_bytes` is read by
its first part's size, its parts past this tier's fields and its header again in one more
round trip, a miss if the header changed meanwhile: engines may differ, as in a rolling
change); a chunk stored as is comes off the socket straight into the
reader's buffer (tiers/redis/replies.py: one copy, by the kernel, where redis-py makes five).
Each value's length is judged before it is read: one longer than the chunk can hold is refused
unread (the connection dropped). A missing part (a hash another writer left short), a value of
the wrong size or kind (a foreign key at the chunk's name) or a checksum mismatch is a counted
miss, and the chunk's hash is deleted.

Capacity: the tier enforces `capacity` when it is > 0, and leaves it to the server when it is 0.
  - capacity > 0: per namespace (prefix + layout) and across every client: a sorted set
    <prefix>{<digest>}:lru scores chunks by last use (server clock); one Lua script adds a new
    chunk, applies the hits batched since the last call, and pops the least recently used beyond
    capacity, atomically, so concurrent writers on many hosts never overshoot (see
    tiers/redis/index.py); a chunk whose index update the server refuses (OOM right after
    the chunk's commit, an ACL user without TIME) is deleted, not left uncounted, and so is
    one evicted whose delete failed, with a later eviction (tiers/redis/undeleted.py). For a
    server shared with other data (which maxmemory eviction would also throw out), or to split one
    server between namespaces. Costs one more round trip per put, on the node holding the set.
  - capacity = 0 (recommended for a dedicated cache server or cluster): the server's `maxmemory`
    with `allkeys-lru` (or `allkeys-lfu`) evicts, with Redis's exact memory accounting, no extra
    round trip and no hot index key; it evicts whole chunks (one hash each). With the default
    `noeviction` policy a full server refuses writes: they are counted as dropped writes.
    `chunks`/`used_bytes` are then not tracked (see `kvtier inspect`).

Failures (tiers/guard.py): the tier starts with the server down; a server (a Cluster node) that
fails a call is marked down and retried with exponential backoff up to `retry_max_s`; while it
is down, lookups and reads miss and writes are dropped (counted) in microseconds, without I/O.
A call blocks at most `socket_timeout_ms` on an open connection, `connect_timeout_ms` +
`socket_timeout_ms` on a new one: redis-py's own retries are off, as they would multiply that.
A server that answers with an error reply other than OOM (NOPERM: an ACL user without HSET
or EXEC, which every put runs; a database index it does not have) is up: every such call
misses or is dropped (counted), and the first of each kind is logged at warning. One still
loading its dataset (LOADING, after a restart) is down, as redis-py's BusyLoadingError says.
For a Cluster, start the servers with `cluster-require-full-coverage no`, so that a dead node
costs only the chunks of its slots (with the default `yes` the whole cluster refuses queries once
it notices). A resharding is followed: lookups, reads and deletes follow its
ASK and MOVED redirections (redis-py), and a put into a migrating slot its ASK (write.py).

Codec and encryption (`codec`, `encryption_secret_file`/`_env`: tiers/encoding.py): a chunk
is encoded on the write-behind thread that puts it and stored as a version 2 header plus as
many parts as its body needs (a compressed chunk: fewer bytes and parts); a read fetches the
header and every part field a chunk of this layout can have, and decodes into the caller's
buffer. A bounded tier (capacity > 0) still counts whole chunks of the uncompressed size;
with capacity 0 the server's maxmemory counts real bytes, so compression holds more chunks.

TTL: `ttl_s` expires chunks idle that long; each hit refreshes it.
Credentials: `password_file` or an environment variable (config.py); never the URL or argv.
TLS: `rediss://` or `tls: true`, verified against `tls_ca_file` or the system CAs.
(Both in tiers/redis/client.py, with the client's timeouts.)

Primitives: `RedisTier`, `ChunkNames`. The config model is `RedisTierConfig`
(tiers/redis/config.py), the operator's view `RedisInventory` (tiers/redis/inventory.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AskError, OutOfMemoryError, RedisClusterException, SlotNotCoveredError

from kvtier.core.chunkformat import HEADER_BYTES, failure_of, read_header
from kvtier.core.guard import Guard
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.tier import (
    DECLINED,
    FULL,
    HELD,
    IO_ERROR,
    MISSING,
    OK,
    UNAVAILABLE,
    Failure,
    LinkSpeed,
    Locality,
    Medium,
    TierCounters,
    TierEvents,
    TierResult,
    TierStats,
)
from kvtier.errors import CorruptChunk, KeyNotHeld, TierUnavailable
from kvtier.tiers.encoding import build_encoder
from kvtier.tiers.manifest import NamespaceManifest
from kvtier.tiers.probe import TierProbe
from kvtier.tiers.redis.client import UNAVAILABLE as DOWN_ERRORS
from kvtier.tiers.redis.client import (
    Client,
    check_server_limits,
    connect,
    read_password,
    wrong_type,
)
from kvtier.tiers.redis.config import MIN_PART_BYTES, RedisTierConfig
from kvtier.tiers.redis.index import RedisLRUIndex
from kvtier.tiers.redis.inventory import CHUNK_SUFFIX, RedisInventory
from kvtier.tiers.redis.manifest import redis_manifest_name, write_redis_manifest
from kvtier.tiers.redis.replies import Place, read_into
from kvtier.tiers.redis.undeleted import OwedDeletes
from kvtier.tiers.redis.write import HEADER_FIELD, part_field, write_chunk
from kvtier.tiers.tlsfiles import check_ca_file

log = logging.getLogger(__name__)
T = TypeVar("T")
MIN_BACKOFF_S = 0.25  # first retry of a server that failed
# `measure_link`: pings and echoes timed (the best of each), and the echo's payload: 256 KiB
# cross a 100 Mbit/s link in 2 x 21 ms; on a 10 Gbit/s one the round trip dominates, and the
# bandwidth is underestimated (a 2 MiB chunk's estimate ~2 ms, still far below a recompute).
LINK_PINGS = 3
LINK_ECHOES = 3
LINK_PROBE_BYTES = 256 << 10


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


class RedisTier:
    """Chunks in Redis/Valkey (standalone or Cluster). Thread-safe.

    Raises (constructor): ConfigError when the password file or variable, or the CA file
    (`tls_ca_file`), is unusable. A server
    that is down is not an error: the tier starts unavailable and keeps retrying.
    """

    # One server for every engine; each TP rank bounds its own chunks (capacity > 0).
    medium: ClassVar[Medium] = Medium.STORAGE
    locality: ClassVar[Locality] = Locality.REMOTE
    has_path: ClassVar[bool] = False
    has_server: ClassVar[bool] = True
    capacity_split_by_rank: ClassVar[bool] = True

    config_model = RedisTierConfig

    @classmethod
    def probe(cls, config: RedisTierConfig, layouts: Sequence[KVLayout]) -> TierProbe:
        """Tier objects per layout (they connect lazily: building them does no I/O), asked
        off the scheduler's thread (each lookup is a network round trip)."""
        return TierProbe([cls(config, layout) for layout in layouts], blocking_ok=False)

    @classmethod
    def open_inventory(cls, config: RedisTierConfig) -> RedisInventory:
        return RedisInventory(config.tier_name, config)

    def __init__(self, config: RedisTierConfig, layout: KVLayout) -> None:
        self.name = config.tier_name
        self.chunk_bytes = layout.bytes_per_chunk
        self.part_bytes = config.part_bytes
        self.encoder = build_encoder(config, layout)
        self.names = ChunkNames(config.key_prefix, layout.digest(),
                                self._parts(self.encoder.max_body_bytes))
        self.stored_bytes = HEADER_BYTES + self.chunk_bytes  # one chunk's values, as stored
        self.bounded = config.capacity > 0
        self.capacity_chunks = config.capacity // self.stored_bytes
        self.ttl_ms = int(config.ttl_s * 1000) if config.ttl_s else None
        self.cluster = bool(config.cluster_nodes)
        self._config = config
        self._password = read_password(config)
        check_ca_file(config.tls_ca_file)
        # host:port only: the userinfo (an ACL user) stays out of logs and error messages
        self._server = ("cluster" if self.cluster
                        else urlsplit(config.url).netloc.rpartition("@")[2] or "server")
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self.guard = Guard(self.name, MIN_BACKOFF_S, config.retry_max_s)
        self._admission = AdmissionFilter(config.admit_after)
        self._counters = TierCounters(self.name, config.capacity)
        self._refusals: set[str] = set()  # kinds of error reply logged at warning already
        # What this client stores and removes (its index's evictions, bad chunks, deletes);
        # what the server drops alone (maxmemory, a TTL) is not seen: a router learns it as
        # a miss.
        self.events = TierEvents(self.name)
        self._manifest: NamespaceManifest | None = None  # written after the next put
        self._owed = OwedDeletes()  # let go, their deletes failed: retried (undeleted.py)
        self._index = (RedisLRUIndex(self.name, self.names.index, self.capacity_chunks,
                                     self.ttl_ms, self.stored_bytes, self._counters,
                                     self._run_for, self._delete_values)
                       if self.bounded else None)

    def _parts(self, body_bytes: int) -> int:
        """Payload parts a body of `body_bytes` is cut into."""
        return max(1, -(-body_bytes // self.part_bytes))

    # -- plumbing ----------------------------------------------------------------------------
    def _connected(self) -> Client:
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = connect(self._config, self._password)
        return self._client

    def _endpoint(self, name: str) -> str:
        """The server holding value `name`: a Cluster node's "host:port", or the server."""
        client = self._client
        if not isinstance(client, RedisCluster):  # standalone, or a cluster not reached yet
            return self._server
        try:
            return str(client.nodes_manager.get_node_from_slot(client.keyslot(name)).name)
        except (RedisClusterException, SlotNotCoveredError, IndexError, KeyError):
            return self._server

    def _run(self, endpoint: str, call: Callable[[Client], T]) -> T:
        """`call(client)` through `endpoint`'s circuit breaker.

        Raises:
            TierUnavailable: the endpoint is down (no I/O was done) or just failed.
            redis.RedisError: any other failure of the call (e.g. OOM, a full server).
            CorruptChunk: the server sent a value the call refused (`_bounded`).
        """
        if not self.guard.allow(endpoint):
            raise TierUnavailable(f"{endpoint} is down")
        try:
            result = call(self._connected())
        except DOWN_ERRORS as exc:
            self.guard.failed(endpoint, exc)
            raise TierUnavailable(f"{endpoint}: {exc}") from exc
        except (redis.RedisError, CorruptChunk):
            self.guard.succeeded(endpoint)  # it answered, with an error or a bad value
            raise
        self.guard.succeeded(endpoint)
        return result

    def _run_for(self, name: str, call: Callable[[Client], T]) -> T:
        """`_run` on the server holding value `name`."""
        return self._run(self._endpoint(name), call)

    def _by_endpoint(self, names: Sequence[str]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            groups.setdefault(self._endpoint(name), []).append(i)
        return groups

    def warm(self, connections: int) -> None:
        """`Warmable`: a standalone server's pool gets `connections` connections (each
        connected and greeted now, not by a read in flight); a Cluster's are opened by the
        reads (its pools are per node). Stops at the first failure, the server's circuit
        breaker untouched (a read finds out). Then warns of server limits that cut this
        tier's values (`client.check_server_limits`)."""
        client = self._connected()
        if isinstance(client, RedisCluster):
            return
        pool = client.connection_pool
        held: list[Any] = []
        try:
            while len(held) < connections and self._client is client:
                held.append(pool.get_connection())  # connects, as a read would
        except (redis.RedisError, OSError) as exc:
            log.debug("redis tier %r: %d connections warmed, then %s", self.name, len(held),
                      exc)
        except Exception as exc:
            if self._client is client:
                raise
            # Closed under a connection's greeting: redis-py's reader of the socket `close`
            # took raises AttributeError or ValueError (a store opened and closed at once,
            # as `kvtier inspect` does: a traceback at error in a leak soak's cycles).
            log.debug("redis tier %r: closed while warming up (%r)", self.name, exc)
        finally:
            for conn in held:
                pool.release(conn)
            if self._client is not client:  # closed meanwhile: drop what this reopened
                pool.disconnect()
        if held and self._client is client:  # the server answers: are its limits ours?
            body_bytes = self.encoder.max_body_bytes
            check_server_limits(client, self.name, min(self.part_bytes, body_bytes),
                                HEADER_BYTES + body_bytes)

    def measure_link(self) -> LinkSpeed | None:
        """See core.tier.LinkProbe: the best of LINK_PINGS pings (the round trip), and of
        LINK_ECHOES echoes of LINK_PROBE_BYTES (the payload crosses the link both ways);
        nothing stored. None when the server does not answer."""
        payload = bytes(LINK_PROBE_BYTES)
        try:
            ping_s = min(self._timed(lambda client: client.ping()) for _ in range(LINK_PINGS))
            echo_s = min(self._timed(lambda client: client.echo(payload))
                         for _ in range(LINK_ECHOES))
        except (TierUnavailable, redis.RedisError):
            return None
        return LinkSpeed(ping_s, 2 * LINK_PROBE_BYTES / max(echo_s - ping_s, 1e-6))

    def _timed(self, call: Callable[[Client], object]) -> float:
        """Seconds `call` takes on the server (`_run`'s raises)."""
        start = time.perf_counter()
        self._run(self._server, call)
        return time.perf_counter() - start

    # -- lookups -----------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        """Whether the chunk's hash holds its header (it is written and evicted whole:
        loadable; see `_held`)."""
        name = self.names.chunk(key)
        try:
            return self._run(self._endpoint(name), lambda c: _held(c, name))
        except (TierUnavailable, redis.RedisError):
            return False

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """`contains` of each key: one pipelined round trip per server (Cluster node)."""
        names = [self.names.chunk(key) for key in keys]
        found = [False] * len(keys)
        for endpoint, indexes in self._by_endpoint(names).items():
            def exists(client: Client, indexes: list[int] = indexes) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for i in indexes:
                    pipe.hexists(names[i], HEADER_FIELD)
                # An error reply (WRONGTYPE: a foreign value at one name) is that key's
                # answer, not every key's on this server.
                found: list[Any] = pipe.execute(raise_on_error=False)
                return found

            try:
                for i, answer in zip(indexes, self._run(endpoint, exists)):
                    found[i] = answer is True or answer == 1
            except (TierUnavailable, redis.RedisError):
                pass  # this server's keys stay "absent"
        return found

    # -- reads -------------------------------------------------------------------------------
    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        if len(out) != self.chunk_bytes:
            raise ValueError(f"buffer is {len(out)} bytes, this tier's chunks {self.chunk_bytes}")
        start = time.perf_counter()
        name = self.names.chunk(key)
        endpoint = self._endpoint(name)
        try:
            values = self._read_values(endpoint, name, key, out)
            if values is None:
                log.info("redis tier %r: chunk %s was written again while read; a miss",
                         self.name, key.hex())
                self._counters.add(misses=1)
                return MISSING
            if values[0] is None:  # no chunk, unless parts are there (their header deleted)
                lost = any(value is not None for value in values[1:])
                if not lost:
                    self._counters.add(misses=1)
                    return MISSING
            else:
                lost = not self._verify_into(key, values, out, meta.tenant)
        except (TierUnavailable, redis.RedisError) as exc:
            if wrong_type(exc):  # not a hash: a foreign value at the chunk's name
                return self._corrupt(key, CorruptChunk(f"not a chunk's hash ({exc})"))
            self._log_failure("read", key, exc)
            self._counters.add(misses=1)
            return UNAVAILABLE if isinstance(exc, TierUnavailable) else IO_ERROR
        except KeyNotHeld as exc:  # not tampering: another engine may hold the key
            log.info("redis tier %r: chunk %s: %s; a miss, kept", self.name, key.hex(), exc)
            self._counters.add(misses=1)
            return TierResult(Failure.NO_KEY)
        except CorruptChunk as exc:
            return self._corrupt(key, exc)
        if lost:  # a hash without its header or a part it needs (not one this tier writes)
            log.info("redis tier %r: chunk %s lacks its header or a part; a miss, removed",
                     self.name, key.hex())
            self._remove(key)
            self._counters.add(misses=1)
            return MISSING
        if self._index is not None:
            self._index.touch(key)
        self._counters.add(hits=1, bytes_read=len(out), read_s=time.perf_counter() - start)
        return OK

    def _read_values(self, endpoint: str, name: str, key: ChunkKey,
                     out: memoryview) -> list[Any] | None:
        """The chunk's header and parts (None each that is missing), read by one HMGET; for
        a chunk its writer cut finer than this tier's fields (another engine's part_bytes),
        its other parts by a second one, which asks for the header again: None when the
        header changed between the two (the chunk deleted or written again meanwhile: parts
        of two writes are neither joined nor judged corrupt, and the new chunk stays).

        Raises:
            as `_run` and `_fetch`.
        """
        values = self._run(endpoint, lambda c: self._fetch(
            c, name, self.names.fields(), self._placer(key, out)))
        more = self._more_fields(key, values)
        if not more:
            return values
        again = self._run(endpoint, lambda c: self._fetch(
            c, name, [HEADER_FIELD, *more], self._bounded(_as_bytes)))
        return values + again[1:] if again[0] == values[0] else None

    def _corrupt(self, key: ChunkKey, exc: CorruptChunk) -> TierResult:
        """A corrupt chunk found by a read: logged, removed, a counted miss."""
        log.warning("redis tier %r: chunk %s is corrupt (%s); removed, a miss", self.name,
                    key.hex(), exc)
        self._remove(key)
        self._counters.add(misses=1, corrupt_reads=1)
        return TierResult(failure_of(exc))

    def _fetch(self, client: Client, name: str, fields: list[str], place: Place) -> list[Any]:
        """`fields` of the chunk's hash `name` (None: missing); parts `place` puts in the
        caller's buffer come back as views of it (tiers/redis/replies.py).

        Raises:
            CorruptChunk: a value longer than any of the chunk's (`_bounded`), left unread.
            redis.RedisError: as `_run` says (WRONGTYPE: `name` is not a hash).
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
        in doubt) as bytes, for `_verify_into` to judge."""
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
        except (CorruptChunk, KeyNotHeld):  # judged (and counted) by _verify_into
            return False
        return chunk.plain and chunk.body_bytes == chunk.payload_bytes == payload_bytes

    def _writer_part_bytes(self, parts: list[Any], body_bytes: int) -> int:
        """The part size a body of `body_bytes` was cut with: its first part's size when
        every part of `parts` that size implies has the size it implies (an engine with
        another `part_bytes` wrote it: a rolling change of the setting), else this tier's
        own (whose checks then find the chunk lost or corrupt). Parts the size implies
        beyond `parts` are not judged: `_more_names` fetches them."""
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
        any other chunk (its header unreadable included: `_verify_into` judges)."""
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

    def _verify_into(self, key: ChunkKey, values: list[Any], out: memoryview,
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

    # -- writes ------------------------------------------------------------------------------
    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """`Tier.put`: one HEXISTS decides whether the chunk is held (a held one is only
        touched: the server's own TTL and eviction date it, not `meta`)."""
        if len(data) != self.chunk_bytes:
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores {self.chunk_bytes}")
        name = self.names.chunk(key)
        endpoint = self._endpoint(name)
        try:
            # Evicted, its delete failed: its hash is outside the index. Stored anew (a HELD
            # would leave it uncounted); owed its delete until then (declined, a failure).
            owed = key.hex() in self._owed
            if not owed and self._run(endpoint, lambda c: _held(c, name)):
                if self._index is not None:
                    self._index.touch(key)
                return HELD
            if self.bounded and self.capacity_chunks == 0:
                return FULL
            if not self._admission.offer(key):
                return DECLINED
            start = time.perf_counter()
            # compressed / sealed, off the engine
            encoded = self.encoder.encode(key, data, meta.tenant)
            body = encoded.body.cast("B") if encoded.body.format != "B" else encoded.body
            parts = self._parts(len(body))
            self._run(endpoint, lambda c: write_chunk(c, name, parts, encoded.header, body,
                                                      self.part_bytes, self.ttl_ms))
            if owed:
                self._owed.discard(key.hex())  # its hash is this chunk's now
            if self._index is not None and (refused := self._index.update(key.hex())):
                # A chunk the index does not count is never evicted by it: a full server
                # refuses the index's script (OOM) right after the chunk's commit.
                self._discard(endpoint, key)
                raise refused
        except (TierUnavailable, redis.RedisError) as exc:
            self._log_failure("write", key, exc)
            self._counters.add(dropped_writes=1)
            return _write_failure(exc)
        self._counters.add(puts=1, bytes_written=len(data), write_s=time.perf_counter() - start)
        self.events.stored(key)
        if self._manifest is not None:
            self._write_manifest()
        return OK

    def _log_failure(self, action: str, key: ChunkKey, exc: Exception) -> None:
        """Log a failed read or write: at debug while the server is down (the guard warned)
        or full (OOM: expected under `noeviction`); an error reply of another kind at
        warning, once per kind: NOPERM (an ACL user without a command the tier needs) or a
        database index out of range fails every call while the server answers, so the
        tier looks up and nothing else would tell the operator."""
        kind = f"{type(exc).__name__} {str(exc).partition(' ')[0]}"  # "ResponseError DB"
        if isinstance(exc, TierUnavailable) or _write_failure(exc) is FULL \
                or kind in self._refusals:
            log.debug("redis tier %r: %s of %s failed (%s); a miss or a dropped write",
                      self.name, action, key.hex(), exc)
            return
        self._refusals.add(kind)
        log.warning("redis tier %r: the server refused a %s (%s: %s); reads miss and writes "
                    "are dropped while it does (logged once per kind of error)", self.name,
                    action, type(exc).__name__, exc)

    def keep_manifest(self, manifest: NamespaceManifest) -> None:
        """Record the namespace's manifest (`ManifestKeeper`): written after the first chunk
        this tier stores, so that a server that is down costs start-up nothing."""
        self._manifest = manifest

    def _write_manifest(self) -> None:
        """Write the pending manifest (once; again after the next put when it failed)."""
        manifest, self._manifest = self._manifest, None
        if manifest is None:
            return
        prefix = self.names.prefix
        name = redis_manifest_name(prefix, manifest.namespace)
        try:
            self._run_for(name, lambda c: write_redis_manifest(c, prefix, manifest))
        except (TierUnavailable, redis.RedisError) as exc:
            log.warning("redis tier %r: namespace manifest not written (%s); retried after "
                        "the next stored chunk", self.name, exc)
            self._manifest = manifest

    def _discard(self, endpoint: str, key: ChunkKey) -> None:
        """Best-effort delete of a chunk just stored that the index did not count (DEL is
        allowed on a full server); owed (deleted with a later eviction) when it fails."""
        name = self.names.chunk(key)
        try:
            self._run(endpoint, lambda c: c.delete(name))
        except (TierUnavailable, redis.RedisError) as exc:
            log.info("redis tier %r: a chunk the index did not count was not deleted (%s); "
                     "deleted with a later eviction", self.name, exc)
            self._owed.owe([key.hex()])

    def delete(self, key: ChunkKey) -> bool:
        name = self.names.chunk(key)
        try:
            held = bool(self._run(self._endpoint(name), lambda c: c.delete(name)))
        except (TierUnavailable, redis.RedisError):
            return False
        if self._index is not None:
            self._index.remove([key.hex()])
        if held:
            self.events.removed(key)
        return held

    def _remove(self, key: ChunkKey) -> None:
        """Best-effort removal of a bad chunk's hash and index entry."""
        self._delete_values([key.hex()])
        if self._index is not None:
            self._index.remove([key.hex()])

    def _delete_values(self, hex_keys: Sequence[str]) -> None:
        """Delete chunks' hashes, one pipeline per server that is up; each is removed from
        now on (evicted by the index, or found bad), whether or not its delete reaches the
        server. Those owed a delete since an earlier one failed (`OwedDeletes`) go with
        them; those whose delete fails now are owed it."""
        keys = [ChunkKey(bytes.fromhex(h)) for h in hex_keys]
        for key in keys:
            self.events.removed(key)
        hex_keys = [*hex_keys, *self._owed.take()]
        keys += [ChunkKey(bytes.fromhex(h)) for h in hex_keys[len(keys):]]
        names = [self.names.chunk(key) for key in keys]
        for endpoint, indexes in self._by_endpoint(names).items():
            def delete(client: Client, indexes: list[int] = indexes) -> None:
                pipe = client.pipeline(transaction=False)
                for i in indexes:
                    pipe.delete(names[i])
                pipe.execute()

            try:
                self._run(endpoint, delete)
            except (TierUnavailable, redis.RedisError) as exc:
                # The index no longer counts them: owed a delete (redis/undeleted.py).
                log.info("redis tier %r: %d evicted chunk(s) not deleted (%s); deleted "
                         "with a later eviction", self.name, len(indexes), exc)
                self._owed.owe(hex_keys[i] for i in indexes)

    # -- upkeep ------------------------------------------------------------------------------
    def available(self) -> bool:
        """Whether no server of this tier is marked down."""
        return not self.guard.down_endpoints()

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def close(self) -> None:
        if self._index is not None and self._index.pending and self.available():
            self._index.update("")
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _as_bytes(index: int, length: int, earlier: list[Any]) -> memoryview | None:
    """A `Place` that places nothing: every value comes back as bytes."""
    return None


def _held(client: Client, name: str) -> bool:
    """Whether hash `name` holds a chunk's header: a hash without one (a field deleted by
    hand) is no chunk, and a value of another type at the name (WRONGTYPE) neither; a put
    replaces either whole (its transaction's DEL).

    Raises:
        redis.RedisError: any other failure of the call.
    """
    try:
        return bool(client.hexists(name, HEADER_FIELD))
    except redis.ResponseError as exc:
        if wrong_type(exc):
            return False
        raise


def _write_failure(exc: Exception) -> TierResult:
    """Why a write failed: the server down, full ("OOM command not allowed" under
    maxmemory with noeviction), or another error reply."""
    if isinstance(exc, TierUnavailable):
        return UNAVAILABLE
    # redis-py raises OutOfMemoryError for an "OOM" reply (and drops the prefix from the
    # message); the text test catches an OOM a Lua script reports as a plain error.
    if isinstance(exc, OutOfMemoryError) or (
            isinstance(exc, redis.ResponseError) and "OOM" in str(exc)):
        return FULL
    return IO_ERROR
