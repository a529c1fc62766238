"""Load or recompute (kvtier.integrations.vllm.scheduler.offer): the hit offered is the longest
prefix
whose expected load time is at most its expected recompute time, from measured costs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.integrations.vllm.scheduler.loadcost import LoadCosts
from kvtier.integrations.vllm.scheduler.offer import TRIAL_MAX_S, TRIAL_MIN_S, HitOffer
from kvtier.integrations.vllm.scheduler.stepcost import EngineSteps
from kvtier.integrations.vllm.transfers import LoadSample

MS = 1e-3
TPC = 256
TIERS = ("memory", "disk", "redis")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FlatSteps(EngineSteps):
    """An engine whose prefill costs `per_token_s` a token (None: not measured yet)."""

    def __init__(self, per_token_s: float | None) -> None:
        super().__init__()
        self.per_token_s = per_token_s

    def recompute_s(self, start: int, end: int) -> float | None:
        return None if self.per_token_s is None else (end - start) * self.per_token_s


def timed(costs: LoadCosts, tier: str, chunk_s: float, loads: int = 3) -> None:
    for _ in range(loads):
        costs.observe_load(LoadSample(((tier, 2),), 2 * chunk_s))


def offer(per_token_s: float | None, load_when: str = "faster"
          ) -> tuple[HitOffer, LoadCosts, Clock, Callable[[float | None], None]]:
    clock, steps = Clock(), FlatSteps(per_token_s)
    costs = LoadCosts(TIERS, clock=clock)

    def set_engine(value: float | None) -> None:
        steps.per_token_s = value

    return HitOffer(costs, steps, TPC, load_when, clock=clock), costs, clock, set_engine


def test_with_nothing_measured_every_hit_is_offered() -> None:
    hits, costs, _, set_engine = offer(per_token_s=None)
    assert hits.cut(["redis"] * 8, 0).num_chunks == 8  # the engine is not measured
    set_engine(1e-5)
    assert hits.cut(["redis"] * 8, 0).num_chunks == 8  # the tier is not measured
    timed(costs, "redis", 1.0)
    assert hits.cut(["redis"] * 8, 0).num_chunks == 0


def test_a_tier_slower_than_recompute_is_cut_a_faster_one_offered() -> None:
    hits, costs, _, _ = offer(per_token_s=40e-6)  # 10.2 ms a chunk of 256 tokens
    timed(costs, "memory", 0.5 * MS)
    timed(costs, "disk", 5 * MS)
    timed(costs, "redis", 30 * MS)
    cut = hits.cut(["memory", "disk", "redis", "redis"], 0)
    # cumulative load 0.5, 5.5, 35.5, 65.5 ms against recompute 10.2, 20.5, 30.7, 41 ms
    assert cut.num_chunks == 2
    assert cut.decisions == {("memory", "loaded"): 1, ("disk", "loaded"): 1,
                             ("redis", "recompute_faster"): 2}


def test_slack_from_fast_chunks_pays_for_a_slower_one() -> None:
    hits, costs, _, _ = offer(per_token_s=40e-6)  # 10.2 ms a chunk
    timed(costs, "memory", 0.5 * MS)
    timed(costs, "redis", 15 * MS)
    # 0.5, 1.0, 1.5, 16.5 ms against 10.2, 20.5, 30.7, 41: the whole hit loads faster
    assert hits.cut(["memory"] * 3 + ["redis"], 0).num_chunks == 4


def test_the_offer_counts_from_the_first_token_vllm_lacks() -> None:
    hits, costs, _, _ = offer(per_token_s=40e-6)
    timed(costs, "disk", 8 * MS)
    # vLLM's own cache holds 200 of the first chunk's 256 tokens: loading that chunk saves
    # the recompute of 56 tokens only (2.2 ms) for 8 ms of load; with the next two (10.2 ms
    # each) the prefix of 3 chunks loads in 24 ms against 22.7 ms; of 4, 32 against 32.9.
    assert hits.cut(["disk"] * 4, 200).num_chunks == 4
    assert hits.cut(["disk"] * 3, 200).num_chunks == 0


def test_load_when_always_offers_everything() -> None:
    hits, costs, _, _ = offer(per_token_s=1e-9, load_when="always")
    timed(costs, "redis", 1.0)
    cut = hits.cut(["redis"] * 3, 0)
    assert cut.num_chunks == 3 and cut.decisions == {("redis", "loaded"): 3}


def test_a_cut_tier_gets_trials_at_growing_gaps_and_comes_back_when_fast() -> None:
    hits, costs, clock, _ = offer(per_token_s=40e-6)
    timed(costs, "redis", 1.0)
    assert hits.cut(["redis"] * 2, 0).num_chunks == 0  # cut; first trial in TRIAL_MIN_S
    clock.now += TRIAL_MIN_S / 2
    assert hits.cut(["redis"] * 2, 0).num_chunks == 0
    clock.now += TRIAL_MIN_S / 2
    trial = hits.cut(["redis"] * 2, 0)
    assert trial.num_chunks == 2 and trial.decisions == {("redis", "trial"): 2}
    assert hits.cut(["redis"] * 2, 0).num_chunks == 0  # the next one is further away
    gaps = []
    for _ in range(8):  # it stays slow: trials every 2, 4, 8 ... s, at most TRIAL_MAX_S
        timed(costs, "redis", 1.0, loads=1)  # the last trial, measured (at once, here)
        start = clock.now
        while hits.cut(["redis"] * 2, 0).num_chunks == 0:
            clock.now += 0.5
        gaps.append(clock.now - start - 2 * 1.0)  # after the trial's expected load
    assert gaps[0] == pytest.approx(2 * TRIAL_MIN_S, abs=0.5)
    assert gaps == sorted(gaps) and max(gaps) == pytest.approx(TRIAL_MAX_S, abs=0.5)
    timed(costs, "redis", 1 * MS, loads=2)  # two fast trials: the tier recovered
    assert hits.cut(["redis"] * 2, 0).num_chunks == 2
    timed(costs, "redis", 1.0, loads=2)  # slow again: cut, trials restart from TRIAL_MIN_S
    assert hits.cut(["redis"] * 2, 0).num_chunks == 0
    clock.now += TRIAL_MIN_S
    assert hits.cut(["redis"] * 2, 0).num_chunks == 2


def test_a_trial_slower_than_the_gap_is_not_followed_by_another_until_it_ends() -> None:
    hits, costs, clock, _ = offer(per_token_s=40e-6)
    timed(costs, "redis", 5.0)  # a 4-chunk trial is expected to take 20 s, 10 gaps
    assert hits.cut(["redis"] * 4, 0).num_chunks == 0
    clock.now += TRIAL_MIN_S
    assert hits.cut(["redis"] * 4, 0).num_chunks == 4  # the trial
    clock.now += 20.0
    timed(costs, "redis", 5.0, loads=1)  # it ended as expected
    clock.now += 2 * TRIAL_MIN_S - 0.5  # its gap has not passed
    assert hits.cut(["redis"] * 4, 0).decisions == {("redis", "recompute_faster"): 4}
    clock.now += 0.5
    assert hits.cut(["redis"] * 4, 0).decisions == {("redis", "trial"): 4}


def test_a_trial_longer_than_expected_runs_alone_and_its_gap_counts_from_its_end() -> None:
    hits, costs, clock, _ = offer(per_token_s=40e-6)
    timed(costs, "redis", 1.0)  # a 2-chunk trial is expected to take 2 s
    assert hits.cut(["redis"] * 2, 0).num_chunks == 0
    clock.now += TRIAL_MIN_S
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "trial"): 2}
    clock.now += 30.0  # still not measured (a tier slower than ever): no second trial
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "recompute_faster"): 2}
    timed(costs, "redis", 15.0, loads=1)  # measured now: the gap (4 s) counts from here
    clock.now += 2 * TRIAL_MIN_S - 0.5
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "recompute_faster"): 2}
    clock.now += 0.5
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "trial"): 2}


def test_a_trial_never_measured_is_given_up_after_the_longest_gap() -> None:
    hits, costs, clock, _ = offer(per_token_s=40e-6)
    timed(costs, "redis", 1.0)
    assert hits.cut(["redis"] * 2, 0).num_chunks == 0
    clock.now += TRIAL_MIN_S
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "trial"): 2}
    # Its chunks were gone (a load that finds none is not timed): the next waits TRIAL_MAX_S.
    clock.now += TRIAL_MAX_S - 0.5
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "recompute_faster"): 2}
    clock.now += 0.5
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "trial"): 2}


def test_a_tier_whose_loads_failed_still_gets_its_trials() -> None:
    hits, costs, clock, _ = offer(per_token_s=40e-6)
    for _ in range(3):  # failed loads: an infinite cost a chunk
        costs.observe_load(LoadSample((("redis", 2),), 5.0, failed=True))
    assert hits.cut(["redis"] * 2, 0).num_chunks == 0
    for gap in (TRIAL_MIN_S, 2 * TRIAL_MIN_S, 4 * TRIAL_MIN_S):
        clock.now += gap - 0.5
        assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "recompute_faster"): 2}
        clock.now += 0.5
        assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "trial"): 2}
        costs.observe_load(LoadSample((("redis", 2),), 5.0, failed=True))  # failed again


def after_a_trial(trial_chunk_s: float) -> tuple[HitOffer, LoadCosts]:
    """A Redis tier cut as slow (1 s a chunk), then tried once: its trial took `trial_chunk_s`
    a chunk."""
    hits, costs, clock, _ = offer(per_token_s=40e-6)
    timed(costs, "redis", 1.0)
    assert hits.cut(["redis"] * 2, 0).num_chunks == 0
    clock.now += TRIAL_MIN_S
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "trial"): 2}
    timed(costs, "redis", trial_chunk_s, loads=1)
    return hits, costs


def test_a_fast_trial_is_confirmed_at_once_by_one_more() -> None:
    hits, costs = after_a_trial(1 * MS)
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "trial"): 2}  # no gap
    # Hits arriving while the confirming trial runs are not tried too.
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "recompute_faster"): 2}
    timed(costs, "redis", 1 * MS, loads=1)  # confirmed: two fast loads of three
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "loaded"): 2}


def test_a_slow_trial_is_not_confirmed() -> None:
    hits, _ = after_a_trial(1.0)
    assert hits.cut(["redis"] * 2, 0).decisions == {("redis", "recompute_faster"): 2}
