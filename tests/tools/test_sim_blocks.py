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
        stack.store(h)
    cpu, nvme = stack.tiers
    assert cpu.resident == {4, 5} and nvme.resident == {1, 2, 3}
    for h in range(6, 8):
        stack.store(h)
    assert nvme.resident == {3, 4, 5} and nvme.evicted_blocks == 2  # 1, 2 dropped


def test_lookup_is_contiguous_and_promotes_lower_tier_hits() -> None:
    stack = _stack(2, 3)
    for h in range(1, 6):
        stack.store(h)
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
        stack.store(1)
        stack.lookup([1], 0, 1)  # 1 is used twice
        for h in range(100, 104):  # one-shot blocks stream through
            stack.store(h)
    assert 1 not in lru.tiers[0].resident and 1 in arc.tiers[0].resident


@pytest.mark.parametrize("text", ["cpu", "gpu=1GiB", "cpu=lots", "cpu=1GiB:fifo"])
def test_bad_tier_specs_raise_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_tier(text)


def test_parse_tier() -> None:
    spec = parse_tier("nvme=2TiB:arc")
    assert (spec.name, spec.capacity_bytes, spec.policy) == ("nvme", 2 * 1024**4, "arc")
