"""load_mode "auto"'s measures (kvtier.integrations.vllm.loadcost): a hit loads inline while
other requests run only when its expected time, from the workers' timed loads, is at most a
fifth of the engine's median step; until measured, by where the hit lives."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.loadcost import (
    INLINE_STEP_SHARE,
    MIN_STEPS,
    LoadCosts,
    LoadSample,
)

MS = 1e-3


def steps_of(costs: LoadCosts, step_s: float, n: int = MIN_STEPS, start_s: float = 0.0
             ) -> float:
    """`n` steps of `step_s` each, planned from `start_s`; the time after them."""
    now = start_s
    for _ in range(n + 1):
        costs.observe_plan(now, runs_tokens=True)
        now += step_s
    return now


def test_until_measured_a_hit_in_ram_loads_inline_and_one_below_it_async() -> None:
    costs = LoadCosts()
    assert costs.inline(ram_chunks=64, lower_chunks=0)
    assert not costs.inline(ram_chunks=0, lower_chunks=1)
    costs.observe_load(LoadSample(ram_chunks=0, lower_chunks=4, seconds=4 * MS))
    assert not costs.inline(0, 1)  # loads measured, steps not yet
    steps_of(costs, 20 * MS, n=MIN_STEPS - 1)
    assert costs.step_s is None and not costs.inline(0, 1)


def test_a_load_within_a_fifth_of_the_step_is_inline_a_longer_one_async() -> None:
    costs = LoadCosts()
    steps_of(costs, 20 * MS)
    assert costs.step_s == pytest.approx(20 * MS)
    costs.observe_load(LoadSample(ram_chunks=8, lower_chunks=0, seconds=8 * MS))  # 1 ms each
    assert pytest.approx(4 * MS) == INLINE_STEP_SHARE * 20 * MS  # the budget: 4 RAM chunks
    assert costs.inline(3, 0)
    assert not costs.inline(5, 0)  # a large RAM hit goes asynchronous
    # Below RAM: the RAM part of a mixed load is taken off, the rest is per lower chunk.
    costs.observe_load(LoadSample(ram_chunks=2, lower_chunks=1, seconds=3.5 * MS))
    assert costs.expected_s(0, 1) == pytest.approx(1.5 * MS)
    assert costs.inline(1, 1)  # 2.5 ms
    assert not costs.inline(1, 3) and not costs.inline(0, 3)  # 5.5 and 4.5 ms


def test_the_per_chunk_costs_follow_recent_loads() -> None:
    costs = LoadCosts()
    costs.observe_load(LoadSample(0, 2, 20 * MS))
    for _ in range(50):  # the tier got faster (a warm cache, a quieter network)
        costs.observe_load(LoadSample(0, 2, 2 * MS))
    expected = costs.expected_s(0, 1)
    assert expected is not None and expected == pytest.approx(1 * MS, rel=0.01)
    costs.observe_load(LoadSample(0, 0, 5.0))  # an empty load says nothing
    assert costs.expected_s(0, 1) == expected


def test_the_step_time_is_a_median_of_recent_steps() -> None:
    costs = LoadCosts()
    now = steps_of(costs, 20 * MS, n=40)
    for _ in range(10):  # steps stretched by inline loads, a few of many
        costs.observe_plan(now, runs_tokens=True)
        now += 300 * MS
    assert costs.step_s == pytest.approx(20 * MS)
    steps_of(costs, 50 * MS, n=64, start_s=now)  # the batch grew
    assert costs.step_s == pytest.approx(50 * MS)


def test_an_idle_spell_is_not_a_step() -> None:
    costs = LoadCosts()
    now = steps_of(costs, 20 * MS, n=MIN_STEPS - 2)
    costs.observe_plan(now, runs_tokens=False)  # a plan that ran nothing (step MIN - 1) ...
    now += 60.0  # ... then the engine idles a minute
    costs.observe_plan(now, runs_tokens=True)
    assert costs.step_s is None  # the minute was not counted
    costs.observe_plan(now + 20 * MS, runs_tokens=True)
    assert costs.step_s == pytest.approx(20 * MS)
