"""`kvtier bench node`: a RAM hit and a store through `kvtier node` against the same RAM tier
in the engine's process and a raw copy. A thin command over `kvtier.tools.bench.node`,
imported when the command runs."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from kvtier.tools.cli.argtypes import output_file, positive_int
from kvtier.tools.cli.bench import given_or, run_and_report

if TYPE_CHECKING:
    from kvtier.tools.bench.node import NodeBenchResult


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "node", help="RAM hits and stores through kvtier node vs in-process vs a raw copy",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=positive_int,
                        help="chunks a batch: a step's stores, a request's hit (64)")
    parser.add_argument("--chunk-kib", type=positive_int, default=2048,
                        help="KiB a chunk, a multiple of 4 (2048)")
    # --quick keeps 5: a median of 2 trials (its 2 before) is their mean, and one trial
    # preempted on a loaded machine set the figure (store in-process 17x the raw copy once).
    parser.add_argument("--trials", type=positive_int, default=5, help="timed trials (5)")
    parser.add_argument("--quick", action="store_true", help="16 chunks (unless given)")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-node.json"),
                        help="where to write the results (default results/bench-node.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.tools.bench.node import NodeBenchConfig, run_node_bench

    config = NodeBenchConfig(chunks=given_or(args.chunks, args.quick, 16, 64),
                             chunk_kib=args.chunk_kib,
                             trials=args.trials)
    config.validate()  # before the spinner: a size that cannot fit, in one line
    result = run_and_report("node", lambda progress: run_node_bench(config, progress),
                            render, lambda r: r.write_json(args.json), args.json)
    return 0 if result.verified else 1


def render(result: NodeBenchResult) -> Iterable[Any]:
    table = Table(title=f"{result.config.chunks} chunks of {result.chunk_bytes >> 10} KiB a "
                        "batch (median of trials), microseconds per chunk")
    for column in ("operation", "raw copy", "in-process", "node", "node / in-process",
                   "node / raw"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    for op, by in result.seconds_per_chunk.items():
        table.add_row(op, *(f"{by[p] * 1e6:.0f}" for p in ("raw", "in-process", "node")),
                      f"{result.ratio(op, 'node', 'in-process'):.2f}x",
                      f"{result.ratio(op, 'node', 'raw'):.2f}x")
    yield table
    yield (f"one control round trip (a one-key Lookup): {result.round_trip_s * 1e6:.0f} us; "
           "per batch: 1 round trip to store (Reserve), commits unanswered; a load of chunks "
           "the engine knows: none (read in place under the slots' locks), otherwise 1 "
           "(Borrow, its release unanswered)")
    faults, preempted = result.store_faults, result.store_preempted
    yield (f"in the timed stores, page faults: in-process {faults['in-process']}, node "
           f"{faults['node']} (0: every slot was written in the warm-ups); preemptions of "
           f"the bench's thread: in-process {preempted['in-process']}, node "
           f"{preempted['node']} (by the machine's other work; through the node also by "
           "the node's thread, woken by each Commit)")
    yield ("loads verified: every chunk came back as stored" if result.verified
           else "[red]loaded bytes differ from the stored ones[/red]")
