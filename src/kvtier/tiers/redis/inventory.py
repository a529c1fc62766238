"""What a redis tier's server holds, as `kvtier.core.tier.Inventory` (`kvtier inspect`,
`kvtier gc`), read from the server without building the tier, the parts that failed
writes left without a header (`orphans`, swept by `kvtier gc`), and the namespaces'
manifests (<prefix><digest>:manifest, tiers/manifest.py: never taken for a chunk's value).

Primitives: `RedisInventory`, `parse_value_name`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.core.keys import KEY_BYTES
from kvtier.core.tier import StoredChunk
from kvtier.tiers.manifest import NamespaceManifest, is_layout_name, parse_manifest
from kvtier.tiers.redis.client import connect, read_password
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.redis.manifest import redis_manifest_name
from kvtier.tiers.redis.write import abort_chunk
from kvtier.tiers.tlsfiles import check_ca_file

SCAN_BATCH = 500  # Redis keys measured per pipelined round trip
MANIFEST_SUFFIX = ":manifest"
_HEX = frozenset("0123456789abcdef")


class RedisInventory:
    """A redis tier's values: <prefix><digest>:{<key hex>}:h|<part>, and LRU sets
    <prefix>{<digest>}:lru. Reads with MEMORY USAGE and OBJECT IDLETIME, which do not touch
    the values' LRU clock (a GET would make every chunk look just used)."""

    def __init__(self, name: str, config: RedisTierConfig) -> None:
        self.name, self.kind, self.prefix = name, "redis", config.key_prefix
        check_ca_file(config.tls_ca_file)
        self.client: Any = connect(config, read_password(config))

    def _values(self) -> tuple[dict[tuple[str, str], list[str]], dict[str, str]]:
        """(namespace, key hex) -> value names; namespace -> its LRU set's name."""
        chunks: dict[tuple[str, str], list[str]] = {}
        indexes: dict[str, str] = {}
        for raw in self.client.scan_iter(match=f"{_glob(self.prefix)}*", count=1000):
            name = raw.decode(errors="replace")
            if not name.startswith(self.prefix):
                continue
            rest = name[len(self.prefix):]
            if rest.startswith("{") and rest.endswith("}:lru") and is_layout_name(rest[1:-5]):
                indexes[rest[1:-5]] = name
                continue
            parsed = parse_value_name(rest)
            if parsed is not None:
                chunks.setdefault(parsed, []).append(name)
        return chunks, indexes

    def chunks(self) -> Iterator[StoredChunk]:
        """Every committed chunk (a header and its parts)."""
        values, indexes = self._values()
        yield from self._measure({c: n for c, n in values.items() if _has_header(n)}, indexes)

    def orphans(self) -> list[StoredChunk]:
        """Payload parts without a header: no reader can reach them. Left by a write that
        failed part-way before parts had a TTL (tiers/redis/write.py), or in flight right
        now (its commit then finds a part missing and drops the write: never corrupt)."""
        values, _indexes = self._values()
        return list(self._measure({c: n for c, n in values.items() if not _has_header(n)}, {}))

    def remove_orphans(self, orphans: Sequence[StoredChunk]) -> int:
        """Delete orphans' parts, each only while its chunk still has no header (a writer
        may have committed it since). Returns the values deleted."""
        deleted = 0
        for orphan in orphans:
            header = f"{self.prefix}{orphan.namespace}:{{{orphan.key_hex}}}:h"
            deleted += abort_chunk(self.client, [header, *orphan.locations])
        return deleted

    def _measure(self, values: dict[tuple[str, str], list[str]],
                 indexes: dict[str, str]) -> Iterator[StoredChunk]:
        now = time.time()
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

    def manifests(self) -> dict[str, NamespaceManifest | None]:
        """namespace -> its manifest (None: a value that is not a valid one), for every
        namespace with a manifest value."""
        names = sorted(raw.decode(errors="replace") for raw in self.client.scan_iter(
            match=f"{_glob(self.prefix)}*{MANIFEST_SUFFIX}", count=1000))
        found: dict[str, NamespaceManifest | None] = {}
        for name in names:
            namespace = name[len(self.prefix):-len(MANIFEST_SUFFIX)]
            if not name.startswith(self.prefix) or not is_layout_name(namespace):
                continue  # another application's key, or a chunk's value: not a manifest
            found[namespace] = parse_manifest(self.client.get(name), namespace)
        return found

    def remove_manifest(self, namespace: str) -> bool:
        """Delete `namespace`'s manifest; True when there was one."""
        return bool(self.client.delete(redis_manifest_name(self.prefix, namespace)))

    def close(self) -> None:
        self.client.close()


def _glob(prefix: str) -> str:
    """`prefix` as a SCAN MATCH pattern of itself: its glob characters escaped (a prefix
    "kv?:" matched another deployment's "kvX:" keys, which `kvtier gc` then deleted; one
    with "[a]" matched none of its own)."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in prefix)


def parse_value_name(rest: str) -> tuple[str, str] | None:
    """(namespace, key hex) of a chunk's value name less the prefix,
    "<digest>:{<key hex>}:h" or ":<part number>", or None for any other name: another
    application's key under the prefix (`session:{<uuid hex>}:data`, with a prefix of "") is
    never listed, so never deleted by `kvtier gc`."""
    namespace, _, tagged = rest.partition(":{")
    key_hex, _, part = tagged.partition("}:")
    part_ok = part == "h" or (part.isascii() and part.isdigit())
    if (not part_ok or not is_layout_name(namespace) or len(key_hex) != 2 * KEY_BYTES
            or not set(key_hex) <= _HEX):
        return None
    return namespace, key_hex


def _has_header(names: list[str]) -> bool:
    return any(name.endswith(":h") for name in names)
