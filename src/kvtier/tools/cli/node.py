"""`kvtier node serve --config FILE`: one cache per node, shared by its engines (kvtier.node);
`kvtier node status`: its engines, leases, counters and tiers.

The config is a store config (the connector's `tiers` schema; the first tier a memory tier,
which the node puts in shared memory). Engines use it with the connector key
`"node": "/run/kvtier/node.sock"` (or `kvtier serve --node`). `serve` is the node's own
(`python -m kvtier.node serve`: kvtier.node.cli, no tool dependency). `--metrics-port N` serves the
node's Prometheus metrics (kvtier.node.metrics) on http://127.0.0.1:N/metrics (another
address: `--metrics-host`); `--events-endpoint` publishes its tiers' KV events for routers
(kvtier.node.events).

Exit codes: 0 stopped cleanly / status printed, 1 no node answers, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtier.errors import NodeUnavailable
from kvtier.node import cli as node_cli
from kvtier.node.cli import add_serve_arguments, add_socket_argument
from kvtier.node.client import node_status
from kvtier.units import format_size


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("node", help="the node's cache, shared by its engines")
    actions = p.add_subparsers(dest="action", required=True)
    serve = actions.add_parser("serve", help="run the node (until SIGTERM or Ctrl-C)")
    add_serve_arguments(serve)
    serve.set_defaults(func=node_cli.serve)
    status = actions.add_parser("status", help="what a running node holds and serves")
    add_socket_argument(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    console = Console()
    try:
        status: dict[str, Any] = node_status(args.socket)
    except NodeUnavailable as exc:
        print(f"kvtier node status: no node answers at --socket {args.socket!r}: {exc}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    # Escaped: an engine names itself in its Hello (any string): read as markup, `gpu[/]0`
    # ended the command with a MarkupError.
    console.print(f"node [bold]{escape(status['node'])}[/bold] (generation "
                  f"{status['generation']}) on {escape(status['socket'])}: "
                  f"{counted(status['connections'], 'connection')}, "
                  f"{counted(status['leases'], 'lease')}; engines: "
                  f"{escape(', '.join(status['engines'])) or '-'}")
    held = ", ".join(f"{engine} {counted(mine['chunks'], 'chunk')} "
                     f"({counted(mine['leases'], 'lease')})"
                     for engine, mine in status.get("held", {}).items())
    if held:
        console.print(f"held: {held}", markup=False)
    # Engines whose connection the node ended (a reply never read: frozen or hung): what they
    # held stays theirs until they close their end (they do once woken) or their process
    # ends; killing it gives the slots back.
    closed = ", ".join(f"{engine} (pid {pid or 'not visible'})"
                       for engine, pid in status.get("quarantined", {}).items())
    if closed:
        console.print(f"ended, kept until the engine closes its end or exits: {closed}",
                      markup=False)
    if status.get("events_endpoint"):
        console.print(f"KV events on {status['events_endpoint']} "
                      f"(topics kv@node:{status['node']}@<model>)", markup=False)
    table = Table("layout", "tier", "chunks", "used", "capacity", "hits", "misses", "puts")
    for digest, layout in status["layouts"].items():
        for tier in layout["tiers"]:
            table.add_row(digest[:16], tier["name"], str(tier["chunks"]),
                          format_size(tier["used_bytes"]), format_size(tier["capacity_bytes"]),
                          str(tier["hits"]), str(tier["misses"]), str(tier["puts"]))
    console.print(table)
    console.print(" ".join(f"{k}={v}" for k, v in status["counters"].items()))
    console.print("borrows: " + ", ".join(
        f"{source} {seen['count']}"
        + (f" (mean {1e3 * seen['sum'] / seen['count']:.1f} ms)" if seen["count"] else "")
        for source, seen in status.get("borrow_seconds", {}).items()))
    return 0


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless one ("1 connection", "2 leases")."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
