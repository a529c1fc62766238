"""The GPU block pool with its prefix cache, and the offload tier stack."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.sim.kvcache import GpuKVCache
from kvtier.tools.sim.tiers import SimTier, TierSpec, TierStack, parse_tier

GB = 10**9


def test_blocks_are_shared_cached_then_evicted_oldest_first() -> None:
    kv = GpuKVCache(4)
    a: list[int] = []
    kv.allocate(2)
    kv.register(10, a)
    kv.register(11, a)
    assert kv.free == 2 and kv.ref == {10: 1, 11: 1}
    b: list[int] = []
    assert kv.match([10, 11, 12], 3) == (2, 0)
    kv.acquire([10, 11], 2, b)  # a second request shares the prefix
    assert kv.ref == {10: 2, 11: 2} and kv.free == 2
    kv.release(a, 0)
    kv.release(b, 0)
    # Released deepest first: 11 is older in the cache than 10, so it goes first.
    assert list(kv.cached) == [11, 10] and kv.free == 2
    assert kv.match([10, 11], 2) == (2, 2)
    assert kv.can_allocate(4) and not kv.can_allocate(4, reclaiming=1)
    kv.allocate(3)
    assert list(kv.cached) == [10] and kv.evictions == 1 and kv.free == 0
    assert not kv.can_allocate(2)


def test_registering_a_block_someone_else_computed_frees_our_copy() -> None:
    kv = GpuKVCache(4)
    a: list[int] = []
    b: list[int] = []
    kv.allocate(2)
    kv.register(7, a)
    kv.register(7, b)
    assert kv.ref == {7: 2} and kv.private == 0 and kv.free == 3


def _stack(*caps_gb: float, policy: str = "lru") -> TierStack:
    names = ["cpu", "nvme", "shared"]
    tiers = [SimTier(TierSpec(names[i], int(c * GB), 10.0, 0.0, policy), block_bytes=GB)
             for i, c in enumerate(caps_gb)]
    return TierStack(tiers, link_gbps=5.0, block_bytes=GB)


def test_write_through_demotes_victims_to_the_next_tier() -> None:
    stack = _stack(2, 3)
    for h in range(1, 6):
        stack.store(h, None)
    cpu, nvme = stack.tiers
    assert cpu.resident == {4, 5} and nvme.resident == {1, 2, 3}
    for h in range(6, 8):
        stack.store(h, None)
    assert nvme.resident == {3, 4, 5} and nvme.evicted_blocks == 2  # 1, 2 dropped


def test_lookup_is_contiguous_and_promotes_lower_tier_hits() -> None:
    stack = _stack(2, 3)
    for h in range(1, 6):
        stack.store(h, None)
    hashes = [1, 2, 3, 99, 4]
    assert stack.lookup(hashes, 0, 5) == [0, 3]  # stops at 99 although 4 is resident
    assert stack.tiers[0].resident == {2, 3}  # 1, 2, 3 promoted in order; 1 pushed out
    assert stack.lookup([1, 2, 3], 1, 3) == [2, 0]


def test_loads_queue_on_the_tier_and_the_link_caps_bandwidth() -> None:
    stack = _stack(4)
    # 10 GB/s medium behind a 5 GB/s link: one 1 GB block takes 0.2 s.
    assert stack.schedule_load(0.0, [1]) == pytest.approx(0.2)
    assert stack.schedule_load(0.1, [2]) == pytest.approx(0.6)  # waits for the first
    assert stack.schedule_load(5.0, [1]) == pytest.approx(5.2)


def test_zero_capacity_tiers_are_left_out() -> None:
    assert not _stack(0).enabled
    assert _stack(0, 1).enabled and len(_stack(0, 1).tiers) == 1


def test_arc_keeps_a_reused_block_through_a_scan() -> None:
    lru, arc = _stack(4), _stack(4, policy="arc")
    for stack in (lru, arc):
        stack.store(1, None)
        stack.lookup([1], 0, 1)  # 1 is used twice
        for h in range(100, 104):  # one-shot blocks stream through
            stack.store(h, None)
    assert 1 not in lru.tiers[0].resident and 1 in arc.tiers[0].resident


def test_tiers_take_their_kinds_default_policy_and_prefix_cuts_a_prompt_from_its_end() -> None:
    """As kvtier's tiers: RAM `prefix`, disk `lru`; a prompt's blocks carry their parents,
    so a full prefix tier evicts a prompt's last block (LRU: its first) and demotes it with
    its parent."""
    assert parse_tier("cpu=1GiB").policy == "prefix" and parse_tier("nvme=1GiB").policy == "lru"
    assert parse_tier("cpu=1GiB:lru").policy == "lru"
    firsts = {}
    for policy in ("prefix", "lru"):
        stack = _stack(3, 3, policy=policy)
        prompt = [1, 2, 3]
        for i, h in enumerate(prompt):
            stack.store(h, prompt[i - 1] if i else None)
        assert stack.lookup(prompt, 0, 3) == [3, 0]  # read first to last
        stack.store(10, None)  # a new prompt: one block goes down to nvme
        cpu, nvme = stack.tiers
        firsts[policy] = 1 in cpu.resident
        (demoted,) = nvme.resident
        assert nvme.parents[demoted] == (prompt[prompt.index(demoted) - 1]
                                         if demoted != 1 else None)
    assert firsts == {"prefix": True, "lru": False}


@pytest.mark.parametrize("text", ["cpu", "gpu=1GiB", "cpu=lots", "cpu=1GiB:fifo"])
def test_bad_tier_specs_raise_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_tier(text)


def test_parse_tier() -> None:
    spec = parse_tier("nvme=2TiB:arc")
    assert (spec.name, spec.capacity_bytes, spec.policy) == ("nvme", 2 * 1024**4, "arc")
