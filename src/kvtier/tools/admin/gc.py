"""`kvtier gc`: evict chunks of persistent tiers to a quota, by age, or whole namespaces.

Selection is a pure function over an inventory (`select_victims`), so a dry run shows exactly
what a real run deletes. Order of the rules, per tier: keep only the chunks of the selected
namespaces (`namespace`, and/or those whose manifest matches `fingerprint` (a prefix of at
least 6 hex digits) or `model` (its name as served): tiers/manifest.py; a namespace without a
manifest matches neither); drop those idle longer than `max_age_s` (idle by the clock that
stamped their times of use, `StorageClock`: a shared directory's or an S3 server's, not
this host's); then drop the least recently used until what is left of the selection fits
`quota_bytes`. A namespace selection with neither rule drops the whole namespaces, their
manifests included (an engine still serving one writes its manifest again when it restarts).
Every run (a dry run only counts them) also deletes the orphans of tiers that can have some
(`OrphanSource`: redis values of an older kvtier, a value per part), in the selected
namespaces; `orphans_only` does only that.

Safe next to running engines: a chunk deleted under a reader is a miss for it (files are
renamed into place and read whole; a redis chunk is one hash), and what is deleted from
a shared directory is taken off its quota ledger at once (chunktree.FileInventory). A victim
of `quota_bytes` or `max_age_s` was chosen for being least recently used when the tier was
listed; one an engine read (or wrote again) between the listing and its deletion is hot now:
where the storage records each use (a file's mtime; a redis hash's idle time or LRU score:
`UnusedRemoval`), it is kept, and counted in `GcOutcome.kept_used`. S3 records no read (an
object's LastModified is its write): its deletions follow the listing. Whole namespaces go
whatever their use.

Primitives: `GcRequest`, `GcOutcome`, `select_victims`, `run_gc`, `parse_duration`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError, GcStopped
from kvtier.tiers.manifest import NamespaceManifest
from kvtier.tools.admin.inventory import (
    UNKNOWN,
    Inventory,
    ManifestSource,
    OrphanSource,
    StoredChunk,
    UnusedRemoval,
    read_manifests,
    storage_now,
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}
_FINGERPRINT_PREFIX = re.compile(r"[0-9a-f]{6,32}")
MIN_FINGERPRINT_DIGITS = 6  # shorter prefixes match too many checkpoints by chance


@dataclass(frozen=True, slots=True)
class GcRequest:
    """What to evict. At least one rule must be set."""

    quota_bytes: int | None = None  # keep at most this many bytes (per tier, of the selection)
    max_age_s: float | None = None  # evict chunks not used for longer than this
    namespace: str | None = None  # consider only this layout digest (alone: evict all of it)
    dry_run: bool = False  # report only
    orphans_only: bool = False  # evict no chunk: only delete orphans (e.g. old redis values)
    # consider only namespaces whose manifest's fingerprint starts with this (>= 6 hex digits)
    fingerprint: str | None = None
    model: str | None = None  # consider only namespaces whose manifest names this model

    def validate(self) -> None:
        """Raises ConfigError when no rule is set (or a rule with `orphans_only`), or when
        `fingerprint` is not 6 to 32 lowercase hex digits, or `model` is empty."""
        rules = (self.quota_bytes, self.max_age_s)
        if self.fingerprint is not None and not _FINGERPRINT_PREFIX.fullmatch(self.fingerprint):
            raise ConfigError("--fingerprint", self.fingerprint,
                              f"{MIN_FINGERPRINT_DIGITS} to 32 lowercase hex digits of a model "
                              "fingerprint (the start of one `kvtier inspect` shows)")
        if self.model is not None and not self.model.strip():
            raise ConfigError("--model", self.model, "a model's name as served (`kvtier "
                                                     "inspect` shows them)")
        if self.orphans_only and any(rule is not None for rule in rules):
            raise ConfigError("gc", "--orphans", "alone, or with --namespace, --fingerprint "
                                                 "or --model only")
        if not self.orphans_only and all(rule is None for rule in (*rules, *self._filters)):
            raise ConfigError("gc", None, "at least one of --quota, --max-age, --namespace, "
                                          "--fingerprint, --model, --orphans")

    @property
    def _filters(self) -> tuple[str | None, ...]:
        return (self.namespace, self.fingerprint, self.model)

    @property
    def by_manifest(self) -> bool:
        """Whether namespaces are selected by their manifests (`fingerprint`, `model`)."""
        return self.fingerprint is not None or self.model is not None

    @property
    def whole_namespaces(self) -> bool:
        """Whether the selected namespaces go whole (no quota, no age, not orphans only)."""
        return not self.orphans_only and self.quota_bytes is None and self.max_age_s is None

    def selects(self, namespace: str, manifest: NamespaceManifest | None) -> bool:
        """Whether `namespace` (with its manifest, None when it has none) is selected."""
        if self.namespace not in (None, namespace):
            return False
        if self.by_manifest and manifest is None:
            return False
        if self.fingerprint is not None and manifest is not None \
                and not manifest.fingerprint.startswith(self.fingerprint):
            return False
        return self.model is None or (manifest is not None and manifest.model == self.model)


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
    removed_orphans: int = 0  # values no reader reaches (an older kvtier's redis values)
    removed_manifest: bool = False  # its manifest went (would go) with the whole namespace
    model: str = UNKNOWN  # the model its manifest names
    fingerprint: str = UNKNOWN  # the model fingerprint its manifest names ("none": none)
    # victims kept: read or written since gc listed them (in kept_*, not removed_*)
    kept_used: int = 0


def parse_duration(text: str, field: str = "--max-age") -> float:
    """Seconds from "90", "90s", "30m", "12h", "7d" or "2w".

    Raises:
        ConfigError: anything else.
    """
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(field, text, "a duration such as 90s, 30m, 12h, 7d or 2w")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def select_victims(chunks: Sequence[StoredChunk], request: GcRequest, now_s: float,
                   namespaces: Collection[str] | None = None) -> list[StoredChunk]:
    """The chunks `request` evicts from one tier, least recently used first. `namespaces`:
    the namespaces selected (`run_gc` computes them from the manifests); None: those
    `request.namespace` names (every namespace when None)."""
    def selected_namespace(namespace: str) -> bool:
        if namespaces is not None:
            return namespace in namespaces
        return request.namespace in (None, namespace)

    selected = sorted((c for c in chunks if selected_namespace(c.namespace)),
                      key=lambda c: c.last_used_s)
    if request.quota_bytes is None and request.max_age_s is None:
        return selected  # namespaces alone: all of them
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
    """Select and (unless a dry run) delete; one outcome per tier and namespace selected
    (none at all: no namespace matched).

    Raises:
        ConfigError: no rule in `request`, or a malformed one.
        OSError, redis.RedisError: a tier's storage could not be listed.
        GcStopped: a deletion failed partway (with what was removed by then).
    """
    request.validate()
    outcomes: list[GcOutcome] = []
    for inventory in inventories:
        try:
            outcomes += _collect(inventory, request)
        except GcStopped as stopped:
            stopped.outcomes[:0] = outcomes  # the tiers' before it
            raise
    return outcomes


def _collect(inventory: Inventory, request: GcRequest) -> list[GcOutcome]:
    """`run_gc` of one tier."""
    manifests = read_manifests(inventory)
    orphans = _orphans(inventory, request, manifests)
    if orphans and not request.dry_run and isinstance(inventory, OrphanSource):
        try:
            inventory.remove_orphans(orphans)
        except Exception as exc:  # how many went is not known
            raise GcStopped(inventory.name, exc, [], counted=False) from exc
    chunks = list(inventory.chunks())
    namespaces = {c.namespace for c in chunks} | {o.namespace for o in orphans} \
        | set(manifests)
    chosen = {n for n in namespaces if request.selects(n, manifests.get(n))}
    # Ages by the clock that stamped the times of use (a shared directory's, an S3 server's),
    # not this host's: a gc host minutes ahead deleted chunks the fleet was reading.
    now_s = storage_now(inventory) if request.max_age_s is not None else time.time()
    victims = [] if request.orphans_only else select_victims(chunks, request, now_s, chosen)
    dropped: set[str] = set()  # the namespaces whose manifest went (would go), so far
    try:
        kept_used: Sequence[StoredChunk] = ()
        if victims and not request.dry_run:
            kept_used = _remove(inventory, victims, request)
        _drop_manifests(inventory, request, chosen & set(manifests), dropped)
    except Exception as exc:  # stopped partway: what went is counted by listing again
        gone = _no_longer_listed(inventory, victims)
        raise GcStopped(inventory.name, exc, [] if gone is None else _outcomes(
            inventory.name, request, chosen, chunks, gone, orphans, manifests, dropped),
            counted=gone is not None) from exc
    return _outcomes(inventory.name, request, chosen, chunks, victims, orphans, manifests,
                     dropped, kept_used)


def _no_longer_listed(inventory: Inventory,
                      victims: Sequence[StoredChunk]) -> list[StoredChunk] | None:
    """Those of `victims` the tier no longer lists (None: it could not be listed)."""
    try:
        listed = {(c.namespace, c.key_hex) for c in inventory.chunks()}
    except Exception:  # the storage gone too
        return None
    return [c for c in victims if (c.namespace, c.key_hex) not in listed]


def _remove(inventory: Inventory, victims: Sequence[StoredChunk],
            request: GcRequest) -> Sequence[StoredChunk]:
    """Delete `victims`; those kept for having been used since they were listed (only by
    the least-recently-used rules, where the storage records use)."""
    if request.whole_namespaces or not isinstance(inventory, UnusedRemoval):
        inventory.remove(victims)
        return ()
    return inventory.remove_unused(victims).kept_used


def _orphans(inventory: Inventory, request: GcRequest,
             manifests: Mapping[str, NamespaceManifest | None]) -> list[StoredChunk]:
    """The orphans of `request`'s namespaces."""
    if not isinstance(inventory, OrphanSource):
        return []
    return [o for o in inventory.orphans()
            if request.selects(o.namespace, manifests.get(o.namespace))]


def _drop_manifests(inventory: Inventory, request: GcRequest,
                    namespaces: Collection[str], dropped: set[str]) -> None:
    """Remove (unless a dry run) the manifests of the namespaces a whole-namespace
    selection evicts, each added to `dropped` as it goes (would go): a removal that fails
    leaves there those that went before it (they were reported kept)."""
    if not request.whole_namespaces or not isinstance(inventory, ManifestSource):
        return
    for namespace in sorted(namespaces):
        if not request.dry_run:
            inventory.remove_manifest(namespace)
        dropped.add(namespace)


def _outcomes(tier: str, request: GcRequest, chosen: Collection[str],
              chunks: Sequence[StoredChunk], victims: Sequence[StoredChunk],
              orphans: Sequence[StoredChunk],
              manifests: Mapping[str, NamespaceManifest | None],
              dropped: Collection[str],
              kept_used: Sequence[StoredChunk] = ()) -> list[GcOutcome]:
    used = {(c.namespace, c.key_hex) for c in kept_used}
    gone = {(c.namespace, c.key_hex) for c in victims} - used
    outcomes = []
    for namespace in sorted(chosen):
        mine = [c for c in chunks if c.namespace == namespace]
        removed = [c for c in mine if (c.namespace, c.key_hex) in gone]
        removed_bytes = sum(c.size_bytes for c in removed)
        manifest = manifests.get(namespace)
        outcomes.append(GcOutcome(
            tier, namespace, len(removed), removed_bytes, len(mine) - len(removed),
            sum(c.size_bytes for c in mine) - removed_bytes, request.dry_run,
            sum(o.namespace == namespace for o in orphans), namespace in dropped,
            manifest.model if manifest else UNKNOWN,
            (manifest.fingerprint or "none") if manifest else UNKNOWN,
            sum(c.namespace == namespace for c in kept_used)))
    return outcomes
