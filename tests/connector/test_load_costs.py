"""What loads cost per tier (kvtier.integrations.vllm.scheduler.loadcost) and load_mode
"auto"'s rule:
a hit loads inline while other requests run only when its expected time, from the workers'
timed loads, is at most a fifth of the engine's median step; until measured, by where the
hit lives."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.scheduler.loadcost import INLINE_STEP_SHARE, LoadCosts
from kvtier.integrations.vllm.transfers import LoadSample

MS = 1e-3
TIERS = ("memory", "disk", "redis")


def sample(seconds: float, **chunks: int) -> LoadSample:
    return LoadSample(tuple(chunks.items()), seconds)


def test_until_measured_a_hit_in_ram_loads_inline_and_one_below_it_async() -> None:
    costs = LoadCosts(TIERS)
    assert costs.inline({"memory": 64}, step_s=None)
    assert not costs.inline({"disk": 1}, step_s=None)
    costs.observe_load(sample(4 * MS, disk=4))
    assert not costs.inline({"disk": 1}, step_s=None)  # loads measured, steps not yet
    assert costs.inline({"disk": 1}, step_s=20 * MS)


def test_a_load_within_a_fifth_of_the_step_is_inline_a_longer_one_async() -> None:
    costs = LoadCosts(TIERS)
    costs.observe_load(sample(8 * MS, memory=8))  # 1 ms a chunk
    assert pytest.approx(4 * MS) == INLINE_STEP_SHARE * 20 * MS  # the budget: 4 RAM chunks
    assert costs.inline({"memory": 3}, 20 * MS)
    assert not costs.inline({"memory": 5}, 20 * MS)  # a large RAM hit goes asynchronous
    # A mixed load: the faster tiers' expected part is taken off, the rest is the slowest's.
    costs.observe_load(sample(3.5 * MS, memory=2, disk=1))
    assert costs.chunk_s("disk") == pytest.approx(1.5 * MS)
    assert costs.expected_s({"memory": 1, "disk": 1}) == pytest.approx(2.5 * MS)
    assert costs.inline({"memory": 1, "disk": 1}, 20 * MS)
    assert not costs.inline({"memory": 1, "disk": 3}, 20 * MS)  # 5.5 ms
    assert costs.expected_s({"redis": 1}) is None  # never timed


def test_each_tier_has_its_own_cost() -> None:
    costs = LoadCosts(TIERS)
    costs.observe_load(sample(2 * MS, disk=2))
    costs.observe_load(sample(40 * MS, redis=2))
    costs.observe_load(sample(22 * MS, disk=1, redis=1))  # redis: 22 - 1 = 21 ms
    assert costs.chunk_s("disk") == pytest.approx(1 * MS)
    assert costs.chunk_s("redis") == pytest.approx(20.5 * MS)  # median of 20 and 21
    assert costs.chunk_s("memory") is None


def test_one_outlier_does_not_move_a_tier_two_do_and_two_bring_it_back() -> None:
    costs = LoadCosts(TIERS)
    for _ in range(3):
        costs.observe_load(sample(2 * MS, disk=2))
    costs.observe_load(sample(2.0, disk=2))  # one load hit a congested moment
    assert costs.chunk_s("disk") == pytest.approx(1 * MS)
    costs.observe_load(sample(2.0, disk=2))  # two in a row: the tier is slow now
    assert costs.chunk_s("disk") == pytest.approx(1.0)
    costs.observe_load(sample(2 * MS, disk=2))
    costs.observe_load(sample(2 * MS, disk=2))
    assert costs.chunk_s("disk") == pytest.approx(1 * MS)
    costs.observe_load(sample(5.0))  # an empty load says nothing
    assert costs.chunk_s("disk") == pytest.approx(1 * MS)


def test_a_failed_load_saved_nothing_two_in_a_row_make_the_tier_slow() -> None:
    costs = LoadCosts(TIERS)
    for _ in range(3):
        costs.observe_load(sample(2 * MS, redis=2))
    costs.observe_load(LoadSample((("redis", 1),), 1 * MS, failed=True))
    assert costs.chunk_s("redis") == pytest.approx(1 * MS)  # one failure among fast loads
    costs.observe_load(LoadSample((("redis", 1),), 1 * MS, failed=True))
    assert costs.chunk_s("redis") == float("inf")  # however quickly they failed
    assert not costs.inline({"redis": 1}, 1.0)


def test_with_a_prior_the_first_slow_load_does_not_condemn_the_tier_a_second_does() -> None:
    costs = LoadCosts(TIERS)
    costs.set_prior("redis", 2 * MS)  # its link: fast
    costs.observe_load(sample(3.0, redis=2))  # the first load, caught in a stall
    assert costs.chunk_s("redis") == pytest.approx(2 * MS)
    costs.observe_load(sample(3.0, redis=2))  # a second: the tier is slow now
    assert costs.chunk_s("redis") == pytest.approx(1.5)
    for _ in range(3):  # a full window of its own loads: the prior no longer counts
        costs.observe_load(sample(8 * MS, redis=2))
    assert costs.chunk_s("redis") == pytest.approx(4 * MS)
    # Without a prior, the first load is all there is.
    costs.observe_load(sample(3.0, disk=2))
    assert costs.chunk_s("disk") == pytest.approx(1.5)
