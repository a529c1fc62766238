"""`kvtier bench disk-load`: a disk-tier hit's load through the worker's own path (the CPU
mover, reads and copies overlapped) against a raw O_DIRECT read of the same bytes, and a
miss's store against a raw O_DIRECT write, no engine needed. A thin command over
`kvtier.tools.bench.diskload`, imported when the command runs."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from kvtier.tools.cli.argtypes import output_file, positive_int, work_dir
from kvtier.tools.cli.bench import given_or, run_and_report

if TYPE_CHECKING:
    from kvtier.tools.bench.diskload import DiskLoadResult


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "disk-load", help="a disk hit's load (reads + copy into blocks) vs a raw O_DIRECT "
                          "read of the same bytes, and a store vs a raw write (no engine)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", default="4,16",
                        help="chunks a load, comma-separated (4,16: 1k and 4k tokens of "
                             "`bench ttft`'s model, 2 MiB a chunk)")
    parser.add_argument("--trials", type=positive_int, help="timed loads (15)")
    # work_dir: probed now; `--dir /proc` (or a file) was a traceback once the run began.
    parser.add_argument("--dir", type=work_dir, default=None,
                        help="a directory where a temp dir is made for the disk tier and the "
                             "raw files (default: the system's temp dir)")
    parser.add_argument("--quick", action="store_true", help="5 trials (unless given)")
    parser.add_argument("--json", type=output_file,
                        default=Path("results/bench-disk-load.json"),
                        help="where to write the results (default "
                             "results/bench-disk-load.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError
    from kvtier.tools.bench.diskload import DiskLoadConfig, run_disk_load_bench

    try:
        chunks = tuple(int(c) for c in args.chunks.split(","))
    except ValueError:
        raise ConfigError("--chunks", args.chunks, "comma-separated chunk counts") from None
    config = DiskLoadConfig(chunks=chunks, trials=given_or(args.trials, args.quick, 5, 15),
                            directory=args.dir)
    config.validate()  # before the spinner: a size that cannot fit, in one line
    result = run_and_report("disk-load", lambda progress: run_disk_load_bench(config, progress),
                            render, lambda r: r.write_json(args.json), args.json)
    return 0 if result.verified else 1


def render(result: DiskLoadResult) -> Iterable[Any]:
    from kvtier.tools.bench.diskload import TARGET_VS_RAW

    table = Table(title=f"disk-tier loads of {result.chunk_bytes >> 20} MiB chunks, ms "
                        f"(median of {result.config.trials} trials; O_DIRECT "
                        f"{'on' if result.o_direct else 'off: buffered reads'})")
    for column in ("chunks", "MiB", "load", "read wait", "copy", "raw O_DIRECT", "load / raw",
                   f"<= {TARGET_VS_RAW}x raw"):
        table.add_column(column, justify="right")
    for p in result.points:
        table.add_row(str(p.chunks), f"{p.nbytes / 2**20:.0f}", f"{p.load_s * 1e3:.1f}",
                      f"{p.read_wait_s * 1e3:.1f}", f"{p.copy_s * 1e3:.1f}",
                      f"{p.raw_s * 1e3:.1f}", f"{p.ratio:.2f}x",
                      "pass" if p.meets_target else "FAIL")
    yield table
    stores = Table(title="disk-tier stores of as many new chunks (gathered from the blocks, "
                         "until on disk), ms (medians)")
    for column in ("chunks", "store", "CPU (all threads)", "CPU a chunk", "raw O_DIRECT write",
                   "store / raw"):
        stores.add_column(column, justify="right")
    for p in result.points:
        stores.add_row(str(p.chunks), f"{p.store_s * 1e3:.1f}", f"{p.store_cpu_s * 1e3:.1f}",
                       f"{p.store_cpu_s / p.chunks * 1e3:.2f}", f"{p.raw_write_s * 1e3:.1f}",
                       f"{p.store_ratio:.2f}x")
    yield stores
    yield ("loads verified byte for byte" if result.verified
           else "[red]loaded bytes differ from the stored ones[/red]")
