"""The simulator's load-or-recompute rule (issue 26): a hit slower than its recompute is not
loaded with load_when "faster"; "always" is the naive cache that loads it anyway."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.cli.main import main
from kvtier.tools.sim.burst import burst_ttft
from kvtier.tools.sim.engine import EngineConfig
from kvtier.tools.sim.tiers import SimTier, TierSpec, TierStack

GB = 10**9


def test_a_slow_tier_is_not_loaded_and_the_burst_recomputes() -> None:
    # 16 x 8K-token prompts behind a 1 GB/s file tier: each 1 GiB load takes ~1 s, its
    # recompute ~0.2 s. The naive cache queues 16 slow loads; the rule recomputes.
    recompute = burst_ttft(8192, 16, None)
    naive = burst_ttft(8192, 16, 1.0, "always")
    rule = burst_ttft(8192, 16, 1.0, "faster")
    assert naive > 2 * recompute
    assert rule <= 1.05 * recompute


def test_a_fast_tier_is_loaded_as_the_naive_cache_would() -> None:
    recompute = burst_ttft(8192, 16, None)
    naive = burst_ttft(8192, 16, 20.0, "always")
    assert burst_ttft(8192, 16, 20.0, "faster") == pytest.approx(naive)
    assert naive < recompute / 2


def test_the_offer_is_the_prefix_that_loads_faster() -> None:
    # Blocks 1-2 in a fast tier, 3-4 in a slow one: taking the fast ones only keeps a prefix.
    fast = SimTier(TierSpec("cpu", 10 * GB, 10.0, 0.0), block_bytes=GB)
    slow = SimTier(TierSpec("shared", 10 * GB, 0.01, 0.0), block_bytes=GB)
    stack = TierStack([fast, slow], link_gbps=10.0, block_bytes=GB)
    for h in (1, 2):
        fast.put(h, None)
    for h in (3, 4):
        slow.put(h, None)
    found = stack.find([1, 2, 3, 4, 5], 0, 5)
    assert found == [0, 0, 1, 1]  # stops at 5: nowhere
    assert stack.load_costs() == ([0.0, 0.0], [0.1, 100.0])
    assert stack.take([1, 2, 3, 4], 0, found[:2]) == [2, 0]
    assert fast.hit_blocks == 2 and slow.hit_blocks == 0


def test_load_when_is_checked() -> None:
    with pytest.raises(ConfigError, match="load_when"):
        EngineConfig(load_when="sometimes")


def test_cli_load_when_counts_the_blocks_it_recomputes(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A small GPU pool sends chat histories to an NFS-class shared tier (2 GB/s): 8B's
    # 64-token block (8 MiB) reads in 4 ms there and recomputes in ~2.4 ms, so the rule
    # recomputes what "always" loads.
    reports = {}
    for when in ("faster", "always"):
        code = main(["simulate", "--requests", "300", "--rate", "4", "--think", "5",
                     "--tier", "shared=64GiB", "--hbm-util", "0.3", "--load-when", when,
                     "--json"])
        assert code == 0
        out = json.loads(capsys.readouterr().out)
        assert out["config"]["engine"]["load_when"] == when
        reports[when] = out["report"]
    naive, rule = reports["always"]["tiers"][0], reports["faster"]["tiers"][0]
    assert naive["cut_blocks"] == 0 and naive["hit_blocks"] > 0
    assert rule["hit_blocks"] == 0 and rule["cut_blocks"] == naive["hit_blocks"]
    assert reports["faster"]["ttft_mean_s"] <= reports["always"]["ttft_mean_s"]
    with pytest.raises(SystemExit) as exc:  # argparse: not one of LOAD_WHEN
        main(["simulate", "--requests", "10", "--load-when", "never"])
    assert exc.value.code == 2
