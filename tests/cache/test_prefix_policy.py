"""The prefix-aware eviction policy (kvtier.core.policies.prefix, issue 45): leaves of the tree
of held prefixes leave first, ranked by recency plus a bonus per doubling of uses, a new
chunk's bonus falling with its place in its run of new chunks, the bonus's horizon learned
from the traffic's reuse gaps; a chunk's uses outlive its eviction, boundedly; any tier can
take it by name."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.policies import POLICIES, Generations, LRUPolicy, PrefixPolicy, make_policy
from kvtier.core.policies.prefix import HORIZON_GAPS, MIN_REMEMBERED
from kvtier.core.policies.reusegaps import REFRESH
from kvtier.core.retention import ChunkMeta
from kvtier.tiers.memory import MemoryTier, MemoryTierConfig
from kvtier.tiers.storeconfig import StoreConfig


def _chain(policy: PrefixPolicy[str], name: str, length: int) -> list[str]:
    """Insert a prompt of `length` chunks, first to last, each extending the one before."""
    keys = [f"{name}{i}" for i in range(length)]
    parent = None
    for key in keys:
        policy.insert(key, parent)
        parent = key
    return keys


def test_a_chain_is_cut_back_from_its_end_even_when_its_start_was_read_last() -> None:
    """A lookup reads a prompt's chunks first to last, so LRU would take the first chunk:
    the prefix policy takes the last, and never a chunk another held chunk extends."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=10**6)
    keys = _chain(policy, "a", 4)
    for key in keys:
        policy.touch(key)
    policy.touch("a0")  # read last: LRU's most recent; still the last to go here
    assert [policy.evict() for _ in range(4)] == ["a3", "a2", "a1", "a0"]
    assert policy.evict() is None and len(policy) == 0


@pytest.mark.parametrize("lending", [False, True], ids=["", "lending"])
def test_a_parent_is_never_evicted_while_a_child_is_held_under_random_traffic(
        lending: bool) -> None:
    """Branching prompts (a shared system prompt, conversations, one-shot prompts) inserted
    and read at random in a small tier: every victim is a leaf of what is held. `lending`:
    the prompt read is lent meanwhile (a load), so evictions pass over it (`keep`)."""
    rng = random.Random(45)
    policy: PrefixPolicy[int] = PrefixPolicy(capacity=64, horizon_ops=500)
    parent_of: dict[int, int | None] = {}
    held: set[int] = set()
    next_key = 0
    for _ in range(3000):
        chain: list[int] = []
        parent: int | None = None
        if held and rng.random() < 0.6:  # extend or re-read something held
            tip = rng.choice(sorted(held))
            node: int | None = tip
            while node is not None:
                chain.append(node)
                node = parent_of[node]
            chain.reverse()
            for key in chain:
                policy.touch(key)
            parent = tip
        lent = set(chain) if lending else set()
        for _ in range(rng.randint(1, 4)):
            key, next_key = next_key, next_key + 1
            if len(held) >= 64:
                victim = policy.evict(keep=lent.__contains__)
                if victim is None:  # every leaf is lent
                    parents = {parent_of[k] for k in held}
                    assert all(k in lent for k in held if k not in parents)
                    victim = policy.evict()
                else:
                    assert victim not in lent, "evicted a lent chunk"
                assert victim is not None  # it may be `parent`: a leaf until extended
                assert all(parent_of[k] != victim for k in held), "evicted a parent"
                held.discard(victim)
            if parent is not None and parent not in held:
                parent = None  # its prefix left meanwhile: it starts a new chain
            parent_of[key] = parent
            policy.insert(key, parent)
            held.add(key)
            parent = key
        assert len(policy) == len(held)


def test_a_chunk_read_more_often_outlives_a_more_recent_one_within_the_bonus() -> None:
    """Two one-chunk prompts: the older one read three times ranks above the newer one read
    once, for as long as the bonus lasts; with no bonus (a tier as large as the horizon),
    plain recency decides."""
    small: PrefixPolicy[str] = PrefixPolicy(capacity=10, horizon_ops=1000)
    small.insert("hot")
    for _ in range(3):
        small.touch("hot")
    small.insert("new")
    assert small.evict() == "new"
    large: PrefixPolicy[str] = PrefixPolicy(capacity=1000, horizon_ops=1000)
    assert large.bonus_ops == 0
    large.insert("hot")
    for _ in range(3):
        large.touch("hot")
    large.insert("new")
    assert large.evict() == "hot"


def test_an_evicted_chunk_offered_again_keeps_its_uses_and_the_memory_is_bounded() -> None:
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=4, horizon_ops=1000)
    policy.insert("turn")
    assert policy.evict() == "turn"
    policy.insert("turn")  # the conversation's next turn stores it again: its 2nd use
    policy.insert("o0")
    policy.insert("other", "o0")  # a prompt's 2nd new chunk: half a first chunk's bonus
    assert policy.evict() == "other"
    for i in range(MIN_REMEMBERED + 10):  # a flood of one-shot chunks
        policy.insert(i)  # type: ignore[arg-type]
        policy.evict()
    assert len(policy._evicted_uses) == MIN_REMEMBERED


def test_the_horizon_is_learned_from_the_reuse_gaps() -> None:
    """No bonus before anything came back (recency alone); then HORIZON_GAPS median gaps,
    less the tier's own turnover: 100 chunks read in turn come back every 100 operations."""
    policy: PrefixPolicy[int] = PrefixPolicy(capacity=10)
    for key in range(100):
        policy.insert(key)
    assert policy.bonus_ops == 0
    for _ in range(2 * REFRESH // 100 + 1):
        for key in range(100):
            policy.touch(key)
    assert HORIZON_GAPS * 100 / 1.19 <= policy.horizon_ops <= HORIZON_GAPS * 100 * 1.19
    assert policy.bonus_ops == policy.horizon_ops - 10


def _agent_sessions(requests: int, active: int) -> list[list[int]]:
    """An agent fleet: `active` sessions at once, each turn the whole context so far plus 4
    new chunks, a mean 15 turns a session, then never again."""
    rng = random.Random(45)
    live: list[tuple[list[int], list[int]]] = []  # (context, [turns left])
    prompts: list[list[int]] = []
    next_key = 0
    while len(prompts) < requests:
        while len(live) < active:
            live.append(([], [1 + int(rng.expovariate(1 / 15))]))
        context, left = rng.choice(live)
        context.extend(range(next_key, next_key + 4))
        next_key += 4
        prompts.append(list(context))
        left[0] -= 1
        if not left[0]:
            live.remove((context, left))
    return prompts


def _hit_ratio(prompts: list[list[int]], policy: LRUPolicy[int] | PrefixPolicy[int],
               capacity: int) -> float:
    """A tier of `capacity` chunks: a prompt hits its longest held prefix, then stores the
    rest."""
    held: set[int] = set()
    hits = chunks = 0
    for keys in prompts:
        n = 0
        while n < len(keys) and keys[n] in held:
            policy.touch(keys[n])
            n += 1
        hits, chunks = hits + n, chunks + len(keys)
        for i in range(n, len(keys)):
            if len(held) >= capacity:
                held.discard(policy.evict())  # type: ignore[arg-type]
            held.add(keys[i])
            policy.insert(keys[i], keys[i - 1] if i else None)
    return hits / chunks


def test_finished_agent_sessions_do_not_outlive_live_ones() -> None:
    """An agent's turns come back within hundreds of operations and a session's early chunks
    are read every turn: a bonus fixed for a chat trace's tens of thousands of operations
    (a fixed 30,000, as before) keeps finished sessions' well-read chunks and evicts the live
    ones' (a third of LRU's hits); the learned horizon keeps at least LRU's."""
    prompts = _agent_sessions(3000, active=8)
    lru = _hit_ratio(prompts, LRUPolicy(), 300)
    assert _hit_ratio(prompts, PrefixPolicy(300), 300) >= lru
    assert _hit_ratio(prompts, PrefixPolicy(300, horizon_ops=30_000), 300) < 0.5 * lru


def test_a_small_tier_trims_a_newer_prompts_tail_before_an_older_prompts_head() -> None:
    """Rule 3: a prompt's first new chunks come back more often than its tail, so the n-th
    new chunk in a row gets 1/n of the first one's bonus. An older one-chunk prompt outlives
    the last three chunks of a newer four-chunk prompt (LRU over leaves would take it
    first), then leaves before the newer prompt's head."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=10, horizon_ops=1000)
    policy.insert("old")
    _chain(policy, "new", 4)
    assert [policy.evict() for _ in range(5)] == ["new3", "new2", "new1", "old", "new0"]


def test_a_conversations_new_turn_heads_a_run_of_its_own() -> None:
    """A run of new chunks starts again under a chunk read again (a returning conversation's
    held prefix): the new turn's 2nd chunk ranks as a fresh prompt's 2nd chunk, above that
    prompt's 3rd, though it was stored earlier."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=10, horizon_ops=1000)
    policy.insert("p0")
    policy.touch("p0")  # the conversation came back: its prefix was read again
    policy.insert("t0", "p0")
    policy.insert("t1", "t0")
    _chain(policy, "f", 3)  # a fresh prompt of three chunks, stored after
    assert [policy.evict() for _ in range(2)] == ["f2", "t1"]


def test_a_chunk_whose_parent_is_not_held_heads_no_run() -> None:
    """A chunk stored under a parent this policy does not hold (evicted meanwhile, pinned,
    in another tier) cannot be reached here by a lookup: it gets no bonus, and leaves before
    an older first chunk; so does a chunk stored under it."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=10, horizon_ops=1000)
    policy.insert("head")
    policy.insert("orphan", "gone")
    policy.insert("below", "orphan")
    assert [policy.evict() for _ in range(3)] == ["below", "orphan", "head"]


def test_remove_of_a_parent_frees_its_last_child_to_rank_alone() -> None:
    """A deleted (or pinned) chunk leaves the policy; its parent becomes a leaf again."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=10**6)
    _chain(policy, "c", 3)
    policy.remove("c2")
    policy.remove("c1")
    assert len(policy) == 1 and policy.evict() == "c0"


def test_a_parent_removed_and_inserted_again_stays_evictable() -> None:
    """A parent pinned (out of the policy) or deleted, then back (its pin ended, stored
    again) is a new chunk: its old children leaving do not count it down. Counted down, it
    went below zero children and was never a leaf again: never evicted, a slot lost for
    good."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=10**6)
    _chain(policy, "p", 2)
    policy.remove("p0")  # pinned: out of the policy while p1 still extends it
    policy.insert("p0")  # its pin ended: back, with no children
    assert [policy.evict() for _ in range(3)] == ["p1", "p0", None]
    assert len(policy) == 0
    # Back under a new child: the old child leaving leaves it a parent.
    _chain(policy, "q", 2)
    policy.remove("q0")
    policy.insert("q0")
    policy.insert("r", "q0")
    policy.remove("q1")
    assert [policy.evict() for _ in range(4)] == ["r", "q0", None, None]


def test_a_parent_that_comes_back_extends_the_children_held_meanwhile() -> None:
    """A chunk stored while its parent was out of the policy (pinned, deleted, in another
    tier) was a root; its parent, back (its pin ended, stored again, promoted), must not be
    a leaf to evict before it: a child held without its parent is useless. Then the parent
    is a leaf again once its children have left, and nothing of them is kept."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=10**6)
    policy.insert("c1", "c0")  # c0 pinned meanwhile: c1 a root for now
    policy.insert("c2", "c1")
    policy.insert("d1", "c0")
    policy.insert("c0")  # its pin ended: c1 and d1 extend it again
    policy.touch("c1")  # read last: LRU's most recent
    assert [policy.evict() for _ in range(5)] == ["c2", "d1", "c1", "c0", None]
    # Children of chunks never inserted are forgotten with them: memory stays bounded.
    for n in range(1000):
        policy.insert(f"o{n}", f"gone{n}")
    evicted = [policy.evict() for _ in range(1000)]
    assert sorted(evicted) == sorted(f"o{n}" for n in range(1000)) and policy.evict() is None
    assert policy._absent == {}
    policy.insert("self", "self")  # a chunk naming itself stays a leaf (evictable)
    assert policy.evict() == "self"


def _memory_tier(slots: int, now: list[float] | None = None, eviction: str = "prefix"
                 ) -> tuple[MemoryTier, memoryview]:
    """A memory tier of `slots` 4 KiB slots (on the clock `now[0]` if given), and a chunk's
    bytes to put (512 B)."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float16",
                      tokens_per_chunk=16)
    config = MemoryTierConfig(kind="memory", capacity=slots * 4096, eviction=eviction,
                              prefault=False)
    tier = (MemoryTier(config, layout) if now is None
            else MemoryTier(config, layout, clock=lambda: now[0]))
    return tier, memoryview(np.zeros(layout.bytes_per_chunk, dtype=np.uint8))


def test_a_memory_tier_keeps_a_parent_whose_pin_ended_under_its_child() -> None:
    """Through the memory tier: a parent pinned (out of the policy) when its child is stored,
    its pin ends, the child is read: a new chunk evicts the child (the leaf), not the parent,
    which held alone still serves a prefix."""
    now = [1000.0]
    tier, data = _memory_tier(2, now)
    keys = [ChunkKey(bytes([i]) * 16) for i in range(3)]
    assert tier.put(keys[0], data, ChunkMeta(retain_until=now[0] + 10)).ok
    assert tier.put(keys[1], data, ChunkMeta(parent=keys[0])).ok
    now[0] += 20  # the pin ends: keys[0] back in the policy
    tier.retention_stats()  # (reaps lapsed pins, as the vLLM worker asks every step)
    with tier.borrow(keys[1]) as view:
        assert view is not None
    assert tier.put(keys[2], data).ok  # a new prompt: one chunk must go
    assert [tier.contains(k) for k in keys] == [True, False, True]
    assert tier.check() == []


def test_a_lent_leaf_stays_a_leaf_and_its_parent_no_victim() -> None:
    """Through the memory tier: the policy's first victim is lent (a load reads it), so the
    policy passes it over and the next leaf goes, never the parent under the lent chunk; the
    next put evicts a leaf again. Before: the lent victim was taken out and put back as a
    root after the put, its parent a leaf meanwhile and the put's victim, the child held
    without its prefix."""
    tier, data = _memory_tier(3)
    keys = [ChunkKey(bytes([i]) * 16) for i in range(5)]
    assert tier.put(keys[0], data).ok
    assert tier.put(keys[1], data, ChunkMeta(parent=keys[0])).ok
    assert tier.put(keys[2], data).ok
    with tier.borrow(keys[1]) as lent:  # keys[1] read first, so the victim below
        assert lent is not None
        with tier.borrow(keys[2]) as view:
            assert view is not None
        assert tier.put(keys[3], data).ok  # victim keys[1] is lent: keys[2] goes
    assert [tier.contains(k) for k in keys[:4]] == [True, True, False, True]
    assert tier.put(keys[4], data).ok  # a leaf goes: keys[1], read before keys[3] came
    assert [tier.contains(k) for k in keys] == [True, False, False, True, True]
    assert tier.check() == []


def test_a_memory_tier_evicts_a_parent_whose_pin_ended() -> None:
    """Through the memory tier: a pin (retain) takes a parent out of the policy, its end puts
    it back; a tier of two slots keeps storing in both."""
    now = [1000.0]
    tier, data = _memory_tier(2, now)
    keys = [ChunkKey(bytes([i]) * 16) for i in range(6)]
    assert tier.put(keys[0], data).ok
    assert tier.put(keys[1], data, ChunkMeta(parent=keys[0])).ok
    assert tier.retain(keys[0], ChunkMeta(retain_until=now[0] + 10))
    now[0] += 20  # the pin ends
    for key in keys[2:]:
        assert tier.put(key, data).ok
    assert [tier.contains(k) for k in keys] == [False] * 4 + [True] * 2
    assert tier.check() == []


def test_the_heap_stays_bounded_under_many_reads() -> None:
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=10**6)
    _chain(policy, "d", 8)
    for _ in range(10_000):
        policy.touch("d7")
    assert len(policy._leaves) <= 2 * len(policy) + 64


def test_any_tier_can_take_it_by_name_and_a_memory_tier_passes_parents() -> None:
    """`eviction: prefix` in a tier's config; the memory tier hands it ChunkMeta.parent, so a
    full tier evicts the end of a prompt, not its start."""
    assert "prefix" in POLICIES
    assert isinstance(make_policy("prefix", 8), Generations)
    config = StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB",
                                           "eviction": "prefix"}]})
    assert config.tiers[0].eviction == "prefix"
    tier, data = _memory_tier(3)
    assert tier.num_slots == 3
    keys = [ChunkKey(bytes([i]) * 16) for i in range(4)]
    parent = None
    for key in keys[:3]:
        assert tier.put(key, data, ChunkMeta(parent=parent)).ok
        parent = key
    for key in keys[:3]:  # a lookup reads them first to last
        with tier.borrow(key) as view:
            assert view is not None
    assert tier.put(keys[3], data, ChunkMeta()).ok  # a new prompt: one chunk must go
    assert [tier.contains(k) for k in keys] == [True, True, False, True]


def test_a_memory_tier_reports_the_horizon_its_policy_learned() -> None:
    """The tier's stats carry what the policy learned (exported as the
    `tier_policy_horizon_ops` gauge): 0 until enough reuses, then HORIZON_GAPS gaps of 8
    operations (8 chunks read in turn); 0 for an LRU tier."""
    keys = [ChunkKey(bytes([i]) * 16) for i in range(8)]
    learned = {}
    for eviction in ("prefix", "lru"):
        tier, data = _memory_tier(8, eviction=eviction)
        for key in keys:
            assert tier.put(key, data, ChunkMeta()).ok
        assert tier.stats().policy_horizon_ops == 0
        for _ in range(2 * REFRESH // len(keys) + 1):
            for key in keys:
                with tier.borrow(key) as view:
                    assert view is not None
        learned[eviction] = tier.stats().policy_horizon_ops
        tier.close()
    assert HORIZON_GAPS * 8 / 1.19 <= learned["prefix"] <= HORIZON_GAPS * 8 * 1.19
    assert learned["lru"] == 0


def test_a_run_is_as_old_as_its_head_so_a_preempted_request_outlives_an_older_one() -> None:
    """Rule 3 ranks a run of new chunks by its head's insertion: request A started first and
    kept decoding (its chain grew to A4), B started after it and was preempted at B1. A's
    chain goes first, from its end, though its newest chunk is newer than B's."""
    policy: PrefixPolicy[str] = PrefixPolicy(capacity=8, horizon_ops=0)
    policy.insert("A0")
    policy.insert("B0")
    policy.insert("A1", "A0")
    policy.insert("B1", "B0")  # B is preempted here
    for i in range(2, 5):
        policy.insert(f"A{i}", f"A{i - 1}")
    assert [policy.evict() for _ in range(5)] == ["A4", "A3", "A2", "A1", "A0"]
    assert [policy.evict() for _ in range(2)] == ["B1", "B0"]


def test_the_learned_horizon_outlives_a_reset() -> None:
    """A reset (a weight update in place: `Generations.retire`) starts a new generation of
    the policy, which keeps the reuse gaps learned before it: the traffic is the same, and
    a loop that updates its weights often would otherwise never learn a horizon."""
    policy: Generations[int] = make_policy("prefix", 10)
    for key in range(100):
        policy.insert(key)
    for _ in range(2 * REFRESH // 100 + 1):
        for key in range(100):
            policy.touch(key)
    learned = policy.horizon_ops
    assert learned > 0
    policy.retire()
    assert policy.horizon_ops == learned
    assert policy.retired == 100
