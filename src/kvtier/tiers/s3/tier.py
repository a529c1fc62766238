"""The s3 tier: one object per chunk in an S3-compatible bucket, shared by every engine (and
cluster, and region) that points at it.

Objects. A chunk is one object, kvtier's stored chunk format (core/chunkformat.py: the
4 KiB header, then the body: the payload as is, or encoded and sealed for its tenant):
    <key_prefix>/<layout digest>/<key hex[:2]>/<key hex>
The layout digest is the namespace (it holds the model's fingerprint); the two hex digits of
a blake3 key after it spread a namespace's objects over 256 prefixes, so none is hot (S3
partitions by key prefix). Next to them, <key_prefix>/<layout digest>/manifest.json
(tiers/manifest.py). An upload is one PUT with an S3 integrity checksum (`upload_checksum`),
so the server stores the whole object or nothing: a failed upload leaves no object; it is
conditional (If-None-Match: *), so one round trip both decides "held already?" and stores. A read is
one GET, verified (header, layout, key, sizes, checksums) before a byte is used, never
unpickled; a short, corrupt or foreign object at a chunk's name is a counted miss, deleted
(one larger than any chunk of the tier is refused by its size, its body never read).

Lookups (`contains_many`, `BatchLookup`, and the scheduler's probe): one HEAD per chunk,
`lookup_concurrency` in flight, all within `lookup_timeout_s`; a key not answered by then is
absent (a lookup that ran late is counted: `lookup_timeouts`). A chunk found absent is
remembered for `negative_cache_s` (a prompt's lookup is asked again every scheduler step while
it waits), and forgotten when this tier stores it.

Failures (core/guard.py): the endpoint failing a call (refused, reset, no reply within
`request_timeout_s`) is marked down and retried with backoff up to `retry_max_s`; meanwhile
lookups and reads miss and writes are dropped (counted) without I/O. A throttled write
(503 SlowDown) backs off and retries until `write_timeout_s`, then is dropped
(`throttled_writes`). Credentials that are missing, or refused by the server when the tier
starts, and an endpoint that answers 200 for an object that does not exist (not an S3 API),
are a ConfigError naming the field (client.py); an endpoint down at start-up is
not: the tier starts unavailable. Any other error answer (credentials revoked mid-run: 403)
misses or drops the call, counted; the first of each error code is logged at warning.

Capacity and expiry: `ttl_days` expires objects by age (a lifecycle rule on the prefix,
written at start-up when `manage_lifecycle`); `capacity` > 0 bounds a namespace's bytes by a
listing at most every `listing_interval_s` (inventory.py states its cost).

Primitives: `S3Tier`. The config model is `S3TierConfig` (tiers/s3/config.py), the
operator's view `S3Inventory` (tiers/s3/inventory.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import wait
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from kvtier.core.chunkformat import HEADER_BYTES, failure_of, read_header
from kvtier.core.guard import Guard
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import AdmissionFilter
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.threads import IOPool
from kvtier.core.tier import (
    DECLINED,
    HELD,
    IO_ERROR,
    MISSING,
    OK,
    UNAVAILABLE,
    Failure,
    LinkSpeed,
    Locality,
    Medium,
    NamespaceManifest,
    TierCounters,
    TierEvents,
    TierResult,
    TierStats,
)
from kvtier.errors import ConfigError, CorruptChunk, KeyNotHeld, TierUnavailable
from kvtier.tiers.encoding import build_encoder
from kvtier.tiers.links import LINK_DEADLINE_S, BoundedMeasure
from kvtier.tiers.probe import TierProbe
from kvtier.tiers.s3.client import (
    REFUSED_CODES,
    S3Errors,
    connect,
    credentials_source,
    error_code,
    is_absent,
    is_held,
    is_refused,
    is_throttle,
    open_session,
    refusal_of_credentials,
)
from kvtier.tiers.s3.config import S3TierConfig
from kvtier.tiers.s3.inventory import (
    S3Inventory,
    S3Names,
    enforce_capacity,
    put_lifecycle,
    write_manifest,
)
from kvtier.tiers.s3.link import ProbeObject, measure_endpoint
from kvtier.tiers.s3.lookup import NegativeCache

log = logging.getLogger(__name__)
T = TypeVar("T")
MIN_BACKOFF_S = 0.25  # first retry of an endpoint that failed
THROTTLE_BACKOFF_S = 0.05  # first wait after a 503 SlowDown (doubled each time)
LISTING_TRIES = 3  # capacity listings run again when this process wrote during one
EXISTS = TierResult()  # _upload's "the object exists already" (HELD, not counted as a put)


class S3Tier:
    """Chunks as objects of an S3-compatible bucket. Thread-safe.

    Raises (constructor): ConfigError when boto3 is missing, no credentials are found, or the
    server refuses them or knows no such bucket. An endpoint that does not answer is not an
    error: the tier starts unavailable and keeps retrying.
    """

    # One bucket for every engine; each TP rank bounds its own namespace (capacity > 0).
    medium: ClassVar[Medium] = Medium.STORAGE
    locality: ClassVar[Locality] = Locality.REMOTE
    has_path: ClassVar[bool] = False
    has_server: ClassVar[bool] = True
    capacity_split_by_rank: ClassVar[bool] = True

    config_model = S3TierConfig

    @classmethod
    def probe(cls, config: S3TierConfig, layouts: Sequence[KVLayout]) -> TierProbe:
        """Tier objects per layout, asked off the scheduler's thread (HEADs)."""
        return TierProbe([cls(config, layout) for layout in layouts], blocking_ok=False)

    @classmethod
    def open_inventory(cls, config: S3TierConfig) -> S3Inventory:
        return S3Inventory(config.tier_name, config)

    def __init__(self, config: S3TierConfig, layout: KVLayout) -> None:
        self.name = config.tier_name
        self.chunk_bytes = layout.bytes_per_chunk
        self.encoder = build_encoder(config, layout)
        self._max_object_bytes = HEADER_BYTES + self.encoder.max_body_bytes
        self.names = S3Names(config.key_prefix, layout.digest())
        self.endpoint = config.endpoint_name
        self.throttled_writes = 0  # puts dropped after backing off from 503 SlowDown
        self._config = config
        self._errors = S3Errors()
        # a call that did not succeed: the endpoint down, or it answered with an error
        self._failed: tuple[type[BaseException], ...] = (TierUnavailable,
                                                         *self._errors.answered)
        self._session = open_session(config)
        threads = config.lookup_concurrency + config.io_threads
        self._client = connect(config, self._session, threads)
        # HEADs of lookups wait no longer than the lookup's own deadline
        self._head_client = connect(config, self._session, config.lookup_concurrency,
                                    min(config.request_timeout_s, config.lookup_timeout_s))
        self._heads = IOPool(config.lookup_concurrency, f"kvtier-s3-{self.name}")
        self.guard = Guard(self.name, MIN_BACKOFF_S, config.retry_max_s)
        self._admission = AdmissionFilter(config.admit_after)
        self._counters = TierCounters(self.name, config.capacity)
        # What this process stores and removes (an object its lifecycle rule expires, or
        # another engine deletes, is not seen: a router learns it as a miss).
        self.events = TierEvents(self.name)
        self._absent = NegativeCache(config.negative_cache_s)  # chunks found absent lately
        self._lock = threading.Lock()
        self._refusals: set[str] = set()  # error codes logged at warning already
        # An absent object answers 403, not 404, to credentials without s3:ListBucket (AWS
        # does not tell them what is not there); learnt from the start-up's HEAD of an
        # object no one writes. Then a HEAD's 403 is an absent chunk: before, every put
        # with `conditional_put: false` (or admission on) was dropped as refused.
        self._absent_refused = False
        self._manifest: NamespaceManifest | None = None
        # Monotonic time of the last capacity listing; none yet, so the first put lists. Not
        # 0.0: monotonic time counts from boot, and on a machine up for less than
        # listing_interval_s no put would list (tests/tiers/test_s3_tier.py).
        self._listed_at = float("-inf")
        self._listing: threading.Thread | None = None
        # Puts and deletes of this process: ended (`_changes`) and under way (`_changing`). A
        # listing that overlapped one may have seen its object and not its count, or the reverse.
        self._changes = 0
        self._changing_now = 0
        self._link = BoundedMeasure(self.name)
        self._probe = ProbeObject(self.names)  # the link's probe object (link.py)
        self._check_bucket()

    # -- plumbing ----------------------------------------------------------------------------
    def _check_bucket(self) -> None:
        """One HEAD of the bucket: refused credentials or no such bucket are ConfigErrors
        now (one clear error at start-up); no answer leaves the tier starting down. A HEAD
        refused to credentials the server knows (no s3:ListBucket) is no error
        (`refusal_of_credentials`; tests/faults/test_s3_refusals.py)."""
        try:
            try:
                self._run(lambda c: c.head_bucket(Bucket=self._config.bucket))
            except self._errors.answered as exc:
                if not is_refused(exc):
                    raise
                absent = f"{self.names.namespace_prefix()}absent-{uuid.uuid4().hex}"
                refused = refusal_of_credentials(lambda: self._run(lambda c: c.get_object(
                    Bucket=self._config.bucket, Key=absent)), self._errors.answered)
                if refused:
                    raise self._refusal(f"{error_code(exc)}, then {refused}", refused) from None
                log.info("s3 tier %r: %s refuses a HEAD of bucket %r to these credentials "
                         "(no s3:ListBucket: needed only with a capacity)", self.name,
                         self.endpoint, self._config.bucket)
        except TierUnavailable as exc:
            log.warning("s3 tier %r: %s does not answer (%s); starting unavailable, retried "
                        "with backoff", self.name, self.endpoint, exc)
            return
        except self._errors.answered as exc:
            if is_absent(exc):
                raise self._refusal(error_code(exc), "NoSuchBucket") from None
            log.warning("s3 tier %r: bucket check answered %s", self.name, error_code(exc))
            return
        self._check_speaks_s3()
        if self._config.manage_lifecycle and self._config.ttl_days is not None:
            put_lifecycle(self._client, self._config, log)

    def _refusal(self, answered: str, code: str) -> ConfigError:
        """The ConfigError of a start-up refused: no such bucket (`code` NoSuchBucket), else
        the credentials. `answered`: what the server answered, for the message."""
        if code == "NoSuchBucket":
            return ConfigError("bucket", self._config.bucket,
                               f"an existing bucket on {self.endpoint}")
        field = "credentials_file" if self._config.credentials_file else "credentials"
        return ConfigError(field, f"from {credentials_source(self._session)}",
                           f"credentials {self.endpoint} accepts for bucket "
                           f"{self._config.bucket!r} (it answered {answered})")

    def _check_speaks_s3(self) -> None:
        """One HEAD of an object no one writes: an S3 API answers 404 (403 to a user
        without s3:ListBucket). A web server that answers 200 to any path (an object
        store's web console: MinIO's is :9001, its API :9000) passes the bucket check, and
        then every lookup found every chunk, every load failed as corrupt.

        Raises:
            ConfigError: `endpoint_url` answered 200.
        """
        name = f"{self.names.namespace_prefix()}absent-{uuid.uuid4().hex}"
        try:
            self._run(lambda c: c.head_object(Bucket=self._config.bucket, Key=name))
        except TierUnavailable:  # no answer: not a web page
            return
        except self._errors.answered as exc:  # an error answer: not a web page
            if is_refused(exc):
                self._absent_refused = True
                log.info("s3 tier %r: %s answers 403 to a HEAD of an absent object (no "
                         "s3:ListBucket): a 403 to a chunk's HEAD reads as absent", self.name,
                         self.endpoint)
            return
        raise ConfigError("endpoint_url", self._config.endpoint_url or self.endpoint,
                          "an S3 API endpoint: it answered 200 to a HEAD of an object that "
                          "does not exist (a web console's port?)")

    def _run(self, call: Callable[[Any], T], client: Any = None) -> T:
        """`call(client)` through the endpoint's circuit breaker.

        Raises:
            TierUnavailable: the endpoint is down (no I/O was done) or just failed.
            botocore ClientError: the server answered with an error (404, 403, 503, ...).
        """
        if not self.guard.allow(self.endpoint):
            raise TierUnavailable(f"{self.endpoint} is down")
        try:
            result = call(client or self._client)
        except self._errors.down as exc:
            self.guard.failed(self.endpoint, exc)
            raise TierUnavailable(f"{self.endpoint}: {type(exc).__name__}") from exc
        except self._errors.answered:
            self.guard.succeeded(self.endpoint)
            raise
        except Exception as exc:  # e.g. expired credentials: still report, or stay stuck
            self.guard.failed(self.endpoint, exc)
            raise TierUnavailable(f"{self.endpoint}: {type(exc).__name__}") from exc
        self.guard.succeeded(self.endpoint)
        return result

    # -- lookups -----------------------------------------------------------------------------
    def _head(self, key: ChunkKey) -> bool:
        """Whether the object of `key` exists (False when unknown: down, slow, an error)."""
        if self._absent.absent(key):
            return False
        name = self.names.chunk(key)
        try:
            self._run(lambda c: c.head_object(Bucket=self._config.bucket, Key=name),
                      self._head_client)
        except TierUnavailable:
            return False
        except self._errors.answered as exc:
            if self._says_absent(exc):
                self._absent.remember(key)
            else:
                self._log_refusal("lookup", name, exc)
            return False
        return True

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """`contains` of each key: parallel HEADs (`lookup_concurrency` at once), all within
        `lookup_timeout_s`; a key without an answer by then is absent. Never raises."""
        if not keys:
            return []
        # No breaker check here: each HEAD asks it (`_run`), so that while the endpoint is
        # down they fail without I/O, and after the backoff exactly one goes out as the probe
        # (an `allow` here would claim the probe and leave it unreported: stuck down).
        futures = [self._heads.submit(self._head, key) for key in keys]
        done, late = wait(futures, timeout=self._config.lookup_timeout_s)
        if late:  # one lookup past its deadline, as the redis tier counts a late reply
            self._counters.add(lookup_timeouts=1)
        for future in late:
            future.cancel()
        return [f in done and not f.cancelled() and f.exception() is None and f.result()
                for f in futures]

    # -- reads -------------------------------------------------------------------------------
    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        if len(out) != self.chunk_bytes:
            raise ValueError(f"buffer is {len(out)} bytes, this tier's chunks {self.chunk_bytes}")
        start = time.perf_counter()
        name = self.names.chunk(key)
        try:
            data = self._run(lambda c: self._get_object(c, name))
        except TierUnavailable as exc:
            log.debug("s3 tier %r: read of %s failed (%s); a miss", self.name, key.hex(), exc)
            self._counters.add(misses=1)
            return UNAVAILABLE
        except self._errors.answered as exc:
            self._counters.add(misses=1)
            if self._says_absent(exc):
                return MISSING
            self._log_refusal("read", name, exc)
            return IO_ERROR
        try:
            if isinstance(data, int):
                raise CorruptChunk(f"object is {data} bytes, more than this tier's chunks "
                                   f"({self._max_object_bytes}); not read")
            self._verify_into(key, memoryview(data), out, meta.tenant)
        except KeyNotHeld as exc:  # not tampering: another engine may hold the key
            log.info("s3 tier %r: chunk %s: %s; a miss, kept", self.name, key.hex(), exc)
            self._counters.add(misses=1)
            return TierResult(Failure.NO_KEY)
        except CorruptChunk as exc:
            log.warning("s3 tier %r: object %s is corrupt (%s); removed, a miss", self.name,
                        name, exc)
            self.delete(key)
            self._counters.add(misses=1, corrupt_reads=1)
            return TierResult(failure_of(exc))
        self._counters.add(hits=1, bytes_read=len(out), read_s=time.perf_counter() - start)
        return OK

    def _get_object(self, client: Any, name: str) -> bytes | int:
        """Object `name`'s bytes, or its size (an int) when it is larger than any chunk of
        this tier can be: its body is not read (a foreign object of gigabytes at a chunk's
        name would be held in memory whole before the checks refuse it)."""
        reply = client.get_object(Bucket=self._config.bucket, Key=name)
        size = int(reply.get("ContentLength") or 0)
        if size > self._max_object_bytes:
            reply["Body"].close()
            return size
        return bytes(reply["Body"].read())

    def _verify_into(self, key: ChunkKey, data: memoryview, out: memoryview,
                     tenant: str | None) -> None:
        """Check the header and the object's size, decode the body into `out` (verifying
        checksums).

        Raises:
            CorruptChunk (AuthFailure, CodecFailure, KeyNotHeld): see ChunkEncoder.decode.
        """
        if len(data) < HEADER_BYTES:
            raise CorruptChunk(f"object is {len(data)} bytes, shorter than a header")
        chunk = read_header(data[:HEADER_BYTES], key, self.names.digest)
        if chunk.payload_bytes != self.chunk_bytes:
            raise CorruptChunk(f"payload is {chunk.payload_bytes} bytes, expected "
                               f"{self.chunk_bytes}")
        if len(data) != HEADER_BYTES + chunk.body_bytes:
            raise CorruptChunk(f"object is {len(data)} bytes, its header says "
                               f"{HEADER_BYTES + chunk.body_bytes}")
        self.encoder.decode(key, chunk, data[HEADER_BYTES:], out, tenant)

    # -- writes ------------------------------------------------------------------------------
    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> TierResult:
        """`Tier.put`: one conditional PUT (If-None-Match: *) decides whether the chunk is
        held and stores it if not; or a HEAD first (`conditional_put` false, or admission
        on). A held chunk is not rewritten: its age, for the lifecycle rule, stays that of
        its first write."""
        if len(data) != self.chunk_bytes:
            raise ValueError(f"chunk is {len(data)} bytes, this tier stores {self.chunk_bytes}")
        name = self.names.chunk(key)
        conditional = self._config.conditional_put and self._config.admit_after == 1
        if not conditional:
            held = self._held(name)
            if held is not None:
                return held
            if not self._admission.offer(key):
                return DECLINED
        start = time.perf_counter()
        encoded = self.encoder.encode(key, data, meta.tenant)  # off the engine
        body = b"".join((encoded.header, encoded.body))
        with self._changing():
            result = self._upload(name, body, conditional)
            self._absent.forget(key)
            if result is EXISTS:
                return HELD
            if not result:
                self._counters.add(dropped_writes=1)
                return result
            self._counters.add(puts=1, bytes_written=len(data), chunks=1,
                               used_bytes=len(body), write_s=time.perf_counter() - start)
        self.events.stored(key)
        if self._manifest is not None:
            self._write_manifest()
        self._maybe_enforce_capacity()
        return OK

    def _held(self, name: str) -> TierResult | None:
        """A HEAD of object `name`: HELD when it exists, None when absent, else the failure
        (counted as a dropped write)."""
        try:
            self._run(lambda c: c.head_object(Bucket=self._config.bucket, Key=name))
            return HELD
        except TierUnavailable:
            self._counters.add(dropped_writes=1)
            return UNAVAILABLE
        except self._errors.answered as exc:
            if self._says_absent(exc):
                return None
            self._log_refusal("write", name, exc)
            self._counters.add(dropped_writes=1)
            return IO_ERROR

    def _says_absent(self, exc: BaseException) -> bool:
        """Whether an error answer to a HEAD or GET says the object is absent: 404, or 403
        where the credentials cannot list the bucket (`_absent_refused`)."""
        return is_absent(exc) or (self._absent_refused and is_refused(exc))

    def _upload(self, name: str, body: bytes, conditional: bool) -> TierResult:
        """One PUT (`conditional`: only if absent; EXISTS when it exists), retried after
        throttling with doubling waits while `write_timeout_s` allows; a failure leaves no
        object (S3 stores a PUT whole or not at all)."""
        args: dict[str, Any] = {"Bucket": self._config.bucket, "Key": name, "Body": body}
        if conditional:
            args["IfNoneMatch"] = "*"
        if self._config.upload_checksum != "none":
            args["ChecksumAlgorithm"] = self._config.upload_checksum
        deadline = time.monotonic() + self._config.write_timeout_s
        backoff = THROTTLE_BACKOFF_S
        while True:
            try:
                self._run(lambda c: c.put_object(**args))
                return OK
            except TierUnavailable as exc:
                log.debug("s3 tier %r: write of %s dropped (%s)", self.name, name, exc)
                return UNAVAILABLE
            except self._errors.answered as exc:
                if conditional and is_held(exc):
                    return EXISTS
                if not is_throttle(exc):
                    self._log_refusal("write", name, exc)
                    return IO_ERROR
                left = deadline - time.monotonic()
                if left <= backoff:
                    log.info("s3 tier %r: write of %s throttled past write_timeout_s; "
                             "dropped", self.name, name)
                    with self._lock:
                        self.throttled_writes += 1
                    return TierResult(Failure.TIMEOUT)
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _log_refusal(self, action: str, name: str, exc: BaseException | str) -> None:
        """Log a lookup, read, write or delete the endpoint answered with an error (not
        "absent"; `exc` or its code): at warning the first time of each error code, then at
        debug. The endpoint is up, so nothing else tells the operator: credentials revoked
        or expired mid-run (403 InvalidAccessKeyId, ExpiredToken) fail every call, reads
        and lookups silently; without s3:DeleteObject, capacity is never enforced."""
        code = exc if isinstance(exc, str) else error_code(exc) or type(exc).__name__
        with self._lock:
            first = code not in self._refusals
            self._refusals.add(code)
        if not first:
            log.debug("s3 tier %r: %s of %s refused (%s)", self.name, action, name, code)
            return
        hint = " (credentials refused: revoked, expired, or without this right?)" \
            if code in REFUSED_CODES else ""
        effect = ("chunks beyond capacity stay" if action == "delete" else
                  "lookups and reads miss and writes are dropped")
        log.warning("s3 tier %r: %s answered a %s of %s with %s%s; %s while it does (logged "
                    "once per error code)", self.name, self.endpoint, action, name, code, hint,
                    effect)

    def keep_manifest(self, manifest: NamespaceManifest) -> None:
        """Record the namespace's manifest (`ManifestKeeper`): written after the first chunk
        this tier stores, so that an endpoint that is down costs start-up nothing."""
        self._manifest = manifest

    def _write_manifest(self) -> None:
        manifest, self._manifest = self._manifest, None
        if manifest is None:
            return
        try:
            self._run(lambda c: write_manifest(c, self._config.bucket, self.names, manifest,
                                               self._says_absent))
        except self._failed as exc:
            log.warning("s3 tier %r: namespace manifest not written (%s); retried after the "
                        "next stored chunk", self.name, type(exc).__name__)
            self._manifest = manifest

    def _maybe_enforce_capacity(self) -> None:
        """capacity > 0: a listing of the namespace (on a thread of its own) at most every
        `listing_interval_s`, evicting the oldest objects beyond capacity."""
        if self._config.capacity <= 0:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._listed_at < self._config.listing_interval_s or (
                    self._listing is not None and self._listing.is_alive()):
                return
            self._listed_at = now
            self._listing = threading.Thread(target=self.enforce_capacity, daemon=True,
                                             name=f"kvtier-s3-list-{self.name}")
            self._listing.start()

    def enforce_capacity(self) -> None:
        """List the namespace, evict the least recently written objects beyond `capacity`,
        and update `chunks`/`used_bytes`/`evictions`. Never raises. A listing that a put or
        delete of this process overlapped (under way when it began or ended, or done
        meanwhile) may or may not have seen it, so its count is not set: the listing is run
        again (up to LISTING_TRIES times), else the count stays what this process counted
        until the next listing."""
        for _ in range(LISTING_TRIES):
            with self._lock:
                # A change under way now may land before or after the listing sees it: the
                # count would not be set (-1 matches nothing), run again.
                changes = -1 if self._changing_now else self._changes
            try:
                kept, used, evicted, gone, refused = self._run(lambda c: enforce_capacity(
                    c, self._config, self.names, self._config.capacity))
            except self._failed as exc:
                log.info("s3 tier %r: capacity listing failed (%s)", self.name,
                         type(exc).__name__)
                return
            for name, code in refused.items():  # capacity is not enforced while it lasts
                self._log_refusal("delete", name, code)
            self._counters.add(evictions=evicted)
            for hex_key in gone:  # whoever stored them: this process evicted them
                self.events.removed(ChunkKey(bytes.fromhex(hex_key)))
            with self._lock:
                if self._changes == changes and not self._changing_now:
                    self._counters.set(chunks=kept, used_bytes=used)
                    return

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """A put or delete of this process under way, its counts added inside the block: a
        capacity listing that overlaps it in any way sets no count (`enforce_capacity`)."""
        with self._lock:
            self._changing_now += 1
        try:
            yield
        finally:
            with self._lock:
                self._changing_now -= 1
                self._changes += 1

    def delete(self, key: ChunkKey) -> bool:
        name = self.names.chunk(key)
        bucket = self._config.bucket
        with self._changing():
            try:
                head = self._run(lambda c: c.head_object(Bucket=bucket, Key=name))
                self._run(lambda c: c.delete_object(Bucket=bucket, Key=name))
            except TierUnavailable:
                return False
            except self._errors.answered as exc:
                if not self._says_absent(exc):
                    self._log_refusal("delete", name, exc)
                return False
            # What this process knows; the next capacity listing counts every writer's.
            self._counters.add(chunks=-1, used_bytes=-int(head.get("ContentLength", 0)))
        self.events.removed(key)
        return True

    # -- upkeep ------------------------------------------------------------------------------
    def measure_link(self) -> LinkSpeed | None:
        """See core.tier.LinkProbe: a probe object PUT, HEADed and GOT, then deleted
        (tiers/s3/link.py), within links.LINK_DEADLINE_S. None (logged) when the endpoint is
        down, refuses, or the measure is late. Any thread."""
        return self._link.measure(lambda deadline: measure_endpoint(
            self._run, self._config.bucket, self.names, deadline, probe=self._probe))

    def available(self) -> bool:
        """Whether the endpoint is not marked down."""
        return not self.guard.down_endpoints()

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def close(self) -> None:
        self._link.wait_idle(LINK_DEADLINE_S)  # a link measure deletes its probe object
        self._heads.shutdown(wait=False, cancel_futures=True)
        for client in (self._client, self._head_client):
            client.close()

