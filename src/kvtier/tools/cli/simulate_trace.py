"""`kvtier simulate --trace FILE`: a request trace replayed through kvtier's eviction policies.

    kvtier simulate --trace ../shared/traces/mooncake_conversation_trace.jsonl
    kvtier simulate --trace T.jsonl --capacity 1M,3M --policies lru,arc,prefix --json
    kvtier simulate --trace T.jsonl --plot hit-ratio.png
    kvtier simulate --trace T.jsonl --engines 2 --router round_robin   # + pooled vs private
    kvtier simulate --workload agent --requests 20000 --write-trace agent.jsonl  # then --trace

`--capacity` and `--policies` go only with `--trace`, `--trace-block-tokens` with `--trace`
or `--write-trace` (given elsewhere they are refused: `simulate.refuse_unused`). A trace
written by `--write-trace` records its block size: replayed, it needs no
`--trace-block-tokens`.

Trace formats: `kvtier.tools.sim.trace`; the replay: `kvtier.tools.sim.replay`; the optimum
and its exact meaning: `kvtier.tools.sim.optimum`. Prefill seconds come from the `--model`,
`--gpu` and `--tp` cost model of `kvtier simulate` (`CostModel.prefill_s`).

Primitives: `add_trace_arguments(parser)`, `run_trace(args)`, `write_trace(args, config)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from kvtier.tools.cli.argtypes import any_path, output_file, positive_int
from kvtier.tools.sim.replay import PolicySpec, Progress, parse_policy
from kvtier.tools.sim.trace import DEFAULT_BLOCK_TOKENS
from kvtier.tools.sim.tracesweep import TraceSweep, parse_tokens

if TYPE_CHECKING:
    from kvtier.tools.sim.pooling import Pooling
    from kvtier.tools.sim.workload import WorkloadConfig

DEFAULT_CAPACITIES = "300k,1M,3M,10M,30M"
DEFAULT_POLICIES = "lru,arc,lru+admit2,prefix"


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The trace mode's options, on `kvtier simulate`'s parser."""
    p.add_argument("--trace", type=any_path, metavar="FILE.jsonl",
                   help="replay a request trace (Mooncake's format, or tokens / block_hashes "
                        "per line) through kvtier's policies: hit ratio vs capacity")
    # Lists that add up when repeated: `--capacity 1M --capacity 3M` replayed 3M alone.
    p.add_argument("--capacity", metavar="TOKENS,...", action="append",
                   help="with --trace: cache capacities in tokens, each at least one block "
                        f"(default {DEFAULT_CAPACITIES}; repeat to add more)")
    p.add_argument("--policies", metavar="POLICY,...", action="append",
                   help="with --trace: eviction policies, each optionally +admitN "
                        f"(default {DEFAULT_POLICIES}; repeat to add more)")
    p.add_argument("--trace-block-tokens", type=positive_int,
                   help="with --trace: tokens a trace block (a chunk) holds (default: the size "
                        f"the trace records, else {DEFAULT_BLOCK_TOKENS}, Mooncake's); with "
                        f"--write-trace: the blocks to write (default {DEFAULT_BLOCK_TOKENS})")
    p.add_argument("--write-trace", type=output_file, metavar="FILE.jsonl",
                   help="write the --workload's traffic (--requests, --seed, blocks of "
                        "--trace-block-tokens, which the trace records) as a trace for "
                        "--trace, and exit")


def run_trace(args: argparse.Namespace) -> int:
    """Replay the trace the arguments name and report; returns the exit code.

    Raises:
        ConfigError: an unreadable trace, a bad capacity, policy, model or GPU.
    """
    from kvtier.tools.ops.hardware import gpu_profile
    from kvtier.tools.sim.cost import build_cost_model, model_spec
    from kvtier.tools.sim.trace import read_trace
    from kvtier.tools.sim.tracesweep import sweep_trace

    policies = DEFAULT_POLICIES if args.policies is None else ",".join(args.policies)
    capacity = DEFAULT_CAPACITIES if args.capacity is None else ",".join(args.capacity)
    # each once: "lru,lru" replayed the trace twice into two columns of the same name
    specs = [parse_policy(name) for name in
             dict.fromkeys(name.strip() for name in policies.split(",") if name.strip())]
    capacities = list(dict.fromkeys(parse_tokens(text) for text in capacity.split(",")
                                    if text.strip()))
    cost = build_cost_model(model_spec(args.model), gpu_profile(args.gpu), args.tp)
    trace = read_trace(args.trace, args.trace_block_tokens, args.requests)
    if args.engines > 1:  # before the sweep's minutes, not after them
        from kvtier.tools.sim.pooling import check_capacity

        for tokens in capacities:
            check_capacity(tokens, trace.block_tokens, args.engines)
    total = len(trace.requests) * len(capacities) * (len(specs) + 1)
    sweep = _with_progress(lambda done: sweep_trace(trace, specs, capacities, cost, done),
                           args.json, total)
    if args.plot:
        from kvtier.tools.sim.plot import plot_trace

        plot_trace(sweep, args.plot)
    pooling = []
    if args.engines > 1:  # one cache for the node's engines against one each (issue 43)
        from kvtier.tools.sim.pooling import compare

        pooling = [compare(trace, specs[0], capacity // trace.block_tokens, cost, args.engines,
                           args.router) for capacity in capacities]
    if args.json:
        print(json.dumps({**sweep.to_dict(), "pooling": [
            {**asdict(p), "gain": p.gain} for p in pooling]}, indent=2))
    else:
        _print(sweep, specs)
        if pooling:
            _print_pooling(pooling, specs[0])
        if args.plot:  # where the image went (--json keeps stdout to the JSON)
            print(f"plot written to {args.plot}")
    return 0


def write_trace(args: argparse.Namespace, config: WorkloadConfig, requests: int) -> int:
    """`--write-trace FILE`: the workload's traffic as a trace; returns the exit code.

    Raises:
        ConfigError: a bad block size.
    """
    from kvtier.tools.sim.trace import write_workload_trace

    block_tokens = args.trace_block_tokens or DEFAULT_BLOCK_TOKENS  # positive when given
    written = write_workload_trace(config, requests, block_tokens, args.seed, args.write_trace)
    print(f"{args.write_trace}: {written:,} requests of the {args.workload} workload, blocks "
          f"of {block_tokens} tokens, recorded in the trace (kvtier simulate --trace "
          f"{args.write_trace})")
    return 0


def _print_pooling(pooling: list[Pooling], spec: PolicySpec) -> None:
    from rich.console import Console
    from rich.table import Table

    first = pooling[0]
    table = Table(title=f"{first.engines} engines, {first.route} routing, {spec.name}: one "
                        "cache for all (kvtier node) vs one each, same total bytes\n"
                        "token hit ratio")
    for column in ("capacity (tokens, in all)", "pooled", "private", "pooled / private"):
        table.add_column(column, justify="right")
    for p in pooling:
        table.add_row(f"{p.capacity_tokens:,}", f"{p.pooled_hit_ratio:.1%}",
                      f"{p.private_hit_ratio:.1%}",
                      "-" if p.gain is None else f"{p.gain:.2f}x")
    Console().print(table)


def _with_progress(work: Callable[[Progress], TraceSweep], quiet: bool,
                   total: int) -> TraceSweep:
    if quiet or not sys.stderr.isatty():
        return work(lambda done: None)
    from rich.progress import Progress as Bar

    with Bar(transient=True) as bar:
        task = bar.add_task("replaying", total=total)
        return work(lambda done: bar.advance(task, done))


def _print(sweep: TraceSweep, specs: list[PolicySpec]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier simulate --trace {sweep.trace}: {sweep.requests:,} requests, "
                        f"{sweep.input_tokens:,} prompt tokens, blocks of {sweep.block_tokens}\n"
                        "token hit ratio (its fraction of the optimum)")
    table.add_column("capacity (tokens)", justify="right")
    for spec in specs:
        table.add_column(spec.name, justify="right")
    table.add_column("optimum", justify="right")
    table.add_column("unbounded", justify="right")
    for point in sweep.points:
        table.add_row(f"{point.capacity_tokens:,}",
                      *[f"{r.hit_ratio:.1%} ({point.of_optimum(r):.0%})" for r in point.policies],
                      f"{point.optimum.hit_ratio:.1%}", f"{sweep.unbounded.hit_ratio:.1%}")
    saved = Table(title=f"prefill saved: tokens, and compute seconds on {sweep.cost_model} "
                        "(cost grows with position)")
    saved.add_column("capacity (tokens)", justify="right")
    for name in [s.name for s in specs] + ["optimum"]:
        saved.add_column(name, justify="right")
    for point in sweep.points:
        saved.add_row(f"{point.capacity_tokens:,}",
                      *[f"{_tokens(r.hit_tokens)} / {_seconds(r.prefill_s_saved)}"
                        for r in (*point.policies, point.optimum)])
    un = sweep.unbounded
    console = Console()
    console.print(table)
    console.print(saved)
    console.print(f"unbounded: {_tokens(un.hit_tokens)} tokens, {_seconds(un.prefill_s_saved)} "
                  f"of {_seconds(un.prefill_s_total)} of prefill. The optimum is Belady's MIN over "
                  "blocks with the prefix constraint: the exact optimum of hit blocks at that "
                  "capacity (kvtier.tools.sim.optimum).")


def _tokens(count: int) -> str:
    """Millions for a production trace; a small one's count whole (912 tokens read 0.0M)."""
    return f"{count / 1e6:,.1f}M" if count >= 100_000 else f"{count:,}"


def _seconds(seconds: float) -> str:
    """Whole seconds, or two significant digits below 10 s (0.032 s of prefill read 0 s)."""
    return f"{seconds:,.0f} s" if seconds >= 10 or seconds == 0 else f"{seconds:.2g} s"
