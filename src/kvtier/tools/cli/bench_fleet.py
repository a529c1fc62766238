"""`kvtier bench fleet`: what a shared directory of many chunks costs each writer (metadata
operations and CPU per put, re-measures across the fleet), eviction throughput, a disk tier's
start-up over the same directory, and the projection for NFS. A thin command over
`kvtier.tools.bench.fleet_fs`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from kvtier.tools.bench.fleet_fs import FleetConfig, run_fleet_bench
from kvtier.tools.cli.argtypes import (
    finite_float,
    output_file,
    positive_float,
    positive_int,
    work_dir,
)
from kvtier.tools.cli.bench import given_or, run_and_report

QUICK: dict[str, Any] = {"chunks": (1_000, 10_000), "writers": (1, 4), "seconds": 3.0}
FULL: dict[str, Any] = {"chunks": (100_000,), "writers": (1, 4), "seconds": 10.0}


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "fleet", help="a shared directory at fleet scale: metadata work per put, "
        "re-measures, eviction, disk-tier start-up", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=positive_int, nargs="+",
                        help="directory sizes in 4 KiB chunks (100000)")
    parser.add_argument("--writers", type=positive_int, nargs="+",
                        help="writer processes per run (1 4)")
    parser.add_argument("--rate", type=positive_float, default=100.0,
                        help="puts/s per writer (100)")
    parser.add_argument("--seconds", type=positive_float,
                        help="length of each writers' run (10)")
    parser.add_argument("--interval", type=positive_float, default=2.0,
                        help="the shared tier's scan_interval_s (2: the heartbeat shows in a "
                        "short run)")
    parser.add_argument("--op-latency-ms", type=finite_float, default=0.5,
                        help="a metadata round trip on NFS, for the projection (0.5)")
    parser.add_argument("--emulate-latency", action="store_true",
                        help="the writers' metadata calls on the directory really wait "
                        "--op-latency-ms each (an LD_PRELOAD shim built with the system's C "
                        "compiler: an emulated NFS)")
    parser.add_argument("--skip-disk", action="store_true",
                        help="no disk-tier start-up figures")
    parser.add_argument("--quick", action="store_true",
                        help="10^3 and 10^4 chunks, 3 s runs (~1 min), unless given")
    parser.add_argument("--dir", type=work_dir, default=None,
                        help="build the directories here, kept for a later run, which reuses "
                        "a directory already filled (default: a temp dir, removed at the end)")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-fleet.json"))
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> FleetConfig:
    """The settings: each flag given, else --quick's, else the full run's."""
    chunks = None if args.chunks is None else tuple(args.chunks)
    writers = None if args.writers is None else tuple(args.writers)
    return FleetConfig(chunks=given_or(chunks, args.quick, QUICK["chunks"], FULL["chunks"]),
                       writers=given_or(writers, args.quick, QUICK["writers"],
                                        FULL["writers"]),
                       seconds=given_or(args.seconds, args.quick, QUICK["seconds"],
                                        FULL["seconds"]),
                       rate=args.rate, interval=args.interval,
                       op_latency_ms=args.op_latency_ms, skip_disk=args.skip_disk,
                       emulate_latency=args.emulate_latency, directory=args.dir)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    config.validate()
    run_and_report("fleet", lambda progress: run_fleet_bench(config, progress),
                   lambda r: (writers_table(r), directory_table(r), projection_lines(r)),
                   lambda r: args.json.write_text(json.dumps(r, indent=1)), args.json)
    return 0


def writers_table(report: dict[str, Any]) -> Table:
    table = Table(title="Writers on one shared directory (every put evicts)")
    latency = report["config"]["op_latency_ms"] if report["config"]["emulate_latency"] else 0
    if latency:
        table.title = (f"Writers on one shared directory (every put evicts), each metadata "
                       f"call {latency:g} ms")
    # Headers in words short enough to wrap: rich cuts a word wider than its column.
    for name in ("chunks", "writers", "puts", "ops per put", "put ms", "CPU ms per put",
                 "CPU s per min per writer", "re-\nmeasures"):
        table.add_column(name, justify="right")
    for size in report["sizes"]:
        for run in size["writers"]:
            table.add_row(f"{size['chunks']:,}", str(run["writers"]), str(run["puts"]),
                          f"{run['ops_per_put']:.1f}", f"{run['put_ms']:.2f}",
                          f"{run['cpu_ms_per_put']:.2f}",
                          f"{run['cpu_s_per_min_per_writer']:.2f}",
                          str(run["remeasures_all_writers"]))
    return table


def directory_table(report: dict[str, Any]) -> Table:
    table = Table(title="First walk, eviction, a disk tier's start-up over the directory")
    for name in ("chunks", "walk CPU", "evict/s", "ops per evict", "serving", "indexed",
                 "lookup", "RSS per chunk"):
        table.add_column(name, justify="right")
    for size in report["sizes"]:
        eviction, disk = size["eviction"], size.get("disk")
        cells = [f"{size['chunks']:,}", f"{size['first_open_cpu_s']:.2f} s",
                 f"{eviction['evictions_per_s']:,}", f"{eviction['ops_per_eviction']:.1f}"]
        if disk is None:
            cells += ["-"] * 4
        else:
            cells += [f"{disk['serving_after_s'] * 1e3:.0f} ms",
                      f"{disk['index_complete_s']:.2f} s",
                      f"{disk['lookup_while_loading']['ms']:.2f} ms",
                      f"{disk['rss_bytes_per_chunk']} B"]
        table.add_row(*cells)
    return table


def projection_lines(report: dict[str, Any]) -> str:
    last = report["sizes"][-1]["projection"]
    return (f"projected on NFS ({last['op_latency_ms']:g} ms a metadata round trip), "
            f"{last['chunks']:,} chunks, {last['writers']} writers: "
            f"{last['metadata_ms_per_put']:g} ms of metadata per put; one walk "
            f"{last['one_walk_s']:,} s, at most one every {last['walk_every_s']:,} s "
            f"fleet-wide (before issue 28: {last['before_walks_per_30s']} walks every 30 s, "
            f"{last['before_walk_ops_per_s']:,} ops/s)")
