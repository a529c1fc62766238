"""What keeps a failed load out of the cache (scheduler side; messages.py has the protocol).

A load that fails leaves blocks unfilled under a forward pass that vLLM runs anyway. So the
blocks each plan loads are remembered for LOAD_CONFIRM_STEPS plans, and a store planned
meanwhile names those its request's prefix depends on (`RecentLoads.before`), so that a
worker can refuse it. A load writes only into blocks vLLM just allocated to its request,
never into blocks a request holds: so each of a request's blocks is checked once, when it
first comes within a store's prefix, and a long prefill (a 128k-token prompt in 2k-token
steps) or decode checks its new blocks each plan, not its whole prefix again.

The workers report the blocks whose load failed; the next plan acknowledges them (vLLM
recomputes them from then on: stores need no longer avoid them). Chunks whose load found
nothing, and stores the workers refused, are planned again, to be stored once vLLM has
recomputed them (`LoadFailures.learn`).

Scheduler side, one thread. Primitives: `LoadFailures`, `RecentLoads`, `LOAD_CONFIRM_STEPS`.
"""

from __future__ import annotations

from collections import deque

from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.requeststate import (
    RecentLoads,
    RequestState,
    RequestTable,
)

__all__ = ["LOAD_CONFIRM_STEPS", "LoadFailures", "RecentLoads"]

# Engine steps during which a load's blocks count as unconfirmed (stores depending on them name
# them). vLLM reports a step's outcome before it schedules the step after next (async
# scheduling keeps one step in flight), so 2 would do; the rest is slack. A block past the
# window whose load failed was acknowledged long since (see `LoadFailures.start_plan`).
LOAD_CONFIRM_STEPS = 4


class LoadFailures:
    """Recent loads and acknowledged failures (scheduler thread)."""

    def __init__(self) -> None:
        self._recent_loads: dict[int, int] = {}  # block -> the plan that loads it
        # The blocks each plan loaded, oldest first, while recent: confirmed a plan at a time.
        self._loads_by_plan: deque[tuple[int, list[int]]] = deque()
        self._confirmed_through = -1  # loads of the plans up to this one are confirmed
        # Blocks whose failed load a worker reported, to acknowledge in the next plan.
        self._acked_failed_blocks: set[int] = set()
        # Blocks looked at for recent loads so far: a request's blocks checked (`recent_loads`),
        # its recent ones checked again, loads confirmed (`start_plan`). What plans cost.
        self.blocks_checked = 0
        # (key, request) pairs a report's failed chunks led to (`learn`): what reports cost.
        self.keys_visited = 0

    def start_plan(self, meta: KVTierMetadata) -> None:
        """Acknowledge, in plan `meta` (its loads set), the failures reported since the last
        plan; note the blocks it loads and forget loads past the window (those of the plan
        that leaves it: not every recent load again)."""
        meta.acked_failed_blocks, self._acked_failed_blocks = self._acked_failed_blocks, set()
        loaded = [block for transfers in (meta.loads | meta.async_loads).values()
                  for transfer in transfers for block in transfer.written_blocks()]
        for block in loaded:
            self._recent_loads[block] = meta.step
        if loaded:
            self._loads_by_plan.append((meta.step, loaded))
        self._confirmed_through = meta.step - LOAD_CONFIRM_STEPS
        while self._loads_by_plan and self._loads_by_plan[0][0] <= self._confirmed_through:
            step, blocks = self._loads_by_plan.popleft()
            self.blocks_checked += len(blocks)
            for block in blocks:
                if self._recent_loads.get(block) == step:  # not loaded again since
                    del self._recent_loads[block]

    def recent_loads(self, state: RequestState, attention: list[list[int]],
                     num_blocks: int) -> RecentLoads:
        """The recently loaded blocks among the first `num_blocks` of each attention group
        (`attention`: the request's blocks per group); usually none. Blocks checked by an
        earlier call are not checked again (a held block is never loaded into: see above);
        those found then are kept, as they were, until one of their loads is confirmed."""
        checked = state.loads_checked_blocks
        upto = min(num_blocks, min((len(ids) for ids in attention), default=0))
        if not self._recent_loads:
            state.recent_loads = RecentLoads()
            state.loads_checked_blocks = max(checked, upto)
            return state.recent_loads
        known = state.recent_loads
        if known.since <= self._confirmed_through:  # some of them are confirmed since
            self.blocks_checked += len(known.blocks)
            known = self._recent([(i, b) for i, b in zip(known.positions, known.blocks)
                                  if b in self._recent_loads])
        if upto > checked:
            self.blocks_checked += len(attention) * (upto - checked)
            found = sorted((i, b) for ids in attention
                           for i, b in enumerate(ids[checked:upto], checked)
                           if b in self._recent_loads)
            if found:
                known = self._recent([*zip(known.positions, known.blocks), *found])
            state.loads_checked_blocks = upto
        state.recent_loads = known
        return known.upto(num_blocks)

    def _recent(self, loaded: list[tuple[int, int]]) -> RecentLoads:
        """`loaded`: (position, block) of recently loaded blocks, by position."""
        if not loaded:
            return RecentLoads()
        return RecentLoads(tuple(i for i, _ in loaded), tuple(b for _, b in loaded),
                           min(self._recent_loads[b] for _, b in loaded))

    def learn(self, report: KVTierWorkerMetadata, requests: RequestTable) -> None:
        """Take in the blocks whose load failed, and plan again the chunks of `requests` that
        a load did not find or whose store a worker refused: found through the index of
        their keys (plannedkeys.py), so a report costs the chunks it names, not every live
        request's planned keys."""
        self._acked_failed_blocks |= report.failed_blocks
        replan = report.missing | report.skipped
        if not replan:
            return
        # vLLM recomputes a failed load into the same blocks, and what its forward computed
        # over them (stores the workers skipped): those chunks are planned again so that they
        # are stored once recomputed; otherwise a corrupt or vanished chunk would stay
        # missing and the next request with that prefix miss too
        # (tests/engine/test_kvtier_restart.py, damaged chunk files).
        cuts: dict[str, tuple[RequestState, int, bool]] = {}  # id -> its first, any missing
        for key in replan:
            missing = key in report.missing
            # A tail (keys.tail_key) that failed to load or store is planned again too.
            for state in requests.tail_holders(key):
                self.keys_visited += 1
                state.stored_tails.discard(key)
                if missing and state.tail is not None and state.tail.key == key:
                    state.load_failed = True
            for state, position in requests.chunk_holders(key):
                self.keys_visited += 1
                if position >= state.num_planned_chunks:
                    continue  # not planned: nothing to undo
                request_id = state.request.request_id
                _, first, any_missing = cuts.get(request_id, (state, position, False))
                cuts[request_id] = (state, min(first, position), any_missing or missing)
        for state, first, any_missing in cuts.values():
            state.num_planned_chunks = first
            state.load_failed |= any_missing
