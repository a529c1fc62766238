"""`kvtier node serve --config FILE`: one cache per node, shared by its engines (kvtier.node);
`kvtier node status`: its engines, leases, counters and tiers.

The config is a store config (the connector's `tiers` schema; the first tier a memory tier,
which the node puts in shared memory). Engines use it with the connector key
`"node": "/run/kvtier/node.sock"` (or `kvtier serve --node`). `--metrics-port N` serves the
node's Prometheus metrics (kvtier.node.metrics) on http://127.0.0.1:N/metrics (another
address: `--metrics-host`).

Exit codes: 0 stopped cleanly / status printed, 1 no node answers, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.errors import NodeUnavailable
from kvtier.node.client import node_status
from kvtier.node.metrics import MetricsServer, NodeCollector
from kvtier.node.server import NodeConfig, NodeServer
from kvtier.tools.cli.inspect import load_store
from kvtier.units import format_size

DEFAULT_SOCKET = "/run/kvtier/node.sock"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("node", help="the node's cache, shared by its engines")
    actions = p.add_subparsers(dest="action", required=True)
    serve = actions.add_parser("serve", help="run the node (until SIGTERM or Ctrl-C)")
    serve.add_argument("--config", required=True, help="store config file (YAML or JSON)")
    serve.add_argument("--socket", default=DEFAULT_SOCKET, help=f"(default {DEFAULT_SOCKET})")
    serve.add_argument("--name", help="the node's name (default: the host name)")
    serve.add_argument("--metrics-port", type=_port, metavar="N",
                       help="serve Prometheus metrics on this port's /metrics (default: none)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="the address the metrics port listens on (default 127.0.0.1: "
                            "this machine only; 0.0.0.0 for a scraper elsewhere)")
    serve.set_defaults(func=run_serve)
    status = actions.add_parser("status", help="what a running node holds and serves")
    status.add_argument("--socket", default=DEFAULT_SOCKET, help=f"(default {DEFAULT_SOCKET})")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=run_status)


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = NodeConfig(load_store(args.config), Path(args.socket),
                        **({"name": args.name} if args.name else {}))
    metrics: MetricsServer | None = None
    if args.metrics_port is not None:
        try:  # before the node opens its socket: a port in use leaves nothing behind
            metrics = MetricsServer(args.metrics_host, args.metrics_port)
        except OSError as exc:
            print(f"kvtier node: cannot serve metrics on {args.metrics_host}:"
                  f"{args.metrics_port}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    with contextlib.ExitStack() as stack:
        if metrics is not None:
            stack.callback(metrics.close)
        node = NodeServer(config)
        if metrics is not None:
            metrics.start(NodeCollector(node.status))
            logging.getLogger(__name__).info(
                "kvtier node: metrics on http://%s:%d/metrics", args.metrics_host, metrics.port)
        return _serve(node)


def _serve(node: NodeServer) -> int:
    """Serve until SIGTERM or SIGINT, and the node closed."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()
        threading.Thread(target=node.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    node.serve_forever()
    stop.wait(timeout=60)
    return 0


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: not a TCP port (1-65535)")
    return port


def run_status(args: argparse.Namespace) -> int:
    console = Console()
    try:
        status: dict[str, Any] = node_status(args.socket)
    except NodeUnavailable as exc:
        console.print(f"[red]no node answers at {args.socket}[/red]: {exc}")
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    console.print(f"node [bold]{status['node']}[/bold] (generation {status['generation']}) "
                  f"on {status['socket']}: {status['connections']} connections, "
                  f"{status['leases']} leases; engines: {', '.join(status['engines']) or '-'}")
    table = Table("layout", "tier", "chunks", "used", "capacity", "hits", "misses", "puts")
    for digest, layout in status["layouts"].items():
        for tier in layout["tiers"]:
            table.add_row(digest[:16], tier["name"], str(tier["chunks"]),
                          format_size(tier["used_bytes"]), format_size(tier["capacity_bytes"]),
                          str(tier["hits"]), str(tier["misses"]), str(tier["puts"]))
    console.print(table)
    console.print(" ".join(f"{k}={v}" for k, v in status["counters"].items()))
    return 0
