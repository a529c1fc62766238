"""Properties of pins, expiries and eviction policies through a TieredStore (memory -> disk),
checked by hypothesis on random sequences of puts (with tenants, pins, expiries and parents),
reads, retains, deletions, floods, restarts and the passing of time, in tiers of a few chunks.
The clock is the test's (both tiers' books read it); every write behind lands before the next
step.

- A chunk read back has the bytes stored under its key, and never after its expiry.
- No tier holds more than its capacity, and each tier's books agree with what it holds.
- Every chunk in a tier's eviction policy can be evicted; a chunk in a prefix policy with its
  parent (entered before or after it: stored, promoted, or back from a pin; not one the disk
  found at start-up: the journal keeps no parents) extends it, so that the parent is not a
  leaf to evict before it; and, nothing pinned and no quota, a flood of new chunks as large as a
  tier (LRU or prefix eviction, whose victims are the least recently used leaves) leaves
  that tier holding the flood alone.
- No tenant (each of the prompt's chunks has one, drawn; floods are the default tenant's)
  holds more chunks of a tier than its quota, drawn, unless a restart lowered it below
  chunks the tenant has pinned; a restart (the store reopened, its RAM empty, the disk's
  quota drawn anew) brings every tenant down to its quota but for pinned chunks.
- A restart keeps each chunk's own expiry (its request's) and dates one the disk's `ttl_s`
  gave anew, by the `ttl_s` drawn for it (none: the chunk no longer expires); RAM (no
  `ttl_s`) holds every chunk, promoted or not, to its own expiry alone, never to a date the
  disk's `ttl_s` gave it.
- The last restart (no quota) keeps on disk exactly the chunks it held that carry no expiry
  now (every expiry a chunk carries has passed by then), with their bytes.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tierkit import footprint_bytes, key, tier_settings, tiny_layout

from kvtier.core.policies import PrefixPolicy
from kvtier.core.retention import ChunkMeta, tenant_label
from kvtier.core.store import TieredStore
from kvtier.tiers import build_tier
from kvtier.tiers.files.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout(4)  # 1 KiB chunks
KEYS = 4
MEMORY_CHUNKS, DISK_CHUNKS = 2, 4
FLOOD = 1000  # keys of flood chunks start here (each flood's are new)
# Keys 0-3 are a prompt: each chunk's parent is the one before it.
PARENTS = {i: None if i == 0 else key(i - 1) for i in range(KEYS)}


def payload(i: int) -> bytes:
    body = bytes((i * 31 + j) % 251 for j in range(LAYOUT.bytes_per_chunk - 8))
    return i.to_bytes(8, "big") + body


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _config(root: Path, memory_eviction: str, disk_eviction: str,
            quota: int | None = None, ttl_s: float | None = None) -> StoreConfig:
    """Both tiers; `quota`: the chunks a tenant may hold of each (None: no quota); `ttl_s`:
    the disk's."""
    def retention(kind: str) -> dict[str, Any]:
        settings: dict[str, Any] = {"ttl_s": ttl_s} if kind == "disk" else {}
        if quota is not None:
            settings["tenant_quota"] = {"cap": quota * footprint_bytes(kind, LAYOUT)}
        return settings

    return StoreConfig.parse({"tiers": [
        tier_settings("memory", root, LAYOUT, MEMORY_CHUNKS, eviction=memory_eviction,
                      prefault=False, **retention("memory")),
        tier_settings("disk", root, LAYOUT, DISK_CHUNKS, eviction=disk_eviction,
                      o_direct="off", **retention("disk"))]})


def _disk(config: StoreConfig, clock: Clock | None = None) -> DiskTier:
    """The disk tier (on the test's clock, its start-up index's too; None: the real one)."""
    disk = DiskTier(config.tiers[1], LAYOUT, clock=clock) if clock is not None \
        else build_tier(config.tiers[1], LAYOUT)
    assert isinstance(disk, DiskTier) and disk.wait_loaded(30)
    return disk


def _over_quota(tier: MemoryTier | DiskTier, quota: int | None,
                tenants: dict[int, str | None], keys: list[int]) -> dict[str, bool]:
    """Tenants (by label) holding more chunks of `tier` than `quota`, each with whether all
    of those are pinned."""
    if quota is None:
        return {}
    over = {u.tenant: True for u in tier.retention_stats().tenants if u.chunks > quota}
    for i in _held(tier, keys):
        label = tenant_label(tenants.get(i))
        if label in over and (m := tier.meta_of(key(i))) is not None and m.retain_until is None:
            over[label] = False
    return over


def _misdated(tier: MemoryTier | DiskTier, keys: set[int], expires: dict[int, float | None],
              ttl_s: float | None, now: float) -> list[int]:
    """Chunks of `tier` whose expiry there is not their own (their request's), or, without
    one, `ttl_s` from `now` (or none); or whose metadata (what a promotion carries) holds
    another expiry than their own."""
    def dated(i: int) -> float | None:
        own = expires.get(i)
        return own if own is not None else None if ttl_s is None else now + ttl_s

    def carried(i: int) -> float | None:
        return None if (m := tier.meta_of(key(i))) is None else m.expires_at

    with tier._lock:
        applied = {i: tier._book.expires_at(key(i)) for i in keys}
    return [i for i in sorted(keys) if applied[i] != dated(i) or carried(i) != expires.get(i)]


def _held(tier: MemoryTier | DiskTier, keys: range | list[int]) -> set[int]:
    return {i for i in keys if tier.contains(key(i))}


def _evictable(tier: MemoryTier | DiskTier) -> tuple[int, int]:
    """(chunks in the tier's eviction policy, how many of them it would evict): a copy of
    the policy, drained."""
    with tier._lock:
        policy = copy.deepcopy(tier._policy)
    resident = len(policy)
    evicted = 0
    while policy.evict() is not None:
        evicted += 1
    return resident, evicted


def _unlinked(tier: MemoryTier | DiskTier, found: set[int]) -> list[tuple[int, int]]:
    """(parent, chunk) pairs of a prefix policy where the chunk does not extend its parent
    though both are in it, whichever entered first (stored, promoted, back from a pin): the
    policy could evict the parent first. But for chunks in `found`: those a disk tier found
    at start-up know no parent (roots). And (-1, chunk) for a chunk whose count of children
    (held or, for a chunk not in the policy, absent) is not the chunks extending it."""
    with tier._lock:
        policies = list(tier._policy._generations.values())
    pairs = []
    for policy in policies:
        if not isinstance(policy, PrefixPolicy):
            continue
        chunks = policy._chunks
        extending: dict[Any, int] = {}
        for k, chunk in chunks.items():
            i = int.from_bytes(k, "big")
            parent = PARENTS.get(i)
            if parent is not None and parent in chunks and chunk.parent != parent \
                    and i not in found:
                pairs.append((i - 1, i))
            if chunk.parent is not None:
                extending[chunk.parent] = extending.get(chunk.parent, 0) + 1
        counts = {k: c.children for k, c in chunks.items() if c.children}
        counts.update({k: a.children for k, a in policy._absent.items()})
        pairs += [(-1, int.from_bytes(k, "big")) for k in counts.keys() | extending.keys()
                  if counts.get(k) != extending.get(k)]
    return pairs


PUT = st.tuples(st.just("put"), st.integers(0, KEYS - 1), st.booleans())
RETAIN = st.tuples(st.just("retain"), st.integers(0, KEYS - 1))
OPS = st.lists(
    st.one_of(
        PUT, PUT, PUT, RETAIN, RETAIN,
        st.tuples(st.just("get"), st.integers(0, KEYS - 1)),
        st.tuples(st.just("delete"), st.integers(0, KEYS - 1), st.integers(0, 1)),
        st.tuples(st.just("advance"), st.sampled_from([1.0, 10.0, 40.0])),
        st.tuples(st.just("flood")),
        # the quota and the disk's ttl_s after it
        st.tuples(st.just("restart"), st.sampled_from([None, 1, 2]),
                  st.sampled_from([None, 30.0, 100.0])),
    ),
    min_size=20, max_size=50,
)


NO_EXPIRY: list[float | None] = [None] * KEYS


def case(ops: list[tuple[Any, ...]], memory_eviction: str, disk_eviction: str,
         expiry: list[float | None] = NO_EXPIRY, ttl_s: float | None = None) -> Any:
    """An explicit example: the default tenant's chunks, no quota."""
    return example(ops=ops, memory_eviction=memory_eviction, disk_eviction=disk_eviction,
                   expiry=expiry, tenants=[None] * KEYS, quota=None, ttl_s=ttl_s)


@settings(max_examples=60, deadline=None, derandomize=True,  # the same examples each run
          suppress_health_check=[HealthCheck.too_slow])
# Sequences that broke a property once (each stays a case):
# a parent pinned while its child was held, back in RAM's prefix policy when its pin ended,
# was counted down by its old child's eviction to -1 children: never evicted again;
@case([("put", 0, False), ("put", 1, False), ("retain", 0), ("advance", 10.0),
       ("put", 2, False)], "prefix", "lru")
# the same on disk, for a parent deleted and stored again;
@case([("put", 0, False), ("put", 1, False), ("delete", 0, 1), ("put", 0, False), ("flood",)],
      "lru", "prefix")
# a chunk promoted back into RAM with its expiry expired twice at once (a KeyError);
@case([("put", 0, False), ("put", 1, False), ("put", 2, False), ("get", 0), ("advance", 40.0),
       ("put", 3, False)], "lru", "lru", expiry=[20.0, None, None, None])
# a chunk promoted from disk with the pin it had there, ended, entered RAM's prefix policy
# as a root: its parent, held there, was a leaf to evict before it;
@case([("put", 0, False), ("put", 1, True), ("advance", 10.0), ("delete", 1, 0), ("get", 1)],
      "prefix", "lru")
# a parent pinned when its child was stored, back in RAM's prefix policy when its pin ended,
# was a leaf beside its child (a root): evicted before it;
@case([("put", 0, True), ("put", 1, False), ("advance", 10.0), ("get", 1), ("put", 2, False)],
      "prefix", "lru")
# a chunk promoted from a disk with a ttl_s carried the date it gave as its own into RAM;
@case([("put", 0, False), ("put", 1, False), ("put", 2, False), ("get", 0)], "lru", "lru",
      ttl_s=30.0)
# a restart that lowered the quota left a tenant over it (the disk applied no quota then);
@case([("put", 0, False), ("put", 1, False), ("restart", 1, None)], "lru", "lru")
# a pinned chunk's journal line kept the expiry the disk's ttl_s gave it, as its own: a
# restart without a ttl_s kept it (docs/retention.md: the tier's ttl_s starts anew).
@case([("put", 0, True), ("restart", None, None)], "lru", "lru", ttl_s=30.0)
@given(ops=OPS, memory_eviction=st.sampled_from(["lru", "arc", "prefix"]),
       disk_eviction=st.sampled_from(["lru", "prefix"]),
       expiry=st.lists(st.sampled_from([None, 20.0, 60.0]), min_size=KEYS, max_size=KEYS),
       tenants=st.lists(st.sampled_from([None, "a"]), min_size=KEYS, max_size=KEYS),
       quota=st.sampled_from([None, 1, 2]), ttl_s=st.sampled_from([None, 30.0]))
def test_retention_properties_hold_for_any_sequence_of_operations(
    ops: list[tuple[Any, ...]], memory_eviction: str, disk_eviction: str,
    expiry: list[float | None], tenants: list[str | None], quota: int | None,
    ttl_s: float | None,
) -> None:
    # Stored "5000 s ago": every expiry has passed by the restart (real clock) at the end.
    clock = Clock(time.time() - 5000)
    expires: dict[int, float | None] = {}  # each chunk's expiry, fixed at its first put
    tenant_of = dict(enumerate(tenants))  # flood chunks: the default tenant's
    # Tenants a restart left over the disk's quota with pinned chunks (nothing evicts those).
    pinned_over: set[str] = set()
    found: set[int] = set()  # chunks the disk held since its last start-up
    floods = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = _config(root, memory_eviction, disk_eviction, quota, ttl_s)
        memory = MemoryTier(config.tiers[0], LAYOUT, clock=clock)
        disk = _disk(config, clock)
        store = TieredStore([memory, disk])
        try:
            out = bytearray(LAYOUT.bytes_per_chunk)

            def meta(i: int, pin: bool) -> ChunkMeta:
                if i not in expires:
                    after = expiry[i]
                    expires[i] = None if after is None else clock.now + after
                return ChunkMeta(tenant_of[i], retain_until=clock.now + 5 if pin else None,
                                 expires_at=expires[i], parent=PARENTS[i])

            def everything() -> list[int]:
                return list(range(KEYS)) + list(range(FLOOD, FLOOD + DISK_CHUNKS * floods))

            for op in ops:
                if op[0] == "put":
                    store.put(key(op[1]), memoryview(payload(op[1])), meta(op[1], op[2]))
                elif op[0] == "get":
                    # The reader names the chunk's parent, as a load of its prompt could.
                    served = store.get_into(key(op[1]), memoryview(out),
                                            ChunkMeta(tenant_of[op[1]], parent=PARENTS[op[1]]))
                    if served:
                        assert bytes(out) == payload(op[1]), "another chunk's bytes"
                        at = expires.get(op[1])
                        assert at is None or clock.now < at, "served after its expiry"
                elif op[0] == "retain":
                    store.retain(key(op[1]), meta(op[1], True))
                elif op[0] == "delete":
                    store.tiers[op[2]].delete(key(op[1]))  # as by `kvtier gc`, or a fault
                elif op[0] == "advance":
                    clock.now += op[1]
                elif op[0] == "restart":  # the process: RAM empty, the disk reopened
                    store.close()
                    quota, ttl_s = op[1], op[2]
                    config = _config(root, memory_eviction, disk_eviction, quota, ttl_s)
                    memory = MemoryTier(config.tiers[0], LAYOUT, clock=clock)
                    disk = _disk(config, clock)
                    store = TieredStore([memory, disk])
                    over = _over_quota(disk, quota, tenant_of, everything())
                    assert all(over.values()), f"a restart left {over} over the quota"
                    pinned_over = set(over)
                    found = _held(disk, everything())
                    assert _misdated(disk, found, expires, ttl_s, clock.now) == []
                else:  # a flood of new unpinned chunks, as many as the disk holds
                    pinned = {t.name: t.retention_stats().pinned_chunks for t in (memory, disk)}
                    flood = [FLOOD + DISK_CHUNKS * floods + n for n in range(DISK_CHUNKS)]
                    floods += 1
                    for i in flood:
                        tenant_of[i] = None
                        # (A quota may leave no room: the default tenant's chunks pinned.)
                        assert store.put(key(i), memoryview(payload(i))) or quota is not None
                        assert store.flush(timeout_s=10)
                    # (A quota bounds the flood: its chunks are the default tenant's.)
                    if quota is None and pinned["memory"] == 0 and memory_eviction != "arc":
                        assert _held(memory, range(FLOOD, flood[-1] + 1)) == set(
                            flood[-MEMORY_CHUNKS:])  # (ARC: scans lose)
                        assert not _held(memory, range(KEYS)), "an unpinned chunk outlived it"
                    # (A disk's "lru" is CLOCK: a chunk read lately outlives unread ones.)
                    if quota is None and pinned["disk"] == 0 and disk_eviction == "prefix":
                        assert _held(disk, flood) == set(flood)
                        assert not _held(disk, range(KEYS)), "an unpinned chunk outlived it"
                assert store.flush(timeout_s=10)
                for tier, stats in zip(store.tiers, store.stats().tiers):
                    assert stats.used_bytes <= stats.capacity_bytes, stats
                    held = _held(tier, everything())
                    assert tier.stats().chunks == len(held), "the chunks gauge is off"
                    resident, evictable = _evictable(tier)
                    assert evictable == resident, "a chunk its policy never evicts"
                    if tier is disk:
                        found &= held
                    unlinked = _unlinked(tier, found if tier is disk else set())
                    assert unlinked == [], "a chunk held apart from its parent"
                    if tier is memory:  # no ttl_s of its own: a lower tier's is not its
                        assert _misdated(memory, held, expires, None, clock.now) == []
                    over = _over_quota(tier, quota, tenant_of, everything())
                    assert set(over) <= pinned_over, f"{over} over the quota in {tier.name}"
                assert memory.check() == [] and disk.check() == []
            # A restart: what the disk held, but for the chunks whose expiry passed meanwhile
            # (their own: the disk's ttl_s is dated anew, and there is none then).
            known = everything()
            kept = {i for i in _held(disk, known) if expires.get(i) is None}
        finally:
            store.close()
        # (Without a quota: one would bring the tenants down to it, pins lapsed by then.)
        again = _disk(_config(root, memory_eviction, disk_eviction))
        try:
            assert _held(again, known) == kept
            for i in kept:
                assert again.get_into(key(i), memoryview(out)).ok
                assert bytes(out) == payload(i)
            assert again.check() == []
        finally:
            again.close()
