"""The redis tier: chunks in a Redis or Valkey server, or a Redis Cluster, shared by every
engine that points at it. `RedisTier` answers the tier contract and owns its outcomes (the
counters, events, the namespace manifest, a bad chunk's removal) and its circuit breaker; the
work on the server lies beside it:
    names.py      a chunk's hash and its fields: one hash a chunk, so it lives or dies whole
    write.py      a put: one MULTI/EXEC transaction, all of it or nothing
    read.py       a read: one HMGET, verified before a byte is used
    index.py      capacity: the tier's LRU index (capacity > 0) or the server's maxmemory (0)
    undeleted.py  the deletes of chunks let go whose delete failed, retried
    client.py     the connection: timeouts, keepalive, credentials, TLS, a Cluster's nodes
A chunk is encoded (`codec`, encryption: tiers/encoding.py) on the write-behind thread that
puts it. What a read finds bad (a part missing, a value of the wrong size or kind, a checksum
mismatch) is a counted miss, and the chunk's hash is deleted.

Failures (tiers/guard.py): the tier starts with the server down; a server (a Cluster node) that
fails a call is marked down and retried with exponential backoff up to `retry_max_s`; while it
is down, lookups and reads miss and writes are dropped (counted) in microseconds, without I/O.
Lookups wait on a request's path (the node's checks, a failed load's report): they have a
client of their own whose replies are due within `lookup_timeout_ms` (unset: as the
transfers', `socket_timeout_ms`). A lookup whose reply is late is a miss, counted
(`lookup_timeouts`); the server's lookups, not the server, are marked down (`lookup_guard`,
logged once an episode) and miss at once until a retry answers in time.
A server that answers with an error reply other than OOM (NOPERM: an ACL user without HSET
or EXEC, which every put runs; a database index it does not have) is up: every such call
misses or is dropped (counted), and the first of each kind is logged at warning. One still
loading its dataset (LOADING, after a restart) is down, as redis-py's BusyLoadingError says.

TTL: `ttl_s` expires chunks idle that long; each hit refreshes it.

Primitives: `RedisTier`. The config model is `RedisTierConfig` (tiers/redis/config.py), the
operator's view `RedisInventory` (tiers/redis/inventory.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import redis
from redis.cluster import RedisCluster
from redis.exceptions import OutOfMemoryError, RedisClusterException, SlotNotCoveredError

from kvtier.core.chunkformat import HEADER_BYTES, failure_of
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
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.redis.index import RedisLRUIndex
from kvtier.tiers.redis.inventory import RedisInventory
from kvtier.tiers.redis.manifest import redis_manifest_name, write_redis_manifest
from kvtier.tiers.redis.names import HEADER_FIELD, ChunkNames
from kvtier.tiers.redis.read import ChunkReader
from kvtier.tiers.redis.undeleted import OwedDeletes
from kvtier.tiers.redis.write import write_chunk
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
        self._lookup_client: Client | None = None  # replies due within lookup_timeout_ms
        self._client_lock = threading.Lock()
        self.guard = Guard(self.name, MIN_BACKOFF_S, config.retry_max_s)
        # Keyed "<endpoint> (lookups)": a server whose lookups ran late, its transfers on.
        self.lookup_guard = Guard(self.name, MIN_BACKOFF_S, config.retry_max_s,
                                  effect="lookups miss at once (reads and writes go on)")
        self._admission = AdmissionFilter(config.admit_after)
        self._counters = TierCounters(self.name, config.capacity)
        self._refusals: set[str] = set()  # kinds of error reply logged at warning already
        # What this client stores and removes (its index's evictions, bad chunks, deletes);
        # what the server drops alone (maxmemory, a TTL) is not seen: a router learns it as
        # a miss.
        self.events = TierEvents(self.name)
        self._manifest: NamespaceManifest | None = None  # written after the next put
        self._owed = OwedDeletes()  # let go, their deletes failed: retried (undeleted.py)
        self._reader = ChunkReader(self.names, self.encoder, self.chunk_bytes,
                                   self.part_bytes, self.ttl_ms)
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

    def _lookups_connected(self) -> Client:
        if self._lookup_client is None:
            with self._client_lock:
                if self._lookup_client is None:
                    self._lookup_client = connect(
                        self._config, self._password,
                        socket_timeout_ms=self._config.lookup_deadline_ms)
        return self._lookup_client

    def _endpoint(self, name: str) -> str:
        """The server holding value `name`: a Cluster node's "host:port", or the server."""
        client = self._client or self._lookup_client
        if not isinstance(client, RedisCluster):  # standalone, or a cluster not reached yet
            return self._server
        try:
            return str(client.nodes_manager.get_node_from_slot(client.keyslot(name)).name)
        except (RedisClusterException, SlotNotCoveredError, IndexError, KeyError):
            return self._server

    def _run(self, endpoint: str, call: Callable[[Client], T], *, lookup: bool = False) -> T:
        """`call(client)` through `endpoint`'s circuit breaker; `lookup`: on the lookups'
        client, and a late reply (redis.TimeoutError) of a server up is raised as it is, the
        server not marked down (`_lookup` marks its lookups).

        Raises:
            TierUnavailable: the endpoint is down (no I/O was done) or just failed.
            redis.RedisError: any other failure of the call (e.g. OOM, a full server).
            CorruptChunk: the server sent a value the call refused (`ChunkReader`).
        """
        if not self.guard.allow(endpoint):
            raise TierUnavailable(f"{endpoint} is down")
        try:
            result = call(self._lookups_connected() if lookup else self._connected())
        except DOWN_ERRORS as exc:
            if lookup and isinstance(exc, redis.TimeoutError) and self.guard.is_up(endpoint):
                raise
            self.guard.failed(endpoint, exc)
            raise TierUnavailable(f"{endpoint}: {exc}") from exc
        except (redis.RedisError, CorruptChunk):
            self.guard.succeeded(endpoint)  # it answered, with an error or a bad value
            raise
        self.guard.succeeded(endpoint)
        return result

    def _lookup(self, endpoint: str, call: Callable[[Client], T]) -> T:
        """`call` on the lookups' client (`_run`), through `endpoint`'s lookups' breaker: a
        reply late past `lookup_timeout_ms` is counted (`lookup_timeouts`) and marks the
        endpoint's lookups down, so the next ones miss at once until a retry answers in time.

        Raises: as `_run` (TierUnavailable for a late reply or lookups marked down).
        """
        lookups = f"{endpoint} (lookups)"
        if not self.lookup_guard.allow(lookups):
            raise TierUnavailable(f"{lookups}: skipped, one ran past lookup_timeout_ms")
        try:
            result = self._run(endpoint, call, lookup=True)
        except redis.TimeoutError as exc:
            self._counters.add(lookup_timeouts=1)
            self.lookup_guard.failed(lookups, TimeoutError(
                f"no reply within lookup_timeout_ms ({self._config.lookup_deadline_ms} ms)"))
            raise TierUnavailable(f"{lookups}: {exc}") from exc
        except TierUnavailable as exc:  # the server down: a probe of its lookups failed too
            if not self.lookup_guard.is_up(lookups):
                self.lookup_guard.failed(lookups, exc)
            raise
        except Exception:  # an error reply, a bad value: the server answered in time
            self.lookup_guard.succeeded(lookups)
            raise
        self.lookup_guard.succeeded(lookups)
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
        connected and greeted now, not by a read in flight), and the lookups' pool one; a
        Cluster's are opened by the calls (its pools are per node). Stops at the first
        failure, the server's circuit breaker untouched (a read finds out). Then warns of
        server limits that cut this tier's values (`client.check_server_limits`)."""
        client = self._connected()
        if isinstance(client, RedisCluster):
            return
        warmed = self._warm_pool(client, connections, lambda: self._client)
        if warmed and self._client is client:  # the server answers: are its limits ours?
            lookups = self._lookups_connected()
            if isinstance(lookups, redis.Redis):
                self._warm_pool(lookups, 1, lambda: self._lookup_client)
            body_bytes = self.encoder.max_body_bytes
            check_server_limits(client, self.name, min(self.part_bytes, body_bytes),
                                HEADER_BYTES + body_bytes)

    def _warm_pool(self, client: redis.Redis, connections: int,
                   current: Callable[[], Client | None]) -> int:
        """Open up to `connections` connections of `client`'s pool while `current()` is it
        (the tier not closed meanwhile); how many opened."""
        pool = client.connection_pool
        held: list[Any] = []
        try:
            while len(held) < connections and current() is client:
                held.append(pool.get_connection())  # connects, as a read would
        except (redis.RedisError, OSError) as exc:
            log.debug("redis tier %r: %d connections warmed, then %s", self.name, len(held),
                      exc)
        except Exception as exc:
            if current() is client:
                raise
            # Closed under a connection's greeting: redis-py's reader of the socket `close`
            # took raises AttributeError or ValueError (a store opened and closed at once,
            # as `kvtier inspect` does: a traceback at error in a leak soak's cycles).
            log.debug("redis tier %r: closed while warming up (%r)", self.name, exc)
        finally:
            for conn in held:
                pool.release(conn)
            if current() is not client:  # closed meanwhile: drop what this reopened
                pool.disconnect()
        return len(held)

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
            return self._lookup(self._endpoint(name), lambda c: _held(c, name))
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
                for i, answer in zip(indexes, self._lookup(endpoint, exists)):
                    found[i] = answer is True or answer == 1
            except (TierUnavailable, redis.RedisError):
                pass  # this server's keys stay "absent"
        return found

    # -- reads -------------------------------------------------------------------------------
    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """`Tier.get_into`: the reader (read.py) fetches and verifies the chunk; here each
        outcome is counted and logged, and a chunk found bad or incomplete is removed."""
        if len(out) != self.chunk_bytes:
            raise ValueError(f"buffer is {len(out)} bytes, this tier's chunks {self.chunk_bytes}")
        start = time.perf_counter()
        name = self.names.chunk(key)
        endpoint = self._endpoint(name)
        try:
            values = self._reader.read_values(lambda call: self._run(endpoint, call), name,
                                              key, out)
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
                lost = not self._reader.verify_into(key, values, out, meta.tenant)
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

    def _corrupt(self, key: ChunkKey, exc: CorruptChunk) -> TierResult:
        """A corrupt chunk found by a read: logged, removed, a counted miss."""
        log.warning("redis tier %r: chunk %s is corrupt (%s); removed, a miss", self.name,
                    key.hex(), exc)
        self._remove(key)
        self._counters.add(misses=1, corrupt_reads=1)
        return TierResult(failure_of(exc))

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
        # Let go of the clients before closing them: a warm-up meanwhile (`_warm_pool`) then
        # sees the tier closed and drops the connections it reopened.
        clients = (self._client, self._lookup_client)
        self._client = self._lookup_client = None
        for client in clients:
            if client is not None:
                client.close()


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
