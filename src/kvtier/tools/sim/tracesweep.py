"""A trace replayed under several policies at several capacities, beside its ceilings.

For each capacity: every policy (`replay.replay`) and the offline optimum
(`optimum.optimum`), each policy's fraction of the optimum; once: unbounded. This is what
`kvtier simulate --trace` prints, writes as JSON and plots.

Primitives: `TraceSweep`, `CapacityPoint`, `sweep_trace`, `parse_tokens`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tools.sim.cost import CostModel
from kvtier.tools.sim.optimum import optimum, unbounded
from kvtier.tools.sim.replay import PolicySpec, Progress, ReplayResult, replay
from kvtier.tools.sim.trace import Trace

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}
MAX_TOKENS = 10**15  # a larger capacity is a typo


def parse_tokens(text: str) -> int:
    """"300k", "1M", "2.5m", "1000000": a token count.

    Raises:
        ConfigError: not a non-negative number with an optional k/M/G suffix, not a whole
            number of tokens ("1.5"), or MAX_TOKENS or more.
    """
    value = text.strip().lower()
    scale = _SUFFIXES.get(value[-1:], 1)
    try:  # decimal: 1.001M is 1,001,000 tokens, where a float made it 1000999.9999999999
        tokens = Decimal(value[:-1] if scale != 1 else value) * scale
    except InvalidOperation:
        tokens = Decimal(-1)
    if not (tokens.is_finite() and 0 <= tokens < MAX_TOKENS):
        raise ConfigError("capacity", text, "a token count like 300k, 1M, 2.5M or 1000000 "
                          f"(0 to {MAX_TOKENS:.0e})")
    if tokens != int(tokens):  # "1.5" was read as 1 token, and refused as 'capacity=1'
        raise ConfigError("capacity", text, f"a whole number of tokens ({tokens:f} is not)")
    return int(tokens)


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    """Every policy and the optimum at one capacity."""

    capacity_tokens: int
    capacity_blocks: int
    policies: tuple[ReplayResult, ...]
    optimum: ReplayResult
    optimum_prefix_closed: bool  # the optimum's check (optimum.Optimum): it must be True

    def of_optimum(self, result: ReplayResult) -> float:
        """`result`'s hit tokens as a fraction of the optimum's."""
        return result.hit_tokens / self.optimum.hit_tokens if self.optimum.hit_tokens else 1.0


@dataclass(frozen=True, slots=True)
class TraceSweep:
    """The whole run: the trace, the model of prefill cost, the points, unbounded."""

    trace: str
    requests: int
    block_tokens: int
    input_tokens: int
    cost_model: str
    points: tuple[CapacityPoint, ...]
    unbounded: ReplayResult

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: each result with its hit ratio and fraction of the optimum."""
        def row(result: ReplayResult, point: CapacityPoint | None) -> dict[str, Any]:
            data = asdict(result)
            data["hit_ratio"] = result.hit_ratio
            if point is not None:
                data["of_optimum"] = point.of_optimum(result)
            return data

        return {
            "trace": self.trace, "requests": self.requests, "block_tokens": self.block_tokens,
            "input_tokens": self.input_tokens, "cost_model": self.cost_model,
            "points": [{"capacity_tokens": p.capacity_tokens,
                        "capacity_blocks": p.capacity_blocks,
                        "policies": [row(r, p) for r in p.policies],
                        "optimum": row(p.optimum, None),
                        "optimum_prefix_closed": p.optimum_prefix_closed}
                       for p in self.points],
            "unbounded": row(self.unbounded, None),
        }


def sweep_trace(trace: Trace, specs: list[PolicySpec], capacities_tokens: list[int],
                cost: CostModel, progress: Progress | None = None) -> TraceSweep:
    """Replay `trace` under each of `specs` and the optimum at each capacity (in tokens,
    rounded down to whole blocks), and once unbounded.

    Raises:
        ConfigError: no policy, no capacity, or a capacity below one block (it would hold
            nothing: every policy at 0%, shown as 100% of an optimum of 0).
    """
    if not specs:
        raise ConfigError("policies", "", "at least one policy")
    if not capacities_tokens:
        raise ConfigError("capacity", "", "at least one capacity")
    for tokens in capacities_tokens:
        if tokens < trace.block_tokens:
            raise ConfigError("capacity", tokens, f"at least one block of the trace: "
                              f"{trace.block_tokens} tokens or more")
    points = []
    for tokens in capacities_tokens:
        blocks = tokens // trace.block_tokens
        results = tuple(replay(trace, spec, blocks, cost, progress) for spec in specs)
        best = optimum(trace, blocks, cost, progress)
        points.append(CapacityPoint(blocks * trace.block_tokens, blocks, results, best.result,
                                    best.block_hits == best.held_uses))
    return TraceSweep(trace.path, len(trace.requests), trace.block_tokens, trace.input_tokens,
                      cost.name, tuple(points), unbounded(trace, cost))
