"""`kvtier bench fleet` end to end on a small directory: the figures issue 28 asks for are
measured by the real shared and disk tiers in writer processes, and written to JSON. Not a
timed test: only what must hold whatever the machine's speed is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.bench.fleet_fs import FleetConfig
from kvtier.tools.cli.main import main


def test_the_command_measures_writers_eviction_and_a_disk_start_up(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    assert main(["bench", "fleet", "--chunks", "500", "--writers", "1", "2", "--seconds", "1",
                 "--rate", "50", "--interval", "0.5", "--dir", str(tmp_path),
                 "--json", str(out)]) == 0
    [size] = json.loads(out.read_text())["sizes"]
    assert size["chunks"] == 500
    assert [run["writers"] for run in size["writers"]] == [1, 2]
    for run in size["writers"]:
        assert run["puts"] > 0 and run["ops_per_put"] > 0
        assert run["evictions"] > 0  # the quota is what the directory holds: puts evict
        # one re-measure per interval for the whole fleet, not one per writer
        assert run["remeasures_all_writers"] <= 1 / 0.5 + 1
    assert size["eviction"]["evicted"] > 0
    # The disk tier indexed every chunk file the writers and the eviction left (how many
    # depends on the machine's speed: concurrent puts each evict a little more than one).
    left = sum(1 for _ in (tmp_path / "shared-500").rglob("*.kvc"))
    assert 0 < left < 500 and size["disk"]["chunks"] == left
    assert size["projection"]["chunks"] == 10**7


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="chunks"):
        FleetConfig(chunks=(10,)).validate()
    with pytest.raises(ConfigError, match="op_latency_ms"):
        FleetConfig(op_latency_ms=-1).validate()
