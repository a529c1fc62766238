"""How the scheduler loads a hit: how much of it (load or recompute), inline or
asynchronously, and what to read ahead into RAM.

Scheduler side, one thread. It keeps the loads planned for the next plan (`add_load`,
`start_plan`). It follows which tiers hold each chunk from the workers' reports (chunks
stored go to RAM; the tiers' stored/removed events: `Holders`), measures what loads cost per
tier (`LoadCosts`, loadcost.py) and what the engine's steps and prefills cost (`EngineSteps`,
stepcost.py), cuts each hit to what loads faster than it recomputes (`HitOffer`, offer.py),
weighs it inline or async under `load_mode` "auto", and collects the chunks below RAM of
requests waiting for blocks, to prefetch into RAM (`KVTierMetadata.prefetch`), so that their
load, a step or more later, is a memcpy.

Primitives: `LoadPlanner`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkIndex
from kvtier.core.tier import EventKind
from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.holders import Holders
from kvtier.integrations.vllm.scheduler.loadcost import LoadCosts
from kvtier.integrations.vllm.scheduler.offer import Cut, HitOffer
from kvtier.integrations.vllm.scheduler.stepcost import EngineSteps
from kvtier.integrations.vllm.transfers import ChunkTransfer

logger = logging.getLogger(__name__)

# Keys whose tiers are remembered (~100 B each): 2^17 chunks is 256 GiB of RAM tier at 2 MiB
# a chunk; past that the oldest are forgotten (expected from the slowest tier).
HOLDERS_MAX_KEYS = 1 << 17
# Chunks asked to be prefetched into RAM per step at most (a request waiting for blocks
# gets its prefix read ahead a batch at a time), and remembered as asked (not asked twice).
PREFETCH_PER_STEP = 32
PREFETCHED_MAX_KEYS = 1 << 14
# A load's budget is its expected recompute, never under this: a short hit's recompute
# estimate is a few ms, below the jitter of a thread's wake-up.
MIN_LOAD_BUDGET_S = 0.05


@dataclass(frozen=True, slots=True)
class _Wanted:
    """A waiting request's hit, to read ahead: its chunks `keys` after `parent`, of `tenant`
    (its cache salt)."""

    keys: Sequence[ChunkKey]
    tenant: str | None
    parent: ChunkKey | None


class LoadPlanner:
    """How much of a hit to load, sync or async, the pending loads and the prefetch list
    (scheduler thread)."""

    def __init__(self, load_mode: str, tiers: Sequence[str], several_groups: bool,
                 tokens_per_chunk: int, load_when: str = "faster",
                 stores_stay: bool = True) -> None:
        """Args:
            load_mode: config.LOAD_MODES ("auto", "sync", "async").
            tiers: the names of the workers' tiers, fastest (RAM) first.
            tokens_per_chunk: the chunk size, in tokens.
            load_when: config.LOAD_WHEN: a hit offered as far as it loads faster than it
                recomputes ("faster") or whole ("always").
            several_groups: the model has several KV cache groups: every load is async
                (vLLM 0.32 takes no block-level load failure then: it stops with a
                RuntimeError; an asynchronous load fails by request, recomputed).
            stores_stay: a chunk the workers stored is in the top tier until their events
                say otherwise; False in node mode (another engine's stores evict it from
                the node's RAM, unreported): where a chunk lies is what the lookup found.
        """
        if several_groups and load_mode == "sync":
            logger.warning("kvtier: load_mode 'sync' ignored: a model with several KV cache "
                           "groups loads asynchronously (vLLM recovers failed loads only by "
                           "request there)")
        self._mode = "async" if several_groups else load_mode
        self._top_tier = tiers[0]
        self._stores_stay = stores_stay
        self._holders = Holders(tiers, HOLDERS_MAX_KEYS)
        self._costs = LoadCosts(tiers)
        self._steps = EngineSteps()
        self._offer = HitOffer(self._costs, self._steps, tokens_per_chunk, load_when)
        # Requests whose hit may read below RAM and that wait for blocks (a lookup, and no
        # allocation after it): their chunks are prefetched into RAM.
        self._wanted: dict[str, _Wanted] = {}
        self._prefetched = ChunkIndex(PREFETCHED_MAX_KEYS)
        # Loads planned for the next plan, inline and asynchronous (request id -> chunks).
        self._pending: dict[str, list[ChunkTransfer]] = {}
        self._pending_async: dict[str, list[ChunkTransfer]] = {}
        self._budgets_s: dict[str, float] = {}  # of the pending loads that have one
        self._always = load_when == "always"

    @property
    def by_cost(self) -> bool:
        """Whether hits are weighed (load_mode "auto"): only then does `loads_async` need to
        know whether other requests run."""
        return self._mode == "auto"

    @property
    def costs(self) -> LoadCosts:
        return self._costs

    @property
    def steps(self) -> EngineSteps:
        return self._steps

    def sources(self, keys: Sequence[ChunkKey],
                found_in: Callable[[ChunkKey], str | None]) -> list[str]:
        """The tier each of `keys` is expected to be loaded from (`found_in`: the tier a
        probe found a key in, if any: ChunkLocator.found_in)."""
        return [self._holders.source(key, found_in(key)) for key in keys]

    def cut(self, sources: Sequence[str], start_token: int,
            end_token: int | None = None) -> Cut:
        """How many chunks of a hit read from `sources` to offer, the hit ending at
        `end_token` (None: at its last chunk's end; offer.py)."""
        return self._offer.cut(sources, start_token, end_token)

    def loads_async(self, sources: Sequence[str], others_running: bool) -> bool:
        """Whether a hit read from `sources` (a tier per chunk) is loaded asynchronously
        (see config.LOAD_MODES). "auto": by its measured cost while other requests run
        (loadcost.py); an idle engine has no batch to protect, and an asynchronous load
        costs its request one more step (a 1k-token disk hit: 14 ms extra TTFT against
        4.5 ms inline, docs/performance.md)."""
        if self._mode != "auto":
            return self._mode == "async"
        if not others_running:
            return False
        return not self._costs.inline(Counter(sources), self._steps.step_s)

    def want(self, request_id: str, keys: Sequence[ChunkKey], tenant: str | None,
             parent: ChunkKey | None) -> None:
        """A request (of `tenant`, its cache salt) waiting for blocks will load `keys`, a run
        of its chunks after `parent`: read those below RAM ahead (a tier that seals the
        tenant's chunks needs the tenant; RAM's "prefix" policy, each one's parent). O(1):
        vLLM asks again about a request each step it waits, and only PREFETCH_PER_STEP
        chunks a plan are read ahead (`_take_prefetch` looks at its chunks then)."""
        self._wanted[request_id] = _Wanted(keys, tenant, parent)  # until vLLM allocates

    def forget(self, request_id: str) -> None:
        """The request got its blocks: it loads now, not ahead."""
        self._wanted.pop(request_id, None)

    def forget_all(self) -> None:
        """A cache reset: nothing looked up before is read ahead (its keys are retired)."""
        self._wanted.clear()

    def add_load(self, request_id: str, transfers: list[ChunkTransfer],
                 load_async: bool, start_token: int = 0, end_token: int = 0) -> None:
        """Plan the load of a request's hit (its tokens `start_token`..`end_token`), into
        the blocks vLLM allocated, for the next plan: inline or asynchronously
        (`loads_async`). Under load_when "faster" it may take as long as its expected
        recompute (once the engine's prefills are measured): what has not landed by then is
        recomputed, so that no hit costs much more than a miss (issue 45)."""
        pending = self._pending_async if load_async else self._pending
        pending[request_id] = transfers
        budget_s = None if self._always else self._steps.recompute_s(start_token, end_token)
        if budget_s is not None:
            self._budgets_s[request_id] = max(budget_s, MIN_LOAD_BUDGET_S)

    def end(self, request_id: str) -> None:
        """The request ended: nothing of it is loaded or read ahead."""
        self._pending.pop(request_id, None)
        self._pending_async.pop(request_id, None)
        self._budgets_s.pop(request_id, None)
        self.forget(request_id)

    def start_plan(self, meta: KVTierMetadata) -> None:
        """Give plan `meta` the loads planned since the last plan and the chunks to
        prefetch."""
        meta.loads, meta.async_loads = self._pending, self._pending_async
        meta.load_budgets_s = self._budgets_s
        self._pending, self._pending_async, self._budgets_s = {}, {}, {}
        meta.prefetch = self._take_prefetch()

    def _take_prefetch(self) -> list[ChunkTransfer]:
        """Up to PREFETCH_PER_STEP chunks of waiting requests to read into RAM ahead of their
        load, none the RAM tier is known to hold, each asked once until RAM evicts it."""
        chunks: list[ChunkTransfer] = []
        for wanted in self._wanted.values():
            for i, key in enumerate(wanted.keys):
                if len(chunks) == PREFETCH_PER_STEP:
                    return chunks
                if key not in self._prefetched and not self._holders.holds(key, self._top_tier):
                    self._prefetched.add(key)
                    chunks.append(ChunkTransfer(
                        key=key, block_ids=(), tenant=wanted.tenant,
                        parent=wanted.keys[i - 1] if i else wanted.parent))
        self._wanted.clear()  # a request still waiting is looked up again
        return chunks

    def observe_plan(self, now_s: float, tokens: int, position: float) -> None:
        """A plan is built at `now_s` (time.monotonic) for a step that runs `tokens` tokens
        at mean `position` in their prompts (call before `start_plan`: it tells whether
        the step loads inline)."""
        self._steps.observe_plan(now_s, tokens, position, inline_loads=bool(self._pending))

    def step_ended(self, now_s: float) -> None:
        """The last planned step finished a request at `now_s` (time.monotonic)."""
        self._steps.step_ended(now_s)

    def learn(self, report: KVTierWorkerMetadata) -> None:
        """Take in the workers' timed loads and what their RAM tier stored and removed."""
        for tier, chunk_s in report.tier_priors_s.items():
            if self._costs.chunk_s(tier) is None:
                logger.info("kvtier: tier %r: restore estimated at %.4g s a chunk from its "
                            "link, before any load", tier, chunk_s)
            self._costs.set_prior(tier, chunk_s)
        for sample in report.load_samples:
            self._costs.observe_load(sample)
        for key in report.stored if self._stores_stay else ():  # stores go to the top tier
            self._holders.stored(key, self._top_tier)
        for event in report.events:
            if event.kind is EventKind.STORED:
                self._holders.stored(event.key, event.tier)
            else:
                self._holders.removed(event.key, event.tier)
                if event.tier == self._top_tier:
                    self._prefetched.discard(event.key)  # may be prefetched again
