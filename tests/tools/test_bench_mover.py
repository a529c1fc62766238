"""`kvtier bench mover`: the device mover on the stand-in device against the CPU mover, the same
chunks through both, verified byte for byte (figures: docs/performance.md)."""

from __future__ import annotations

from pathlib import Path

from kvtier.tools.bench.mover import OPERATIONS, MoverBenchConfig, run_mover_bench
from kvtier.tools.cli.main import main


def test_both_movers_move_the_same_chunks_and_the_ratios_are_measured() -> None:
    result = run_mover_bench(MoverBenchConfig(chunks=4, layers=2, kv_heads=2, head_size=64,
                                              trials=1))
    assert result.verified
    assert {(f.operation, f.mover) for f in result.figures} == {
        (op, mover) for op in OPERATIONS for mover in ("cpu", "stand-in device")}
    assert all(f.seconds_per_chunk > 0 for f in result.figures)
    assert all(result.ratio(op) > 0 for op in OPERATIONS)


def test_the_command_prints_a_table_and_writes_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "mover.json"
    assert main(["bench", "mover", "--quick", "--layers", "2", "--json", str(out)]) == 0
    assert "load-thread load" in capsys.readouterr().out
    assert '"ratios"' in out.read_text()
