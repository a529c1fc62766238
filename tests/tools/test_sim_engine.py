"""Invariants of the engine loop: conservation, sane pools, determinism, monotonicity."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise

import pytest

from kvtier.tools.sim.engine import Engine, EngineConfig
from kvtier.tools.sim.fleet import SimConfig, build_fleet, simulate
from kvtier.tools.sim.tiers import parse_tier
from kvtier.tools.sim.workload import generate, workload_preset

# A pool of 400 x 64-token blocks (25.6k tokens) under chat traffic whose sessions come back
# after a minute: the GPU cache cannot keep the histories, so tiers and preemption matter.
PRESSURE = SimConfig(workload=workload_preset("chat", think_s=60.0, rate_rps=6.0),
                     engine=EngineConfig(kv_blocks=400), requests=1500,
                     tiers=(parse_tier("cpu=8GB"),))


def _check_pool(engine: Engine) -> None:
    kv = engine.kv
    assert kv.free >= 0 and kv.private >= 0
    running = [*engine.prefilling, *engine.decoding.values(),
               *(r for _, _, r in engine.loading)]
    assert sum(r.n_private for r in running) == kv.private
    assert sum(len(r.held) for r in running) == sum(kv.ref.values())
    assert all(r.n_private >= 0 for r in running)
    assert not set(kv.ref) & set(kv.cached)


def test_requests_are_conserved_and_pools_stay_consistent() -> None:
    engines, _ = build_fleet(PRESSURE)
    engine = engines[0]
    cfg = PRESSURE
    for i, req in enumerate(generate(cfg.workload, cfg.requests, cfg.engine.block_tokens, 0)):
        engine.run_until(req.arrival_s)
        engine.submit(req)
        if i % 50 == 0:
            s = engine.stats
            assert s.arrived == s.completed + engine.in_flight() + s.rejected
            _check_pool(engine)
    engine.run_until(math.inf)
    s = engine.stats
    assert s.arrived == cfg.requests == s.completed + s.rejected
    assert s.rejected == 0 and s.preemptions > 0  # the scenario does exercise preemption
    assert engine.in_flight() == 0 and engine.kv.private == 0 and not engine.kv.ref
    assert engine.kv.free + len(engine.kv.cached) == engine.kv.total
    assert len(s.ttft_s) == cfg.requests and min(s.ttft_s) > 0


def test_two_engines_conserve_requests_and_share_a_shared_tier() -> None:
    cfg = replace(PRESSURE, engines=2, router="round_robin",
                  tiers=(parse_tier("cpu=4GB"), parse_tier("redis=20GB")))
    report = simulate(cfg)
    assert report.completed == cfg.requests and report.in_flight == 0
    redis = report.tiers[-1]
    assert [t.name for t in report.tiers] == ["cpu", "cpu", "redis"]
    assert redis.hit_blocks > 0  # round-robin: one engine's stores are the other's hits


def test_same_seed_same_report() -> None:
    a, b = simulate(PRESSURE), simulate(PRESSURE)
    assert replace(a, wall_s=0.0) == replace(b, wall_s=0.0)
    c = simulate(replace(PRESSURE, seed=1))
    assert c.ttft_p50_s != a.ttft_p50_s


def test_hit_rate_and_ttft_improve_with_cpu_tier_capacity() -> None:
    # More CPU capacity may only add hits (LRU's stack property); timing feedback may shift a
    # block or two, hence the small slack. Mean TTFT must not get worse beyond noise.
    reports = [simulate(replace(PRESSURE, tiers=(parse_tier(f"cpu={gb}GB"),)))
               for gb in (0.5, 2, 4, 8, 16)]
    hits = [r.gpu_hit_rate + sum(t.hit_rate for t in r.tiers) for r in reports]
    for small, large in pairwise(hits):
        assert large >= small - 0.002
    assert hits[-1] > hits[0] + 0.1
    ttft = [r.ttft_mean_s for r in reports]
    for small, large in pairwise(ttft):
        assert large <= small * 1.02
    assert ttft[-1] < ttft[0] * 0.8
    assert reports[-1].reprefills_avoided > reports[0].reprefills_avoided


def test_throughput_at_saturation_grows_with_cpu_tier_capacity() -> None:
    # An overloaded coding agent (requests queue up), so throughput is what the engine can
    # do, not the offered load: loading history instead of re-prefilling it frees compute.
    # Between tier sizes throughput must not drop; against no tier at all it may (a tier
    # smaller than the GPU pool adds no hits, only store costs), so that is not asserted.
    hot = replace(PRESSURE, requests=800, workload=workload_preset("agent", rate_rps=10.0))
    base = simulate(replace(hot, tiers=()))
    thr = [simulate(replace(hot, tiers=(parse_tier(f"cpu={gb}GB"),))).throughput_tok_s
           for gb in (4, 16, 64)]
    for small, large in pairwise(thr):
        assert large >= small * 0.99
    assert thr[-1] > base.throughput_tok_s * 1.1


def test_zero_reuse_gets_no_hits_and_offload_only_costs() -> None:
    # A pool large enough that nothing is preempted: a preempted request's own blocks
    # would be legitimate reuse.
    unique = replace(PRESSURE, workload=workload_preset("unique", rate_rps=6.0),
                     engine=EngineConfig(kv_blocks=4000))
    base = simulate(replace(unique, tiers=()))
    off = simulate(replace(unique, tiers=(parse_tier("cpu=64GB"),)))
    assert base.gpu_hit_rate < 0.001 and off.gpu_hit_rate < 0.001
    assert off.tiers[0].hit_rate < 0.001 and off.reprefills_avoided <= 2
    assert off.ttft_p50_s >= base.ttft_p50_s
    assert off.throughput_tok_s <= base.throughput_tok_s
    assert base.preemptions == off.preemptions == 0
    assert off.tiers[0].stored_blocks > 0  # it paid for the stores


@pytest.mark.parametrize("bad", [{"block_tokens": 0}, {"gpu_memory_utilization": 1.2},
                                 {"max_num_seqs": 0}, {"kv_blocks": 0}])
def test_bad_engine_config(bad: dict) -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError):
        EngineConfig(**bad)
