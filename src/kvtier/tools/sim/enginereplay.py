"""A trace replayed through a kvtier tier behind the engine's own prefix cache, as vLLM runs it.

`replay.replay` is kvtier's tier alone. In an engine, vLLM's own prefix cache answers first
and kvtier only for what lies beyond its hit (`get_num_new_matched_tokens`), so that:
  - a request's hit is the longer of the engine's and the tier's longest held prefix (the
    tier's from chunk 0: `ChunkLocator`), at most its tokens but the last one, in chunks;
  - only the tier's chunks past the engine's hit are loaded, and so `touch`ed;
  - every full chunk of the request that the tier does not hold is offered to it (the store
    plan stores the full chunks computed, those served by the engine's cache included);
  - the engine's cache (vLLM's block pool, here in chunks) keeps the request's full blocks
    once it ends, freed last block first: an LRU whose oldest end is the latest request's
    tail; while a request runs, its blocks (its hit and the new ones, the partial last and
    the output token's included) are taken from the free ones, the oldest cached first.
The tier is driven as in `replay.replay`: the policy classes `make_policy` gives a tier, in
`Generations`, and the tier's `AdmissionFilter`.

Primitives: `EngineReplay`, `replay_behind_engine`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.policies import AdmissionFilter, Generations, make_policy
from kvtier.errors import ConfigError
from kvtier.tools.sim.cost import CostModel
from kvtier.tools.sim.replay import (
    ADMISSION_MEMORY_MIN,
    PolicySpec,
    ReplayResult,
    store_blocks,
    total_prefill_s,
)
from kvtier.tools.sim.trace import Trace


@dataclass(frozen=True, slots=True)
class EngineReplay:
    """What the engine's cache and the tier together made of a trace."""

    result: ReplayResult  # hit_tokens: served by either (prefill saved)
    engine_hit_tokens: int  # served by the engine's own cache
    tier_hit_tokens: int  # served by the tier (loaded past the engine's hit)


def replay_behind_engine(trace: Trace, spec: PolicySpec, capacity_blocks: int,
                         engine_blocks: int, output_tokens: int,
                         cost: CostModel) -> EngineReplay:
    """Replay `trace` through a tier of `capacity_blocks` chunks under `spec` behind an engine
    cache of `engine_blocks` chunks, each request generating `output_tokens`.

    Raises:
        ConfigError: a negative capacity, an engine cache too small for a request, or the
            disk tier's "clock" (a memory tier's policies only).
    """
    if capacity_blocks < 0:
        raise ConfigError("capacity", capacity_blocks, "blocks >= 0")
    if spec.eviction == "clock":
        raise ConfigError("policy", spec.name, "a memory tier's eviction policy")
    start = time.perf_counter()
    size = trace.block_tokens
    policy: Generations[int] = make_policy(spec.eviction, capacity_blocks)
    admission = AdmissionFilter(spec.admit_after, max(ADMISSION_MEMORY_MIN, 8 * capacity_blocks))
    held: set[int] = set()
    engine: OrderedDict[int, None] = OrderedDict()  # oldest (evicted first) first
    engine_tokens = tier_tokens = evictions = 0
    saved_s = 0.0
    for request in trace.requests:
        keys = request.keys
        loadable = min(len(keys), (request.input_tokens - 1) // size)
        local = _held_prefix(keys[:loadable], engine.__contains__)
        tier = _held_prefix(keys[:loadable], held.__contains__)
        for key in keys[local:tier]:
            policy.touch(key)
        hit = max(local, tier)
        engine_tokens += local * size
        tier_tokens += (hit - local) * size
        saved_s += cost.prefill_s(0, hit * size)
        _take_engine_blocks(engine, keys[:local], request.input_tokens + output_tokens,
                            size, engine_blocks)
        evictions += store_blocks(keys, request.parents, held, capacity_blocks, policy,
                                  admission)
        for key in reversed(keys):  # freed last block first: the tail is evicted first
            engine[key] = None
            engine.move_to_end(key)
    result = ReplayResult(spec.name, capacity_blocks * size, engine_tokens + tier_tokens,
                          trace.input_tokens, saved_s, total_prefill_s(trace, cost), evictions,
                          time.perf_counter() - start)
    return EngineReplay(result, engine_tokens, tier_tokens)


def _held_prefix(keys: tuple[int, ...], held: Callable[[int], bool]) -> int:
    """How many of `keys`, first first, `held(key)` says are held, up to the first that is not."""
    count = 0
    while count < len(keys) and held(keys[count]):
        count += 1
    return count


def _take_engine_blocks(engine: OrderedDict[int, None], hit: tuple[int, ...], tokens: int,
                        size: int, engine_blocks: int) -> None:
    """Free the engine blocks a request of `tokens` needs past its `hit`: the oldest cached
    blocks that are not its hit are evicted.

    Raises:
        ConfigError: the engine cache cannot hold the request.
    """
    need = -(-tokens // size)
    if need > engine_blocks:
        raise ConfigError("engine_blocks", engine_blocks, f">= {need} (a request's chunks)")
    in_use = set(hit)
    spare = [key for key in engine if key not in in_use]
    excess = len(engine) - len(in_use) - (engine_blocks - need)
    for key in spare[:max(0, excess)]:
        del engine[key]
