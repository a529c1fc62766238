"""Load or recompute: how much of a hit kvtier offers to vLLM.

A hit is worth loading only where loading it is faster than recomputing it. The rule
(`HitOffer.cut`, load_when "faster", the default):

    Of a hit's chunks c_1..c_n (after the tokens vLLM's own cache holds), offer the longest
    prefix c_1..c_k whose expected load time is at most its expected recompute time:
        sum(restore_s(tier(c_i)) for i <= k) <= recompute_s(start, end(c_k))
    and leave c_(k+1)..c_n to be recomputed (and stored, as any computed chunk).

Inputs, all measured on this engine:
  - restore_s(tier): the tier's seconds per chunk, the median of its last loads
    (`LoadCosts`, loadcost.py);
  - tier(c): the fastest tier known to hold the chunk: the workers' reports of what each tier
    stored and removed, or the tier whose probe found it (`Holders`, holders.py);
  - recompute_s(s, e): the engine's prefill cost of the prompt's tokens s..e, fitted to its
    own step times by position (attention makes a later token dearer: `EngineSteps`,
    stepcost.py).
Defaults before anything is measured: a tier with no timed load and no prior counts as free,
and an engine with no timed prefill yet as infinitely slow: every hit is loaded, as with load_when
"always", until both sides are measured (the first loads measure the tiers).

A tier judged slower than recompute is no longer loaded from, so its cost would never be
measured again: every TRIAL_MIN_S (doubling up to TRIAL_MAX_S while it stays slow) one hit
that the rule would cut is offered whole, as a trial; its load is timed like any other, and
two fast trials bring the tier back (loadcost.TIER_WINDOW): a trial whose load the rule would
have taken (judged by that load's own cost) is followed by another at once, to confirm it.
A trial runs alone: the next is not due until its load was measured (at most TRIAL_MAX_S,
for one whose chunks were gone and so was never timed), and its gap counts from the later of
the trial's measured end and its expected end (its chunks at the tier's measured cost, at most
TRIAL_MAX_S; its start where the tier's loads failed), so that trials never run back to back,
however slow. A tier that turns slow drops out within two loads.

A tier never timed is judged by its prior, the workers' estimate from its link (loadcost.py):
one slower than recompute is recomputed from the first request, and not tried with users'
requests (its link is measured again every minute, worker/connector_worker.py); once loads
are timed, the trials above take over. Every load may take at most its expected recompute
(its budget, loadplan.py): what has not landed by then is recomputed, so that a load that
turns out slow costs its request at most about twice its recompute.

Decisions are counted per tier, in chunks: "loaded", "trial" (offered against the rule, to
measure), "recompute_faster" (cut).

Primitives: `HitOffer`, `Cut` (load_when: config.LOAD_WHEN).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.integrations.vllm.scheduler.loadcost import LoadCosts
from kvtier.integrations.vllm.scheduler.stepcost import EngineSteps

TRIAL_MIN_S = 2.0
TRIAL_MAX_S = 60.0


@dataclass(frozen=True, slots=True)
class Cut:
    """How many of a hit's chunks are offered, and the decisions by (tier, reason)."""

    num_chunks: int
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)


class HitOffer:
    """The rule above, with the trial clock of each tier it cut (scheduler thread)."""

    def __init__(self, costs: LoadCosts, steps: EngineSteps, tokens_per_chunk: int,
                 load_when: str = "faster",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._costs = costs
        self._steps = steps
        self._tpc = tokens_per_chunk
        self._always = load_when == "always"
        self._clock = clock
        self._next_trial_s: dict[str, float] = {}  # tier -> when it may be tried again
        self._trial_gap_s: dict[str, float] = {}  # tier -> the gap after its next trial
        self._confirmed: dict[str, int] = {}  # tier -> its timed loads when last confirmed
        # tier -> its timed loads and the time when its last trial was offered
        self._trials: dict[str, tuple[int, float]] = {}

    def cut(self, tiers: Sequence[str], start_token: int, end_token: int | None = None) -> Cut:
        """The chunks of a hit to offer. `tiers`: the tier each chunk of the hit is expected
        to be read from, in order; `start_token`: the first token the load provides (vLLM's
        own cache holds the ones before), inside the hit's first chunk; `end_token`: where
        the hit ends, when its last chunk is a tail (keys.tail_key: it costs a chunk's read
        and saves the recompute of its blocks only); None: at its last chunk's end."""
        by_rule = len(tiers) if self._always else self._faster_prefix(tiers, start_token,
                                                                        end_token=end_token)
        decisions: Counter[tuple[str, str]] = Counter(
            (tier, "loaded") for tier in tiers[:by_rule])
        for tier in set(tiers[:by_rule]):
            self._trial_gap_s.pop(tier, None)  # loaded by the rule: fast again
        if by_rule == len(tiers):
            return Cut(by_rule, decisions)
        slowest = max(tiers[by_rule:], key=lambda t: self._costs.chunk_s(t) or 0.0)
        # A tier cut by its prior alone (no load timed) is not tried with a user's request:
        # its link is measured again instead (issue 45: a trial of a slow link costs its
        # request up to its recompute time twice over).
        tried = self._costs.loads(slowest) > 0 and self._trial_due(
            slowest, self._trial_s(tiers[by_rule:]),
            self._to_confirm(slowest, tiers, start_token, end_token))
        reason = "trial" if tried else "recompute_faster"
        decisions.update((tier, reason) for tier in tiers[by_rule:])
        return Cut(len(tiers) if reason == "trial" else by_rule, decisions)

    def _faster_prefix(self, tiers: Sequence[str], start_token: int,
                       cost: Callable[[str], float | None] | None = None,
                       end_token: int | None = None) -> int:
        """The rule: the longest prefix whose load is expected to beat its recompute, at the
        tiers' `cost` a chunk (their medians by default), the hit ending at `end_token`."""
        cost = cost or self._costs.chunk_s
        first_chunk, load_s, offered = start_token // self._tpc, 0.0, 0
        for i, tier in enumerate(tiers):
            load_s += cost(tier) or 0.0
            end = (first_chunk + i + 1) * self._tpc
            if end_token is not None:
                end = min(end, end_token)
            recompute_s = self._steps.recompute_s(start_token, end)
            if recompute_s is None or load_s <= recompute_s:
                offered = i + 1
        return offered

    def _to_confirm(self, tier: str, tiers: Sequence[str], start_token: int,
                    end_token: int | None) -> bool:
        """Whether `tier`'s latest load (a trial) was fast, the rule judging the hit at each
        tier's latest cost, and no trial has confirmed it yet (one confirmation a trial, so
        that hits arriving while it runs are not all tried)."""
        loads = self._costs.loads(tier)
        if self._confirmed.get(tier) == loads \
                or self._faster_prefix(tiers, start_token, self._costs.last_s,
                                       end_token) < len(tiers):
            return False
        self._confirmed[tier] = loads
        return True

    def _trial_s(self, tiers: Sequence[str]) -> float:
        """A trial's expected load time, at most TRIAL_MAX_S (0 where a tier failed its last
        loads: such a trial ends at the tier's first failure)."""
        expected_s = sum(self._costs.chunk_s(tier) or 0.0 for tier in tiers)
        return min(expected_s, TRIAL_MAX_S) if math.isfinite(expected_s) else 0.0

    def _trial_due(self, tier: str, trial_s: float, confirm: bool) -> bool:
        """Whether a cut tier is due a trial load (and, if so, when the next one is: the gap
        after the trial's expected `trial_s`); `confirm`: its last trial was fast, so it is
        due at once."""
        now = self._clock()
        gap = self._trial_gap_s.get(tier)
        if gap is None:  # just cut: the first trial after TRIAL_MIN_S
            self._trial_gap_s[tier] = TRIAL_MIN_S
            self._next_trial_s[tier] = now + TRIAL_MIN_S
            self._trials.pop(tier, None)
            return False
        if not confirm and not self._gap_passed(tier, now):
            return False
        gap = self._trial_gap_s[tier] = min(2 * gap, TRIAL_MAX_S)
        self._next_trial_s[tier] = now + trial_s + gap
        self._trials[tier] = (self._costs.loads(tier), now)
        return True

    def _gap_passed(self, tier: str, now: float) -> bool:
        """Whether the tier's gap has passed since its last trial's expected end and since
        that trial was measured (one not measured yet still runs, up to TRIAL_MAX_S)."""
        if now < self._next_trial_s[tier]:
            return False
        if tier not in self._trials:
            return True
        loads, offered_s = self._trials[tier]
        taken_s = self._costs.taken_s(tier)
        if self._costs.loads(tier) == loads or taken_s is None:
            return now >= offered_s + TRIAL_MAX_S
        return now >= taken_s + self._trial_gap_s[tier]
