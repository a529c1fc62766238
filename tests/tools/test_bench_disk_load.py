"""`kvtier bench disk-load`: a disk hit's load through the CPU mover against a raw O_DIRECT
read of the same bytes, verified byte for byte, and a store against a raw O_DIRECT write
(figures: docs/performance.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.bench.diskload import DiskLoadConfig, run_disk_load_bench
from kvtier.tools.cli.main import main


def test_loads_come_back_byte_for_byte_and_are_split_into_reads_and_copy(
        tmp_path: Path) -> None:
    result = run_disk_load_bench(DiskLoadConfig(chunks=(2, 9), layers=2, kv_heads=2,
                                                head_size=64, tokens_per_chunk=64, trials=2,
                                                directory=tmp_path))
    assert result.verified
    assert [p.chunks for p in result.points] == [2, 9]  # 9: two borrow batches of 8 and 1
    for point in result.points:
        assert point.nbytes == point.chunks * result.chunk_bytes
        assert 0 < point.read_wait_s <= point.load_s and point.raw_s > 0 and point.ratio > 0
        assert point.store_s > 0 and point.store_cpu_s > 0 and point.raw_write_s > 0
        assert point.store_ratio > 0
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed


def test_the_command_prints_a_table_and_writes_json(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "disk-load.json"
    scratch = tmp_path / "scratch"  # an existing directory (`work_dir`), a temp dir made in it
    scratch.mkdir()
    assert main(["bench", "disk-load", "--quick", "--chunks", "2", "--dir", str(scratch),
                 "--json", str(out)]) == 0
    assert scratch.is_dir() and list(scratch.iterdir()) == []
    printed = capsys.readouterr().out
    assert "loads verified byte for byte" in printed and "disk-tier stores" in printed
    point = json.loads(out.read_text())["points"][0]
    assert point["chunks"] == 2 and point["copy_s"] == pytest.approx(
        point["load_s"] - point["read_wait_s"])


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="tokens_per_chunk"):
        run_disk_load_bench(DiskLoadConfig(tokens_per_chunk=100))
    with pytest.raises(ConfigError, match="chunks"):
        run_disk_load_bench(DiskLoadConfig(chunks=(0,)))
