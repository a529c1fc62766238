"""A node's settings (`NodeConfig`), validated once where they are made (`kvtier node serve`'s
flags, the tests). Apart from the server: the operator tools (`kvtier plan node`) read its
defaults without importing the node's sockets, stores and threads.

Primitives: `NodeConfig`, `MAX_LAYOUTS_LIMIT`, `SOCKET_PATH_MAX`.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.node.eventpub import ALLOWED as ENDPOINTS
from kvtier.node.eventpub import check_endpoint
from kvtier.tiers.storeconfig import StoreConfig

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_LAYOUTS_LIMIT = 1024  # --max-layouts' bound: far past any node's RAM for a slab each
# The longest stop_flush_s and lease_timeout_s: a year. Far past any use, and within what the
# kernel's and Python's timeouts take (a finite 1e300 passed the check, then every
# connection's send timeout failed to pack: each engine's connection reset, a traceback each).
MAX_SECONDS = 365 * 86400
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
    # How long an engine may hold chunks lent for a load (a `Borrow`'s lease) before the node
    # takes them back: an engine frozen (SIGSTOP) or hung pins their slots no longer. Each
    # lent slot carries its stamp, which the engine reads again once its copy is done: a slot
    # given to another chunk meanwhile makes that copy a failed load (recomputed), never
    # wrong KV. Far above any real load (a load's copies take milliseconds to seconds).
    # Never from an engine of an older kvtier, which does not check (`Hello.stamps`).
    # Slots reserved for stores are not taken back (docs/node.md: a late write). Also how
    # long a reply may go without progress before the node gives it up and closes the
    # connection (a frozen engine's; what it may still write kept until its process exits).
    lease_timeout_s: float = 60.0

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
        shared = getattr(first, "shared_memory", None)
        if shared is not None:
            # The node names each layout's slab (kvtier-<name>-<layout>): one named here was
            # dropped without a word (tests/node/test_node_config.py).
            raise ConfigError("tiers[0].shared_memory", shared,
                              "unset: the node names its slabs /dev/shm/kvtier-<name>-<layout> "
                              "(--name)")
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
                or not 0 <= flush <= MAX_SECONDS:
            raise ConfigError("stop_flush_s", flush,
                              f"seconds, a finite number 0 or more, at most {MAX_SECONDS:,}")
        lease = self.lease_timeout_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) \
                or not 0 < lease <= MAX_SECONDS:
            raise ConfigError("lease_timeout_s", lease,
                              f"seconds, a finite number above 0, at most {MAX_SECONDS:,} (how "
                              "long a load's chunks stay lent before the node takes them back)")
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
