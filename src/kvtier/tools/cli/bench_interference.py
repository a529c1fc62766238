"""`kvtier bench interference`: the running streams' inter-token latency and the arriving
requests' TTFT while the arrivals' prefixes load from the disk tier (or, `--tier redis`, from a
redis tier across an emulated network, or, `--tier memory`, from a memory tier that holds them
all), for vLLM alone, kvtier with synchronous loads and kvtier with asynchronous loads (issue
13). A thin command over `kvtier.tools.bench.interference`.

Throughput with 0% hits (kvtier on / off) is not measured here: `kvtier bench ttft` measures
it, paired within one engine (its "0%-hit throughput" check)."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.testing.engines import quiet_engine_logs
from kvtier.tools.bench.interference import (
    CHOICES,
    CONFIGS,
    TIERS,
    ConfigRun,
    InterferenceConfig,
    InterferenceResult,
    checks,
    run_interference_bench,
)
from kvtier.tools.bench.serving.stalls import STALL_S
from kvtier.tools.cli.argtypes import (
    AppendOnce,
    finite_float,
    non_negative_int,
    output_dir,
    output_file,
    work_dir,
)
from kvtier.tools.cli.bench import ms_p50_p99, run_and_report, run_summary, runs_table

# ~3 minutes on 2 cores, most of it the three server start-ups.
QUICK = {"streams": 2, "stream_tokens": 128, "arrivals": 4, "prefix_tokens": (4096,)}
THROUGHPUT_NOTE = ("0%-hit throughput, kvtier on / off: measured by `kvtier bench ttft` "
                   "(check \"0%-hit throughput, kvtier on / off (paired)\"), not repeated here")


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "interference", help="streams' ITL and arrivals' TTFT while prefixes load from disk "
        "(or redis): vLLM vs kvtier sync vs async loads",
        description="Streams' inter-token latency and arrivals' TTFT while the arrivals' "
        "prefixes load from kvtier's disk tier (or a redis tier across an emulated network): "
        "vLLM alone, kvtier sync loads, async loads.")
    defaults = InterferenceConfig(Path("."), Path("."))
    parser.add_argument("--config", action=AppendOnce, choices=CHOICES,
                        help=f"configuration to run (repeatable; default {', '.join(CONFIGS)})")
    parser.add_argument("--streams", type=non_negative_int,
                        help=f"K decoding streams ({defaults.streams})")
    parser.add_argument("--stream-tokens", type=non_negative_int,
                        help=f"tokens each stream generates ({defaults.stream_tokens})")
    parser.add_argument("--arrivals", type=non_negative_int,
                        help=f"M arriving requests ({defaults.arrivals})")
    parser.add_argument("--gap-s", type=finite_float, dest="arrival_gap_s",
                        help=f"seconds between arrivals ({defaults.arrival_gap_s})")
    parser.add_argument("--prefix-tokens",
                        help="arrivals' prefix lengths, comma-separated, cycled; multiples of "
                             "256 (" + ",".join(map(str, defaults.prefix_tokens)) + ")")
    parser.add_argument("--memory-chunks", type=non_negative_int, dest="memory_tier_chunks",
                        help="kvtier's memory tier (the node's, for kvtier-node), in chunks "
                             f"({defaults.memory_tier_chunks}; --tier memory sizes it to hold "
                             "every prefix)")
    parser.add_argument("--tier", choices=TIERS,
                        help="the tier the arrivals' prefixes come back from, below a "
                             f"{defaults.memory_tier_chunks}-chunk memory tier ({defaults.tier}); "
                             "redis: a private redis-server behind a delaying, bandwidth-capped "
                             "proxy on 127.0.0.1; memory: no tier below, a memory tier that "
                             "holds every prefix")
    parser.add_argument("--net-delay-ms", type=finite_float, dest="net_delay_ms", metavar="MS",
                        help="--tier redis: the emulated network's one-way delay, ms "
                             f"({defaults.net_delay_ms:g}: a round trip of "
                             f"{2 * defaults.net_delay_ms:g} ms, a server in the same datacenter)")
    parser.add_argument("--net-gbps", type=finite_float, dest="net_bandwidth_gbps", metavar="GBPS",
                        help="--tier redis: the emulated network's bandwidth per direction, "
                             f"Gbit/s ({defaults.net_bandwidth_gbps:g})")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="a scratch dir (server logs, disk tiers, redis) is made here")
    parser.add_argument("--model-root", type=output_dir, default=Path(".kvtier-models"),
                        help="where the generated bench model is cached")
    parser.add_argument("--quick", action="store_true",
                        help="2 streams, 4 arrivals, 4k-token prefixes (~3 min)")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-interference.json"))
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> InterferenceConfig:
    """The settings: --quick's, then any flag given. Raises ConfigError."""
    settings: dict[str, object] = dict(QUICK) if args.quick else {}
    for name in ("streams", "stream_tokens", "arrivals", "arrival_gap_s", "tier",
                 "net_delay_ms", "net_bandwidth_gbps", "memory_tier_chunks"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    for name in ("net_delay_ms", "net_bandwidth_gbps"):
        if getattr(args, name) is not None and settings.get("tier") != "redis":
            raise ConfigError(name, getattr(args, name), "only with --tier redis")
    if args.memory_tier_chunks is not None and settings.get("tier") == "memory":
        raise ConfigError("--memory-chunks", args.memory_tier_chunks, "not with --tier memory "
                          "(its memory tier is sized to hold every prefix)")
    if args.prefix_tokens is not None:
        try:
            settings["prefix_tokens"] = tuple(int(t) for t in args.prefix_tokens.split(",") if t)
        except ValueError:
            raise ConfigError("prefix_tokens", args.prefix_tokens,
                              "integers, e.g. 4096,8192") from None
    if args.config:
        settings["configs"] = tuple(args.config)
    config = InterferenceConfig(directory=args.dir, model_root=args.model_root,
                                **settings)  # type: ignore[arg-type]
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    """Returns 0, or 1 when a request failed."""
    config = config_from(args)
    if not args.verbose:
        quiet_engine_logs()
    result = run_and_report("interference",
                            lambda progress: run_interference_bench(config, progress),
                            lambda r: (figures_table(r), target_table(r), summary(r)),
                            lambda r: r.write_json(args.json), args.json)
    return 1 if any(run.failures for run in result.runs) else 0


def figures_table(result: InterferenceResult) -> Table:
    """One column per configuration."""
    c = result.config
    rows: tuple[tuple[str, Callable[[ConfigRun], str]], ...] = (
        ("streams' ITL p50 / p99, no arrivals (ms)", lambda r: ms_p50_p99(r.baseline_itl)),
        ("streams' ITL p50 / p99, with arrivals (ms)", lambda r: ms_p50_p99(r.itl)),
        ("ITL p99 with / without", lambda r: _x(r.itl_p99_ratio)),
        ("arrivals' TTFT p50 / p99 (ms)", lambda r: ms_p50_p99(r.ttft)),
        ("  those no machine stall touched (ms)", lambda r: (
            f"{ms_p50_p99(r.unstalled_ttft)} ({len(r.unstalled_arrivals)} of {len(r.arrivals)})")),
        (f"machine stalls >= {STALL_S * 1000:.0f} ms, arrival window", _stalls),
        ("arrival window (s)", lambda r: "{:.1f}-{:.1f}".format(*r.window_s)),
        ("streams decode through it", lambda r: "yes" if r.streams_cover_window else "NO"),
        ("kvtier tokens loaded", lambda r: f"{r.counter('loaded_tokens_total'):,.0f}"),
        ("kvtier async loads", lambda r: f"{r.counter('async_loads_total'):,.0f}"),
        ("kvtier load seconds, inline / async", lambda r: "{:.3f} / {:.3f}".format(
            r.counter("load_seconds_total"), r.counter("async_load_seconds_total"))),
        ("failed requests", lambda r: str(len(r.failures))),
        ("tokens per stream, timed phase", lambda r: str(r.timed_stream_tokens)),
        ("server start / warm-up (s)", lambda r: f"{r.startup_s:.0f} / {r.warmup_s:.0f}"),
    )
    if c.tier == "redis":
        rows += (("redis PING through the network, idle (ms)",
                  lambda r: "-" if r.ping_ms is None else f"{r.ping_ms:.2f}"),)
    return runs_table(f"{c.streams} streams x {c.stream_tokens} tokens; {c.arrivals} arrivals "
                      f"{c.arrival_gap_s:g} s apart, prefixes "
                      f"{'/'.join(map(str, c.prefix_tokens))} tokens from {c.source}",
                      result.runs, rows)


def _stalls(run: ConfigRun) -> str:
    """The machine's stops while the arrivals came (a loaded machine has none this long)."""
    stalls = run.stalls_in_window
    if not stalls:
        return "none"
    text = f"{len(stalls)}, longest {max(s.seconds for s in stalls) * 1000:,.0f} ms"
    causes = Counter(s.cause for s in stalls if s.cause is not None)
    if causes:  # what went on through them (stalls.Stall.cause)
        text += "; " + ", ".join(f"{n} {cause}" for cause, n in sorted(causes.items()))
    return text


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def target_table(result: InterferenceResult) -> Table:
    title = "Targets (issue 13)" if result.config.tier == "disk" else \
        f"Targets (issue 13; prefixes from {result.config.source})"
    table = Table(title=title)
    for name in ("check", "measured", "target", ""):
        table.add_column(name)
    for c in checks(result.by_name()):
        mark = "[dim]-[/]" if c.passed is None else "[green]pass[/]" if c.passed else "[red]FAIL[/]"
        table.add_row(c.what, c.value, c.limit, mark)
    return table


def summary(result: InterferenceResult) -> str:
    return run_summary(result.wall_s, result.machine, result.runs, (THROUGHPUT_NOTE,))
