"""`kvtier bench storage`: tier put/get throughput against the machine's ceilings.

A thin command over `kvtier.tools.bench.storage`: parses arguments, shows a progress bar, prints
the tables and writes the JSON. See that module for what is measured and how.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.tools.bench.storage import (
    DEFAULT_TIERS,
    MIB,
    TARGET_MIN_BYTES,
    TIERS,
    BenchConfig,
    BenchResult,
    rounds_total,
    run_bench,
    size_label,
)
from kvtier.tools.cli.argtypes import non_negative_int, output_file, positive_int, work_dir
from kvtier.units import parse_size

MAX_CHUNK_BYTES = 1 << 40  # 1 TiB: a larger chunk is a typo
QUICK = {"trials": 3, "trial_bytes": 32 * MIB, "min_chunks": 2}  # ~10 s on a 2-core VM
# (subject, op, column title) of the ceilings table
# The copy is timed twice a round, beside the puts and beside the gets, and a tier's put and
# get are each held to their own: both are shown (one column once showed the puts' alone).
CEILINGS = (("copy", "put", "copy (puts)"), ("copy", "get", "copy (gets)"),
            ("direct", "put", "O_DIRECT write"), ("direct", "get", "O_DIRECT read"),
            ("direct_1file", "put", "1-file write"), ("direct_1file", "get", "1-file read"))


CEILING_NAMES = {(subject, op): title for subject, op, title in CEILINGS} | {
    ("copy", "put"): "copy", ("copy", "get"): "copy", ("redis_raw", "put"): "raw SET",
    ("redis_raw", "get"): "raw GET", ("s3_raw", "put"): "raw PUT", ("s3_raw", "get"): "raw GET"}


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "storage", help="tier put/get GB/s against raw copy and O_DIRECT ceilings",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--tier", action="append", choices=TIERS,
                        help="tier to measure (repeatable; default: memory, disk, shared; "
                             "redis and s3 start a private server)")
    parser.add_argument("--sizes", default="0.5,2,8,32",
                        help="chunk sizes, comma-separated, in MiB or with a unit "
                             "(e.g. 512KiB); default 0.5,2,8,32")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="a temp dir is made here for the disk and shared tiers and the "
                             "O_DIRECT ceilings (default: the current directory's filesystem)")
    # The defaults' figures from where they are set (the help said "quick 64MiB" of a
    # --quick that moves 32 MiB).
    default = BenchConfig(directory=Path("."))
    parser.add_argument("--trials", type=non_negative_int,
                        help=f"timed rounds per size (default {default.trials}; quick "
                             f"{QUICK['trials']})")
    parser.add_argument("--trial-bytes", help="bytes each subject moves per round (default "
                                              f"{_mib(default.trial_bytes)}; quick "
                                              f"{_mib(QUICK['trial_bytes'])})")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="threads issuing the chunks of O_DIRECT, the disk and shared "
                             "tiers and LMCache (default 1; copy and memory stay on one)")
    parser.add_argument("--quick", action="store_true", help="a ~10 s run (CI smoke, demo)")
    parser.add_argument("--lmcache-python", metavar="PATH",
                        help="an interpreter with lmcache 0.5.6 installed: measure its "
                             "LocalDiskBackend beside kvtier")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-storage.json"),
                        help="where to write the results (default results/bench-storage.json)")
    parser.set_defaults(func=run)


def _mib(size_bytes: int) -> str:
    return f"{size_bytes // MIB}MiB"


def parse_sizes(text: str) -> tuple[int, ...]:
    """"0.5,2,512KiB" -> bytes. Bare numbers are MiB. Raises ConfigError."""
    sizes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            mib = float(part)
        except ValueError:
            sizes.append(parse_size(part, "sizes"))
            continue
        if not math.isfinite(mib) or mib * MIB > MAX_CHUNK_BYTES:  # 1e400 overflowed int()
            raise ConfigError("sizes", part, f"a finite size up to {MAX_CHUNK_BYTES // MIB} MiB")
        sizes.append(int(mib * MIB))
    if not sizes:
        raise ConfigError("sizes", text, "at least one chunk size, e.g. 0.5,2,8,32")
    return tuple(sizes)


def config_from(args: argparse.Namespace) -> BenchConfig:
    settings: dict[str, object] = dict(QUICK) if args.quick else {}
    if args.trials is not None:
        settings["trials"] = args.trials
    if args.trial_bytes is not None:
        settings["trial_bytes"] = parse_size(args.trial_bytes, "trial-bytes")
    if args.lmcache_python and not os.access(args.lmcache_python, os.X_OK):
        raise ConfigError("lmcache-python", args.lmcache_python, "an executable interpreter")
    return BenchConfig(
        directory=args.dir, sizes_bytes=parse_sizes(args.sizes),
        tiers=tuple(dict.fromkeys(args.tier)) if args.tier else DEFAULT_TIERS,
        lmcache_python=args.lmcache_python, threads=args.threads, **settings,  # type: ignore[arg-type]
    )


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    config.validate()
    tiers_log = logging.getLogger("kvtier.tiers")
    level = tiers_log.level
    if not args.verbose:  # the tiers' start-up notices would break the progress bar
        tiers_log.setLevel(logging.WARNING)
    try:
        return _run(args, config)
    finally:
        tiers_log.setLevel(level)  # as it was (a caller in the same process, e.g. a test)


def _run(args: argparse.Namespace, config: BenchConfig) -> int:
    console = Console()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("bench storage", total=rounds_total(config))
        result = run_bench(config, lambda text: progress.update(task, advance=1,
                                                                description=text))
    console.print(ceiling_table(result))
    console.print(verdict_table(result))
    console.print(summary(result))
    if result.s3_lookup:
        look = result.s3_lookup
        console.print(f"s3 lookup of a {look['chunks']:.0f}-chunk prefix "
                      f"({look['lookup_concurrency']:.0f} HEADs in flight): held "
                      f"{look['held_s'] * 1e3:.0f} ms, absent {look['absent_cold_s'] * 1e3:.0f}"
                      f" ms (again: {look['absent_cached_s'] * 1e3:.1f} ms, negative cache); "
                      f"one HEAD after another {look['held_one_by_one_s'] * 1e3:.0f} ms")
    if result.lmcache and "error" in result.lmcache:
        console.print(f"[yellow]LMCache not measured:[/] {result.lmcache['error']}")
    result.write_json(args.json, shlex.join(["kvtier", *sys.argv[1:]]))
    console.print(f"results written to {args.json}")
    return 0


def ceiling_table(result: BenchResult) -> Table:
    table = Table(title="Machine ceilings (GB/s, median of trials; O_DIRECT: a file per chunk)")
    table.add_column("chunk", justify="right")
    for _subject, _op, title in CEILINGS:
        table.add_column(title, justify="right")
    by_key = {(m.subject, m.op, m.size_bytes): m for m in result.measurements}
    for size in result.config.sizes_bytes:
        table.add_row(size_label(size), *(f"{by_key[(subject, op, size)].gbps:.2f}"
                                              for subject, op, _title in CEILINGS))
    return table


def verdict_table(result: BenchResult) -> Table:
    table = Table(title="Tiers against their ceilings (GB/s, median of trials)")
    for name, justify in (("tier", "left"), ("op", "left"), ("chunk", "right"),
                          ("GB/s", "right"), ("ceiling", "left"), ("ratio", "right"),
                          ("target", "right"), ("", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    order = ("memory", "disk", "shared", "lmcache", "redis", "s3")
    for v in sorted(result.verdicts, key=lambda v: (v.size_bytes, order.index(v.tier),
                                                    v.op == "get")):
        mark = ("[green]pass[/]" if v.passed else "[red]FAIL[/]") if v.passed is not None \
            else "[dim]-[/]"
        target = f">={v.target:g}x" if v.target is not None else "-"
        ceiling = f"{CEILING_NAMES[(v.ceiling, v.op)].removeprefix('O_DIRECT ')} " \
            f"{v.ceiling_gbps:.2f}"
        table.add_row(v.tier, v.op, size_label(v.size_bytes), f"{v.gbps:.2f}", ceiling,
                      f"{v.ratio:.2f}x", target, mark)
    return table


def summary(result: BenchResult) -> str:
    failed = [v for v in result.verdicts if v.passed is False]
    before, after = result.machine["loadavg_before"][0], result.machine["loadavg_after"][0]
    fs = result.machine["filesystem"]
    verdict = f"[red]{len(failed)} below target[/]" if failed else "[green]all targets met[/]"
    if all(v.passed is None for v in result.verdicts):  # "all targets met" of none judged
        verdict = "[yellow]no target judged[/]"
    return (f"{verdict} (targets apply to chunks >= {TARGET_MIN_BYTES / MIB:g} MiB); "
            f"{result.wall_s:.0f} s; {result.config.threads} I/O thread(s); load average "
            f"{before:.2f} -> {after:.2f} on {result.machine['cpus']} CPUs; files on "
            f"{fs['type']} ({fs['mount']})")
