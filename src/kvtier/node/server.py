"""`kvtier node`: one cache per node, shared by its engines, outliving their restarts.

The node owns the tier stack (RAM, disk, shared, redis, s3: a `TieredStore` per KV layout its
engines bring, built from the node's config), its index, eviction and write-behind. The RAM
tier's slab lives in named shared memory (`MemoryTierConfig.shared_memory`): engines map it
and copy blocks straight into and out of its slots, so a RAM hit through the node costs the
copies of an in-process hit plus one control round trip per request.

Each engine thread holds one connection (a Unix stream socket, mode 0660: the node's group);
a connection's leases (chunks lent for a load, slots reserved for stores) end with it, so an
engine killed mid-load or mid-store leaks nothing. Each connection is served on a thread of
its own: a slow tier read for one engine holds up no other engine.

With an events endpoint (`NodeConfig.events_endpoint`), the node publishes its tiers' KV
events for cache-aware routers, once for all its engines (events.py).

Primitives: `NodeServer`, `NodeConfig`, `NodeCounters`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import gc
import itertools
import logging
import math
import mmap
import os
import re
import secrets
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.loans import Lending
from kvtier.core.stall import call_within
from kvtier.core.store import ChunkView, PendingPut, TieredStore
from kvtier.errors import ConfigError
from kvtier.node.eventpub import ALLOWED as ENDPOINTS
from kvtier.node.eventpub import check_endpoint
from kvtier.node.events import NodeEvents
from kvtier.node.latency import Latencies
from kvtier.node.links import NodeLinks
from kvtier.node.protocol import (
    HELD,
    MAX_FRAME,
    SEND,
    SKIPPED,
    Answer,
    Borrow,
    Commit,
    Describe,
    Flush,
    Found,
    Hello,
    Lent,
    Lookup,
    MeasureLinks,
    Refused,
    Release,
    Reply,
    Request,
    Reserve,
    Reserved,
    Retain,
    Status,
    Touch,
    Welcome,
    receive_request,
    send,
)
from kvtier.tiers import open_store
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.shmslab import SHM_DIR
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.units import format_size

log = logging.getLogger(__name__)
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SLAB_DIGEST = re.compile(r"[0-9a-f]{16}")  # a slab's name: kvtier-<node>-<its layout's>
MAX_LAYOUTS_LIMIT = 1024  # --max-layouts' bound: far past any node's RAM for a slab each
STALE_PROBE_S = 2.0  # how long a socket file's probe waits for a node to accept
# What a Reserve may spend asking the tiers below RAM whether they hold the chunks RAM has no
# slot for (an index lookup and a stat a disk tier, a batch a remote one); past it they are
# sent, as without the question: a tier below RAM gone slow must not make the engine's
# store call (its deadline: lookup_timeout_s, 1 s by default) wait for its read timeout.
HELD_BELOW_BUDGET_S = 0.1
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path on Linux: sun_path's 108, less its NUL


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """A node's settings: its tiers (the connector's `tiers` schema; the first a memory tier,
    whose slab the node puts in shared memory) and where it listens."""

    store: StoreConfig  # capacities per KV layout (an engine's TP rank brings one)
    socket_path: Path
    name: str = field(default_factory=socket.gethostname)
    max_layouts: int = 4  # layouts (models x TP ranks) held at once; one more is refused
    # Leave the RAM slabs in /dev/shm when the node stops, for the next node on this name to
    # recover their chunks (a crash leaves them anyway); False: removed at a clean stop.
    keep_ram: bool = True
    # Where the node publishes its tiers' KV events (events.py): tcp://HOST:PORT (connects, as
    # vLLM's publisher does), tcp://*:PORT or ipc://PATH (binds); None: none, nothing listens.
    events_endpoint: str | None = None
    # Tokens a block of the events announce (a chunk as tokens_per_chunk / event_block_size
    # chained blocks: NVIDIA Dynamo's router drops blocks of another size than its own); None:
    # one block a chunk. A layout whose chunk it does not divide is announced a block a chunk.
    event_block_size: int | None = None
    # How long a stop waits for the writes queued behind RAM (the rest are dropped and logged,
    # and a write stuck in a tier that stopped answering is not waited for): under the pod's
    # termination grace period (120 s in deploy/kubernetes-node), which ends in SIGKILL.
    stop_flush_s: float = 60.0

    def __post_init__(self) -> None:
        """Raises:
            ConfigError: a setting of the wrong type or out of its range, naming it.
        """
        if not isinstance(self.store, StoreConfig):
            raise ConfigError("store", self.store, "a StoreConfig (StoreConfig.parse or .load)")
        first = self.store.tiers[0]
        if first.kind != "memory":
            raise ConfigError("tiers[0].kind", first.kind,
                              "memory (the node shares its RAM tier with its engines)")
        _check_socket_path(self.socket_path)
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError("name", self.name, "1-64 letters, digits, '.', '_' or '-' "
                              "(it names the node's slabs in /dev/shm)")
        if not _is_int(self.max_layouts) or not 1 <= self.max_layouts <= MAX_LAYOUTS_LIMIT:
            raise ConfigError("max_layouts", self.max_layouts,
                              f"a positive integer, at most {MAX_LAYOUTS_LIMIT} (layouts: "
                              "models x TP ranks, each a RAM slab of the tier's capacity)")
        if not isinstance(self.keep_ram, bool):
            raise ConfigError("keep_ram", self.keep_ram, "True or False")
        if self.events_endpoint is not None:
            if not isinstance(self.events_endpoint, str):
                raise ConfigError("events_endpoint", self.events_endpoint,
                                  f"{ENDPOINTS}, or None (nothing published)")
            check_endpoint(self.events_endpoint)
        block = self.event_block_size
        if block is not None and (not _is_int(block) or block < 1):
            raise ConfigError("event_block_size", block, "a positive integer (tokens)")
        flush = self.stop_flush_s
        if isinstance(flush, bool) or not isinstance(flush, (int, float)) \
                or not 0 <= flush < math.inf:
            raise ConfigError("stop_flush_s", flush, "seconds, a finite number 0 or more")
        if block is not None and self.events_endpoint is None:
            raise ConfigError("event_block_size", block,
                              "unset without an events endpoint (--events-endpoint)")


def _is_int(value: object) -> bool:
    """Whether `value` is an int (a bool is not one here: `True` layouts is a slip)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_socket_path(path: object) -> None:
    """Raises ConfigError: `path` is no path a Unix socket can be bound on, or a relative one
    (the engines name the node's socket by its absolute path)."""
    if not isinstance(path, Path) or not path.is_absolute() or not path.name \
            or "\0" in str(path):
        raise ConfigError("socket_path", path,
                          "an absolute path (a pathlib.Path) of the socket's file, no NUL")
    size = len(os.fsencode(path))
    if size > SOCKET_PATH_MAX:
        raise ConfigError("socket_path", path,
                          f"at most {SOCKET_PATH_MAX} bytes (this one has {size}): Linux "
                          f"limits a Unix socket's path to its sun_path's 108 bytes, NUL "
                          f"included")


# The node's own counters (`NodeServer.counters`), each only ever added to.
COUNTERS = ("borrows", "lent_chunks", "read_in_place", "reserved_chunks",
            "committed_chunks",
            "received_chunks", "sent_chunks", "lookups",
            "refused", "disconnects_with_leases", "recovered_chunks", "recovery_dropped_chunks",
            "described_chunks", "events_stored", "events_removed", "stored_unannounced")


class NodeCounters:
    """`COUNTERS`, added to from every connection's thread. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, count: int = 1) -> None:
        """Raises KeyError: `name` is not one of COUNTERS."""
        with self._lock:
            self._values[name] += count

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


@dataclass
class _Layout:
    """One layout's store, and its RAM tier (whose slab the engines map)."""

    store: TieredStore
    memory: MemoryTier
    welcome: Welcome
    model: str  # its first engine's model (a label of the node's metrics)
    links: NodeLinks  # its tiers' links, measured by the node (MeasureLinks' answer)


@dataclass
class _Puts:
    """Slots reserved by one `Reserve`: each a `putting` block left open until its commit."""

    blocks: list[tuple[AbstractContextManager[PendingPut], PendingPut] | None]
    open: int
    chunk_bytes: int


class NodeServer:
    """The node: serves `NodeConfig.socket_path` until `shutdown`. Thread-safe."""

    def __init__(self, config: NodeConfig) -> None:
        """Raises:
            OSError: the socket cannot be bound (a live node there: EADDRINUSE; a file that
                is not a socket: EEXIST), nor the events endpoint (events.py); a running
                node has this node's name (EBUSY: their slabs would be one).
        """
        self.config = config
        self.generation = secrets.token_hex(8)
        self._layouts: dict[str, _Layout] = {}
        self._lock = threading.Lock()
        self._building = threading.Lock()  # a new layout's tiers opening (`layout_for`)
        # Layout digest -> why its tiers last failed to open, as logged: each of its engines
        # asks again every retry_s, and the same error is logged at debug (an error per ask
        # before, for as long as /dev/shm was full). Held under `_building`.
        self._failed_builds: dict[str, str] = {}
        self._closing = False  # `shutdown` has begun
        self._leases: dict[int, tuple[int, Lending[ChunkView] | _Puts]] = {}  # -> owner
        self._lease_ids = itertools.count(1)
        self._connections: dict[int, str] = {}  # connection id -> engine
        self._sockets: dict[int, socket.socket] = {}  # connection id -> its socket
        self._closed = threading.Event()  # set when `shutdown` has closed everything
        self.counters = NodeCounters()
        self.borrow_seconds = Latencies()  # per source: RAM alone, or a tier below it
        self._name_lock: int | None = _hold_name(config.name)
        self.events: NodeEvents | None = None
        try:
            if config.events_endpoint is not None:
                self.events = NodeEvents(config.events_endpoint, config.name,
                                         {t.tier_name: t.kind for t in config.store.tiers},
                                         self.counters.add, block_size=config.event_block_size)
            _clear_stale_socket(config.socket_path)
            self._server = _Server(str(config.socket_path), _Handler)
        except BaseException:
            if self.events is not None:
                self.events.close()
            _let_go_of_name(config.name, self._name_lock)
            self._name_lock = None
            raise
        self._server.node = self
        os.chmod(config.socket_path, 0o660)  # the node's group: its engines
        bound = config.socket_path.stat()
        self._socket_file = (bound.st_dev, bound.st_ino)  # removed at the end if still ours

    def serve_forever(self) -> None:
        """Serve until `shutdown` (from another thread: a signal's handler) has finished."""
        log.info("kvtier node %r: listening on %s (generation %s)", self.config.name,
                 self.config.socket_path, self.generation)
        self._server.serve_forever(poll_interval=0.2)
        # Returning earlier let `kvtier node serve` exit on SIGTERM before the stores were
        # closed: the socket and the /dev/shm slab were left behind, queued writes lost
        # (tests/node/test_node_down.py).
        self._closed.wait()

    def shutdown(self) -> None:
        """Stop serving, end every engine's connection (their leases with them; the engines
        miss, then find the next node), close every store (writes behind RAM are flushed)
        and remove the socket and the shared memory."""
        try:
            with self._lock:
                self._closing = True
            self._server.shutdown()
            self._server.server_close()
            with self._lock:
                layouts, self._layouts = list(self._layouts.values()), {}
                sockets = list(self._sockets.values())
            for sock in sockets:  # else their threads go on serving from closed stores
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            deadline = time.monotonic() + self.config.stop_flush_s
            for layout in layouts:
                layout.store.close(max(0.0, deadline - time.monotonic()))
            if self.events is not None:
                self.events.close()  # after the stores: what their closing stored goes out
            with contextlib.suppress(FileNotFoundError):
                found = self.config.socket_path.stat()
                if (found.st_dev, found.st_ino) == self._socket_file:  # not a successor's
                    self.config.socket_path.unlink()
        finally:
            if self._name_lock is not None:  # a second shutdown: the name is another's now
                _let_go_of_name(self.config.name, self._name_lock)
                self._name_lock = None
            self._closed.set()

    @property
    def closing(self) -> bool:
        """Whether `shutdown` has begun (no request is answered from then on)."""
        return self._closing

    def status(self) -> dict[str, Any]:
        """What `kvtier node status` prints: engines, leases, counters and each layout's
        tiers."""
        with self._lock:
            layouts = dict(self._layouts)
            leases = len(self._leases)
            engines = sorted(set(self._connections.values()))
        return {
            "node": self.config.name, "generation": self.generation,
            "socket": str(self.config.socket_path), "engines": engines,
            "events_endpoint": self.config.events_endpoint,
            "event_block_size": self.config.event_block_size,
            "tiers": [tier.tier_name for tier in self.config.store.tiers],
            "connections": len(self._connections), "leases": leases,
            "counters": self.counters.snapshot(),
            "borrow_seconds": self.borrow_seconds.snapshot(),
            "layouts": {digest: {
                "model": layout.model, "shm_path": layout.welcome.shm_path,
                "chunk_bytes": layout.welcome.chunk_bytes,
                "engines": layout.memory.engine_usage(),
                "tiers": [s.as_dict() for s in layout.store.stats().tiers]}
                for digest, layout in layouts.items()},
        }

    # -- requests ---------------------------------------------------------------------------
    def layout_for(self, hello: Hello) -> _Layout | Refused:
        """The store of the engine's layout, built at its first engine's hello."""
        try:
            layout = msgspec.convert(hello.layout, KVLayout)
        except (msgspec.ValidationError, ConfigError) as exc:
            return Refused(f"bad layout: {exc}")
        unservable = self._unservable(layout)
        if unservable is not None:
            return Refused(unservable)
        digest = layout.digest()
        with self._lock:
            known = self._layouts.get(digest)
        if known is not None:
            return known
        # Built one at a time, outside the node's lock: a tier that takes long to open (a
        # dead mount) holds up other layouts' first engines, never the node's status, leases
        # or stop.
        with self._building:
            with self._lock:
                known = self._layouts.get(digest)
                if known is not None:
                    return known
                if len(self._layouts) >= self.config.max_layouts:
                    return Refused(f"the node holds {len(self._layouts)} layouts "
                                   "(max_layouts)")
                if self._closing:
                    return Refused("the node is stopping")
            built = self._build(digest, layout, hello)
            if isinstance(built, Refused):
                return built
            known = built
        # The layout's tiers are built: the heap is frozen, as vLLM freezes an engine's once
        # started (`freeze_gc_heap`), so that no full collection walks the maps that grow from
        # here on (a disk tier's CLOCK ring of 2 million keys, rebuilt in place: ~30 ms a
        # collection, every connection's thread stopped meanwhile; frozen: none). Once a
        # layout, a few ms.
        gc.collect()
        gc.freeze()
        # A predecessor's slab (a restart) is recovered behind the engines' requests.
        threading.Thread(target=self._recover, args=(digest, known.memory), daemon=True,
                         name=f"kvtier-recover-{digest[:8]}").start()
        return known

    def _unservable(self, layout: KVLayout) -> str | None:
        """Why no chunk of `layout` could pass through this node (None: some could): its RAM
        has no slot of its size and a frame cannot carry it (a SEND). Refused before its tiers
        are built: a Hello of absurd sizes (any user of the node's group may send one) raised
        from its slab's header with a traceback, left its /dev/shm file behind, and one just
        below that took one of `max_layouts` for a layout that stores nothing
        (tests/node/test_node_hostile_layouts.py)."""
        chunk_bytes = layout.bytes_per_chunk
        capacity = self.config.store.tiers[0].capacity
        if chunk_bytes <= capacity or chunk_bytes < MAX_FRAME // 2:
            return None
        return (f"bad layout: a chunk of {chunk_bytes} B; the node's RAM (tiers[0].capacity "
                f"{capacity} B) has no slot of that size and a message carries at most "
                f"{MAX_FRAME // 2} B of chunk")

    def _build(self, digest: str, layout: KVLayout, hello: Hello) -> _Layout | Refused:
        """Open the tiers of a new layout and enter it (unless the node stopped meanwhile)."""
        name = f"kvtier-{self.config.name}-{digest[:16]}"
        recovering = (SHM_DIR / name).exists()  # a predecessor's slab, kept
        tiers = [self.config.store.tiers[0].model_copy(update={"shared_memory": name}),
                 *self.config.store.tiers[1:]]
        try:
            store = open_store(self.config.store.model_copy(update={"tiers": tiers}),
                               layout, NamespaceInfo(hello.model, hello.fingerprint,
                                                     hello.weight_files))
        except OSError as exc:  # /dev/shm full (ENOSPC), a tier's directory unwritable
            stale = self._unused_slabs() if exc.errno == errno.ENOSPC else ""
            said = f"{exc}{stale}"
            again, self._failed_builds[digest] = self._failed_builds.get(digest) == said, said
            log.log(logging.DEBUG if again else logging.ERROR,
                    "kvtier node: layout %s (%s): its tiers cannot open (%s); engines "
                    "of this layout are refused until they can%s", digest[:16],
                    hello.model, exc, stale)
            return Refused(f"the node cannot open this layout's tiers: {exc} (its RAM "
                           f"slab is {SHM_DIR / name}){stale}")
        memory = store.tiers[0]
        assert isinstance(memory, MemoryTier) and memory.shared_memory_path is not None
        welcome = Welcome(str(memory.shared_memory_path),
                          memory.num_slots * memory.slot_bytes, memory.chunk_bytes,
                          self.generation, self.config.name,
                          events=self.events is not None,
                          tiers=[tier.name for tier in store.tiers])
        memory.keep_shared_memory = self.config.keep_ram
        built = _Layout(store, memory, welcome, hello.model,
                        NodeLinks(store, memory.chunk_bytes))
        with self._lock:
            entered = not self._closing
            if entered:
                self._layouts[digest] = built
        if not entered:  # the node stopped meanwhile: its new slab, empty, is not kept (a
            memory.keep_shared_memory = False  # successor would take it for the one aside)
            store.close(0.0)
            return Refused("the node is stopping")
        self._failed_builds.pop(digest, None)  # a later failure is news
        store.start_reads()  # the first Borrow's reads start at once
        if self.events is not None:
            self.events.add_layout(store, hello.model, layout.tokens_per_chunk,
                                   announce=layout.tp_rank == 0, clear=not recovering)
        log.info("kvtier node: layout %s (%s, %d B chunks): %d RAM slots in %s",
                 digest[:16], hello.model, memory.chunk_bytes, memory.num_slots,
                 welcome.shm_path)
        return built

    def _unused_slabs(self) -> str:
        """The slabs of this node's name that no running node holds (layouts of earlier
        nodes: kept for a successor to recover, never swept, as their model may come back),
        as a note for an error about a full /dev/shm; "" when there are none."""
        with self._lock:  # this node's; no other node of its name runs (`_hold_name`)
            mine = {f"kvtier-{self.config.name}-{digest[:16]}" for digest in self._layouts}
        unused = []
        for path in _slabs_of(self.config.name, aside=True):
            with contextlib.suppress(OSError):
                if path.name not in mine:
                    unused.append(f"{path} ({format_size(path.stat().st_size)})")
        return "" if not unused else (
            "; slabs of this node's earlier layouts no engine asks for now hold "
            f"{SHM_DIR}: {', '.join(unused)} (remove those of models no longer served)")

    def _recover(self, digest: str, memory: MemoryTier) -> None:
        try:
            recovered, dropped = memory.recover()
        except Exception:  # a damaged old slab costs its chunks, never the node
            log.exception("kvtier node: layout %s: recovering the RAM tier failed", digest[:16])
            return
        self.counters.add("recovered_chunks", recovered)
        self.counters.add("recovery_dropped_chunks", dropped)
        if recovered or dropped:
            log.info("kvtier node: layout %s: %d chunks recovered into RAM from the last "
                     "node's slab, %d dropped (torn or damaged)", digest[:16], recovered,
                     dropped)

    def borrow(self, owner: int, layout: _Layout, request: Borrow, spares: list[memoryview],
               part: Callable[[Lent], None] | None = None) -> Lent:
        """Lend the request's chunks in order until the first miss, each in the RAM slab
        (a chunk below RAM is promoted by its read); a chunk RAM cannot take (read into a
        spare, which the engine cannot see) goes in the reply's `data` (SEND), up to half
        a frame's bound, where the run ends. `part` (a streamed Borrow): sent each part of the
        reply but the last (returned) as soon as the next chunk has not landed yet."""
        keys = [ChunkKey(k) for k in request.keys]
        if self._lending_open(owner):
            # The connection's spares may still take an earlier lending's late reads (a run
            # cut at the frame's bound): this one reads into spares of its own.
            spares = []
        if len(spares) < len(keys):
            spares.extend(_spare_buffers(len(keys) - len(spares), layout.memory.chunk_bytes))
        started = time.monotonic()
        until = None if request.budget_s is None else started + request.budget_s
        # The connection's own list: a spare a late read may still write into is replaced
        # in it by the lending (an abandoned read), never handed to the next Borrow.
        lending = layout.store.lend_as_landed(keys, spares,
                                              [m.chunk_meta() for m in request.metas],
                                              in_order=True, until=until)
        reply = Lent(0, [], [], None)  # the part not sent yet
        lent = sent = 0
        ram = layout.memory.name
        below = False  # a chunk came from below RAM
        with contextlib.ExitStack() as undo:
            undo.callback(lending.close)
            for loan in lending:
                offset = layout.memory.offset_of(loan.view.data)
                if offset is None:
                    if (sent + 1) * len(loan.view.data) > MAX_FRAME // 2:
                        break
                    reply.data.append(bytes(loan.view.data))  # the spare is the next Borrow's
                    sent += 1
                    offset = SEND
                reply.offsets.append(offset)
                reply.tiers.append(loan.view.tier)
                below = below or loan.view.tier != ram
                lent += 1
                if part is not None and lent < lending.stopped_at and not lending.ready():
                    reply.more = True
                    part(reply)
                    reply = Lent(0, [], [], None)
            failed = lending.failed_tier if lending.stopped_at == lent else None
            self.counters.add("borrows")
            self.counters.add("lent_chunks", lent - sent)
            self.counters.add("sent_chunks", sent)
            below = below or failed not in (None, ram)
            self.borrow_seconds.observe("below" if below else "ram",
                                        time.monotonic() - started)
            reply.failed_tier = failed
            if not lent:
                return reply
            undo.pop_all()  # kept until Release, or the connection's end
        reply.lease = self._lease(owner, lending)
        return reply

    def reserve(self, owner: int, layout: _Layout, request: Reserve, spare: memoryview
                ) -> Reserved:
        """A RAM slot per key for the engine to fill, or HELD (stored already, in RAM or,
        where RAM has no slot, below it: the pin and expiry of its meta applied), SEND (no
        RAM slot: declined, full, or the engine at its `engine_quota` with every chunk of its
        own pinned, but a tier below RAM takes the bytes the engine sends with its commit)
        or SKIPPED (no tier takes it). Each chunk is the engine's (`ChunkMeta.engine`: its
        quota's)."""
        offsets: list[int] = []
        puts = _Puts([], 0, layout.memory.chunk_bytes)
        engine = self._engine_of(owner)
        try:
            for key, meta in zip(request.keys, request.metas):
                chunk_meta = dataclasses.replace(meta.chunk_meta(), engine=engine)
                block = layout.store.putting(ChunkKey(key), spare, chunk_meta)
                put = block.__enter__()
                offset = None if put.data is None or not put.in_place \
                    else layout.memory.offset_of(put.data)
                if offset is None and (put.data is None or not _sendable(put)):
                    put.cancel()  # held, or no tier takes it (or its bytes cannot come)
                    block.__exit__(None, None, None)
                    offsets.append(HELD if put.stored else SKIPPED)
                    puts.blocks.append(None)
                    continue
                # A RAM slot, or (RAM has none) the lower tiers' bytes to come with the commit.
                offsets.append(SEND if offset is None else offset)
                puts.blocks.append((block, put))
                puts.open += 1
            self._held_below(layout, request, engine, offsets, puts)
        except BaseException:
            _end(puts)  # slots reserved before a tier raised are given back, not leaked
            raise
        self.counters.add("reserved_chunks", puts.open)
        return Reserved(self._lease(owner, puts) if puts.open else 0, offsets)

    @staticmethod
    def _held_below(layout: _Layout, request: Reserve, engine: str | None,
                    offsets: list[int], puts: _Puts) -> None:
        """Turn each SEND whose chunk a tier below RAM holds already (or a write behind
        carries) into HELD, its `putting` ended: the engine ships no bytes the node has (the
        disk's put would drop them), and RAM, which has no slot, gets no promotion. One
        batch per remote tier (`contains_many`), only for the SENDs: rare, RAM gives most
        chunks a slot. Its meta's pin and expiry go to the tiers that hold it, as a HELD in
        RAM gets them from `reserve`. All within `HELD_BELOW_BUDGET_S`, else they stay SENDs."""
        sends = [i for i, offset in enumerate(offsets) if offset == SEND]
        if not sends:
            return
        keys = [ChunkKey(request.keys[i]) for i in sends]
        metas = [dataclasses.replace(request.metas[i].chunk_meta(), engine=engine)
                 for i in sends]

        def held_below() -> list[bool]:
            found = layout.store.contains_many(keys)
            for key, meta, held in zip(keys, metas, found):
                if held and not meta.is_default:
                    layout.store.retain(key, meta)
            return found

        answered, found = call_within(held_below, HELD_BELOW_BUDGET_S,
                                      "kvtier-node-held-below")
        for i, held in zip(sends, found if answered and found is not None else []):
            taken = puts.blocks[i]
            if not held or taken is None:
                continue
            block, put = taken
            put.cancel()
            block.__exit__(None, None, None)
            puts.blocks[i], offsets[i] = None, HELD
            puts.open -= 1

    def commit(self, owner: int, request: Commit) -> None:
        with self._lock:
            entry = self._leases.get(request.lease)
        if entry is None or entry[0] != owner or not isinstance(entry[1], _Puts):
            return
        puts = entry[1]
        if not 0 <= request.index < len(puts.blocks):
            return
        taken, puts.blocks[request.index] = puts.blocks[request.index], None
        if taken is None:
            return
        block, put = taken
        if not put.in_place:  # a SEND: the bytes come with the commit (the spare is shared)
            if request.data is not None and len(request.data) == puts.chunk_bytes:
                put.data = memoryview(request.data)
                self.counters.add("received_chunks", int(request.filled))
            else:
                put.cancel()
        if not request.filled:
            put.cancel()
        block.__exit__(None, None, None)  # stores it (and queues the writes behind RAM)
        self.counters.add("committed_chunks", int(request.filled))
        if request.reply and self.events is not None:
            self.events.wake()  # the step's last commit: its chunks are announced now
        puts.open -= 1
        if puts.open == 0:
            with self._lock:
                self._leases.pop(request.lease, None)

    def describe(self, layout: _Layout, request: Describe) -> None:
        """Token ids of chunks an engine of `layout`'s model plans to store, for the events."""
        if self.events is not None:
            self.events.describe(layout.model, request.chunks)

    def release(self, owner: int, lease: int) -> None:
        """End connection `owner`'s `lease` (another connection's is not its to end)."""
        with self._lock:
            entry = self._leases.get(lease)
            if entry is None or entry[0] != owner:
                return
        # Ended, then uncounted: a status that shows no lease shows its slots free (a
        # connection's requests come one at a time: nothing else ends it meanwhile).
        _end(entry[1])
        with self._lock:
            self._leases.pop(lease, None)

    def disconnected(self, owner: int) -> None:
        """A connection ended (the engine closed it, exited or was killed): its leases end;
        not once the node stops (`shutdown` ends every connection while their engines live: a
        slot one of them still copies from must not be handed to another's store meanwhile;
        the next node recovers the slab as its records say)."""
        with self._lock:
            self._connections.pop(owner, None)
            self._sockets.pop(owner, None)
            if self._closing:
                return
            mine = [lease for lease, (who, _) in self._leases.items() if who == owner]
            ended = [self._leases[lease][1] for lease in mine]
        # Ended while still counted, then uncounted and the disconnect counted at once: a
        # status that shows no lease shows their slots free and the disconnect counted, and
        # one that shows the disconnect counted shows no lease.
        for held in ended:
            _end(held)
        if ended:
            with self._lock:
                for lease in mine:
                    self._leases.pop(lease, None)
                self.counters.add("disconnects_with_leases")
            log.info("kvtier node: a connection ended holding %d leases; released", len(ended))

    def _lease(self, owner: int, held: Lending[ChunkView] | _Puts) -> int:
        with self._lock:
            lease = next(self._lease_ids)
            self._leases[lease] = (owner, held)
            return lease

    def _lending_open(self, owner: int) -> bool:
        """Whether a lending of connection `owner` is not released yet."""
        with self._lock:
            return any(who == owner and not isinstance(held, _Puts)
                       for who, held in self._leases.values())

    def _engine_of(self, owner: int) -> str | None:
        with self._lock:
            return self._connections.get(owner)

    def connected(self, owner: int, engine: str) -> None:
        with self._lock:
            self._connections[owner] = engine

    def opened(self, owner: int, sock: socket.socket) -> None:
        """A connection accepted (ended by `shutdown` if still open then)."""
        with self._lock:
            self._sockets[owner] = sock


def _spare_buffers(count: int, chunk_bytes: int) -> list[memoryview]:
    """`count` page-aligned buffers of `chunk_bytes`, all in one anonymous mapping (its pages
    taken only when a read writes them). A mapping each, as before, let one Borrow of as many
    keys as a frame holds take the process's `vm.max_map_count`: every other engine's next
    buffer failed (ENOMEM) and its connection dropped (tests/node/test_node_borrow_mappings.py).

    Raises:
        OSError: ENOMEM, the mapping is larger than the kernel allows (the connection ends).
    """
    stride = -(-chunk_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    whole = memoryview(mmap.mmap(-1, count * stride))
    return [whole[i * stride:i * stride + chunk_bytes] for i in range(count)]


def _sendable(put: PendingPut) -> bool:
    """Whether a chunk RAM has no slot for can come with its commit (a frame's bound)."""
    return put.data is not None and len(put.data) < MAX_FRAME // 2


def _end(held: Lending[ChunkView] | _Puts) -> None:
    """End a lease: a lending's loans released; reserved slots never committed given back."""
    if isinstance(held, _Puts):
        for taken in held.blocks:
            if taken is not None:
                taken[1].cancel()
                taken[0].__exit__(None, None, None)
        held.blocks.clear()
    else:
        held.close()


def _hold_name(name: str) -> int:
    """Hold the lock of node name `name` on this host (/dev/shm/kvtier-<name>.lock, an flock
    held as long as the node runs, which the kernel drops when it ends): a node's name is its
    slabs' names, and two nodes of one name would lend each other's slots. The lock's fd.

    Raises:
        OSError: EBUSY, a node of that name runs; no /dev/shm.
    """
    path = SHM_DIR / f"kvtier-{name}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(errno.EBUSY, f"a kvtier node named {name!r} is running on this host "
                                       f"(it holds {path}): give each node its own "
                                       "--name") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            held = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            held = False
        if held:
            return fd
        os.close(fd)  # a node that stopped meanwhile removed it: the path's file now


def _let_go_of_name(name: str, fd: int) -> None:
    """Remove the name's lock file, then drop the lock (so a node that opened the file before
    it went finds, once it holds the lock, that the path names another file: `_hold_name`)."""
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / f"kvtier-{name}.lock").unlink()
    os.close(fd)


def _slabs_of(name: str, aside: bool = False) -> list[Path]:
    """The RAM slabs of nodes named `name` in /dev/shm (kvtier-<name>-<layout>; not those of
    a node whose name only starts like it), and with `aside` those a successor moved aside
    (<slab>.old, until recovered)."""
    prefix = f"kvtier-{name}-"
    return [path for path in sorted(SHM_DIR.glob(prefix + "*"))
            if _SLAB_DIGEST.fullmatch(path.name.removeprefix(prefix).removesuffix(
                ".old" if aside else ""))]


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket file a dead node left; refuse to start beside a live one, or over a
    file that is not a socket.

    Raises:
        OSError: EADDRINUSE, a node answers there (or accepts and does not answer: stopped);
            EEXIST, a file that is not a socket.
    """
    try:
        found = path.lstat()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not stat.S_ISSOCK(found.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket: not replaced")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(STALE_PROBE_S)  # a stopped node's full queue would block a connect
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:  # no one listens: a dead node's file
        path.unlink()
        return
    except (TimeoutError, BlockingIOError) as exc:  # its queue full: not accepting
        raise OSError(errno.EADDRINUSE, f"a process listens on {path} and does not accept "
                                        "(a kvtier node stopped?)") from exc
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"a kvtier node is already listening on {path}")


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    request_queue_size = socket.SOMAXCONN  # engines reconnecting at once after a restart
    node: NodeServer

    def server_bind(self) -> None:
        """Bind the socket's file as the node's alone (0600, narrowed by the umask; Linux
        takes a unix socket's file mode from its inode), widened to its group by `NodeServer`
        once bound: bound with the process's mode bits, under umask 0 the file was 0777 until
        that chmod, and any user of the host who connected meanwhile kept a connection
        (tests/node/test_node_socket_bind.py)."""
        os.fchmod(self.socket.fileno(), 0o600)
        super().server_bind()


class _Handler(socketserver.BaseRequestHandler):
    """One connection: its requests in order, on its own thread."""

    server: _Server

    def handle(self) -> None:
        node = self.server.node
        owner = id(self)
        sock: socket.socket = self.request
        layout: _Layout | None = None
        spares: list[memoryview] = []
        scratch: memoryview | None = None
        node.opened(owner, sock)
        try:
            while True:
                try:
                    request = receive_request(sock)
                except (msgspec.MsgspecError, ValueError) as exc:
                    send(sock, Refused(f"bad message: {exc}"))
                    return
                if request is None or node.closing:
                    return
                if isinstance(request, Hello):
                    answer = node.layout_for(request)
                    if isinstance(answer, Refused):
                        node.counters.add("refused")
                        send(sock, answer)
                        continue
                    layout = answer
                    node.connected(owner, request.engine)
                    send(sock, layout.welcome)
                    continue
                if isinstance(request, Release):
                    node.release(owner, request.lease)
                    continue
                if isinstance(request, Touch):
                    if layout is not None:
                        layout.memory.touch([ChunkKey(k) for k in request.keys])
                        node.counters.add("read_in_place", len(request.keys))
                    continue
                if isinstance(request, Commit):
                    node.commit(owner, request)
                    if request.reply:
                        send(sock, Answer(True))
                    continue
                if isinstance(request, Status):
                    send(sock, Answer(node.status()))
                    continue
                if isinstance(request, Describe):
                    if layout is not None:
                        node.describe(layout, request)
                    continue
                if layout is None:
                    send(sock, Refused("say Hello first"))
                    continue
                if scratch is None:
                    scratch = memoryview(mmap.mmap(-1, layout.memory.chunk_bytes))
                send(sock, _answer(node, owner, layout, request, spares, scratch,
                                   lambda part: send(sock, part)))
        except OSError:
            return  # the engine went away mid-message
        finally:
            node.disconnected(owner)


def _answer(node: NodeServer, owner: int, layout: _Layout, request: Request,
            spares: list[memoryview], scratch: memoryview,
            part: Callable[[Lent], None]) -> Reply:
    """The reply to a request about the connection's layout (`part`: sends a part of a
    streamed one)."""
    if isinstance(request, Lookup):
        node.counters.add("lookups")
        keys = [ChunkKey(k) for k in request.keys]
        if request.ram_only:
            return Found([layout.memory.contains(key) for key in keys])
        # One batch per remote tier below RAM, not a round trip per key.
        return Found(layout.store.contains_many(keys))
    if isinstance(request, MeasureLinks):  # measured now the first time, then when due
        return Answer({name: [speed.round_trip_s, speed.bytes_per_s]
                       for name, speed in layout.links.current().items()})
    if isinstance(request, Borrow):
        return node.borrow(owner, layout, request, spares, part if request.stream else None)
    if isinstance(request, Reserve):
        return node.reserve(owner, layout, request, scratch)
    if isinstance(request, Retain):
        return Answer(layout.store.retain(ChunkKey(request.key), request.meta.chunk_meta()))
    if isinstance(request, Flush):
        return Answer(layout.store.flush(request.timeout_s))
    return Refused(f"unexpected {type(request).__name__}")


@contextlib.contextmanager
def running_node(config: NodeConfig) -> Iterator[NodeServer]:
    """A node serving on a thread of this process until the block ends (tests, benches)."""
    node = NodeServer(config)
    thread = threading.Thread(target=node.serve_forever, name="kvtier-node", daemon=True)
    thread.start()
    try:
        yield node
    finally:
        node.shutdown()
        thread.join(timeout=10)
