"""The ceilings a policy is measured against: the offline optimum at a capacity, and unbounded.

**The optimum** is Belady's MIN with bypass over the trace's block accesses (each request's
full blocks, first block first), under the prefix constraint: a block counts as a hit only if
every block before it in the prompt is held. MIN keeps, at each insertion, the blocks whose
next use comes soonest, and stores a block only if its next use comes before some held
block's (bypass); ties go against the deeper block. Every request that uses a block uses its
parent too, so a parent's next use is never later than its child's: MIN never evicts a parent
while a child is held, and never stores a child whose parent it passed over. Its cache thus
stays prefix-closed, every held block a request uses is a prefix hit, and its prefix hits are
exactly its block hits. No policy hits more blocks than MIN with bypass does (optimal for
blocks of one size, even without the prefix constraint), so this is the **exact optimum of
hit blocks** at that capacity, not a loose bound (`Optimum.block_hits == Optimum.held_uses`
checks the prefix-closure on every run). Hit tokens follow from hit blocks up to the
last-token rule (one token a request at most); seconds saved are not what it optimises (a
deeper block saves more seconds), so its seconds are a reference, not a ceiling.

**Unbounded**: every full block is kept: the hit ratio no capacity can pass (the trace's
cache ratio).

Primitives: `Optimum`, `optimum(trace, capacity_blocks, cost)`, `unbounded(trace, cost)`.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from kvtier.tools.sim.cost import CostModel
from kvtier.tools.sim.replay import (
    PROGRESS_EVERY,
    Progress,
    ReplayResult,
    hit_tokens,
    total_prefill_s,
)
from kvtier.tools.sim.trace import Trace

NEVER = 1 << 62  # the next use of a block never used again


@dataclass(frozen=True, slots=True)
class Optimum:
    """The optimum's result, and the check that its cache stayed prefix-closed."""

    result: ReplayResult
    block_hits: int  # blocks hit as prefixes
    held_uses: int  # blocks used while held, prefix or not (== block_hits: prefix-closed)


def _next_uses(trace: Trace) -> list[int]:
    """For each block access, in order, the index of the next access of the same block."""
    accesses = [key for request in trace.requests for key in request.keys]
    following = [NEVER] * len(accesses)
    last: dict[int, int] = {}
    for index in range(len(accesses) - 1, -1, -1):
        key = accesses[index]
        following[index] = last.get(key, NEVER)
        last[key] = index
    return following


def optimum(trace: Trace, capacity_blocks: int, cost: CostModel,
            progress: Progress | None = None) -> Optimum:
    """Belady's MIN with bypass and the prefix constraint (module docstring) at a capacity."""
    start = time.perf_counter()
    following = _next_uses(trace)
    held: dict[int, tuple[int, int]] = {}  # key -> (next use, depth): its eviction rank
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    access = saved_tokens = block_hits = held_uses = evictions = 0
    saved_s = 0.0
    for number, request in enumerate(trace.requests, 1):
        hit = 0
        while hit < len(request.keys) and request.keys[hit] in held:
            hit += 1
        block_hits += hit
        tokens = hit_tokens(request, hit, trace.block_tokens)
        saved_tokens += tokens
        saved_s += cost.prefill_s(0, tokens)
        for depth, key in enumerate(request.keys):
            rank = (following[access], depth)
            access += 1
            if key in held:
                held_uses += 1
            elif rank[0] == NEVER or capacity_blocks == 0:
                continue
            elif len(held) >= capacity_blocks:
                while held.get(heap[0][2]) != (-heap[0][0], -heap[0][1]):
                    heapq.heappop(heap)  # stale: the key was used or evicted since
                if (-heap[0][0], -heap[0][1]) < rank:
                    continue  # bypass: every held block is used before this one
                del held[heapq.heappop(heap)[2]]
                evictions += 1
            held[key] = rank
            heapq.heappush(heap, (-rank[0], -rank[1], key))
        if len(heap) > 4 * len(held) + 1024:  # drop the stale entries: bounded memory
            heap = [(-r[0], -r[1], k) for k, r in held.items()]
            heapq.heapify(heap)
        if progress is not None and number % PROGRESS_EVERY == 0:
            progress(PROGRESS_EVERY)
    if progress is not None:
        progress(len(trace.requests) % PROGRESS_EVERY)
    result = ReplayResult("optimum", capacity_blocks * trace.block_tokens, saved_tokens,
                          trace.input_tokens, saved_s, total_prefill_s(trace, cost), evictions,
                          time.perf_counter() - start)
    return Optimum(result, block_hits, held_uses)


def unbounded(trace: Trace, cost: CostModel) -> ReplayResult:
    """Every full block kept: the trace's cache ratio."""
    start = time.perf_counter()
    held: set[int] = set()
    saved_tokens = 0
    saved_s = 0.0
    for request in trace.requests:
        hit = 0
        while hit < len(request.keys) and request.keys[hit] in held:
            hit += 1
        tokens = hit_tokens(request, hit, trace.block_tokens)
        saved_tokens += tokens
        saved_s += cost.prefill_s(0, tokens)
        held.update(request.keys)
    return ReplayResult("unbounded", None, saved_tokens, trace.input_tokens, saved_s,
                        total_prefill_s(trace, cost), 0, time.perf_counter() - start)
