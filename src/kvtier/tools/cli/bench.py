"""`kvtier bench ...`: benchmark commands. Each workload is one sub-command module.

Primitives: `register`, `run_and_report` (what every in-process bench command does around its
measurement: a spinner with its progress, its tables, its JSON), and what the commands' reports
share: `ms_p50_p99`, `runs_table` (one column per run), `run_summary`; `given_or` (an
option's value under --quick).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from kvtier.tools.bench.serving.stats import Percentiles

R = TypeVar("R")
T = TypeVar("T")


class NamedRun(Protocol):
    """One run of a bench with several setups: its name and why its failed requests failed."""

    @property
    def name(self) -> str: ...

    @property
    def failures(self) -> list[str]: ...


RunT = TypeVar("RunT", bound=NamedRun)

# One line per `kvtier bench` workload module; each exposes `register(subparsers)`.
WORKLOADS: tuple[str, ...] = (
    "kvtier.tools.cli.bench_storage",
    "kvtier.tools.cli.bench_serve",
    "kvtier.tools.cli.bench_copy",
    "kvtier.tools.cli.bench_ttft",
    "kvtier.tools.cli.bench_sharing",
    "kvtier.tools.cli.bench_pooling",
    "kvtier.tools.cli.bench_interference",
    "kvtier.tools.cli.bench_disagg",
    "kvtier.tools.cli.bench_codecs",
    "kvtier.tools.cli.bench_mover",
    "kvtier.tools.cli.bench_node",
    "kvtier.tools.cli.bench_link",
    "kvtier.tools.cli.bench_fleet",
    "kvtier.tools.cli.bench_disk_load",
    "kvtier.tools.cli.bench_clients",
    "kvtier.tools.cli.bench_trace",
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("bench", help="measure kvtier against baselines")
    workloads = parser.add_subparsers(dest="workload", metavar="WORKLOAD", required=True)
    for name in WORKLOADS:
        importlib.import_module(name).register(workloads)


def given_or(given: T | None, quick: bool, quick_value: T, default: T) -> T:
    """An option's value: the one given on the command line (its parser default is None),
    else --quick's, else the default. --quick sets only what the user left out:
    `--quick --trials 9` runs 9 trials, as `bench storage` and `bench interference` do."""
    if given is not None:
        return given
    return quick_value if quick else default


def run_and_report(name: str, measure: Callable[[Callable[[str], None]], R],
                   render: Callable[[R], Iterable[Any]],
                   write_json: Callable[[R], None], json_path: Path) -> R:
    """Run `measure(progress)` under a spinner showing its progress, print what `render`
    returns (tables, lines), then `write_json` the result and say where."""
    console = Console()
    with console.status(f"bench {name}") as status:
        result = measure(lambda text: status.update(f"bench {name}: {text}"))
    for item in render(result):
        console.print(item)
    write_json(result)
    console.print(f"results written to {json_path}")
    return result


def ms_p50_p99(p: Percentiles) -> str:
    """`p`'s p50 / p99 in milliseconds ("-" where not measured)."""
    return " / ".join("-" if v is None else f"{v * 1e3:.1f}" for v in (p.p50, p.p99))


def runs_table(title: str, runs: Sequence[RunT],
               rows: Iterable[tuple[str, Callable[[RunT], str]]]) -> Table:
    """A table with one column per run, one row per (label, how to show it) of `rows`."""
    table = Table(title=title)
    table.add_column("")
    for run in runs:
        table.add_column(run.name, justify="right")
    for label, fmt in rows:
        table.add_row(label, *(fmt(run) for run in runs))
    return table


def run_summary(wall_s: float, machine: Mapping[str, Any], runs: Sequence[NamedRun],
                notes: Sequence[str] = ()) -> str:
    """The lines under the tables: the time and the load average, `notes`, and each run's
    first failed request (in red)."""
    before, after = machine["loadavg_before"][0], machine["loadavg_after"][0]
    failures = [f"{run.name}: {run.failures[0]}" for run in runs if run.failures]
    return "\n".join([
        f"{wall_s:.0f} s; load average {before:.2f} -> {after:.2f} on {machine['cpus']} CPUs",
        *notes, *(f"[red]failed request, {f}[/red]" for f in failures)])
