"""`kvtier bench copy`: the connector's worker copy path (paged KV <-> host chunks) against a
raw contiguous copy of the same bytes. A thin command over `kvtier.bench.copy`, which imports
torch: it is imported when the command runs, not when `kvtier` builds its parser."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from kvtier.cli.argtypes import output_file
from kvtier.cli.bench import run_and_report
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK

if TYPE_CHECKING:
    from kvtier.bench.copy import CopyBenchConfig, CopyBenchResult

CPU_BLOCKS = 64  # default scattered blocks on CPU: 128 MiB of Llama-3-8B KV each way
CUDA_BLOCKS = 512  # on CUDA: 1 GiB each way


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "copy", help="worker copy path (paged KV <-> pinned host chunks) vs a raw copy",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--blocks", type=int,
                        help=f"scattered blocks each way (default {CUDA_BLOCKS} on CUDA, "
                             f"{CPU_BLOCKS} on CPU)")
    parser.add_argument("--block-size", type=int, default=16, help="vLLM block size (16)")
    parser.add_argument("--tokens-per-chunk", type=int, default=TOKENS_PER_CHUNK,
                        help=f"kvtier chunk ({TOKENS_PER_CHUNK})")
    parser.add_argument("--layers", type=int, default=32, help="model layers (Llama-3-8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (8)")
    parser.add_argument("--head-size", type=int, default=128, help="head size (128)")
    parser.add_argument("--trials", type=int, default=5, help="timed trials (5)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's; 1 is steadier on a busy "
                             "machine)")
    parser.add_argument("--quick", action="store_true", help="2 trials, 32 blocks")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-copy.json"),
                        help="where to write the results (default results/bench-copy.json)")
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> CopyBenchConfig:
    from kvtier.bench.copy import CopyBenchConfig

    base = CopyBenchConfig(device=args.device)
    blocks = args.blocks or (32 if args.quick else
                             CUDA_BLOCKS if base.resolved_device() == "cuda" else CPU_BLOCKS)
    return CopyBenchConfig(device=args.device, layers=args.layers, kv_heads=args.kv_heads,
                           head_size=args.head_size, block_size=args.block_size,
                           tokens_per_chunk=args.tokens_per_chunk, blocks=blocks,
                           trials=2 if args.quick else args.trials,
                           threads=args.threads)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.copy import run_copy_bench

    config = config_from(args)
    config.validate()
    run_and_report("copy", lambda progress: run_copy_bench(config, progress),
                   lambda r: (table(r), summary(r)), lambda r: r.write_json(args.json),
                   args.json)
    return 0


def table(result: CopyBenchResult) -> Table:
    c = result.config
    mib = result.figures[0].bytes_moved / 2**20
    table = Table(title=f"{c.blocks} scattered blocks of {c.block_size} tokens "
                        f"({mib:.0f} MiB) on {result.device}, {result.kv_layout} layout; "
                        "GB/s, median of trials")
    for name, justify in (("what", "left"), ("GB/s", "right"), ("ms", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for f in result.figures:
        ms = f.bytes_moved / f.gbps / 1e6
        table.add_row(f.name, f"{f.gbps:.2f}", f"{ms:.1f}")
    return table


def summary(result: CopyBenchResult) -> str:
    from kvtier.bench.copy import TARGET_RATIO

    parts = [f"{name} {ratio:.2f}x raw" for name, ratio in result.ratios.items()]
    mark = "[green]target met[/]" if result.passed else "[red]below target[/]"
    check = "verified" if result.verified else "[red]LOADED BYTES DIFFER[/]"
    return (f"{', '.join(parts)} (target >= {TARGET_RATIO}x): {mark}; bytes {check}; "
            f"all layers in one op: {result.single_allocation}; "
            f"load average {result.machine['loadavg'][0]:.2f} on {result.machine['cpus']} CPUs")
