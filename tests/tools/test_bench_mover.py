"""`kvtier bench mover`: the device mover on the stand-in device against the CPU mover, the same
chunks through both, verified byte for byte (figures: docs/performance.md)."""

from __future__ import annotations

from pathlib import Path

from kvtier.tools.bench.mover import (
    BATCHED,
    OPERATIONS,
    PER_CHUNK,
    MoverBenchConfig,
    run_mover_bench,
)
from kvtier.tools.cli.main import main


def test_both_movers_move_the_same_chunks_and_the_ratios_are_measured() -> None:
    result = run_mover_bench(MoverBenchConfig(chunks=4, layers=2, kv_heads=2, head_size=64,
                                              trials=1))
    assert result.verified
    assert {(f.operation, f.mover) for f in result.figures} == {
        (op, mover) for op in OPERATIONS for mover in ("cpu", BATCHED, PER_CHUNK)}
    assert all(f.seconds_per_chunk > 0 for f in result.figures)
    assert all(result.ratio(op) > 0 for op in OPERATIONS)


def test_the_host_work_a_chunk_is_measured_batched_and_a_chunk_at_a_time() -> None:
    """4 chunks: one batch of 4 against 4 of one; the device calls a chunk are counted from
    the stand-in's counters (issue 47)."""
    result = run_mover_bench(MoverBenchConfig(chunks=4, layers=2, kv_heads=2, head_size=64,
                                              trials=1))
    by = {(f.operation, f.mover): f for f in result.host}
    assert set(by) == {(op, mover) for op in OPERATIONS for mover in (BATCHED, PER_CHUNK)}
    assert all(f.host_s_per_chunk > 0 for f in result.host)
    store = by[("store", PER_CHUNK)].calls_per_chunk
    assert store["index uploads"] == store["index kernels"] == 1.0  # each chunk its own
    assert store["run"] == 2.0  # a gather and a DMA
    batched = by[("store", BATCHED)].calls_per_chunk
    assert batched["index uploads"] == batched["index kernels"] == 0.25  # one for 4 chunks
    assert batched["run"] == 0.5
    assert by[("store", BATCHED)].total_calls < by[("store", PER_CHUNK)].total_calls / 3
    assert all(result.host_ratio(op) > 0 for op in OPERATIONS)


def test_the_command_prints_a_table_and_writes_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "mover.json"
    assert main(["bench", "mover", "--quick", "--layers", "2", "--json", str(out)]) == 0
    assert "load-thread load" in capsys.readouterr().out
    assert '"ratios"' in out.read_text() and '"host_ratios"' in out.read_text()


def test_the_ratio_columns_say_which_way_they_divide() -> None:
    """Both were headed "ratio", which said neither what was divided nor which way."""
    from rich.table import Table

    from kvtier.tools.cli.bench_mover import render

    result = run_mover_bench(MoverBenchConfig(chunks=2, layers=1, kv_heads=2, head_size=64,
                                              trials=1))
    tables = [t for t in render(result) if isinstance(t, Table)]
    headers = [[str(c.header) for c in t.columns] for t in tables]
    assert headers[0][-1] == "device / CPU"
    assert headers[1][-1] == "batched / a chunk at a time (us)"
