"""What a redis tier's server holds, as `kvtier.core.tier.Inventory` (`kvtier inspect`,
`kvtier gc`), read from the server without building the tier: the chunks (a hash each,
<prefix><digest>:{<key hex>}:c), the values an older kvtier stored a chunk in (a value per
part, "...:h", "...:0"...: no reader reads them, so they are `orphans`, swept by `kvtier gc`),
and the namespaces' manifests (<prefix><digest>:manifest, tiers/manifest.py: never taken for
a chunk's value).

A chunk's last use is what the server records of it: its LRU set's score when the tier keeps
one (`capacity` > 0: every hit, batched, tiers/redis/index.py), else its hash's idle time
(OBJECT IDLETIME: every read of the hash resets it). `remove_unused` (`kvtier gc --quota` and
`--max-age`) deletes a victim only if neither shows a use since the listing: the idle time
is checked by the script that deletes it, atomically, to the second the server's LRU clock
counts (`IDLE_SLACK_S`); the score just before (a hit reaches the set within
index.TOUCH_FLUSH_S, and resets the idle time at once). A chunk used within IDLE_SLACK_S
after its last use before the listing shows no use since (the idle time's resolution).

Under an LFU `maxmemory-policy` the server keeps no idle time, and without an LRU set
(`capacity` 0) no time of use: every chunk is listed as used at the listing (`--max-age`
selects none, `--quota` takes victims in the listing's order, not by use). A use since the
listing is then its LFU counter (OBJECT FREQ) found higher by the deleting script than the
listing saw. The counter is logarithmic: a use raises one of 5 or less (a new chunk's is 5,
and it decays by one each `lfu-decay-time` minute the chunk is not used) for certain, a
higher one c with probability 1 / ((c - 5) * lfu-log-factor + 1) (1/11 at 6 by default);
and a decay between the use and the deletion (or between the listing and the use, when the
listed counter was above 0) hides it. So a cold victim's use is seen unless the server's
minute clock turns in that window; a hot one's mostly not.

A value of another type at a name of the tier's (a foreign string at an LRU set's or a
manifest's name, a list at a chunk's) or a member of an LRU set that is no key never fails
a listing or a deletion: such a set's scores are not used, such a manifest reads as none,
and a chunk's name holding a foreign value is listed (a name of the tier's, deleted by
whatever rule selects it).

Primitives: `RedisInventory`, `parse_value_name`, `IDLE_SLACK_S`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from kvtier.core.keys import KEY_BYTES
from kvtier.core.tier import Removal, StoredChunk
from kvtier.tiers.manifest import NamespaceManifest, is_layout_name, parse_manifest
from kvtier.tiers.redis.client import connect, read_password, wrong_type
from kvtier.tiers.redis.config import RedisTierConfig
from kvtier.tiers.redis.manifest import redis_manifest_name
from kvtier.tiers.redis.names import CHUNK_SUFFIX
from kvtier.tiers.tlsfiles import check_ca_file

SCAN_BATCH = 500  # Redis keys measured per pipelined round trip
MANIFEST_SUFFIX = ":manifest"
_HEX = frozenset("0123456789abcdef")
# How much less idle than expected a victim may look and still count as unused since it was
# listed: OBJECT IDLETIME counts whole seconds of an LRU clock the server ticks every 100 ms
# (at hz 10), once at the listing and again at the deletion.
IDLE_SLACK_S = 3
# KEYS: a chunk's values (its hash); ARGV[1]: the least idle time (s) it shows if nothing used
# it since gc listed it; ARGV[2]: its LFU counter when listed (-1: none seen). Deletes it
# unless it shows less idle time, or, under an LFU policy (no idle time), a higher counter.
# 1: deleted, 0: gone already, -1: used since, kept.
_DELETE_UNUSED = """
local idle = redis.pcall('OBJECT', 'IDLETIME', KEYS[1])
if not idle then return 0 end
if type(idle) == 'number' then
  if idle < tonumber(ARGV[1]) then return -1 end
elseif tonumber(ARGV[2]) >= 0 then
  local freq = redis.pcall('OBJECT', 'FREQ', KEYS[1])
  if type(freq) == 'number' and freq > tonumber(ARGV[2]) then return -1 end
end
return redis.call('DEL', unpack(KEYS)) > 0 and 1 or 0
"""


class RedisInventory:
    """A redis tier's values: chunks <prefix><digest>:{<key hex>}:c, an older kvtier's
    <prefix><digest>:{<key hex>}:h|<part>, and LRU sets <prefix>{<digest>}:lru. Reads with
    MEMORY USAGE and OBJECT IDLETIME, which do not touch the values' LRU clock (a read would
    make every chunk look just used)."""

    def __init__(self, name: str, config: RedisTierConfig) -> None:
        self.name, self.kind, self.prefix = name, "redis", config.key_prefix
        check_ca_file(config.tls_ca_file)
        self.client: Any = connect(config, read_password(config))
        # (namespace, key hex) -> what the last listing saw of its use (`remove_unused`).
        self._listed: dict[tuple[str, str], _ListedUse] = {}

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
        self._listed = {}  # this listing's, not an earlier one's
        yield from self._measure({(ns, k): n for (ns, k, old), n in values.items() if not old},
                                 indexes, self._listed)

    def orphans(self) -> list[StoredChunk]:
        """An older kvtier's values of each chunk (a header, parts): no reader reads them
        (tiers/redis/names.py), and parts a failed write of that kvtier left without a
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

    def _scores(self, namespace: str, index: str) -> dict[tuple[str, str], float]:
        """(namespace, key hex) -> last use (s, the server's clock) of the members of LRU set
        `index` that are keys; {} when the value at its name is not a sorted set."""
        scores: dict[tuple[str, str], float] = {}
        try:
            for member, score in self.client.zscan_iter(index, count=1000):
                key_hex = member.decode(errors="replace")
                if len(key_hex) == 2 * KEY_BYTES and set(key_hex) <= _HEX:
                    scores[(namespace, key_hex)] = score / 1e6  # microseconds
        except redis.ResponseError as exc:
            if not wrong_type(exc):
                raise
            return {}
        return scores

    def _measure(self, values: dict[tuple[str, str], list[str]], indexes: dict[str, str],
                 listed: dict[tuple[str, str], _ListedUse] | None = None,
                 ) -> Iterator[StoredChunk]:
        """The chunks (or orphans) of `values`, measured; what each showed of its use is kept
        in `listed`, when given."""
        now = time.time()
        scores: dict[tuple[str, str], float] = {}
        for namespace, index in indexes.items():
            scores.update(self._scores(namespace, index))
        items = sorted(values.items())
        for start in range(0, len(items), SCAN_BATCH):
            batch = items[start : start + SCAN_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for _chunk, names in batch:
                for name in names:  # SAMPLES 0: every field of a hash, not an estimate
                    pipe.execute_command("MEMORY", "USAGE", name, "SAMPLES", 0)
                # ":0" of older ones; each an error reply under the other kind of policy
                pipe.execute_command("OBJECT", "IDLETIME", min(names))
                pipe.execute_command("OBJECT", "FREQ", min(names))
            replies = pipe.execute(raise_on_error=False)
            position = 0
            for (namespace, key_hex), names in batch:
                sizes = replies[position : position + len(names)]
                idle, freq = replies[position + len(names) : position + len(names) + 2]
                position += len(names) + 2
                idle_s = float(idle) if isinstance(idle, int) else 0.0
                score = scores.get((namespace, key_hex))
                if listed is not None:
                    listed[(namespace, key_hex)] = _ListedUse(
                        now - idle_s if isinstance(idle, int) else None, score,
                        freq if isinstance(freq, int) else None)
                yield StoredChunk(
                    namespace, key_hex, sum(s for s in sizes if isinstance(s, int)),
                    now - idle_s if score is None else score, tuple(sorted(names)))

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for chunk in chunks:
            pipe.delete(*chunk.locations)
            pipe.zrem(self._index_name(chunk.namespace), chunk.key_hex)
        replies = _answers(pipe.execute(raise_on_error=False))
        return sum(1 for deleted in replies[::2] if deleted)

    def remove_unused(self, chunks: Sequence[StoredChunk]) -> Removal:
        """`UnusedRemoval` (tools/admin/inventory.py): each chunk is deleted unless the server
        recorded a use of it since the last listing (see the module's docstring): a chunk an
        engine read after `kvtier gc` listed it stays. A chunk this inventory did not list is
        taken as used last at its `last_used_s`. Raises redis.RedisError."""
        removed, kept = 0, []
        for start in range(0, len(chunks), SCAN_BATCH):
            batch = chunks[start : start + SCAN_BATCH]
            listed = [self._listed.get((c.namespace, c.key_hex), _ListedUse(c.last_used_s, None))
                      for c in batch]
            scored = self._scored_since(batch, listed)
            now = time.time()
            pipe = self.client.pipeline(transaction=False)
            for chunk, use, used in zip(batch, listed, scored):
                if not used:
                    least_idle = -1 if use.idle_base_s is None else max(
                        0, int(now - use.idle_base_s) - IDLE_SLACK_S)
                    # EVAL by name: a cluster pipeline's `eval` is another method
                    pipe.execute_command("EVAL", _DELETE_UNUSED, len(chunk.locations),
                                         *chunk.locations, least_idle,
                                         -1 if use.freq is None else use.freq)
            replies = iter(pipe.execute())
            gone = []
            for chunk, used in zip(batch, scored):
                outcome = -1 if used else int(next(replies))
                if outcome < 0:
                    kept.append(chunk)
                else:
                    removed += outcome
                    gone.append(chunk)
            if gone:
                pipe = self.client.pipeline(transaction=False)
                for chunk in gone:
                    pipe.zrem(self._index_name(chunk.namespace), chunk.key_hex)
                _answers(pipe.execute(raise_on_error=False))
        return Removal(removed, tuple(kept))

    def _scored_since(self, chunks: Sequence[StoredChunk], listed: Sequence[_ListedUse]
                      ) -> list[bool]:
        """Whether each chunk's LRU set scores a use later than the listing saw (False for
        one not in a set when listed)."""
        pipe = self.client.pipeline(transaction=False)
        asked = [use.score_s is not None for use in listed]
        for chunk, ask in zip(chunks, asked):
            if ask:
                pipe.zscore(self._index_name(chunk.namespace), chunk.key_hex)
        scores = iter(_answers(pipe.execute(raise_on_error=False)) if any(asked) else [])
        used = []
        for use, ask in zip(listed, asked):
            score = next(scores) if ask else None
            used.append(score is not None and use.score_s is not None
                        and score / 1e6 > use.score_s)
        return used

    def _index_name(self, namespace: str) -> str:
        """The namespace's LRU set (tiers/redis/index.py)."""
        return f"{self.prefix}{{{namespace}}}:lru"

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
            try:
                found[namespace] = parse_manifest(self.client.get(name), namespace)
            except redis.ResponseError as exc:  # not a string: not a manifest
                if not wrong_type(exc):
                    raise
                found[namespace] = None
        return found

    def remove_manifest(self, namespace: str) -> bool:
        """Delete `namespace`'s manifest; True when there was one."""
        return bool(self.client.delete(redis_manifest_name(self.prefix, namespace)))

    def close(self) -> None:
        self.client.close()


@dataclass(frozen=True, slots=True)
class _ListedUse:
    """What a listing saw of a chunk's use."""

    idle_base_s: float | None  # unix time (this host's clock) its idle time started; None:
    # the server keeps none (an LFU policy)
    score_s: float | None  # its LRU set's score (the server's clock, s); None: in no set
    freq: int | None = None  # its LFU counter (OBJECT FREQ); None: the server keeps none (an
    # LRU policy)


def _answers(replies: list[Any]) -> list[Any]:
    """A pipeline's replies (run with raise_on_error=False), a WRONGTYPE reply read as None
    (a foreign value at an LRU set's name: nothing of the tier's there).

    Raises:
        redis.RedisError: any other error reply.
    """
    for reply in replies:
        if isinstance(reply, Exception) and not wrong_type(reply):
            raise reply
    return [None if isinstance(reply, Exception) else reply for reply in replies]


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
