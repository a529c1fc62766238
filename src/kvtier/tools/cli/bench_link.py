"""`kvtier bench link`: TTFT of a prefix held in a remote (redis) tier as its emulated link
slows down: recompute, kvtier's load-or-recompute rule, kvtier forced to load every hit; the
crossover printed and drawn. A thin command over `kvtier.tools.bench.linksweep`."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.testing.engines import quiet_engine_logs
from kvtier.tools.bench.linksweep import CONFIGS, LinkConfig, LinkResult, run_link_bench
from kvtier.tools.cli.argtypes import (
    AppendOnce,
    finite_float,
    non_negative_int,
    output_dir,
    output_file,
    plot_file,
    positive_int,
    work_dir,
)
from kvtier.tools.cli.bench import run_and_report

QUICK = {"gbps": (4.0, 0.5, 0.1), "reps": 3, "warmup": 2}
DEFAULT_GBPS = "8,2,1,0.5,0.25,0.1"


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "link", help="TTFT of remote-tier hits as the link slows: recompute vs kvtier's "
        "load-or-recompute rule vs loading every hit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=4096,
                        help="cached prompt length (a multiple of 256; 4096)")
    parser.add_argument("--gbps",
                        help=f"link speeds in Gbit/s, comma-separated ({DEFAULT_GBPS})")
    parser.add_argument("--delay-ms", type=finite_float, default=0.1,
                        help="one-way delay of the link (0.1 ms)")
    parser.add_argument("--reps", type=positive_int,
                        help="timed pairs (hit, recompute) per speed (5)")
    parser.add_argument("--warmup", type=non_negative_int,
                        help="untimed hits after each change of link (3)")
    parser.add_argument("--config", action=AppendOnce, choices=CONFIGS,
                        help="engine to run (repeatable; default both)")
    parser.add_argument("--quick", action="store_true",
                        help="three speeds, fewer repetitions (~6 min), unless given")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="redis-server's scratch files go here")
    parser.add_argument("--model-root", type=output_dir, default=Path(".kvtier-models"),
                        help="where the generated bench model is cached")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-link.json"))
    parser.add_argument("--png", type=plot_file, default=Path("results/bench-link.png"))
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> LinkConfig:
    """The settings: --quick's, then each flag given (LinkConfig's defaults: the help's)."""
    settings: dict[str, object] = dict(QUICK) if args.quick else {}
    if args.gbps is not None:
        try:
            settings["gbps"] = tuple(float(g) for g in args.gbps.split(",") if g)
        except ValueError:
            raise ConfigError("gbps", args.gbps, "numbers, e.g. 8,1,0.1") from None
    for name in ("reps", "warmup"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    return LinkConfig(directory=args.dir, model_root=args.model_root,
                      cached_tokens=args.tokens, delay_ms=args.delay_ms,
                      configs=tuple(args.config) if args.config else CONFIGS,
                      **settings)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    config.validate()
    if not args.verbose:  # the engines' start-up logs would bury the tables
        quiet_engine_logs()

    def write(result: LinkResult) -> None:
        result.write_json(args.json)
        plot(result, args.png)

    run_and_report("link", lambda progress: run_link_bench(config, progress),
                   lambda r: (ttft_table(r), checks_table(r), summary(r, args.png)),
                   write, args.json)
    return 0


def ttft_table(result: LinkResult) -> Table:
    table = Table(title=f"TTFT, ms (median), {result.config.cached_tokens} cached tokens "
                        f"({result.config.chunk_mib:g} MiB chunks) from redis behind the link")
    for name in ("Gbit/s", "recompute", "rule", "always", "rule /\nrecompute",
                 "always /\nrecompute", "rule's chunks\nloaded/trial/cut"):
        table.add_column(name, justify="right")
    for gbps in result.config.gbps:
        recompute = result.recompute_s(gbps)
        cells = [f"{gbps:g}", f"{recompute * 1e3:.0f}"]
        points = [result.point(name, gbps) for name in ("rule", "always")]
        cells += ["-" if p is None else f"{p.hit_median_s * 1e3:.0f}" for p in points]
        cells += ["-" if p is None else f"{p.hit_median_s / recompute:.2f}x" for p in points]
        rule = points[0]
        cells.append("-" if rule is None else "/".join(
            f"{rule.decisions.get(r, 0):.0f}" for r in ("loaded", "trial", "recompute_faster")))
        table.add_row(*cells)
    return table


def checks_table(result: LinkResult) -> Table:
    table = Table(title="Targets (issue 26)")
    for name in ("check", "measured", ""):
        table.add_column(name)
    for what, value, met in result.checks():
        table.add_row(what, value, "[green]pass[/]" if met else "[red]FAIL[/]")
    return table


def summary(result: LinkResult, png: Path) -> str:
    crossover = result.crossover_gbps()
    before, after = result.machine["loadavg_before"][0], result.machine["loadavg_after"][0]
    where = (f"loading every hit stops paying below {crossover:.2g} Gbit/s"
             if crossover is not None else "no crossover within the sweep")
    return (f"crossover: {where}\nplot: {png}\n"
            f"{result.wall_s:.0f} s; load average {before:.2f} -> {after:.2f} on "
            f"{result.machine['cpus']} CPUs")


def plot(result: LinkResult, path: Path) -> Path:
    """TTFT against link speed (log scale), the three lines and the crossover."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbps = list(result.config.gbps)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(gbps, [result.recompute_s(g) * 1e3 for g in gbps], "-o", label="recompute")
    for name, label in (("rule", "kvtier (load or recompute)"),
                        ("always", "kvtier forced to load")):
        points = [(g, p.hit_median_s * 1e3) for g in gbps
                  if (p := result.point(name, g)) is not None]
        if points:
            ax.plot(*zip(*points), "-o", label=label)
    crossover = result.crossover_gbps()
    if crossover is not None:
        ax.axvline(crossover, color="grey", linestyle="--",
                   label=f"crossover {crossover:.2g} Gbit/s")
    ax.set_xscale("log")
    ax.set_xlabel("link to the redis tier (Gbit/s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"kvtier bench link: {result.config.cached_tokens}-token prefix")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
