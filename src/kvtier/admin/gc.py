"""`kvtier gc`: evict chunks of persistent tiers to a quota, by age, or a whole namespace.

Selection is a pure function over an inventory (`select_victims`), so a dry run shows exactly
what a real run deletes. Order of the rules, per tier: keep only the chunks of `namespace`
when one is given; drop those idle longer than `max_age_s`; then drop the least recently used
until what is left of the selection fits `quota_bytes`. A namespace with neither rule drops
the whole namespace. Every run (a dry run only counts them) also deletes the orphans of
tiers that can have some (`OrphanSource`: redis parts a failed write left without a header),
in the selected namespace; `orphans_only` does only that.

Safe next to running engines: a chunk deleted under a reader is a miss for it (files are
renamed into place and read whole; redis headers are deleted first).

Primitives: `GcRequest`, `GcOutcome`, `select_victims`, `run_gc`, `parse_duration`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.admin.inventory import Inventory, OrphanSource, StoredChunk
from kvtier.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}


@dataclass(frozen=True, slots=True)
class GcRequest:
    """What to evict. At least one rule must be set."""

    quota_bytes: int | None = None  # keep at most this many bytes (per tier, of the selection)
    max_age_s: float | None = None  # evict chunks not used for longer than this
    namespace: str | None = None  # consider only this layout digest (alone: evict all of it)
    dry_run: bool = False  # report only
    orphans_only: bool = False  # evict no chunk: only delete orphans (e.g. redis parts)

    def validate(self) -> None:
        """Raises ConfigError when no rule is set (or a rule with `orphans_only`)."""
        rules = (self.quota_bytes, self.max_age_s)
        if self.orphans_only and any(rule is not None for rule in rules):
            raise ConfigError("gc", "--orphans", "alone, or with --namespace only")
        if not self.orphans_only and all(rule is None for rule in (*rules, self.namespace)):
            raise ConfigError("gc", None, "at least one of --quota, --max-age, --namespace, "
                                          "--orphans")


@dataclass(frozen=True, slots=True)
class GcOutcome:
    """What gc did (or, in a dry run, would do) to one tier's namespace."""

    tier: str
    namespace: str
    removed_chunks: int
    removed_bytes: int
    kept_chunks: int
    kept_bytes: int
    dry_run: bool
    removed_orphans: int = 0  # values left without a header by failed writes (redis parts)


def parse_duration(text: str, field: str = "--max-age") -> float:
    """Seconds from "90", "90s", "30m", "12h", "7d" or "2w".

    Raises:
        ConfigError: anything else.
    """
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(field, text, "a duration such as 90s, 30m, 12h, 7d or 2w")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def select_victims(chunks: Sequence[StoredChunk], request: GcRequest,
                   now_s: float) -> list[StoredChunk]:
    """The chunks `request` evicts from one tier, least recently used first."""
    selected = sorted((c for c in chunks if request.namespace in (None, c.namespace)),
                      key=lambda c: c.last_used_s)
    if request.quota_bytes is None and request.max_age_s is None:
        return selected  # a namespace alone: all of it
    victims = []
    if request.max_age_s is not None:
        cutoff = now_s - request.max_age_s
        victims = [c for c in selected if c.last_used_s < cutoff]
        selected = selected[len(victims):]  # sorted: the old ones are a prefix
    if request.quota_bytes is not None:
        held = sum(c.size_bytes for c in selected)
        for chunk in selected:
            if held <= request.quota_bytes:
                break
            victims.append(chunk)
            held -= chunk.size_bytes
    return victims


def run_gc(inventories: Sequence[Inventory], request: GcRequest) -> list[GcOutcome]:
    """Select and (unless a dry run) delete; one outcome per tier and namespace touched.

    Raises:
        ConfigError: no rule in `request`.
        OSError, redis.RedisError: a tier's storage could not be listed.
    """
    request.validate()
    outcomes: list[GcOutcome] = []
    for inventory in inventories:
        orphans = _sweep_orphans(inventory, request)
        chunks = list(inventory.chunks())
        victims = [] if request.orphans_only else select_victims(chunks, request, time.time())
        if victims and not request.dry_run:
            inventory.remove(victims)
        gone = {(c.namespace, c.key_hex) for c in victims}
        for namespace in sorted({c.namespace for c in chunks} | set(orphans)):
            if request.namespace not in (None, namespace):
                continue
            mine = [c for c in chunks if c.namespace == namespace]
            removed = [c for c in mine if (c.namespace, c.key_hex) in gone]
            outcomes.append(GcOutcome(
                inventory.name, namespace, len(removed), sum(c.size_bytes for c in removed),
                len(mine) - len(removed),
                sum(c.size_bytes for c in mine) - sum(c.size_bytes for c in removed),
                request.dry_run, orphans.get(namespace, 0)))
    return outcomes


def _sweep_orphans(inventory: Inventory, request: GcRequest) -> dict[str, int]:
    """Delete (unless a dry run) the orphans of `request`'s namespaces: namespace -> how
    many chunks' leftovers were (or would be) removed."""
    if not isinstance(inventory, OrphanSource):
        return {}
    orphans = [o for o in inventory.orphans() if request.namespace in (None, o.namespace)]
    if orphans and not request.dry_run:
        inventory.remove_orphans(orphans)
    counts: dict[str, int] = {}
    for orphan in orphans:
        counts[orphan.namespace] = counts.get(orphan.namespace, 0) + 1
    return counts
