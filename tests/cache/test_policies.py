"""Eviction policies (LRU, ARC) and admission, driven by small access traces.

`_replay` plays a trace against a cache of `capacity` chunks the way a tier uses a policy:
a hit touches, a miss evicts one victim when full and inserts the key.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import pytest

from kvtier.core.policies import (
    AdmissionFilter,
    ARCPolicy,
    EvictionPolicy,
    Generations,
    LRUPolicy,
    make_policy,
)
from kvtier.core.policies.clock import ClockPolicy
from kvtier.errors import ConfigError


def _replay(policy: EvictionPolicy, capacity: int, trace: Iterable[Hashable]) -> int:
    """Return the hits of `trace` on a cache of `capacity` keys ordered by `policy`."""
    resident: set[Hashable] = set()
    hits = 0
    for key in trace:
        if key in resident:
            hits += 1
            policy.touch(key)
            continue
        if len(resident) >= capacity:
            victim = policy.evict()
            assert victim in resident, "a policy evicted a key that is not resident"
            resident.discard(victim)
        policy.insert(key)
        resident.add(key)
        assert len(policy) == len(resident)
    return hits


def test_lru_evicts_the_key_used_longest_ago() -> None:
    """a, b, c are stored; a is read again; the next two victims are b, then c, then a."""
    lru = LRUPolicy()
    for key in "abc":
        lru.insert(key)
    lru.touch("a")
    assert [lru.evict(), lru.evict(), lru.evict(), lru.evict()] == ["b", "c", "a", None]


def test_lru_forgets_removed_keys_and_ignores_touches_of_unknown_ones() -> None:
    lru = LRUPolicy()
    for key in "abc":
        lru.insert(key)
    lru.remove("a")
    lru.touch("zzz")
    assert len(lru) == 2 and lru.evict() == "b"


def _loop_and_scans(rounds: int = 30) -> list[str]:
    """A chat service: 6 shared system prompts, each used twice at start-up (so they are
    known to be reused) and then once every round; between rounds, a burst of 12 one-shot
    prompts (a scan) that will never be seen again."""
    trace = [f"hot{i}" for i in range(6)] * 2
    for round_ in range(rounds):
        trace += [f"scan{round_}-{i}" for i in range(12)]
        trace += [f"hot{i}" for i in range(6)]
    return trace


def test_arc_keeps_reused_prefixes_through_scans_that_flush_lru() -> None:
    """With room for 10 chunks, every 12-chunk scan flushes LRU's hot prompts (only the
    start-up repeats hit); ARC holds the hot ones in its frequency list, lets the scans
    replace each other in its recency list, and hits the hot prompts every round."""
    trace = _loop_and_scans()
    lru_hits = _replay(LRUPolicy(), 10, trace)
    arc_hits = _replay(ARCPolicy(10), 10, trace)
    assert lru_hits == 6
    assert arc_hits >= 6 + 0.9 * 6 * 30, (arc_hits, lru_hits)


def test_arc_matches_lru_on_pure_recency_traffic() -> None:
    """On a trace with no scans (a sliding window of reuse) ARC must not be worse than
    LRU by more than a little."""
    trace = [f"k{i // 3 + j}" for i in range(300) for j in range(2)]
    assert _replay(ARCPolicy(8), 8, trace) >= 0.9 * _replay(LRUPolicy(), 8, trace)


def test_a_hit_on_a_recency_ghost_grows_the_recency_target() -> None:
    """Key a is evicted from T1 (seen once) and comes back: ARC learns that recency matters
    and raises p, the target size of T1; a returns as a frequent key."""
    arc = ARCPolicy(4)
    for key in "abcd":
        arc.insert(key)
    assert arc.p == 0
    assert arc.evict() == "a"  # T1's oldest goes to the ghost list B1
    arc.insert("a")
    assert arc.p >= 1
    assert len(arc) == 4
    # a is now frequent (T2): with p = 1, T1's once-seen keys b and c go before it.
    assert [arc.evict() for _ in range(2)] == ["b", "c"]


def test_a_hit_on_a_frequency_ghost_shrinks_the_recency_target() -> None:
    """Key x was frequent (T2), got evicted into ghost list B2 and comes back: ARC lowers p
    to favour frequency again."""
    arc = ARCPolicy(4)
    arc.insert("x")
    arc.touch("x")  # x: T1 -> T2
    for key in "abc":
        arc.insert(key)
    arc.evict()  # a (T1) -> B1
    arc.insert("a")  # ghost hit in B1: p rises
    raised = arc.p
    assert raised > 0
    victims = [arc.evict() for _ in range(4)]
    assert "x" in victims  # x went to B2 at some point
    arc.insert("x")  # ghost hit in B2
    assert arc.p < raised


def test_arc_ghost_lists_stay_bounded() -> None:
    """A long scan must not make ARC's bookkeeping grow without bound (ghosts <= 2c)."""
    arc = ARCPolicy(16)
    _replay(arc, 16, (f"k{i}" for i in range(5000)))
    ghosts = len(arc._b1) + len(arc._b2)
    assert len(arc) + ghosts <= 2 * 16


def test_make_policy_builds_by_name_and_rejects_unknown_names() -> None:
    """Each in generations (a tier can retire what it holds), ordered by the named policy
    within one: ARC keeps a key read twice over a newer one read once, LRU does not."""
    victims = {}
    for name in ("lru", "arc"):
        policy = make_policy(name, 2)
        assert isinstance(policy, Generations)
        policy.insert("a")
        policy.touch("a")
        policy.insert("b")
        victims[name] = policy.evict()
    assert victims == {"lru": "a", "arc": "b"}
    with pytest.raises(ConfigError) as caught:
        make_policy("lfu", 4)
    assert caught.value.field == "eviction" and "arc" in caught.value.allowed


def test_admission_stores_a_chunk_only_from_its_nth_offer() -> None:
    """With threshold 3, a one-shot prompt is never stored; a prompt seen three times is,
    and stays admitted afterwards."""
    admission = AdmissionFilter(threshold=3)
    assert [admission.offer("p") for _ in range(5)] == [False, False, True, True, True]
    assert admission.offer("one-shot") is False


def test_admission_threshold_one_admits_everything() -> None:
    admission = AdmissionFilter(threshold=1)
    assert all(admission.offer(i) for i in range(100))


def test_admission_memory_is_bounded_and_forgets_the_oldest_offers() -> None:
    """Under unique traffic the offer table stays at `remembered_keys`; a key pushed out of
    it starts counting again from zero."""
    admission = AdmissionFilter(threshold=2, remembered_keys=2)
    assert admission.offer("a") is False
    admission.offer("b")
    admission.offer("c")  # a is forgotten
    assert admission.offer("a") is False
    assert admission.offer("a") is True
    assert len(admission._counts) <= 2


@pytest.mark.parametrize("make", [LRUPolicy, lambda: ARCPolicy(8), ClockPolicy],
                         ids=["lru", "arc", "clock"])
def test_retired_keys_leave_before_any_key_inserted_after(make: object) -> None:
    """A weight update retires what a tier holds: those keys are evicted first, whatever
    the policy thinks of them (read often, read just before), and a retired key stored
    again counts as new."""
    policy: Generations[str] = Generations(make)  # type: ignore[arg-type]
    for key in "abcd":
        policy.insert(key)
    for _ in range(3):
        policy.touch("a")  # hot under every policy
    policy.retire()
    for key in "xyz":
        policy.insert(key)
    policy.touch("b")
    assert policy.retired == 4 and len(policy) == 7
    first = {policy.evict() for _ in range(2)}
    assert first <= set("abcd")
    policy.insert("c")  # stored again after the reset: current, not retired
    old = set("abcd") - first - {"c"}
    victims = [policy.evict() for _ in range(len(policy))]
    assert set(victims[:len(old)]) == old
    assert set(victims[len(old):]) == set("xyzc") and policy.evict() is None


@pytest.mark.parametrize("name", ["lru", "arc", "prefix", "clock"])
def test_kept_keys_are_passed_over_and_stay_where_they_rank(name: str) -> None:
    """`evict(keep=...)`: a tier's chunk being read (lent) must stay; the policy takes the
    next victim, leaves the kept key resident where it ranked (no new use, no ARC ghost),
    and answers None when every resident is kept. In a retired generation too."""
    policy: Generations[str] = Generations(ClockPolicy) if name == "clock" \
        else make_policy(name, 8)
    for key in "abc":
        policy.insert(key)
    policy.retire()
    policy.insert("d")
    assert policy.evict(keep=lambda key: key in "ab") == "c" and policy.left_retired
    assert policy.evict(keep=lambda key: True) is None and len(policy) == 3
    victims = [policy.evict() for _ in range(3)]
    assert sorted(victims[:2]) == ["a", "b"] and victims[2] == "d"  # retired ones first
    assert name == "clock" or victims[:2] == ["a", "b"]  # the clock's hand moved on
    if name == "arc":  # the kept keys were never ghosts: no target moved
        arc: ARCPolicy[str] = ARCPolicy(8)
        for key in "ab":
            arc.insert(key)
        assert arc.evict(keep=lambda key: key == "a") == "b"
        arc.insert("x")
        assert arc.p == 0.0 and arc.evict() == "a"


def test_a_key_leaving_says_whether_it_was_retired() -> None:
    """`left_retired` after each removal and eviction: what a tier's removal event carries
    (a router told at the reset that the retired keys are gone is not told again)."""
    policy: Generations[str] = Generations(LRUPolicy)
    for key in "abc":
        policy.insert(key)
    assert policy.evict() == "a" and not policy.left_retired  # no reset yet
    policy.retire()
    policy.remove("c")  # deleted, expired, found corrupt
    assert policy.left_retired
    policy.insert("x")
    policy.remove("x")
    assert not policy.left_retired
    policy.remove("pinned")  # not resident (a pinned chunk is out of the policy)
    assert not policy.left_retired
    policy.insert("y")
    assert policy.evict() == "b" and policy.left_retired
    assert policy.evict() == "y" and not policy.left_retired
    assert policy.evict() is None and not policy.left_retired


def test_generations_pile_up_only_while_keys_are_retired() -> None:
    """Resets with nothing held, or many in a row, add no empty generation; once the
    retired keys are gone the policy is one generation again, with no per-key record."""
    policy: Generations[int] = Generations(LRUPolicy)
    policy.retire()  # nothing held: nothing to retire
    assert policy.retired == 0 and len(policy._generations) == 1
    for reset in range(50):
        policy.insert(reset)
        policy.retire()
    assert policy.retired == 50 and len(policy._generations) == 51
    policy.insert(1000)
    policy.touch(3)
    policy.remove(7)
    assert [policy.evict() for _ in range(3)] == [0, 1, 2]
    while policy.retired:
        policy.evict()
    assert len(policy._generations) == 1 and policy._generation_of == {}
    assert policy.evict() == 1000 and len(policy) == 0
