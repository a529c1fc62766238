"""`kvtier bench ...`: benchmark commands. Each workload is one sub-command module.

Primitives: `register`, `run_and_report` (what every in-process bench command does around its
measurement: a spinner with its progress, its tables, its JSON).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

R = TypeVar("R")

# One line per `kvtier bench` workload module; each exposes `register(subparsers)`.
WORKLOADS: tuple[str, ...] = (
    "kvtier.cli.bench_storage",
    "kvtier.cli.bench_serve",
    "kvtier.cli.bench_copy",
    "kvtier.cli.bench_ttft",
    "kvtier.cli.bench_sharing",
    "kvtier.cli.bench_interference",
    "kvtier.cli.bench_disagg",
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("bench", help="measure kvtier against baselines")
    workloads = parser.add_subparsers(dest="workload", metavar="WORKLOAD", required=True)
    for name in WORKLOADS:
        importlib.import_module(name).register(workloads)


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
