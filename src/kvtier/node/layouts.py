"""A KV layout as the node serves it: its tiers opened from the node's config, its RAM slab
named after the node and the layout in /dev/shm (a predecessor's recovered), and what its
engines are told at their Hello. Apart from the server, which decides when a layout is built
and holds the ones built; here is how one is opened, started and recovered.

Primitives: `ServedLayout`, `slab_name`, `unservable`, `open_layout`, `start_layout`,
`recover_ram`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvtier.core.layout import KVLayout
from kvtier.core.store import TieredStore
from kvtier.node.config import NodeConfig
from kvtier.node.counters import NodeCounters
from kvtier.node.events import NodeEvents
from kvtier.node.links import NodeLinks
from kvtier.node.protocol import MAX_FRAME, Hello, Welcome
from kvtier.tiers import open_store
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.shmslab import SHM_DIR, is_own_file

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
        OSError: a tier cannot open (/dev/shm full: ENOSPC; a tier's directory unwritable).
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
