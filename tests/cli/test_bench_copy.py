"""`kvtier bench copy` end to end on a tiny shape: the worker's copy path round-trips the
bytes and the command writes its JSON. Not a timed test: figures are not checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier.bench.copy import CopyBenchConfig, run_copy_bench
from kvtier.cli.main import main
from kvtier.errors import ConfigError


def test_blocks_stored_and_loaded_through_the_worker_come_back_identical() -> None:
    config = CopyBenchConfig(device="cpu", layers=2, kv_heads=2, head_size=64, block_size=16,
                             tokens_per_chunk=32, blocks=8, trials=1)
    result = run_copy_bench(config)
    assert result.verified and result.single_allocation and result.kv_layout == "cpu"
    assert {f.name for f in result.figures} >= {"store", "load", "raw out", "raw in"}


def test_the_command_writes_json_and_refuses_a_partial_chunk(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    assert main(["bench", "copy", "--device", "cpu", "--layers", "2", "--kv-heads", "2",
                 "--blocks", "16", "--trials", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["verified"] is True
    with pytest.raises(ConfigError, match="blocks"):
        CopyBenchConfig(blocks=15).validate()
