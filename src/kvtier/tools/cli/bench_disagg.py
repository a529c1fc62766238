"""`kvtier bench disagg`: disaggregated prefill (a prefill and a decode instance sharing
kvtier's shared tier, behind `kvtier proxy`) vs one instance, under a mixed workload: the
streams' inter-token latency and the long arrivals' TTFT and ITL (issue 16). A thin command
over `kvtier.tools.bench.disagg`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from kvtier.testing.engines import quiet_engine_logs
from kvtier.tools.bench.disagg import (
    SETUPS,
    DisaggBenchConfig,
    DisaggResult,
    SetupRun,
    run_disagg_bench,
)
from kvtier.tools.cli.argtypes import (
    AppendOnce,
    finite_float,
    non_negative_int,
    output_dir,
    output_file,
    work_dir,
)
from kvtier.tools.cli.bench import ms_p50_p99, run_and_report, run_summary, runs_table

# ~4 minutes on 2 cores, most of it the three server start-ups.
QUICK = {"streams": 2, "stream_tokens": 128, "arrivals": 4, "arrival_tokens": 2048}


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "disagg", help="disaggregated prefill through kvtier vs one instance: streams' ITL, "
        "long arrivals' TTFT and ITL",
        description=__doc__.split("\n\n")[0])
    defaults = DisaggBenchConfig(Path("."), Path("."))
    parser.add_argument("--setup", action=AppendOnce, choices=SETUPS,
                        help=f"setup to run (repeatable; default {', '.join(SETUPS)})")
    parser.add_argument("--streams", type=non_negative_int,
                        help=f"K decoding streams ({defaults.streams})")
    parser.add_argument("--stream-tokens", type=non_negative_int,
                        help=f"tokens each stream generates ({defaults.stream_tokens})")
    parser.add_argument("--arrivals", type=non_negative_int,
                        help=f"M long prompts ({defaults.arrivals})")
    parser.add_argument("--arrival-tokens", type=non_negative_int,
                        help=f"each arrival's prompt ({defaults.arrival_tokens})")
    parser.add_argument("--gap-s", type=finite_float, dest="arrival_gap_s",
                        help=f"seconds between arrivals ({defaults.arrival_gap_s})")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="a scratch dir (server logs, the shared tier) is made here")
    parser.add_argument("--model-root", type=output_dir, default=Path(".kvtier-models"),
                        help="where the generated bench model is cached")
    parser.add_argument("--quick", action="store_true",
                        help="2 streams, 4 arrivals of 2048 tokens (~4 min)")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-disagg.json"))
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> DisaggBenchConfig:
    """The settings: --quick's, then any flag given. Raises ConfigError."""
    settings: dict[str, object] = dict(QUICK) if args.quick else {}
    for name in ("streams", "stream_tokens", "arrivals", "arrival_tokens", "arrival_gap_s"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.setup:
        settings["setups"] = tuple(args.setup)
    config = DisaggBenchConfig(directory=args.dir, model_root=args.model_root,
                               **settings)  # type: ignore[arg-type]
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    """Returns 0, or 1 when a request failed."""
    config = config_from(args)
    if not args.verbose:
        quiet_engine_logs()
    result = run_and_report("disagg", lambda progress: run_disagg_bench(config, progress),
                            lambda r: (figures_table(r), summary(r)),
                            lambda r: r.write_json(args.json), args.json)
    return 1 if any(run.failures for run in result.runs) else 0


def figures_table(result: DisaggResult) -> Table:
    """One column per setup."""
    c = result.config
    rows: tuple[tuple[str, Callable[[SetupRun], str]], ...] = (
        ("streams' ITL p50 / p99, arrivals coming (ms)", lambda r: ms_p50_p99(r.stream_itl)),
        ("arrivals' TTFT p50 / p99 (ms)", lambda r: ms_p50_p99(r.ttft)),
        ("arrivals' ITL p50 / p99 (ms)", lambda r: ms_p50_p99(r.arrival_itl)),
        ("external hit tokens (answering server)", lambda r: f"{r.external_hit_tokens:,.0f}"),
        ("arrival window (s)", lambda r: "{:.1f}-{:.1f}".format(*r.window_s)),
        ("failed requests", lambda r: str(len(r.failures))),
        ("servers' start (s)", lambda r: f"{r.startup_s:.0f}"),
    )
    return runs_table(f"{c.streams} streams x {c.stream_tokens} tokens; {c.arrivals} new "
                      f"{c.arrival_tokens}-token prompts {c.arrival_gap_s:g} s apart, "
                      f"{c.arrival_max_tokens} tokens each", result.runs, rows)


def summary(result: DisaggResult) -> str:
    return run_summary(result.wall_s, result.machine, result.runs)
