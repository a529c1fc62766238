"""A trace replayed through kvtier's own eviction and admission classes, at one capacity.

The cache is one tier of `capacity_blocks` chunks, driven the way kvtier's memory tier is
(`kvtier.tiers.memory`): a request's lookup finds the longest prefix held (`ChunkLocator`),
each chunk of that hit is read and so `touch`ed (the store's borrow, first chunk first);
then each full block past the hit is put: a held one is left as is (the tier's `reserve`
answers OK without touching it), a new one is offered to the tier's `AdmissionFilter`, and
an admitted one takes a free slot or the policy's victim's, and is `insert`ed with its
parent's key (as a tier does with `ChunkMeta.parent`). The policy objects are those
`make_policy` gives a tier, in `Generations`.

A hit saves its tokens' prefill, but the last prompt token is always recomputed (vLLM needs
its logits); the seconds saved are the engine's compute for positions 0..hit, which grow with
position (`CostModel.prefill_s`: causal attention over everything before).

Primitives: `PolicySpec` (`parse_policy("lru+admit2")`), `ReplayResult`, `replay`,
`hit_tokens`, `Progress`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.policies import POLICIES, AdmissionFilter, Generations, make_policy
from kvtier.core.policies.clock import ClockPolicy
from kvtier.errors import ConfigError
from kvtier.tools.sim.cost import CostModel
from kvtier.tools.sim.trace import ROOT, Trace, TraceRequest

Progress = Callable[[int], None]  # called with how many requests were replayed since the last call
PROGRESS_EVERY = 2000  # requests between progress calls
# "clock" is what the disk tier runs for `eviction: lru` (tiers/files/diskindex.py)
REPLAY_POLICIES = (*POLICIES, "clock")
# Admission filters remember this many keys per slot of the tier, at least the tier's own
# default (AdmissionFilter's 65,536): enough to see a second offer a conversation turn later.
ADMISSION_MEMORY_MIN = 1 << 16


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """An eviction policy and an admission threshold, as a tier's config names them."""

    eviction: str  # one of REPLAY_POLICIES
    admit_after: int = 1  # store a chunk on its N-th offer (the tier's `admit_after`)

    @property
    def name(self) -> str:
        admit = f"+admit{self.admit_after}" if self.admit_after > 1 else ""
        return self.eviction + admit


def parse_policy(text: str) -> PolicySpec:
    """"lru", "arc+admit2", ...: an eviction policy, optionally "+admitN".

    Raises:
        ConfigError: an unknown policy or a bad admission threshold.
    """
    eviction, _, admit = text.strip().partition("+admit")
    if eviction not in REPLAY_POLICIES:
        raise ConfigError("policy", text, f"one of {REPLAY_POLICIES}, optionally +admitN")
    try:
        admit_after = int(admit) if admit else 1
    except ValueError:
        admit_after = 0
    if admit_after < 1:
        raise ConfigError("policy", text, "+admitN with N an integer >= 1")
    return PolicySpec(eviction, admit_after)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one policy at one capacity made of a trace."""

    policy: str  # PolicySpec.name, "optimum" or "unbounded"
    capacity_tokens: int | None  # None: unbounded
    hit_tokens: int  # prompt tokens served from the cache (prefill saved)
    input_tokens: int  # prompt tokens of the whole trace
    prefill_s_saved: float  # engine compute seconds the hits saved
    prefill_s_total: float  # engine compute seconds of every prompt without a cache
    evictions: int  # chunks evicted
    wall_s: float  # seconds the replay took here

    @property
    def hit_ratio(self) -> float:
        """Token hit ratio: hit tokens over prompt tokens."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def hit_tokens(request: TraceRequest, hit_blocks: int, block_tokens: int) -> int:
    """Tokens a hit of `hit_blocks` blocks saves: all but the last prompt token, at most."""
    return max(0, min(hit_blocks * block_tokens, request.input_tokens - 1))


def _policy(spec: PolicySpec, capacity_blocks: int) -> Generations[int]:
    if spec.eviction == "clock":
        return Generations(ClockPolicy)
    return make_policy(spec.eviction, capacity_blocks)


def replay(trace: Trace, spec: PolicySpec, capacity_blocks: int, cost: CostModel,
           progress: Progress | None = None) -> ReplayResult:
    """Replay `trace` through one tier of `capacity_blocks` chunks under `spec`.

    Raises:
        ConfigError: a negative capacity.
    """
    if capacity_blocks < 0:
        raise ConfigError("capacity", capacity_blocks, "blocks >= 0")
    start = time.perf_counter()
    policy = _policy(spec, capacity_blocks)
    admission = AdmissionFilter(spec.admit_after, max(ADMISSION_MEMORY_MIN, 8 * capacity_blocks))
    held: set[int] = set()
    saved_tokens = evictions = 0
    saved_s = 0.0
    for number, request in enumerate(trace.requests, 1):
        keys = request.keys
        hit = 0
        while hit < len(keys) and keys[hit] in held:
            policy.touch(keys[hit])
            hit += 1
        tokens = hit_tokens(request, hit, trace.block_tokens)
        saved_tokens += tokens
        saved_s += cost.prefill_s(0, tokens)
        evictions += store_blocks(keys[hit:], request.parents[hit:], held, capacity_blocks,
                                  policy, admission)
        if progress is not None and number % PROGRESS_EVERY == 0:
            progress(PROGRESS_EVERY)
    if progress is not None:
        progress(len(trace.requests) % PROGRESS_EVERY)
    return ReplayResult(spec.name, capacity_blocks * trace.block_tokens, saved_tokens,
                        trace.input_tokens, saved_s, total_prefill_s(trace, cost), evictions,
                        time.perf_counter() - start)


def store_blocks(keys: Sequence[int], parents: Sequence[int], held: set[int],
                 capacity_blocks: int, policy: Generations[int],
                 admission: AdmissionFilter) -> int:
    """Store a request's blocks (`keys`, each with its parent) in a tier holding `held` of
    `capacity_blocks`, as the memory tier does: those its admission takes, each evicting the
    policy's victim when the tier is full. The blocks evicted."""
    evictions = 0
    for key, parent in zip(keys, parents, strict=True):
        if key in held or not admission.offer(key):
            continue
        if len(held) >= capacity_blocks:
            victim = policy.evict()
            if victim is None:
                continue  # a tier of no slots stores nothing
            held.remove(victim)
            evictions += 1
        held.add(key)
        policy.insert(key, None if parent == ROOT else parent)
    return evictions


def total_prefill_s(trace: Trace, cost: CostModel) -> float:
    """Engine compute seconds of every prompt of `trace`, prefilled from scratch."""
    return sum(cost.prefill_s(0, r.input_tokens) for r in trace.requests)
