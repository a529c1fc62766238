"""Sweep one parameter and find where offload starts to pay and where it only costs.

At every value the simulation runs twice on the same seeded traffic: with the configured
offload tiers and without any (the baseline). A point "pays" when offload cuts the median
TTFT by at least `PAY_TTFT` or raises throughput by at least `PAY_THROUGHPUT`; it "only costs"
when it makes the median TTFT worse and throughput no better; otherwise it is "neutral".

Parameters:
    cpu_gb   -- capacity of the first tier, GB (the baseline does not depend on it)
    hbm_util -- vLLM's gpu_memory_utilization (GPU pool size)
    rate     -- arrival rate, requests per second

Primitives:
    SWEEP_PARAMS, SweepPoint, SweepResult, sweep(config, param, values, progress)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvtier.errors import ConfigError
from kvtier.tools.sim.fleet import SimConfig, simulate
from kvtier.tools.sim.report import SimReport
from kvtier.tools.sim.tiers import TIER_PRESETS

SWEEP_PARAMS = ("cpu_gb", "hbm_util", "rate")
PAY_TTFT = 0.05  # offload pays when the median TTFT drops by 5% or more ...
PAY_THROUGHPUT = 0.02  # ... or throughput rises by 2% or more


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One value of the swept parameter."""

    value: float  # the parameter's value
    offload: SimReport  # with the configured tiers
    baseline: SimReport  # without offload
    verdict: str  # "pays", "only costs" or "neutral"


@dataclass(frozen=True, slots=True)
class SweepResult:
    """A whole sweep."""

    param: str  # which parameter was swept
    points: tuple[SweepPoint, ...]  # in the order of the values given
    pays_from: float | None  # first value where offload pays; None if it never does
    costs_at: tuple[float, ...]  # values where offload only costs


def verdict(offload: SimReport, baseline: SimReport) -> str:
    """Classify one comparison ("pays", "only costs", "neutral")."""
    ttft_gain = 1 - offload.ttft_p50_s / baseline.ttft_p50_s if baseline.ttft_p50_s else 0.0
    thr_gain = (offload.throughput_tok_s / baseline.throughput_tok_s - 1
                if baseline.throughput_tok_s else 0.0)
    if ttft_gain >= PAY_TTFT or thr_gain >= PAY_THROUGHPUT:
        return "pays"
    if ttft_gain < 0 and thr_gain <= 0:
        return "only costs"
    return "neutral"


def _with(config: SimConfig, param: str, value: float) -> SimConfig:
    if param == "cpu_gb":
        first = config.tiers[0] if config.tiers else TIER_PRESETS["cpu"]
        tier = replace(first, capacity_bytes=int(value * 1e9))
        return replace(config, tiers=(tier, *config.tiers[1:]))
    if param == "hbm_util":
        return replace(config, engine=replace(config.engine, gpu_memory_utilization=value))
    return replace(config, workload=replace(config.workload, rate_rps=value))


def sweep(config: SimConfig, param: str, values: Sequence[float],
          progress: Callable[[int, int], None] | None = None) -> SweepResult:
    """Run the sweep; `progress(done, total)` is called after every simulation.

    Raises:
        ConfigError: unknown parameter, no values, or a value the config rejects.
    """
    if param not in SWEEP_PARAMS:
        raise ConfigError("sweep", param, f"one of {SWEEP_PARAMS}")
    if not values:
        raise ConfigError("sweep values", values, "at least one value")
    total = len(values) * 2 - (len(values) - 1 if param == "cpu_gb" else 0)
    done, shared_baseline, points = 0, None, []
    for value in values:
        cfg = _with(config, param, value)
        offload = simulate(cfg)
        done += 1
        if progress:
            progress(done, total)
        baseline = shared_baseline
        if baseline is None:
            baseline = simulate(replace(cfg, tiers=()))
            done += 1
            if progress:
                progress(done, total)
            if param == "cpu_gb":
                shared_baseline = baseline
        points.append(SweepPoint(value, offload, baseline, verdict(offload, baseline)))
    pays = [p.value for p in points if p.verdict == "pays"]
    return SweepResult(param, tuple(points), pays[0] if pays else None,
                       tuple(p.value for p in points if p.verdict == "only costs"))
