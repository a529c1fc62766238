"""`kvtier bench ...`: benchmark commands. Each workload is one sub-command module."""

from __future__ import annotations

import argparse
import importlib

# One line per `kvtier bench` workload module; each exposes `register(subparsers)`.
WORKLOADS: tuple[str, ...] = (
    "kvtier.cli.bench_storage",
    "kvtier.cli.bench_serve",
    "kvtier.cli.bench_copy",
    "kvtier.cli.bench_ttft",
    "kvtier.cli.bench_sharing",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="measure kvtier against baselines")
    workloads = parser.add_subparsers(dest="workload", metavar="WORKLOAD", required=True)
    for name in WORKLOADS:
        importlib.import_module(name).register(workloads)
