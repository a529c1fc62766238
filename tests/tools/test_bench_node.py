"""`kvtier bench node` on a real node process, at a small size: every path measured, every
load verified byte for byte, and the JSON the command writes."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers import memory
from kvtier.tiers.shmslab import SHM_DIR
from kvtier.tools.bench.node import OPERATIONS, PATHS, NodeBenchConfig, run_node_bench
from kvtier.tools.cli.main import main


def test_the_bench_measures_every_path_and_verifies_the_loads() -> None:
    result = run_node_bench(NodeBenchConfig(chunks=4, chunk_kib=64, trials=1, round_trips=5),
                            lambda _text: None)
    assert result.verified
    assert result.chunk_bytes == 64 * 1024
    for op in OPERATIONS:
        assert set(result.seconds_per_chunk[op]) == set(PATHS)
        assert all(s > 0 for s in result.seconds_per_chunk[op].values())
    assert result.round_trip_s > 0
    # The node it ran is gone, and its RAM with it (a benchmark leaves nothing in /dev/shm).
    assert not list(SHM_DIR.glob(f"kvtier-bench-{os.getpid()}-*"))


def test_the_command_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "node.json"
    assert main(["bench", "node", "--chunks", "2", "--chunk-kib", "32", "--trials", "1",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["verified"] is True
    assert set(data["ratios"]) == set(OPERATIONS)


def test_a_chunk_is_the_size_asked() -> None:
    """`--chunk-kib 32` (or anything but a multiple of 64) measured 64 KiB chunks: the layout
    was whole layers of 64 KiB; now any multiple of 4 KiB is exact."""
    for kib in (4, 32, 100, 2048):
        assert NodeBenchConfig(chunk_kib=kib).layout().bytes_per_chunk == kib * 1024, kib
    assert NodeBenchConfig().layout().num_layers == 32  # the default's shape as before
    with pytest.raises(ConfigError, match="chunk_kib"):
        NodeBenchConfig(chunk_kib=6).validate()


def test_the_timed_stores_never_first_touch_a_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """One warm-up trial wrote `chunks` of the tiers' `chunks + 16 MiB` slots: the first timed
    trial stored into slots never written, a page fault a page timed (through the node
    always: the node's prefault maps no page of this process; in process where the tier's
    prefault, at lowest priority, had not reached them: a loaded machine, as here with it
    off). `--quick`'s store in-process read 17x the raw copy once. The warm-ups now write
    every slot."""
    monkeypatch.setattr(memory, "prefault_in_background", lambda *_args: None)
    result = run_node_bench(NodeBenchConfig(chunks=4, chunk_kib=64, trials=2, round_trips=5),
                            lambda _text: None)
    assert result.verified
    pages_a_chunk = 64 * 1024 // mmap.PAGESIZE
    # 0 in steady state; a stray fault or two of the interpreter's own allowed
    assert all(n < pages_a_chunk for n in result.store_faults.values()), result.store_faults
    assert set(result.store_preempted) == {"in-process", "node"}
