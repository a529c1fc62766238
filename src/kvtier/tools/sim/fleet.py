"""Run a simulation: a fleet of engines behind a router, fed by a workload, in time order.

Arrivals are processed in order. Before routing an arrival at time t, every engine runs its
steps up to t, so engines never see the future; tiers marked `shared` (a shared directory,
Redis) are one object in every engine's stack, so one engine's stores are another's hits.
Routers: "session" sends every turn of a session to the same engine (what a prefix-aware
router achieves), "round_robin" spreads requests blindly.

Primitives:
    SimConfig         -- frozen description of one simulation (validated)
    build_fleet(cfg)  -- engines and their distinct tiers
    simulate(cfg, progress=None) -> SimReport
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.tools.ops.hardware import PREFILL_MFU, gpu_profile
from kvtier.tools.sim.cost import STEP_OVERHEAD_S, CostModel, build_cost_model, model_spec
from kvtier.tools.sim.engine import Engine, EngineConfig
from kvtier.tools.sim.report import SimReport, summarize
from kvtier.tools.sim.tiers import SimTier, TierSpec, TierStack
from kvtier.tools.sim.workload import WorkloadConfig, generate

ROUTERS = ("session", "round_robin")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation."""

    model: str = "llama-3.1-8b"  # preset name or path to a config.json
    gpu: str = "h100"  # GPU profile name (kvtier.tools.ops.hardware)
    tp: int = 1  # tensor-parallel size of each engine
    engine: EngineConfig = field(default_factory=EngineConfig)  # scheduler and pool
    tiers: tuple[TierSpec, ...] = ()  # offload tiers, fastest first; () means no offload
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)  # traffic
    requests: int = 10_000  # requests to simulate
    seed: int = 0  # seed of the workload's random numbers
    engines: int = 1  # engines in the fleet
    router: str = "session"  # how arrivals are spread over engines
    mfu: float = PREFILL_MFU  # share of peak FLOPs a step reaches
    step_overhead_s: float = STEP_OVERHEAD_S  # fixed CPU cost per engine step
    link_gbps: float | None = None  # host<->GPU GB/s per rank; None: the GPU's PCIe profile

    def __post_init__(self) -> None:
        if self.requests < 0:
            raise ConfigError("requests", self.requests, "an integer >= 0")
        if self.engines < 1:
            raise ConfigError("engines", self.engines, "an integer >= 1")
        if self.tp < 1:
            raise ConfigError("tp", self.tp, "an integer >= 1")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ConfigError("link_gbps", self.link_gbps, "GB/s > 0 or None")
        if self.router not in ROUTERS:
            raise ConfigError("router", self.router, f"one of {ROUTERS}")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError("tiers", names, "each tier at most once")

    def cost_model(self) -> CostModel:
        """The cost model of one engine.

        Raises:
            ConfigError: unknown model or GPU, or bad cost parameters.
        """
        return build_cost_model(model_spec(self.model), gpu_profile(self.gpu), self.tp,
                                mfu=self.mfu, step_overhead_s=self.step_overhead_s,
                                link_gbps=self.link_gbps)


def build_fleet(cfg: SimConfig) -> tuple[list[Engine], list[SimTier]]:
    """Create the engines and their tiers; shared tiers are one object for all engines.

    Returns:
        (engines, distinct tiers in stack order).
    Raises:
        ConfigError: as SimConfig.cost_model, or a GPU pool too small for the weights.
    """
    cost = cfg.cost_model()
    block_bytes = cost.kv_bytes_per_token * cfg.engine.block_tokens
    shared = {t.name: SimTier(t, block_bytes) for t in cfg.tiers if t.shared}
    engines, distinct = [], list(shared.values())
    for _ in range(cfg.engines):
        stack = []
        for spec in cfg.tiers:
            tier = shared.get(spec.name) or SimTier(spec, block_bytes)
            if not spec.shared:
                distinct.append(tier)
            stack.append(tier)
        engines.append(Engine(cfg.engine, cost, TierStack(stack, cost.link_gbps, block_bytes)))
    order = {t.name: i for i, t in enumerate(cfg.tiers)}
    distinct.sort(key=lambda t: order[t.spec.name])
    return engines, [t for t in distinct if t.capacity_blocks > 0]


def simulate(cfg: SimConfig,
             progress: Callable[[int], None] | None = None) -> SimReport:
    """Run `cfg` to the end (every request completed) and report.

    Args:
        progress: called with the number of requests routed so far, every 10,000.
    Raises:
        ConfigError: as build_fleet.
    """
    started = time.perf_counter()
    engines, tiers = build_fleet(cfg)
    n = len(engines)
    for i, req in enumerate(generate(cfg.workload, cfg.requests, cfg.engine.block_tokens,
                                     cfg.seed)):
        t = req.arrival_s
        for engine in engines:
            if engine.now < t:
                engine.run_until(t)
        target = req.session % n if cfg.router == "session" else i % n
        engines[target].submit(req)
        if progress is not None and i % 10_000 == 0:
            progress(i)
    for engine in engines:
        engine.run_until(math.inf)
    if progress is not None:
        progress(cfg.requests)
    return summarize([e.stats for e in engines], tiers, cfg.requests,
                     sum(e.in_flight() for e in engines), cfg.engine.block_tokens,
                     time.perf_counter() - started)
