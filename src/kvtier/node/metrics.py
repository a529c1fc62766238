"""The node's own Prometheus metrics, on /metrics of `kvtier node serve --metrics-port N`.

`NodeCollector` reads the live numbers from `NodeServer.status()` at each scrape: no thread
updates them in between, and a scrape sees what `kvtier node status` would print then. Every
name starts with `kvtier_node_` (an engine's own are `vllm:kvtier_*`, on vLLM's /metrics):

  - per layout and tier (labels `layout`: the first 16 hex digits of the layout's digest, as
    the node names its slabs; `tier`; `model`: the model of the layout's first engine): the
    tier's counters (`TIER_COUNTERS`, `kvtier_node_tier_<name>_total`) and gauges
    (`TIER_GAUGES`, `kvtier_node_tier_<name>`);
  - per layout and engine, with the RAM tier's `engine_quota` (labels `layout`, `model`,
    `engine`: host:pid:tag): `ENGINE_GAUGES` (`kvtier_node_engine_<name>`) and its chunks evicted
    (`kvtier_node_engine_evictions_total`);
  - the node's (label `node`, its name): `NODE_GAUGES` and its `NodeServer.counters`
    (`kvtier_node_<name>_total`), and `kvtier_node_info` (1, with the node's generation).

`MetricsServer` binds its port when built (a port in use raises before the node opens its
socket) and serves on daemon threads once started; nothing listens on a network address
unless the operator asks (the CLI's `--metrics-host`).

Primitives: `NodeCollector`, `MetricsServer`.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier.node.counters import COUNTERS

PREFIX = "kvtier_node_"
TIER_LABELS = ("layout", "tier", "model")
# TierStats field -> help; exported as kvtier_node_tier_<field>_total.
TIER_COUNTERS: dict[str, str] = {
    "hits": "Chunk reads the tier served",
    "misses": "Chunk reads the tier did not serve (absent, corrupt, unreadable)",
    "puts": "Chunks stored in the tier",
    "evictions": "Chunks evicted from the tier to make room",
    "corrupt_reads": "Chunks that failed verification (treated as misses, removed)",
    "dropped_writes": "Writes the tier did not store (I/O error, full disk, full queue)",
    "lookup_timeouts": "Lookups not answered within the tier's lookup deadline (redis "
                       "lookup_timeout_ms, s3 lookup_timeout_s): misses",
    "bytes_read": "Payload bytes read from the tier",
    "bytes_written": "Payload bytes written to the tier",
}
# TierStats field -> (name, help); exported as kvtier_node_tier_<name>_total.
TIER_SECONDS: dict[str, tuple[str, str]] = {
    "read_s": ("read_seconds", "Seconds the tier's reads took (over its hits: per chunk)"),
    "write_s": ("write_seconds", "Seconds the tier's writes took (over its puts: per chunk)"),
}
# TierStats field -> help; exported as kvtier_node_tier_<field>.
TIER_GAUGES: dict[str, str] = {
    "chunks": "Chunks the tier holds",
    "used_bytes": "Bytes the tier holds (as stored, headers included)",
    "capacity_bytes": "The tier's bound in bytes",
    "policy_horizon_ops": "The reuse horizon the tier's eviction policy learned, in "
                          "operations (eviction: prefix; 0 until learned, or another policy)",
}
# The layout's `engines` (status) field -> help; kvtier_node_engine_<field>.
ENGINE_LABELS = ("layout", "model", "engine")
ENGINE_GAUGES: dict[str, str] = {
    "used_bytes": "Bytes of the node's RAM tier holding chunks this engine stored",
    "chunks": "Chunks this engine stored that the node's RAM tier holds",
    "quota_bytes": "The engine's limit in the node's RAM tier (engine_quota)",
}
# status() key -> help; kvtier_node_<key> (engines and layouts: the length of their list/map).
NODE_GAUGES: dict[str, str] = {
    "connections": "Engine connections open (one per engine thread)",
    "leases": "Leases held: chunks lent for a load, slots reserved for stores",
    "engines": "Engine processes connected (host:pid:tag: an engine's scheduler and each of "
               "its workers count apart)",
    "layouts": "KV layouts (models x TP ranks) the node holds a store for",
}
# NodeServer.counters -> help; kvtier_node_<name>_total.
NODE_COUNTERS: dict[str, str] = {
    "borrows": "Borrow requests (one per load of an engine)",
    "lent_chunks": "Chunks lent to engines from the RAM slab",
    "read_in_place": "Chunks engines read from the RAM slab with no round trip (they knew "
                     "the slot and held it by a lock in the slab's file)",
    "reserved_chunks": "RAM slots reserved for engines' stores",
    "committed_chunks": "Reserved slots filled and stored",
    "received_chunks": "Chunks RAM had no slot for, received over the socket for the tiers "
                       "below it",
    "sent_chunks": "Chunks lent from a tier below RAM that RAM had no slot for, sent over the "
                   "socket",
    "lookups": "Lookup requests",
    "refused": "Hellos refused (max_layouts reached, a bad layout, a layout's tiers that "
               "cannot open: /dev/shm full); the node logs each reason once",
    "refused_messages": "Messages refused as they decoded (malformed, a list of more keys "
                        "than MAX_KEYS): the connection is closed",
    "disconnects_with_leases": "Connections that ended holding leases (released by the node)",
    "leases_expired": "Lendings taken back from engines that held them past lease_timeout_s "
                      "(frozen or hung)",
    "expired_chunks": "Chunks of the lendings taken back",
    "send_timeouts": "Connections closed for a reply their engine took nothing of within "
                     "lease_timeout_s (frozen or hung): the slots it may still write kept",
    "quarantines_ended": "Connections closed by send_timeouts whose kept slots were freed "
                         "once their engine closed its end or its process was gone",
    "held_below_skipped": "Stores whose chunks RAM had no slot for were not checked against "
                          "the tiers below RAM (every check thread held: a tier below hangs): "
                          "their bytes were asked for",
    "recovered_chunks": "Chunks recovered into RAM from the last node's slab at start-up",
    "recovery_dropped_chunks": "Chunks of the last node's slab dropped at start-up: torn or "
                               "damaged (their checksum did not match)",
    "described_chunks": "Chunk descriptions (token ids) engines sent for the node's KV events",
    "events_stored": "BlockStored KV events published (--events-endpoint)",
    "events_removed": "BlockRemoved KV events published (--events-endpoint)",
    "stored_unannounced": "Chunks stored with no known token ids: no BlockStored published",
}
assert set(NODE_COUNTERS) == set(COUNTERS)  # a new counter needs its help here


class NodeCollector(Collector):
    """The node's metrics from `status` (`NodeServer.status`), read at each scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        """Called by prometheus_client on its server's thread, once per scrape."""
        status = self._status()
        node = [status["node"]]
        info = GaugeMetricFamily(PREFIX + "info", "The node (1), its name and generation",
                                 labels=["node", "generation"])
        info.add_metric([status["node"], status["generation"]], 1)
        yield info
        sizes = {"engines": len(status["engines"]), "layouts": len(status["layouts"])}
        for name, text in NODE_GAUGES.items():
            gauge = GaugeMetricFamily(PREFIX + name, text, labels=["node"])
            gauge.add_metric(node, sizes.get(name, status.get(name, 0)))
            yield gauge
        for name, text in NODE_COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, text, labels=["node"])
            counter.add_metric(node, status["counters"][name])
            yield counter
        rows = [([digest[:16], tier["name"], layout["model"]], tier)
                for digest, layout in status["layouts"].items() for tier in layout["tiers"]]
        for name, text in TIER_COUNTERS.items():
            counter = CounterMetricFamily(f"{PREFIX}tier_{name}", text, labels=TIER_LABELS)
            for labels, tier in rows:
                counter.add_metric(labels, tier[name])
            yield counter
        for field, (name, text) in TIER_SECONDS.items():
            counter = CounterMetricFamily(f"{PREFIX}tier_{name}", text, labels=TIER_LABELS)
            for labels, tier in rows:
                counter.add_metric(labels, tier[field])
            yield counter
        for name, text in TIER_GAUGES.items():
            gauge = GaugeMetricFamily(f"{PREFIX}tier_{name}", text, labels=TIER_LABELS)
            for labels, tier in rows:
                gauge.add_metric(labels, tier[name])
            yield gauge
        yield from _engine_metrics(status)
        yield _borrow_seconds(node, status["borrow_seconds"])


def _borrow_seconds(node: list[str], by_source: dict[str, dict[str, Any]]) -> Metric:
    """The Borrows' seconds (node/latency.py), per source: "ram" or "below"."""
    histogram = HistogramMetricFamily(
        PREFIX + "borrow_seconds", "Seconds a Borrow (an engine's load) took on the node: "
        "source ram (every chunk from the RAM slab) or below (a tier below RAM read)",
        labels=["node", "source"])
    for source, seen in by_source.items():
        histogram.add_metric([*node, source],
                             [(str(le), count) for le, count in seen["buckets"]], seen["sum"])
    return histogram


def _engine_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    """Each engine's part of each layout's RAM tier (empty without `engine_quota`)."""
    rows = [([digest[:16], layout["model"], engine], usage)
            for digest, layout in status["layouts"].items()
            for engine, usage in layout.get("engines", {}).items()]
    for name, text in ENGINE_GAUGES.items():
        gauge = GaugeMetricFamily(f"{PREFIX}engine_{name}", text, labels=ENGINE_LABELS)
        for labels, usage in rows:
            gauge.add_metric(labels, usage[name])
        yield gauge
    counter = CounterMetricFamily(f"{PREFIX}engine_evictions",
                                  "This engine's chunks evicted from the node's RAM tier (by "
                                  "its quota or the tier's policy)", labels=ENGINE_LABELS)
    for labels, usage in rows:
        counter.add_metric(labels, usage["evictions"])
    yield counter


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Not a line on stderr per scrape."""


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold up the node's exit


class MetricsServer:
    """/metrics of a registry over HTTP, on daemon threads, until `close`."""

    def __init__(self, host: str, port: int) -> None:
        """Bind `host`:`port`; serve nothing until `start`.

        Raises:
            OSError: the port is in use (EADDRINUSE), the host is not one of this machine's.
        """
        self.registry = CollectorRegistry()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_MetricsServer", (_Server,), {"address_family": family})
        self._httpd: WSGIServer = make_server(host, port, make_wsgi_app(self.registry),
                                              server_class, handler_class=_Quiet)
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="kvtier-node-metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self, collector: Collector) -> None:
        """Serve `collector`'s metrics from now on."""
        self.registry.register(collector)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port. Any thread but the server's."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

