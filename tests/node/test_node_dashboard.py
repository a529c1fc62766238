"""The Grafana dashboard's "kvtier node" row (deploy/grafana/kvtier-dashboard.json) against
the node's real metrics: a node in this process serves an engine (chunks stored, lent back,
asked about), and its registry (`NodeCollector`, what `--metrics-port` serves) is what the
panels are checked against.

- Every series a node panel names is one the node exports (a misspelt name evaluates to
  nothing, silently), and only the node row names the node's series.
- With Prometheus installed (Debian's `prometheus`; skipped, saying so, without it): a real
  Prometheus scrapes the node's /metrics, and every node panel's query (its variables filled
  in: all models, a window spanning the run) evaluates and returns series.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from nodekit import connect, key, lend, node_tiers, put_chunks
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.node.metrics import MetricsServer, NodeCollector
from kvtier.node.probe import NodeProbe
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvtier-dashboard.json"
NODE_ROW = "kvtier node"
NODE_SERIES = re.compile(r"\bkvtier_node_\w+")
PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 1


def panels_by_row() -> dict[str, list[dict[str, Any]]]:
    """The dashboard's panels (rows left out) under the title of the row above them."""
    rows: dict[str, list[dict[str, Any]]] = {}
    row = ""
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            rows[row] = []
        else:
            rows.setdefault(row, []).append(panel)
    return rows


def node_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL with the dashboard's variables filled in) of the node row."""
    fill = {'"$model_name"': '".*"', "$__rate_interval": "1h"}  # the window spans the run
    out = []
    for panel in panels_by_row()[NODE_ROW]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in fill.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, expr
            out.append((panel["title"], target["legendFormat"], expr))
    return out


@pytest.fixture
def busy_node(tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]]
              ) -> Iterator[NodeServer]:
    """A node whose engine stored five chunks, borrowed three back and asked about two, so that
    every family has its samples (a layout's tier series exist once an engine brought it; an
    engine's, with an engine_quota on the RAM tier)."""
    config = node_tiers(tmp_path, ram_chunks=16, disk_chunks=8)
    config["tiers"][0]["engine_quota"] = {"share": 0.5}
    with in_process_node(config) as node:
        client, engine = connect(node.config.socket_path)
        try:
            assert put_chunks(engine, range(5)) == [True] * 5
            assert len(lend(engine, [key(0), key(1), key(2)]).chunks) == 3
            assert NodeProbe([client]).contains_many([key(3), key(99)]) == [True, False]
            yield node
        finally:
            client.close()


def exported(node: NodeServer) -> set[str]:
    """The sample names on the node's /metrics (its collector, rendered as the server does)."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(node.status))
    text = generate_latest(registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_node_panel_names_only_series_the_node_exports(busy_node: NodeServer) -> None:
    names = exported(busy_node)
    assert {"kvtier_node_tier_hits_total", "kvtier_node_borrows_total",
            "kvtier_node_engine_used_bytes"} <= names
    rows = panels_by_row()
    assert len(rows[NODE_ROW]) >= 6
    for panel in rows[NODE_ROW]:
        for target in panel["targets"]:
            named = set(NODE_SERIES.findall(target["expr"]))
            assert named, (panel["title"], target["expr"])
            assert named <= names, (panel["title"], sorted(named - names))
            assert "vllm:" not in target["expr"], panel["title"]
    # The engines' panels name no node series: the node row is where they are.
    for row, panels in rows.items():
        if row != NODE_ROW:
            assert not [p["title"] for p in panels for t in p["targets"]
                        if NODE_SERIES.search(t["expr"])], row


@contextlib.contextmanager
def running_prometheus(target: str, root: Path) -> Iterator[str]:
    """Prometheus on 127.0.0.1 scraping `target` (host:port) every SCRAPE_S; its URL.
    Stopped on exit."""
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s"},
              "scrape_configs": [{"job_name": "kvtier-node",
                                  "static_configs": [{"targets": [target]}]}]}
    (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    with socket.socket() as probe:  # a port nothing listens on now (the kernel's pick)
        probe.bind(("127.0.0.1", 0))
        free = int(probe.getsockname()[1])
    log = (root / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [str(PROMETHEUS), f"--config.file={root / 'prometheus.yml'}",
         f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{free}"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{free}"
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert process.poll() is None, (root / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _ready(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url + "/-/ready",
                                                              timeout=2) as reply:
        return reply.status == 200
    return False


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """The instant vector `expr` evaluates to now, through Prometheus' HTTP API."""
    params = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=30) as response:
        body = json.loads(response.read().decode())
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian: apt-get "
                    "install prometheus; scripts/setup.sh does)")
def test_every_node_panel_query_returns_series(busy_node: NodeServer, tmp_path: Path) -> None:
    metrics = MetricsServer("127.0.0.1", 0)
    metrics.start(NodeCollector(busy_node.status))
    try:
        with running_prometheus(f"127.0.0.1:{metrics.port}", tmp_path) as url:
            # Two scrapes at least: rate() and increase() need two samples in their window.
            deadline = time.monotonic() + 60
            while not (result := query(url, 'sum_over_time(up{job="kvtier-node"}[1h])')) \
                    or float(result[0]["value"][1]) < 3:
                assert time.monotonic() < deadline, "fewer than 3 scrapes of the node in 60 s"
                time.sleep(0.3)
            empty = [(title, legend) for title, legend, expr in node_queries()
                     if not query(url, expr)]
            assert not empty, empty
    finally:
        metrics.close()


def test_the_node_faults_panel_charts_every_fault_the_node_counts() -> None:
    """What goes wrong on a node, each counted, is on its faults panel: before, a frozen
    engine's lendings taken back (`leases_expired`), its replies given up (`send_timeouts`),
    messages refused and stores not checked below RAM were on /metrics and in the status
    but charted nowhere; so were a tier's lookups past its deadline (`tier_lookup_timeouts`:
    misses of chunks the tier holds)."""
    [faults] = [panel for panel in panels_by_row()["kvtier node"]
                if panel["title"] == "Node faults (per second)"]
    charted = " ".join(target["expr"] for target in faults["targets"])
    for counter in ("tier_corrupt_reads", "tier_dropped_writes", "tier_lookup_timeouts",
                    "refused", "refused_messages", "disconnects_with_leases", "leases_expired",
                    "send_timeouts", "held_below_skipped"):
        assert f"kvtier_node_{counter}_total" in charted, counter
