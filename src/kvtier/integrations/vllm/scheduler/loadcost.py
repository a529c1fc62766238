"""What a load costs, per tier, measured from the workers' complete loads; and the rule of
load_mode "auto" (inline or asynchronous) built on it.

Restore cost: each tier's seconds per chunk, the median of its last TIER_WINDOW samples (a
single slow load does not move it; two in a row do, and two fast ones bring it back). A
sample is one request's load (`LoadSample`): the chunks each tier lent and the time from the
first read to the last scatter. A load that a tier failed (it erred, was down, or did not
answer in time) saved nothing, as its request recomputes after the wait: it counts as an
infinitely slow load of that tier (without that, a tier whose reads all time out would never
look slow). One failure among fast loads does not move the median; two do. Until a tier has
TIER_WINDOW timed loads, its prior (below) stands in for the missing ones: a first load caught
in a stall (this project's VM stops for 1-3 s at times) does not alone make a tier whose link
is fast look slow for the rest of a run; a second slow one does. A load stopped at
its budget (its expected recompute, issue 45) did not fail: its time so far over the chunks it
lent and the one it waited for is its sample, a lower bound (finite, so the tier's cost stays
a number the router weights and the trials can compare). A load that found
its chunk missing or damaged says nothing of the tier's speed: it is not sampled (a damaged
chunk is removed and stored again; the tier serves on). A load
that read from several tiers is charged to the slowest (last) one, less what the faster
tiers' chunks are expected to have cost.

Inline or asynchronous (`LoadCosts.inline`): a hit loaded inline stretches the step that
needs it, and so one inter-token gap of every request in the batch, by the load's time.
Loaded asynchronously, it costs the batch nothing and its own request one more step or so
(vLLM learns of a finished load at a step's end and schedules the request in the next one):
  - no other request runs: inline (there is no batch to protect);
  - else inline when the load's expected time is at most INLINE_STEP_SHARE of the engine's
    median step, so that the batch feels one gap of at most 1.2x (issue 13's ITL target);
  - else asynchronous.
Before a tier's first timed load, its cost is its prior, where the workers estimated one at
start-up from the tier's link (the round trip and bandwidth of a disk, a shared directory, a
remote store, or, in node mode, the node's slowest remote tier: core.tier.LinkProbe, issue
45), so that a slow link's first hits are judged like any other; a tier with neither is
unknown (None). Until a step time and the costs the hit needs are known: a hit held in RAM
inline, one below RAM asynchronous (the measured defaults: a RAM hit adds 0.3-8.3 ms at 1k-16k
tokens, a disk hit 6-91 ms, docs/performance.md).

Primitives: `LoadCosts`, `INLINE_STEP_SHARE`, `TIER_WINDOW` (over the workers'
`transfers.LoadSample`s).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence

from kvtier.integrations.vllm.transfers import LoadSample

# An inline load may stretch one step by this share of the median step: 1.2x at most.
INLINE_STEP_SHARE = 0.2
# Loads per tier whose median is the tier's cost: one outlier does not move it, two do.
TIER_WINDOW = 3


class LoadCosts:
    """Each tier's measured seconds per chunk restored (scheduler thread)."""

    def __init__(self, tiers: Sequence[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`tiers`: the store's tier names, fastest first (the first is RAM)."""
        self._tiers = list(tiers)
        self._clock = clock
        self._samples: dict[str, deque[float]] = {}
        self._loads: Counter[str] = Counter()  # timed loads per tier, ever
        self._taken_s: dict[str, float] = {}  # tier -> when its latest load was taken in
        self._priors_s: dict[str, float] = {}  # tier -> its estimate before a timed load

    @property
    def top_tier(self) -> str:
        return self._tiers[0]

    @property
    def tiers(self) -> list[str]:
        return list(self._tiers)

    def observe_load(self, sample: LoadSample) -> None:
        """Take a worker's timing of a complete load in."""
        lent = [(tier, n) for tier, n in sample.chunks if n > 0]
        if not lent:
            return
        *faster, (slowest, count) = sorted(lent, key=lambda tn: self._rank(tn[0]))
        others_s = sum((self.chunk_s(tier) or 0.0) * n for tier, n in faster)
        # A failed load saved nothing: its request recomputes after the wait.
        per_chunk = math.inf if sample.failed else max(0.0, sample.seconds - others_s) / count
        self._samples.setdefault(slowest, deque(maxlen=TIER_WINDOW)).append(per_chunk)
        self._loads[slowest] += 1
        self._taken_s[slowest] = self._clock()

    def set_prior(self, tier: str, chunk_s: float) -> None:
        """The tier's estimated seconds per chunk, before any of its loads is timed (the
        workers' start-up measure of its link)."""
        self._priors_s[tier] = chunk_s

    def chunk_s(self, tier: str) -> float | None:
        """The tier's seconds per chunk restored: the median of its last TIER_WINDOW timed
        loads, its prior standing in for those not taken yet (so that the first load, caught
        in a stall, does not alone condemn a tier its link says is fast: two slow ones do);
        the prior before any; None without either."""
        samples = self._samples.get(tier)
        prior = self._priors_s.get(tier)
        if not samples:
            return prior
        if prior is None or len(samples) >= TIER_WINDOW:
            return statistics.median(samples)
        return statistics.median([*samples, *[prior] * (TIER_WINDOW - len(samples))])

    def last_s(self, tier: str) -> float | None:
        """The tier's seconds per chunk in its latest timed load; its prior before one
        (None without)."""
        samples = self._samples.get(tier)
        return samples[-1] if samples else self._priors_s.get(tier)

    def loads(self, tier: str) -> int:
        """How many of the tier's loads were timed so far."""
        return self._loads[tier]

    def taken_s(self, tier: str) -> float | None:
        """When the tier's latest timed load was taken in (the clock's time); None before."""
        return self._taken_s.get(tier)

    def expected_s(self, chunks: Mapping[str, int]) -> float | None:
        """The expected time of a load of `chunks` (tier -> count); None until every tier it
        reads from is measured."""
        total = 0.0
        for tier, count in chunks.items():
            if count:
                cost = self.chunk_s(tier)
                if cost is None:
                    return None
                total += cost * count
        return total

    def inline(self, chunks: Mapping[str, int], step_s: float | None) -> bool:
        """Whether a hit of `chunks` (tier -> count), while other requests run, loads inline
        (`step_s`: the engine's median step, None until measured)."""
        expected_s = self.expected_s(chunks)
        if step_s is None or expected_s is None:
            return all(tier == self.top_tier for tier, n in chunks.items() if n)
        return expected_s <= INLINE_STEP_SHARE * step_s

    def _rank(self, tier: str) -> int:
        return self._tiers.index(tier) if tier in self._tiers else len(self._tiers)
