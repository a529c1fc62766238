"""The engine's step time and recompute cost, learned from its own steps
(kvtier.integrations.vllm.scheduler.stepcost)."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.scheduler.stepcost import MIN_PREFILL_STEPS, MIN_STEPS, EngineSteps

MS = 1e-3


def run(steps: EngineSteps, plans: list[tuple[float, int, float]], start_s: float = 0.0,
        inline_loads: bool = False) -> float:
    """Plan steps of (seconds, tokens, mean position), each timed by the next plan."""
    now = start_s
    for seconds, tokens, position in plans:
        steps.observe_plan(now, tokens, position, inline_loads)
        now += seconds
    steps.observe_plan(now, 0, 0.0, False)
    return now


def engine_step(tokens: int, position: float, overhead_s: float = 5 * MS,
                a: float = 1e-4, b: float = 1e-8) -> tuple[float, int, float]:
    """A step of this engine: overhead + tokens * (a + b * position)."""
    return overhead_s + tokens * (a + b * position), tokens, position


def test_the_step_time_is_a_median_of_recent_steps() -> None:
    steps = EngineSteps()
    now = run(steps, [(20 * MS, 1, 100.0)] * (MIN_STEPS - 1))
    assert steps.step_s is None
    now = run(steps, [(20 * MS, 1, 100.0)] * 40, start_s=now)
    run(steps, [(300 * MS, 1, 100.0)] * 10, start_s=now)  # a few stretched steps
    assert steps.step_s == pytest.approx(20 * MS)


def test_an_idle_spell_is_not_a_step() -> None:
    steps = EngineSteps()
    now = run(steps, [(20 * MS, 1, 0.0)] * (MIN_STEPS - 1))  # ends with a plan of nothing
    steps.observe_plan(now + 60.0, 1, 0.0, False)  # ... after an idle minute
    assert steps.step_s is None
    steps.observe_plan(now + 60.02, 1, 0.0, False)
    assert steps.step_s == pytest.approx(20 * MS)


def test_no_recompute_cost_until_prefills_are_measured() -> None:
    steps = EngineSteps()
    run(steps, [engine_step(1, 500.0)] * 50)  # decodes only
    assert steps.recompute_s(0, 1000) is None
    run(steps, [engine_step(512, 256.0)] * (MIN_PREFILL_STEPS - 1), start_s=100.0)
    assert steps.recompute_s(0, 1000) is None
    run(steps, [engine_step(512, 256.0)], start_s=200.0)
    assert steps.recompute_s(0, 1000) is not None


def test_the_fit_recovers_the_engine_cost_and_its_growth_with_position() -> None:
    steps = EngineSteps()
    run(steps, [engine_step(1, 1000.0)] * 20)  # decodes: the overhead
    prefills = [engine_step(512, 256.0 + 512 * i) for i in range(8)]  # a 4k prompt, chunked
    run(steps, prefills, start_s=50.0)
    expected = 1000 * (1e-4 + 1e-8 * 999 / 2)
    assert steps.recompute_s(0, 1000) == pytest.approx(expected, rel=0.05)
    later = 1000 * (1e-4 + 1e-8 * (3000 + 3999) / 2)
    assert steps.recompute_s(3000, 4000) == pytest.approx(later, rel=0.05)
    assert steps.recompute_s(10, 10) == 0.0


def test_steps_stretched_by_inline_loads_are_not_prefill_samples() -> None:
    steps = EngineSteps()
    run(steps, [engine_step(512, 256.0)] * 5)
    before = steps.recompute_s(0, 512)
    run(steps, [(5.0, 512, 256.0)] * 5, start_s=100.0, inline_loads=True)
    assert steps.recompute_s(0, 512) == before


def test_a_step_that_finished_a_request_ends_there_not_after_the_idle_spell() -> None:
    """Offline engines idle between requests: the step that ran a request's prefill is
    timed when the request finishes, not when the next request's plan comes."""
    steps = EngineSteps()
    now = 0.0
    for _ in range(MIN_PREFILL_STEPS):
        steps.observe_plan(now, 512, 256.0, False)
        steps.step_ended(now + 0.1)  # the prefill took 100 ms and finished its request
        now += 30.0  # ... then the engine idled until the next request
    assert steps.recompute_s(0, 512) == pytest.approx(0.1, rel=0.01)
