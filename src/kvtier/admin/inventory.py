"""What a store's persistent tiers hold, read from the tiers' storage itself (directories,
Redis), without building the tiers: building a tier evicts to its quota, and an operator's
`kvtier inspect` must change nothing.

A namespace is a layout digest (KVLayout.digest()): each directory tier keeps a layout's
chunks under ROOT/<digest>/, the redis tier under <prefix><digest>:. Chunk keys are hashes,
so the model behind a namespace is not recoverable from storage; `kvtier plan` or the engine's
logs map models to digests.

Primitives: `StoredChunk`, `NamespaceUsage`, `Inventory` (protocol), `FileInventory`,
`RedisInventory`, `open_inventories`, `summarize`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvtier.config import RedisTierConfig, StoreConfig
from kvtier.core.keys import KEY_BYTES
from kvtier.tiers.chunkfiles import SUFFIX

SCAN_BATCH = 500  # Redis keys measured per pipelined round trip


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """One chunk as its tier stores it."""

    namespace: str  # the layout digest
    key_hex: str  # the chunk key
    size_bytes: int  # bytes it takes in the tier (file size; Redis MEMORY USAGE of its values)
    last_used_s: float  # unix time of its last write or hit (mtime; LRU index or idle time)
    locations: tuple[str, ...]  # its file path, or its Redis value names


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """What one tier holds of one namespace."""

    tier: str  # the tier's name in the store config
    kind: str  # disk, shared, redis
    namespace: str
    chunks: int
    size_bytes: int
    oldest_s: float | None  # unix time of the least recently used chunk
    newest_s: float | None  # unix time of the most recently used chunk
    hits: int | None  # hits recorded by the storage itself; None when it records none


class Inventory(Protocol):
    """The chunks of one persistent tier, and a way to remove some of them."""

    name: str
    kind: str

    def chunks(self) -> Iterator[StoredChunk]:
        """Every chunk stored, every namespace. Raises OSError / redis errors if unreachable."""
        ...

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        """Delete these chunks; the number that were still there."""
        ...

    def close(self) -> None: ...


class FileInventory:
    """A disk or shared tier's directory: ROOT/<digest>/<k0k1>/<k2k3>/<key hex>.kvc."""

    def __init__(self, name: str, kind: str, root: Path) -> None:
        self.name, self.kind, self.root = name, kind, Path(root)

    def chunks(self) -> Iterator[StoredChunk]:
        if not self.root.is_dir():
            return
        for namespace in sorted(p.name for p in self.root.iterdir() if p.is_dir()):
            for dirpath, _dirs, filenames in os.walk(self.root / namespace):
                for filename in filenames:
                    stem = filename[: -len(SUFFIX)]
                    if not filename.endswith(SUFFIX) or len(stem) != 2 * KEY_BYTES:
                        continue  # temp files and strangers: not chunks
                    path = os.path.join(dirpath, filename)
                    try:
                        info = os.stat(path)
                    except FileNotFoundError:  # evicted by a running tier meanwhile
                        continue
                    yield StoredChunk(namespace, stem, info.st_size, info.st_mtime, (path,))

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        removed = 0
        for chunk in chunks:
            try:
                os.unlink(chunk.locations[0])
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def close(self) -> None:
        pass


class RedisInventory:
    """A redis tier's values: <prefix><digest>:{<key hex>}:h|<part>, and LRU sets
    <prefix>{<digest>}:lru. Reads with MEMORY USAGE and OBJECT IDLETIME, which do not touch
    the values' LRU clock (a GET would make every chunk look just used)."""

    def __init__(self, name: str, config: RedisTierConfig) -> None:
        from kvtier.tiers.redis_client import connect, read_password

        self.name, self.kind, self.prefix = name, "redis", config.key_prefix
        self.client: Any = connect(config, read_password(config))

    def _values(self) -> tuple[dict[tuple[str, str], list[str]], dict[str, str]]:
        """(namespace, key hex) -> value names; namespace -> its LRU set's name."""
        chunks: dict[tuple[str, str], list[str]] = {}
        indexes: dict[str, str] = {}
        for raw in self.client.scan_iter(match=f"{self.prefix}*", count=1000):
            name = raw.decode()
            rest = name[len(self.prefix):]
            if rest.startswith("{") and rest.endswith("}:lru"):
                indexes[rest[1:-5]] = name
                continue
            namespace, _, tagged = rest.partition(":{")
            key_hex, _, _part = tagged.partition("}:")
            if namespace and len(key_hex) == 2 * KEY_BYTES:
                chunks.setdefault((namespace, key_hex), []).append(name)
        return chunks, indexes

    def chunks(self) -> Iterator[StoredChunk]:
        now = time.time()
        values, indexes = self._values()
        scores: dict[tuple[str, str], float] = {}
        for namespace, index in indexes.items():
            for member, score in self.client.zscan_iter(index, count=1000):
                scores[(namespace, member.decode())] = score / 1e6  # microseconds
        items = sorted(values.items())
        for start in range(0, len(items), SCAN_BATCH):
            batch = items[start : start + SCAN_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for _chunk, names in batch:
                for name in names:
                    pipe.execute_command("MEMORY", "USAGE", name)
                pipe.execute_command("OBJECT", "IDLETIME", min(names))  # the ":0" or ":h"
            replies = pipe.execute(raise_on_error=False)
            position = 0
            for (namespace, key_hex), names in batch:
                sizes = replies[position : position + len(names)]
                idle = replies[position + len(names)]
                position += len(names) + 1
                idle_s = float(idle) if isinstance(idle, int) else 0.0
                yield StoredChunk(
                    namespace, key_hex, sum(s for s in sizes if isinstance(s, int)),
                    scores.get((namespace, key_hex), now - idle_s), tuple(sorted(names)))

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for chunk in chunks:
            # Header first: a reader that finds no header finds no chunk.
            names = sorted(chunk.locations, key=lambda n: not n.endswith(":h"))
            pipe.delete(*names)
            pipe.zrem(f"{self.prefix}{{{chunk.namespace}}}:lru", chunk.key_hex)
        replies = pipe.execute()
        return sum(1 for deleted in replies[::2] if deleted)

    def close(self) -> None:
        self.client.close()


def open_inventories(config: StoreConfig, tier: str | None = None) -> list[Inventory]:
    """An inventory per persistent tier of `config` (memory tiers live in a process: none),
    or only the tier named `tier`.

    Raises:
        ConfigError: `tier` names no persistent tier of the config; a redis password file
            or variable is unusable.
    """
    from kvtier.errors import ConfigError

    out: list[Inventory] = []
    for tier_config in config.tiers:
        if tier is not None and tier_config.tier_name != tier:
            continue
        if tier_config.kind in ("disk", "shared"):
            out.append(FileInventory(tier_config.tier_name, tier_config.kind,
                                     tier_config.path))  # type: ignore[union-attr]
        elif isinstance(tier_config, RedisTierConfig):
            out.append(RedisInventory(tier_config.tier_name, tier_config))
    if tier is not None and not out:
        names = [t.tier_name for t in config.tiers if t.kind != "memory"]
        raise ConfigError("--tier", tier, f"a disk, shared or redis tier of the config: {names}")
    return out


def summarize(inventory: Inventory, chunks: Sequence[StoredChunk]) -> list[NamespaceUsage]:
    """Per-namespace totals of `chunks` (all from `inventory`), namespaces sorted."""
    groups: dict[str, list[StoredChunk]] = {}
    for chunk in chunks:
        groups.setdefault(chunk.namespace, []).append(chunk)
    return [
        NamespaceUsage(inventory.name, inventory.kind, namespace, len(group),
                       sum(c.size_bytes for c in group), min(c.last_used_s for c in group),
                       max(c.last_used_s for c in group), None)
        for namespace, group in sorted(groups.items())
    ]
