"""`kvtier bench pooling`'s pure parts: its default RAM holds every user's history once (so
the node's tier holds them all and each private tier half), bad settings name their field,
the node's ratios to the private tiers, and the table that shows them. The engines' run is
measured by the command itself (docs/performance.md)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest
from rich.console import Console

from kvtier.errors import ConfigError
from kvtier.tools.bench.demo import PLANS
from kvtier.tools.bench.pooling import CONFIGS, PooledRun, PoolingResult
from kvtier.tools.cli.bench_pooling import config_from, history_bytes, pooling_table

MIB = 1 << 20


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {"quick": True, "ram": None, "config": None,
                                 "model_root": Path("models")}
    return argparse.Namespace(**{**values, **overrides})


def test_the_default_ram_holds_every_history_once() -> None:
    plan = PLANS["quick"]
    config = config_from(_args(), Path("/scratch"))
    tokens = plan.users * (plan.first_len + (plan.turns - 1) * (plan.output_len + plan.user_len)
                           + plan.output_len)
    assert config.ram_bytes >= tokens * plan.kv_bytes_per_token()
    assert config.ram_bytes - tokens * plan.kv_bytes_per_token() < MIB
    assert config.ram_bytes == history_bytes(plan) and config.configs == CONFIGS
    assert config_from(_args(ram="96MiB", config=["node"]), Path("/s")).ram_bytes == 96 * MIB


@pytest.mark.parametrize(("overrides", "field"), [
    ({"ram": "1KiB"}, "ram_bytes"), ({"ram": "lots"}, "ram")])
def test_bad_settings_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_from(_args(**overrides), Path("/s")).validate()


def _run(name: str, prompt: int, hits: int, ttfts: list[float]) -> PooledRun:
    return PooledRun(name, requests=12, failures=[], returning_prompt_tokens=prompt,
                     kvtier_hit_tokens=hits, engine_hit_tokens=0, returning_ttft_s=ttfts)


def test_the_node_is_judged_against_the_private_tiers_of_the_same_run() -> None:
    config = config_from(_args(), Path("/s"))
    result = PoolingResult(config, (_run("private", 1000, 250, [0.4, 0.6, 0.5]),
                                    _run("node", 1000, 750, [0.1, 0.3, 0.2])),
                           {}, 60.0, {"cpus": 2, "loadavg_before": (1.0, 1.0, 1.0),
                                      "loadavg_after": (1.5, 1.0, 1.0)})
    ratios = result.ratios()
    assert ratios["kvtier_hit_share"] == pytest.approx(3.0)
    assert ratios["returning_ttft_p50"] == pytest.approx(0.2 / 0.5)
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(pooling_table(result))
    text = console.export_text()
    assert "750 (75%)" in text and "3.00x" in text and "0.40x" in text
    assert f"2 x {config.ram_bytes / 2 / MIB:.0f} MiB" in text
    only_node = PoolingResult(config, result.runs[1:], {}, 1.0, result.machine)
    assert only_node.ratios() == {}
