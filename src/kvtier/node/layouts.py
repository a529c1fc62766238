"""The KV layouts a node serves: a layout's tiers opened from the node's config, its RAM slab
named after the node and the layout in /dev/shm (a predecessor's recovered), and what its
engines are told at their Hello; and the node's set of them (`ServedLayouts`), each built at
its first engine's Hello, one at a time, outside the lock its engines' lookups take. Apart
from the server, which answers requests from a layout's store.

Primitives: `ServedLayout`, `ServedLayouts`, `slab_name`, `unservable`, `open_layout`,
`start_layout`, `recover_ram`.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import threading
from dataclasses import dataclass

import msgspec

from kvtier.core.layout import KVLayout
from kvtier.core.store import TieredStore
from kvtier.errors import ConfigError
from kvtier.node.config import NodeConfig
from kvtier.node.counters import NodeCounters
from kvtier.node.events import NodeEvents
from kvtier.node.hostfiles import slabs_of
from kvtier.node.links import NodeLinks
from kvtier.node.protocol import MAX_FRAME, Hello, Refused, Welcome
from kvtier.node.refusals import Refusals
from kvtier.tiers import open_store
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.shmslab import SHM_DIR, is_own_file
from kvtier.units import format_size

log = logging.getLogger(__name__)


@dataclass
class ServedLayout:
    """One layout's store, and its RAM tier (whose slab the engines map)."""

    store: TieredStore
    memory: MemoryTier
    welcome: Welcome
    model: str  # its first engine's model (a label of the node's metrics)
    links: NodeLinks  # its tiers' links, measured by the node (MeasureLinks' answer)
    inherited: bool  # its slab a predecessor's, kept: its chunks are to be recovered


def slab_name(node_name: str, digest: str) -> str:
    """The name in /dev/shm of the RAM slab of node `node_name`'s layout `digest`."""
    return f"kvtier-{node_name}-{digest[:16]}"


def unservable(layout: KVLayout, ram_capacity: int) -> str | None:
    """Why no chunk of `layout` could pass through a node whose RAM holds `ram_capacity`
    bytes (None: some could): its RAM has no slot of its size and a frame cannot carry it (a
    SEND). Refused before its tiers are built: a Hello of absurd sizes (any user of the
    node's group may send one) raised from its slab's header with a traceback, left its
    /dev/shm file behind, and one just below that took one of `max_layouts` for a layout that
    stores nothing (tests/node/test_node_hostile_layouts.py)."""
    chunk_bytes = layout.bytes_per_chunk
    if chunk_bytes <= ram_capacity or chunk_bytes < MAX_FRAME // 2:
        return None
    return (f"bad layout: a chunk of {chunk_bytes} B; the node's RAM (tiers[0].capacity "
            f"{ram_capacity} B) has no slot of that size and a message carries at most "
            f"{MAX_FRAME // 2} B of chunk")


def open_layout(config: NodeConfig, digest: str, layout: KVLayout, hello: Hello,
                generation: str, events: bool) -> ServedLayout:
    """Open the tiers of layout `layout` (its digest `digest`) for the engine that said
    `hello`, its RAM slab in /dev/shm (a predecessor's, if kept, taken over). `generation`
    and `events` (whether the node publishes events) go to its engines' Welcome.

    Raises:
        OSError: a tier cannot open (/dev/shm full: ENOSPC; a tier's directory unwritable);
        ConfigError: a tier refuses what it finds (a disk tier's directory another user's).
    """
    name = slab_name(config.name, digest)
    inherited = is_own_file(SHM_DIR / name)  # a predecessor's slab, kept
    tiers = [config.store.tiers[0].model_copy(update={"shared_memory": name}),
             *config.store.tiers[1:]]
    store = open_store(config.store.model_copy(update={"tiers": tiers}),
                       layout, NamespaceInfo(hello.model, hello.fingerprint,
                                             hello.weight_files))
    memory = store.tiers[0]
    assert isinstance(memory, MemoryTier) and memory.shared_memory_path is not None
    welcome = Welcome(str(memory.shared_memory_path),
                      memory.num_slots * memory.slot_bytes, memory.chunk_bytes,
                      generation, config.name, events=events,
                      tiers=[tier.name for tier in store.tiers])
    memory.keep_shared_memory = config.keep_ram
    return ServedLayout(store, memory, welcome, hello.model,
                        NodeLinks(store, memory.chunk_bytes), inherited)


def start_layout(built: ServedLayout, layout: KVLayout, digest: str,
                 events: NodeEvents | None) -> None:
    """Start a layout the node has entered: its reads, and its events (announced by its TP
    rank 0; a fresh slab's clear the routers' view of the model first)."""
    built.store.start_reads()  # the first Borrow's reads start at once
    if events is not None:
        events.add_layout(built.store, built.model, layout.tokens_per_chunk,
                          announce=layout.tp_rank == 0, clear=not built.inherited,
                          chunk_bytes=built.memory.chunk_bytes)
    log.info("kvtier node: layout %s (%s, %d B chunks): %d RAM slots in %s",
             digest[:16], built.model, built.memory.chunk_bytes, built.memory.num_slots,
             built.welcome.shm_path)


def recover_ram(digest: str, memory: MemoryTier, counters: NodeCounters) -> None:
    """Recover into `memory` the chunks of a predecessor's slab (run behind the engines'
    requests, on a thread of its own), counted in `counters`."""
    try:
        recovered, dropped = memory.recover()
    except Exception:  # a damaged old slab costs its chunks, never the node
        log.exception("kvtier node: layout %s: recovering the RAM tier failed", digest[:16])
        return
    counters.add("recovered_chunks", recovered)
    counters.add("recovery_dropped_chunks", dropped)
    if recovered or dropped:
        log.info("kvtier node: layout %s: %d chunks recovered into RAM from the last "
                 "node's slab, %d dropped (torn or damaged)", digest[:16], recovered,
                 dropped)


class ServedLayouts:
    """The layouts a node serves: each built at its first engine's Hello, one at a time, at
    most `NodeConfig.max_layouts`, until the node stops (`stop`). Thread-safe: each
    connection's thread asks for its engine's."""

    def __init__(self, config: NodeConfig, generation: str, events: NodeEvents | None,
                 counters: NodeCounters) -> None:
        self.config = config
        self.generation = generation  # the node's, told its engines in the Welcome
        self.events = events  # the node's KV events, a built layout's tiers added to them
        self.counters = counters
        self.refusals = Refusals()  # the other refusals of Hellos, logged once a reason
        self._layouts: dict[str, ServedLayout] = {}
        self._lock = threading.Lock()  # `_layouts`, `_stopping`
        self._stopping = False  # `stop`: no layout is entered from then on
        self._building = threading.Lock()  # a new layout's tiers opening (`layout_for`)
        # Layout digest -> why its tiers last failed to open, as logged: its engines ask again
        # every retry_s, the same error logged at debug. Held under `_building`.
        self._failed_builds: dict[str, str] = {}

    def served(self) -> dict[str, ServedLayout]:
        """The layouts built, by digest (a copy: the status reads it)."""
        with self._lock:
            return dict(self._layouts)

    def stop(self) -> None:
        """The node stops: no layout is entered from now on (one whose tiers are opening
        meanwhile is closed, its engine refused)."""
        with self._lock:
            self._stopping = True

    def take_all(self) -> list[ServedLayout]:
        """The layouts built, taken out (the node closes their stores once its connections
        are shut)."""
        with self._lock:
            layouts, self._layouts = list(self._layouts.values()), {}
        return layouts

    def layout_for(self, hello: Hello) -> ServedLayout | Refused:
        """The store of the engine's layout, built at its first engine's hello."""
        try:
            layout = msgspec.convert(hello.layout, KVLayout)
        except (msgspec.ValidationError, ConfigError) as exc:
            return self.refusals.refuse(hello, f"bad layout: {exc}")
        refusal = unservable(layout, self.config.store.tiers[0].capacity)
        if refusal is not None:
            return self.refusals.refuse(hello, refusal)
        digest = layout.digest()
        with self._lock:
            known = self._layouts.get(digest)
        if known is not None:
            return known
        # Built one at a time, outside `_lock`: a tier that takes long to open (a dead mount)
        # holds up other layouts' first engines, never the node's status, leases or stop.
        with self._building:
            with self._lock:
                known = self._layouts.get(digest)
                if known is not None:
                    return known
                if len(self._layouts) >= self.config.max_layouts:
                    return self.refusals.refuse(hello, f"the node holds {len(self._layouts)} "
                                                "layouts (max_layouts)", "raise --max-layouts")
                if self._stopping:
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
        threading.Thread(target=recover_ram, args=(digest, known.memory, self.counters),
                         daemon=True, name=f"kvtier-recover-{digest[:8]}").start()
        return known

    def _build(self, digest: str, layout: KVLayout, hello: Hello) -> ServedLayout | Refused:
        """Open the tiers of a new layout and enter it (unless the node stopped meanwhile:
        `stop`)."""
        try:
            built = open_layout(self.config, digest, layout, hello, self.generation,
                                events=self.events is not None)
        except (OSError, ConfigError) as exc:
            # /dev/shm full (ENOSPC), a tier's directory unwritable, or a tier refusing what
            # it found (a disk tier's layout directory another user made: a ConfigError, which
            # raised out of the Hello, a traceback each try, its engines taking the node for
            # down: tests/node/test_node_disk_owned.py).
            full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
            stale = self._unused_slabs() if full else ""
            said = f"{exc}{stale}"
            again, self._failed_builds[digest] = self._failed_builds.get(digest) == said, said
            log.log(logging.DEBUG if again else logging.ERROR,
                    "kvtier node: layout %s (%s): its tiers cannot open (%s); engines "
                    "of this layout are refused until they can%s", digest[:16],
                    hello.model, exc, stale)
            return Refused(f"the node cannot open this layout's tiers: {exc} (its RAM "
                           f"slab is {SHM_DIR / slab_name(self.config.name, digest)}){stale}")
        with self._lock:
            entered = not self._stopping
            if entered:
                self._layouts[digest] = built
        if not entered:  # the node stopped meanwhile: its new slab, empty, is not kept (a
            built.memory.keep_shared_memory = False  # successor would take it for the one aside)
            built.store.close(0.0)
            return Refused("the node is stopping")
        self._failed_builds.pop(digest, None)  # a later failure is news
        start_layout(built, layout, digest, self.events)
        return built

    def _unused_slabs(self) -> str:
        """The slabs of this node's name that no running node holds (layouts of earlier
        nodes: kept for a successor to recover, never swept, as their model may come back),
        as a note for an error about a full /dev/shm; "" when there are none."""
        with self._lock:  # this node's; no other node of its name runs (`hold_name`)
            mine = {slab_name(self.config.name, digest) for digest in self._layouts}
        unused = []
        for path in slabs_of(self.config.name, aside=True):
            with contextlib.suppress(OSError):
                if path.name not in mine:
                    unused.append(f"{path} ({format_size(path.stat().st_size)})")
        return "" if not unused else (
            "; slabs of this node's earlier layouts no engine asks for now hold "
            f"{SHM_DIR}: {', '.join(unused)} (remove those of models no longer served)")
