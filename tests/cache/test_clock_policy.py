"""CLOCK, the disk tier's LRU (kvtier.core.policies.clock): second chances, removals, and a
ring that does not grow without bound."""

from __future__ import annotations

import gc
import random

from kvtier.core.policies.clock import ClockPolicy


def test_an_unread_key_leaves_before_a_read_one() -> None:
    policy: ClockPolicy[str] = ClockPolicy()
    for k in "abc":
        policy.insert(k)
    policy.touch("a")
    assert [policy.evict(), policy.evict(), policy.evict(), policy.evict()] == \
        ["b", "c", "a", None]


def test_a_new_key_is_the_last_the_hand_reaches() -> None:
    """Full at 3: each put evicts one; the newest key is never the next victim."""
    policy: ClockPolicy[int] = ClockPolicy()
    for k in range(3):
        policy.insert(k)
    for k in range(3, 20):
        victim = policy.evict()
        assert victim == k - 3
        policy.insert(k)
    assert len(policy) == 3


def test_removed_keys_are_never_evicted_and_the_ring_stays_bounded() -> None:
    rng = random.Random(5)
    policy: ClockPolicy[int] = ClockPolicy()
    resident: set[int] = set()
    for step in range(20_000):
        k = rng.randrange(500)
        action = rng.random()
        if action < 0.5:
            policy.insert(k)
            resident.add(k)
        elif action < 0.7:
            policy.touch(k)
        elif action < 0.85:
            policy.remove(k)
            resident.discard(k)
        else:
            victim = policy.evict()
            assert (victim is None) == (not resident)
            if victim is not None:
                assert victim in resident
                resident.discard(victim)
        assert len(policy) == len(resident)
        assert len(policy._ring) <= 2 * len(resident) + 65, step


def test_its_maps_are_out_of_the_collectors_walks() -> None:
    """A disk tier's policy holds millions of keys: its maps of residents and referenced keys
    are ones the garbage collector does not track (a set of 2 million keys took ~105 ms of
    every full collection); only the ring, a list, is walked."""
    policy: ClockPolicy[bytes] = ClockPolicy()
    for i in range(1000):
        policy.insert(i.to_bytes(16, "big"))
    for i in range(0, 1000, 3):
        policy.touch(i.to_bytes(16, "big"))
    gc.collect()
    assert not gc.is_tracked(policy._resident)
    assert not gc.is_tracked(policy._referenced)
    assert len(policy) == 1000
    # The ring, a list, is walked unless frozen (vLLM freezes an engine's heap once started):
    # rebuilt in place, a frozen ring stays frozen.
    ring = policy._ring
    for i in range(900):
        policy.remove(i.to_bytes(16, "big"))
    assert len(policy._ring) < 1000  # compacted
    assert policy._ring is ring
