"""`kvtier bench fleet` end to end on a small directory: the figures issue 28 asks for are
measured by the real shared and disk tiers in writer processes, and written to JSON. Not a
timed test: only what must hold whatever the machine's speed is checked."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from kvtier.errors import ConfigError
from kvtier.tools.bench.fleet_fs import FleetConfig, run_fleet_bench
from kvtier.tools.cli.bench_fleet import directory_table, writers_table
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


def test_a_run_without_a_directory_removes_its_own(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --dir the run's directories (10^5 chunk files by default) were left in the
    temp dir, a kvtier-fleet-* of no process's after every run."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = run_fleet_bench(FleetConfig(chunks=(100,), writers=(1,), seconds=0.2, rate=20,
                                         interval=0.5, skip_disk=True))
    assert report["sizes"][0]["writers"][0]["puts"] > 0
    assert Path(report["config"]["directory"]).parent == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_a_run_stopped_by_sigterm_ends_its_writers_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGTERM to the command while its writers run: multiprocessing joined them at exit,
    and they put for the rest of --seconds into the directory the run had removed, making it
    again (a kvtier-fleet-* left in the temp dir). They are ended with the run now."""
    (tmp_path / "tmp").mkdir()
    child = subprocess.Popen(
        [sys.executable, "-m", "kvtier.tools.cli.main", "bench", "fleet", "--chunks", "100",
         "--writers", "2", "--seconds", "60", "--rate", "20", "--skip-disk",
         "--json", str(tmp_path / "fleet.json")],
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    writers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len(writers) < 2 or not list((tmp_path / "tmp").glob("kvtier-fleet-*/*/*/*")):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "no writers putting after 120 s"
            time.sleep(0.1)
            writers = [p for p in psutil.Process(child.pid).children()
                       if "resource_tracker" not in " ".join(p.cmdline())]
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=60)  # not the writers' 60 s
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        for process in writers:
            if process.is_running():
                process.kill()
    assert child.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert not [p for p in writers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="chunks"):
        FleetConfig(chunks=(10,)).validate()
    with pytest.raises(ConfigError, match="op_latency_ms"):
        FleetConfig(op_latency_ms=-1).validate()


def test_the_tables_headers_show_whole_in_80_columns() -> None:
    """Printed into a pipe (80 columns), the headers once read "CPU s/min/w…", "re-measu…",
    "ops/ev…" and "RSS/ch…": rich cuts a header word wider than its column."""
    run = {"writers": 4, "puts": 1188, "ops_per_put": 40.2, "put_ms": 17.63,
           "cpu_ms_per_put": 0.98, "cpu_s_per_min_per_writer": 3.08, "remeasures_all_writers": 1}
    disk = {"serving_after_s": 0.514, "index_complete_s": 1.23, "rss_bytes_per_chunk": 341,
            "lookup_while_loading": {"ms": 0.09}}
    size = {"chunks": 10_000, "writers": [run], "first_open_cpu_s": 0.27,
            "eviction": {"evictions_per_s": 3194, "ops_per_eviction": 28.7}, "disk": disk}
    report = {"config": {"op_latency_ms": 0.5, "emulate_latency": False}, "sizes": [size]}
    console = Console(file=io.StringIO(), width=80)
    console.print(writers_table(report), directory_table(report))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "…" not in text
    for word in ("writer", "measures", "evict", "chunk"):
        assert word in text
