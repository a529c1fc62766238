"""The scheduler's lookups through `kvtier node` (`NodeProbe`): whether the node holds a
step's chunks for every layout, and the token ids of the chunks it plans to store, for the
node's KV events.

Primitives: `NodeProbe`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.errors import NodeUnavailable
from kvtier.node.client import NodeClient, node_status
from kvtier.node.protocol import (
    MAX_KEYS,
    Describe,
    Described,
    Found,
    Lookup,
)
from kvtier.tiers.eventfacts import ChunkInfo


class NodeProbe:
    """The scheduler's lookup through the node (`kvtier.core.tier.Probe`): a chunk counts when
    the node holds it for every layout (tensor-parallel rank). Two of them, as for in-process
    tiers: one of the node's RAM (`ram_only`: an index lookup, asked inline on the
    scheduler's thread) and, where the node has tiers below RAM, one of every tier (a remote
    store's round trips: asked off that thread, `blocking_ok` False). Each call is bounded by
    the client's deadline; a node down raises NodeUnavailable at once (the locator then
    answers from what this engine stored: chunks it still reads in place)."""

    def __init__(self, clients: Sequence[NodeClient], *, ram_only: bool = True) -> None:
        self._clients = list(clients)
        self._ram_only = ram_only
        self.blocking_ok = ram_only

    def below_ram(self) -> bool:
        """Whether the node has tiers below RAM; True when it cannot say now (it may have: it
        is asked again when back). Asked of the node's status, which opens no layout: a
        scheduler side replaced at vLLM's handshake, before any lookup, leaves no layout of
        the namespace it was built in on the node (a slab of the node's RAM tier each:
        tests/connector/test_handshake_rebuild.py)."""
        if not self._clients:
            return True
        client = self._clients[0]
        if client.welcome is not None:
            return len(client.welcome.tiers) != 1
        try:
            tiers = node_status(client.socket_path, client.timeout_s).get("tiers")
        except NodeUnavailable:
            return True
        if not isinstance(tiers, list):  # a node of an older kvtier: its welcome tells
            welcome = client.welcomed()
            return welcome is None or len(welcome.tiers) != 1
        return len(tiers) != 1

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether every layout's node holds each key; the keys past MAX_KEYS (a node
        refuses more) are not asked: misses."""
        found = [True] * min(len(keys), MAX_KEYS)
        for client in self._clients:
            held = client.call(Lookup(list(keys[:MAX_KEYS]), self._ram_only), Found,
                               slow=not self._ram_only).held
            found = [f and h for f, h in zip(found, held)]
        return found + [False] * (len(keys) - len(found))

    def close(self) -> None:
        """Close its clients (the scheduler's RAM and below-RAM probes share them: a second
        close does nothing): their connections end, and the node forgets them."""
        for client in self._clients:
            client.close()

    def publishes_events(self) -> bool:
        """Whether the node publishes KV events of its tiers (its welcome says so), and so
        wants each step's `describe`; a node unavailable: False (asked again later)."""
        welcome = self._clients[0].welcomed() if self._clients else None
        return welcome is not None and welcome.events

    def describe(self, chunks: Mapping[ChunkKey, ChunkInfo]) -> None:
        """Send the node the token ids of the chunks a step plans to store, no reply (one
        layout's connection: the node keeps them per model). Scheduler thread."""
        if chunks and self._clients:
            self._clients[0].post(Describe([
                Described(key, info.parent, info.token_ids, info.lora_name, info.cache_salt)
                for key, info in itertools.islice(chunks.items(), MAX_KEYS)]))
