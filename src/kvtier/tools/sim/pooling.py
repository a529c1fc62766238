"""One cache for a node's engines against one cache each, same total bytes (issue 43: the
case for `kvtier node`), on a request trace.

The trace's requests are routed to `engines` engines as `kvtier simulate`'s routers do:
"round_robin" (a load balancer that knows nothing of prefixes: a conversation's turns land
anywhere) or "session" (each request to the engine its first block hashes to: the trace has
no session ids, and a conversation's turns share their first block, as do conversations with
one system prompt). Private: each engine replays its requests through a cache of
capacity / engines. Pooled: every request through one cache of the whole capacity (the
node's RAM tier, which every engine reads). Both through kvtier's policy classes
(`replay.replay`).

Private caches get the whole blocks of capacity / engines: a capacity below one block an
engine would leave them empty (every private hit ratio 0), so it is refused.

Primitives: `ROUTES`, `split`, `Pooling`, `check_capacity`, `compare`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtier.errors import ConfigError
from kvtier.tools.sim.cost import CostModel
from kvtier.tools.sim.replay import PolicySpec, replay
from kvtier.tools.sim.trace import Trace

ROUTES = ("session", "round_robin")  # as kvtier.tools.sim.fleet.ROUTERS


def split(trace: Trace, engines: int, route: str) -> list[Trace]:
    """Each engine's share of `trace`, in arrival order.

    Raises:
        ConfigError: engines < 1, or an unknown route.
    """
    if engines < 1:
        raise ConfigError("engines", engines, "a positive integer")
    if route not in ROUTES:
        raise ConfigError("route", route, f"one of {ROUTES}")
    shares: list[list[int]] = [[] for _ in range(engines)]
    for i, request in enumerate(trace.requests):
        engine = i % engines if route == "round_robin" or not request.keys \
            else hash(request.keys[0]) % engines
        shares[engine].append(i)
    return [replace(trace, requests=tuple(trace.requests[i] for i in share))
            for share in shares]


@dataclass(frozen=True, slots=True)
class Pooling:
    """Token hit ratios of one capacity: pooled (one cache) and private (one each)."""

    capacity_tokens: int
    engines: int
    route: str
    pooled_hit_ratio: float
    private_hit_ratio: float

    @property
    def gain(self) -> float | None:
        """Pooled over private; None when private hits nothing (no ratio: JSON has no
        infinity, and `--json` printed `Infinity`, which strict parsers refuse)."""
        return (self.pooled_hit_ratio / self.private_hit_ratio if self.private_hit_ratio
                else None)


def check_capacity(capacity_tokens: int, block_tokens: int, engines: int) -> None:
    """Refuse a capacity that gives an engine's private cache less than one block.

    Raises:
        ConfigError: capacity_tokens // block_tokens < engines.
    """
    if capacity_tokens // block_tokens < engines:
        raise ConfigError("capacity", capacity_tokens,
                          f"with {engines} engines, at least {engines} blocks of the trace "
                          f"({engines * block_tokens:,} tokens): one block a private cache")


def compare(trace: Trace, spec: PolicySpec, capacity_blocks: int, cost: CostModel,
            engines: int, route: str) -> Pooling:
    """Replay `trace` pooled and split over `engines` at `capacity_blocks` in all.

    Raises:
        ConfigError: fewer blocks than engines (`check_capacity`), engines < 1, a bad route.
    """
    check_capacity(capacity_blocks * trace.block_tokens, trace.block_tokens, engines)
    pooled = replay(trace, spec, capacity_blocks, cost)
    hits = sum(replay(share, spec, capacity_blocks // engines, cost).hit_tokens
               for share in split(trace, engines, route))
    return Pooling(capacity_blocks * trace.block_tokens, engines, route, pooled.hit_ratio,
                   hits / trace.input_tokens if trace.input_tokens else 0.0)
