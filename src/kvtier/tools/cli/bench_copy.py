"""`kvtier bench copy`: the connector's chunk movers against a raw copy of the same bytes.

Paged KV <-> host chunks, at one chunk size or a sweep of them. A thin command over
`kvtier.tools.bench.copy`, which imports torch: it is imported when the command runs, not when
`kvtier` builds its parser. Exit status 1 where loaded bytes differ from the stored ones."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK
from kvtier.tools.cli.argtypes import output_file, positive_float, positive_int
from kvtier.tools.cli.bench import given_or, run_and_report

if TYPE_CHECKING:
    from kvtier.tools.bench.copy import CopyBenchConfig, CopyBenchResult, CopySweep

CPU_BLOCKS = 64  # default scattered blocks on CPU: 128 MiB of Llama-3-8B KV each way
CUDA_BLOCKS = 512  # on CUDA: 1 GiB each way
MAX_CHUNK_MIB = 1 << 20  # 1 TiB: a larger chunk is a typo
SWEEP_CHUNK_MIB = (2.0, 4.0, 8.0, 16.0, 32.0)  # --sweep: Llama-3-8B bf16 chunks of 1-16 blocks


def mib_list(text: str) -> tuple[float, ...]:
    """`--chunk-mib`: comma-separated sizes in MiB, each > 0 and at most MAX_CHUNK_MIB."""
    sizes = tuple(positive_float(part) for part in text.split(","))
    if max(sizes) > MAX_CHUNK_MIB:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: each at most {MAX_CHUNK_MIB} MiB")
    return sizes


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "copy", help="the connector's movers (paged KV <-> pinned host chunks) vs a raw copy",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--layout",
                        help="vLLM 0.33's KV layout (kvtier.testing.vllmviews.LAYOUTS: LBNHC, "
                             "BLHNC, ...; default LBNHC on CUDA) or 'cpu' (vLLM's CPU "
                             "backend's own, the default on CPU)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "fp8"), default="bfloat16",
                        help="KV cache dtype; fp8: a uint8 cache (--kv-cache-dtype fp8)")
    parser.add_argument("--blocks", type=positive_int,
                        help=f"scattered blocks each way (default {CUDA_BLOCKS} on CUDA, "
                             f"{CPU_BLOCKS} on CPU)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="vLLM block size (16)")
    parser.add_argument("--tokens-per-chunk", type=positive_int,
                        help=f"kvtier chunk ({TOKENS_PER_CHUNK}); not with --chunk-mib or "
                             "--sweep, which set the chunks measured")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--chunk-mib", type=mib_list,
                       help="chunk sizes in MiB, comma-separated (each a whole number of "
                            "blocks): one measurement each, instead of --tokens-per-chunk")
    sizes.add_argument("--sweep", action="store_true",
                       help="--chunk-mib " + ",".join(f"{m:g}" for m in SWEEP_CHUNK_MIB))
    parser.add_argument("--layers", type=positive_int, default=32,
                        help="model layers (Llama-3-8B: 32)")
    parser.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads (8)")
    parser.add_argument("--head-size", type=positive_int, default=128, help="head size (128)")
    parser.add_argument("--trials", type=positive_int, help="timed trials (5)")
    parser.add_argument("--threads", type=positive_int,
                        help="torch CPU threads (default: torch's; 1 is steadier on a busy "
                             "machine)")
    parser.add_argument("--quick", action="store_true", help="2 trials, 32 blocks (unless given)")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-copy.json"),
                        help="where to write the results (default results/bench-copy.json)")
    parser.add_argument("--markdown", type=output_file,
                        help="also write the chunk-size table as markdown there")
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> CopyBenchConfig:
    from kvtier.tools.bench.copy import CopyBenchConfig

    if args.tokens_per_chunk is not None and (args.sweep or args.chunk_mib):
        raise ConfigError("--tokens-per-chunk", args.tokens_per_chunk, "not with "
                          "--chunk-mib or --sweep, which set the chunk sizes measured")
    base = CopyBenchConfig(device=args.device)
    blocks = args.blocks or (32 if args.quick else
                             CUDA_BLOCKS if base.resolved_device() == "cuda" else CPU_BLOCKS)
    return CopyBenchConfig(device=args.device, layout=args.layout, layers=args.layers,
                           kv_heads=args.kv_heads, head_size=args.head_size, dtype=args.dtype,
                           block_size=args.block_size,
                           tokens_per_chunk=args.tokens_per_chunk or TOKENS_PER_CHUNK,
                           chunk_mib=SWEEP_CHUNK_MIB if args.sweep else args.chunk_mib or (),
                           blocks=blocks, trials=given_or(args.trials, args.quick, 2, 5),
                           threads=args.threads)


def run(args: argparse.Namespace) -> int:
    from kvtier.tools.bench.copy import run_copy_sweep

    config = config_from(args)
    config.validate()

    def write(sweep: CopySweep) -> None:
        sweep.write_json(args.json)
        if args.markdown:
            args.markdown.write_text(markdown(sweep))

    sweep = run_and_report("copy", lambda progress: run_copy_sweep(config, progress),
                           render, write, args.json)
    return 0 if sweep.verified else 1


def render(sweep: CopySweep) -> list[Table | str]:
    """The chunk-size table; with one chunk size, every figure too; the verdict."""
    items: list[Table | str] = [sizes_table(sweep)]
    if len(sweep.results) == 1:
        items.append(table(sweep.results[0]))
    return [*items, runner_line(sweep), summary(sweep)]


def _title(result: CopyBenchResult) -> str:
    c = result.config
    mib = result.figures[0].bytes_moved / 2**20
    return (f"{c.blocks} scattered blocks of {c.block_size} tokens ({mib:.0f} MiB, "
            f"{c.dtype}) on {result.device}, {result.kv_layout} layout; GB/s, median of "
            f"{c.trials} trials")


def _columns() -> tuple[str, ...]:
    """GB/s but for the ratios and the runner: store (device -> host) and load (host ->
    device), each beside its raw copies; the last column: the verdict against the target."""
    from kvtier.tools.bench.copy import TARGET_RATIO

    return ("MiB", "store", "raw", "chunked", "ratio", "load", "raw", "chunked", "ratio",
            "runner ms", f"{TARGET_RATIO}x")


def _legend(sweep: CopySweep) -> str:
    from kvtier.tools.bench.copy import TARGET_RATIO

    runner = sweep.results[0].runner
    chunks = f"a step's {runner.chunks} chunks" if runner else "a step's stores"
    return ("Per chunk size (MiB): store (device -> host) and load (host -> device) GB/s "
            "beside a raw copy of the same bytes (one copy; chunked: one copy a chunk); "
            f"ratio: to the one copy, target >= {TARGET_RATIO}x. Runner ms: runner blocked, "
            f"X/Y: the ms the caller spends handing {chunks} to a store thread (mark + "
            "submit), of the job's ms.")


def _rows(sweep: CopySweep) -> list[list[str]]:
    """One row per chunk size (see `_columns`)."""
    rows = []
    for r in sweep.results:
        gbps = {f.name: f"{f.gbps:.2f}" for f in r.figures}
        runner = r.runner
        rows.append([
            f"{r.chunk_bytes / 2**20:g}",
            gbps["store"], gbps["raw out"], gbps["raw out, chunked"], f"{r.ratios['store']:.2f}x",
            gbps["load"], gbps["raw in"], gbps["raw in, chunked"], f"{r.ratios['load']:.2f}x",
            "-" if runner is None else f"{runner.blocked_s * 1e3:.2f}/{runner.job_s * 1e3:.1f}",
            ("PASS" if r.passed else "FAIL") if r.verified else "DIFFER",
        ])
    return rows


def sizes_table(sweep: CopySweep) -> Table:
    """One row per chunk size, sized to fit 80 columns (a pipe's width): one space between
    columns, no edges, so that GB/s of two digits, a runner of 100 ms and a verdict of
    "DIFFER" (loaded bytes differ) still fit; rich cuts what does not fit to "…"."""
    table = Table(title=_title(sweep.results[0]), caption=_legend(sweep), box=box.SIMPLE,
                  padding=0, show_edge=False)
    for name in _columns():
        table.add_column(name, justify="right", no_wrap=True)
    for row in _rows(sweep):
        table.add_row(*row)
    return table


def markdown(sweep: CopySweep) -> str:
    """The chunk-size table as markdown, under its title and legend."""
    columns = _columns()
    lines = [_title(sweep.results[0]) + ".", "", _legend(sweep), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(sweep)]
    return "\n".join([*lines, "", runner_line(sweep), ""])


def table(result: CopyBenchResult) -> Table:
    """Every figure of one chunk size."""
    table = Table(title=_title(result))
    for name, justify in (("what", "left"), ("GB/s", "right"), ("ms", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for f in result.figures:
        ms = f.bytes_moved / f.gbps / 1e6
        table.add_row(f.name, f"{f.gbps:.2f}", f"{ms:.1f}")
    return table


def runner_line(sweep: CopySweep) -> str:
    """"runner blocked: X ms of Y ms", per chunk size."""
    parts = [f"{r.runner.blocked_s * 1e3:.2f} ms of {r.runner.job_s * 1e3:.1f} ms "
             f"({r.runner.chunks} x {r.chunk_bytes / 2**20:g} MiB)"
             for r in sweep.results if r.runner is not None]
    return "runner blocked (a step's stores handed to a store thread): " + "; ".join(parts)


def summary(sweep: CopySweep) -> str:
    from kvtier.tools.bench.copy import TARGET_RATIO

    first = sweep.results[0]
    below = [f"{r.chunk_bytes / 2**20:g}" for r in sweep.results if not r.passed]
    mark = "[green]target met[/]" if sweep.passed else \
        f"[red]below target at {', '.join(below)} MiB[/]"
    check = "verified" if sweep.verified else "[red]LOADED BYTES DIFFER[/]"
    return (f"store and load >= {TARGET_RATIO}x raw: {mark}; bytes {check}; "
            f"all layers in one op: {first.single_allocation}; "
            f"load average {first.machine['loadavg'][0]:.2f} on {first.machine['cpus']} CPUs")
