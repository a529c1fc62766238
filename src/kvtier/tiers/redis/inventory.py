"""What a redis tier's server holds, as `kvtier.core.tier.Inventory` (`kvtier inspect`,
`kvtier gc`), read from the server without building the tier: the chunks (a hash each,
<prefix><digest>:{<key hex>}:c), the values an older kvtier stored a chunk in (a value per
part, "...:h", "...:0"...: no reader reads them, so they are `orphans`, swept by `kvtier gc`),
and the namespaces' manifests (<prefix><digest>:manifest, tiers/manifest.py: never taken for
a chunk's value).

Primitives: `RedisInventory`, `parse_value_name`, `CHUNK_SUFFIX`.
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
from kvtier.tiers.tlsfiles import check_ca_file

SCAN_BATCH = 500  # Redis keys measured per pipelined round trip
MANIFEST_SUFFIX = ":manifest"
CHUNK_SUFFIX = "c"  # a chunk's hash: <prefix><digest>:{<key hex>}:c (tiers/redis/tier.py)
_HEX = frozenset("0123456789abcdef")


class RedisInventory:
    """A redis tier's values: chunks <prefix><digest>:{<key hex>}:c, an older kvtier's
    <prefix><digest>:{<key hex>}:h|<part>, and LRU sets <prefix>{<digest>}:lru. Reads with
    MEMORY USAGE and OBJECT IDLETIME, which do not touch the values' LRU clock (a read would
    make every chunk look just used)."""

    def __init__(self, name: str, config: RedisTierConfig) -> None:
        self.name, self.kind, self.prefix = name, "redis", config.key_prefix
        check_ca_file(config.tls_ca_file)
        self.client: Any = connect(config, read_password(config))

    def _values(self) -> tuple[dict[tuple[str, str, bool], list[str]], dict[str, str]]:
        """(namespace, key hex, of the older form) -> value names; namespace -> its LRU
        set's name."""
        chunks: dict[tuple[str, str, bool], list[str]] = {}
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
        """Every chunk (its hash)."""
        values, indexes = self._values()
        yield from self._measure({(ns, k): n for (ns, k, old), n in values.items() if not old},
                                 indexes)

    def orphans(self) -> list[StoredChunk]:
        """An older kvtier's values of each chunk (a header, parts): no reader reads them
        (tiers/redis/tier.py), and parts a failed write of that kvtier left without a
        header. Today's writes leave none (tiers/redis/write.py)."""
        values, _indexes = self._values()
        return list(self._measure({(ns, k): n for (ns, k, old), n in values.items() if old},
                                  {}))

    def remove_orphans(self, orphans: Sequence[StoredChunk]) -> int:
        """Delete orphans' values (an engine still running an older kvtier loses those
        chunks: a miss it recomputes). Returns the values deleted."""
        pipe = self.client.pipeline(transaction=False)
        for orphan in orphans:
            pipe.delete(*orphan.locations)
        return sum(int(deleted) for deleted in pipe.execute()) if orphans else 0

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
                for name in names:  # SAMPLES 0: every field of a hash, not an estimate
                    pipe.execute_command("MEMORY", "USAGE", name, "SAMPLES", 0)
                pipe.execute_command("OBJECT", "IDLETIME", min(names))  # ":0" of older ones
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
            pipe.delete(*chunk.locations)
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


def parse_value_name(rest: str) -> tuple[str, str, bool] | None:
    """(namespace, key hex, whether of an older kvtier) of a chunk's value name less the
    prefix: "<digest>:{<key hex>}:c" (a chunk's hash), or an older kvtier's ":h" or
    ":<part number>"; None for any other name: another application's key under the prefix
    (`session:{<uuid hex>}:data`, with a prefix of "") is never listed, so never deleted by
    `kvtier gc`."""
    namespace, _, tagged = rest.partition(":{")
    key_hex, _, suffix = tagged.partition("}:")
    old = suffix == "h" or (suffix.isascii() and suffix.isdigit())
    if ((suffix != CHUNK_SUFFIX and not old) or not is_layout_name(namespace)
            or len(key_hex) != 2 * KEY_BYTES or not set(key_hex) <= _HEX):
        return None
    return namespace, key_hex, old
