"""`python -m kvtier.node serve|status`: the node's own entry point, part of the cache (no tool
dependency: a node runs where only `pip install kvtier` is). `kvtier node` (the tools) runs
the same `serve` and renders `status` as a table.

    python -m kvtier.node serve --config node.yaml --socket /run/kvtier/node.sock
        [--name N] [--metrics-port N [--metrics-host ADDR]] [--events-endpoint ENDPOINT]
    python -m kvtier.node status --socket /run/kvtier/node.sock      # JSON

Exit codes: 0 stopped cleanly / status printed, 1 no node answers, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from kvtier.errors import ConfigError, NodeUnavailable
from kvtier.node.client import node_status
from kvtier.node.config import NodeConfig
from kvtier.node.hostfiles import slabs_of
from kvtier.node.metrics import MetricsServer, NodeCollector
from kvtier.node.server import NodeServer
from kvtier.tiers.shmslab import SHM_DIR, shm_size_bytes
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.units import format_size

DEFAULT_SOCKET = "/run/kvtier/node.sock"
AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
log = logging.getLogger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="store config file (YAML or JSON)")
    add_socket_argument(parser)
    parser.add_argument("--name", help="the node's name (default: the host name)")
    parser.add_argument("--drop-ram", action="store_true",
                        help="remove the RAM slabs from /dev/shm when the node stops (default: "
                             "kept for the next node on this --name to recover their chunks)")
    parser.add_argument("--metrics-port", type=_port, metavar="N",
                        help="serve Prometheus metrics on this port's /metrics (default: none)")
    parser.add_argument("--metrics-host", type=listen_host, default="127.0.0.1",
                        help="the address the metrics port listens on (default 127.0.0.1: "
                             "this machine only; 0.0.0.0 for a scraper elsewhere)")
    parser.add_argument("--events-endpoint", metavar="ENDPOINT",
                        help="publish the tiers' KV events for routers (vLLM's format, topic "
                             "kv@node:NAME@MODEL) on this ZMQ endpoint: tcp://HOST:PORT "
                             "(connects, as vLLM does), tcp://*:PORT or ipc://PATH (binds); "
                             "default: none")
    parser.add_argument("--event-block-size", type=int, metavar="TOKENS",
                        help="announce each chunk as chained blocks of this many tokens, as "
                             "the router expects (NVIDIA Dynamo: its kv_block_size); must "
                             "divide the engines' tokens_per_chunk (default: a block a chunk)")
    parser.add_argument("--max-layouts", type=int, default=4, metavar="N",
                        help="KV layouts (models x tensor-parallel ranks) the node holds at "
                             "once, each its own RAM slab; an engine of one more is refused "
                             "and misses (default 4)")
    parser.add_argument("--stop-flush-s", type=float, default=60.0, metavar="SECONDS",
                        help="how long a stop waits for the writes queued behind RAM; the "
                             "rest are dropped and logged, and a write stuck in a tier that "
                             "stopped answering is not waited for (default 60: under the "
                             "pod's termination grace period, 120 s in deploy/)")
    parser.add_argument("--lease-timeout-s", type=float, default=60.0, metavar="SECONDS",
                        help="how long an engine may hold chunks lent for a load before "
                             "the node takes them back (an engine frozen or hung: its "
                             "copies, if it wakes, are failed loads, recomputed), and how long "
                             "a reply may go unread before its connection is closed; far "
                             "above any real load (default 60)")


def serve(args: argparse.Namespace) -> int:
    """Run the node until SIGTERM or SIGINT. Exits the process itself (`os._exit`) where a
    call into a tier that stopped answering outlives the node's close: the interpreter's exit
    would wait for it, as long as the tier does (a dead mount: until the SIGKILL).

    Raises:
        ConfigError: a bad config file (the caller prints it and exits 2).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not Path(args.socket).is_absolute():  # named as given (a Path's repr, otherwise)
        raise ConfigError("--socket", args.socket, "an absolute path")
    config = NodeConfig(StoreConfig.load(args.config), Path(args.socket),
                        keep_ram=not args.drop_ram, events_endpoint=args.events_endpoint,
                        event_block_size=args.event_block_size,
                        stop_flush_s=args.stop_flush_s, max_layouts=args.max_layouts,
                        lease_timeout_s=args.lease_timeout_s,
                        # "" is refused, not the host name: `--name "$NODE_NAME"` with the
                        # variable unset would name the slabs and the events' topic after the
                        # pod, not the Kubernetes node (docs/node.md)
                        **({"name": args.name} if args.name is not None else {}))
    check_shm_room(config, args.config)
    note_cpu_group()  # once its settings hold: not before an error that ends it
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
        try:
            node = NodeServer(config)
        except OSError as exc:  # its socket or its events endpoint taken, unreachable
            print(f"kvtier node: {exc}", file=sys.stderr)
            return 2
        if metrics is not None:
            metrics.start(NodeCollector(node.status))
            log.info("kvtier node: metrics on http://%s:%d/metrics", args.metrics_host,
                     metrics.port)
        code = _serve(node)
    stuck = _running_calls(grace_s=1.0)
    if stuck:  # daemon threads (core/threads.py): the exit does not wait for them
        log.warning("kvtier node: stopped; %d calls into tiers that stopped answering are "
                    "still running (%s): exiting without them", len(stuck), ", ".join(stuck))
    return code


def check_shm_room(config: NodeConfig, where: str, shm_bytes: int | None = None) -> None:
    """Refuse a RAM tier larger than /dev/shm, where the node puts it (a slab per KV layout):
    the node would start, then refuse every engine, /dev/shm full at its first layout. Warn
    when /dev/shm holds fewer slabs than `max_layouts`: the engines of one more are refused.
    `shm_bytes`: /dev/shm's size (default: this host's; a manifest's check gives its host's).

    Raises:
        ConfigError: naming the config's tiers[0].capacity, its value and /dev/shm's size.
    """
    shm = shm_size_bytes() if shm_bytes is None else shm_bytes
    capacity = config.store.tiers[0].capacity
    if shm is None:
        return
    if capacity > shm:
        raise ConfigError(f"{where}: tiers[0].capacity", format_size(capacity),
                          f"at most {format_size(shm)}, the size of {SHM_DIR}, where the node "
                          "keeps its RAM tier (a slab per KV layout): lower it, or grow "
                          f"{SHM_DIR} (mount -o remount,size=...)")
    if capacity * config.max_layouts > shm:
        log.warning("kvtier node: %s (%s) holds %d RAM slabs of %s, fewer than max_layouts "
                    "(%d): engines of a layout past them are refused (/dev/shm full)",
                    SHM_DIR, format_size(shm), shm // capacity, format_size(capacity),
                    config.max_layouts)


def _running_calls(grace_s: float) -> list[str]:
    """The names of kvtier's threads still running a call `grace_s` from now (the stores are
    closed: an idle thread of theirs ends at once)."""
    deadline = time.monotonic() + grace_s
    threads = [t for t in threading.enumerate() if t.name.startswith("kvtier-")]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


def note_cpu_group() -> None:
    """Warn where the node shares a CPU scheduling group with what started it: under Linux's
    autogroup a session is one, and busy work in it delays every engine's loads (docs/
    node.md, "Give it a CPU group of its own"). A systemd unit, a container or `setsid`
    starts it as its session's leader."""
    try:
        autogroup = AUTOGROUP.read_text().strip() == "1"
    except OSError:  # not Linux, or no autogroup
        return
    if autogroup and os.getsid(0) != os.getpid():
        log.warning("kvtier node: it shares session %d, a CPU group under the kernel's "
                    "autogroup, with the processes that started it: busy work there delays "
                    "every engine's loads; start it with setsid or as a service",
                    os.getsid(0))


def _serve(node: NodeServer) -> int:
    """Serve until SIGTERM or SIGINT, and the node closed."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            # One stop: a second started another shutdown, which found nothing left to close
            # and ended at once, and the process with it, cutting the first's flush short
            # (its writes lost: tests/node/test_node_second_signal.py). SIGKILL ends it now.
            log.info("kvtier node %r: %s: already stopping (writes behind RAM flushed for "
                     "up to %g s; SIGKILL to end it now)", node.config.name,
                     signal.Signals(signum).name, node.config.stop_flush_s)
            return
        # The pod's log says why the node went, and when it is gone.
        log.info("kvtier node %r: %s: stopping (engines disconnected, writes behind RAM "
                 "flushed for up to %g s)", node.config.name, signal.Signals(signum).name,
                 node.config.stop_flush_s)
        stop.set()
        threading.Thread(target=node.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    node.serve_forever()
    stop.wait(timeout=60)
    log.info("kvtier node %r: stopped (%s)", node.config.name, _slabs_at_stop(node))
    return 0


def _slabs_at_stop(node: NodeServer) -> str:
    """What the stop line says of the RAM slabs, once the stores are closed. With --drop-ram,
    the slabs of the node's name still in /dev/shm are named: an earlier node's layouts that
    no engine asked this one for (it removes only its own; they are never swept, as their
    model may come back). A node stopped cold to clean up had logged "RAM slabs removed" and
    left a whole RAM tier there (tests/node/test_node_recovery.py)."""
    if node.config.keep_ram:
        return "RAM slabs kept for the next node"
    left = []
    for path in slabs_of(node.config.name, aside=True):
        with contextlib.suppress(OSError):
            left.append(f"{path} ({format_size(path.stat().st_size)})")
    if not left:
        return "RAM slabs removed"
    return (f"its RAM slabs removed; left in {SHM_DIR}: {', '.join(left)}, of an earlier "
            "node's layouts no engine asked this one for (remove those of models no longer "
            "served)")


def add_socket_argument(parser: argparse.ArgumentParser) -> None:
    """`--socket`: the node's Unix socket, not blank (`--socket "$NODE_SOCKET"` with the
    variable unset: status reported "no node answers", exit 1, a usage error taken for a
    node down)."""
    parser.add_argument("--socket", default=DEFAULT_SOCKET, type=_socket_path,
                        help=f"(default {DEFAULT_SOCKET})")


def _socket_path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: the node's socket path, not empty")
    return text


def listen_host(text: str) -> str:
    """`--metrics-host`: an address, not blank ("" binds every interface: `--metrics-host
    "$HOST"` with the variable unset exposed the metrics meant for 127.0.0.1). The tools'
    `--host` options have their own (kvtier.tools.cli.argtypes.listen_host): the node,
    below the tools, does not import them, and they do not import the node's server."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: an address such as 127.0.0.1 (this "
                                         "machine only) or 0.0.0.0 (every interface), not "
                                         "empty: empty listens on every interface")
    return text


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: not a TCP port (1-65535)")
    return port


def main(argv: list[str] | None = None) -> int:
    # Raw: the docstring's usage lines stay lines (filled, they ran into one paragraph).
    parser = argparse.ArgumentParser(prog="python -m kvtier.node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", required=True)
    add_serve_arguments(actions.add_parser("serve", help="run the node"))
    status = actions.add_parser("status", help="the node's status, as JSON")
    add_socket_argument(status)
    # Taken as `kvtier node status --json` takes it: a probe written for one runs as the other.
    status.add_argument("--json", action="store_true", help="JSON (as without it)")
    args = parser.parse_args(argv)
    try:
        if args.action == "serve":
            return serve(args)
        print(json.dumps(node_status(args.socket), indent=2))
        return 0
    except ConfigError as exc:
        print(f"kvtier node: {exc}", file=sys.stderr)
        return 2
    except NodeUnavailable as exc:
        print(f"kvtier node: no node answers at {args.socket}: {exc}", file=sys.stderr)
        return 1
