"""`kvtier bench mover`: the device mover's ordering protocol (streams, events, staging
buffers) on a CPU stand-in device, against the CPU mover moving the same chunks. A thin command
over `kvtier.tools.bench.mover`, imported when the command runs."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from kvtier.tools.cli.argtypes import output_file, positive_int
from kvtier.tools.cli.bench import given_or, run_and_report

if TYPE_CHECKING:
    from kvtier.tools.bench.mover import MoverBenchResult


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "mover", help="the device mover's protocol overhead on a stand-in device vs the CPU "
                      "mover (no GPU needed)", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=positive_int, help="chunks each way (32)")
    parser.add_argument("--layers", type=positive_int, default=8, help="model layers (8)")
    parser.add_argument("--tokens-per-chunk", type=positive_int, default=64,
                        help="tokens a chunk (64: 2 MiB with 8 layers, 8 heads of 128)")
    parser.add_argument("--trials", type=positive_int, help="timed trials (5)")
    parser.add_argument("--quick", action="store_true", help="8 chunks, 2 trials (unless given)")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-mover.json"),
                        help="where to write the results (default results/bench-mover.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.tools.bench.mover import MoverBenchConfig, run_mover_bench

    config = MoverBenchConfig(chunks=given_or(args.chunks, args.quick, 8, 32),
                              layers=args.layers, tokens_per_chunk=args.tokens_per_chunk,
                              trials=given_or(args.trials, args.quick, 2, 5))
    config.validate()  # before the spinner: a size that cannot fit, in one line
    result = run_and_report("mover", lambda progress: run_mover_bench(config, progress),
                            render, lambda r: r.write_json(args.json), args.json)
    return 0 if result.verified else 1


def render(result: MoverBenchResult) -> Iterable[Any]:
    table = Table(title=f"{result.config.chunks} chunks of {result.chunk_bytes >> 10} KiB each "
                        "way (median of trials)")
    # The ratios' columns say which way they divide: "ratio" read as a speed-up either way.
    for column in ("operation", "CPU mover us/chunk", "device mover (stand-in) us/chunk",
                   "device / CPU"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    by = {(f.operation, f.mover): f.seconds_per_chunk for f in result.figures}
    for op in ("store", "inline load", "load-thread load"):
        table.add_row(op, f"{by[(op, 'cpu')] * 1e6:.0f}",
                      f"{by[(op, 'stand-in device')] * 1e6:.0f}", f"{result.ratio(op):.2f}x")
    yield table
    if result.host:
        yield host_table(result)
    yield ("loads verified byte for byte" if result.verified
           else "[red]loaded bytes differ from the stored ones[/red]")


def host_table(result: MoverBenchResult) -> Table:
    """The device mover's host work a chunk, batched against a chunk at a time."""
    from kvtier.tools.bench.mover import BATCHED, PER_CHUNK

    table = Table(title="the device mover's host work a chunk on the stand-in: CPU time of "
                        "the calling thread, calls (events, records, waits, runs, index "
                        "uploads and kernels; each chunk's DMA call not counted)")
    for column in ("operation", "a chunk at a time: us", "calls", "batched: us", "calls",
                   "batched / a chunk at a time (us)"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    by = {(f.operation, f.mover): f for f in result.host}
    for op in ("store", "inline load", "load-thread load"):
        single, batched = by[(op, PER_CHUNK)], by[(op, BATCHED)]
        table.add_row(op, f"{single.host_s_per_chunk * 1e6:.0f}", f"{single.total_calls:.2f}",
                      f"{batched.host_s_per_chunk * 1e6:.0f}", f"{batched.total_calls:.2f}",
                      f"{result.host_ratio(op):.2f}x")
    return table
