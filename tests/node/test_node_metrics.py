"""The node's own /metrics (`kvtier node serve --metrics-port N`, kvtier.node.metrics), scraped
over HTTP from a real node process: an engine stores a step of chunks, borrows some back (one
run cut short by a miss) and asks about others, and every counter moves by exactly what it did,
per layout and tier (labels layout, tier, model) and for the node; the gauges say what the RAM
tier holds and that nothing is left lent. A metrics port already taken stops the node before it
opens its socket, with exit status 2 and the port named.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodekit import (
    INFO,
    LAYOUT,
    SLOT_BYTES,
    NodeProcess,
    connect,
    expected,
    key,
    lend,
    node_tiers,
    put_chunks,
    wait_for,
    write_config,
)
from prometheus_client.parser import text_string_to_metric_families

from kvtier.node.probe import NodeProbe
from kvtier.testing.ports import free_port

pytestmark = pytest.mark.timeout(120)  # a hang fails here, not at the suite's 900 s

Sample = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)


def scrape(port: int) -> dict[Sample, float]:
    """Every sample on the node's /metrics, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def tier(name: str, tier_name: str = "memory") -> Sample:
    labels = {"layout": LAYOUT.digest()[:16], "tier": tier_name, "model": INFO.model}
    return (f"kvtier_node_tier_{name}", tuple(sorted(labels.items())))


def node_sample(name: str, node_name: str) -> Sample:
    return (f"kvtier_node_{name}", (("node", node_name),))


@pytest.fixture
def metrics_node(tmp_path: Path, socket_path: Path, node_name: str) -> Iterator[NodeProcess]:
    """A node with RAM for 16 chunks and its metrics on a free port of 127.0.0.1."""
    config = write_config(tmp_path / "node.json", node_tiers(tmp_path, ram_chunks=16))
    node = NodeProcess(config, socket_path, node_name, tmp_path / "node.log",
                       args=("--metrics-port", str(free_port())))
    try:
        yield node.start()
    finally:
        node.kill()


def test_the_metrics_move_by_exactly_what_an_engine_did(metrics_node: NodeProcess):
    node = metrics_node
    port = int(node.args[1])
    name = node.name
    before = scrape(port)
    # No engine yet: the node's counters are there, at 0, and no layout has a tier yet.
    assert before[node_sample("borrows_total", name)] == 0
    assert before[node_sample("connections", name)] == 0
    assert not [s for s in before if s[0].startswith("kvtier_node_tier_")]

    client, engine = connect(node.socket_path)
    # One step of five stores: one Reserve of five slots, five commits.
    assert put_chunks(engine, range(5)) == [True] * 5
    wait_for(lambda: scrape(port)[node_sample("committed_chunks_total", name)] == 5, 10,
             "the five commits counted")
    # Two loads: chunks 0-2 read in place (this engine stored them: no round trip); then 3,
    # and a miss that ends the run (a chunk whose slot is not known: a borrow).
    assert lend(engine, [key(0), key(1), key(2)]).chunks == expected([0, 1, 2])
    lent = lend(engine, [key(3), key(99)])
    assert lent.chunks == expected([3]) and lent.stopped_at == 1
    wait_for(lambda: scrape(port)[node_sample("read_in_place_total", name)] == 3, 10,
             "the three reads in place told")
    # One lookup of three keys.
    assert NodeProbe([client]).contains_many([key(0), key(4), key(99)]) == [True, True, False]

    after = scrape(port)
    moved = {n: after[node_sample(n, name)] - before[node_sample(n, name)]
             for n in ("borrows_total", "lent_chunks_total", "read_in_place_total",
                       "reserved_chunks_total", "committed_chunks_total", "lookups_total",
                       "refused_total", "disconnects_with_leases_total")}
    assert moved == {"borrows_total": 1, "lent_chunks_total": 1, "read_in_place_total": 3,
                     "reserved_chunks_total": 5, "committed_chunks_total": 5,
                     "lookups_total": 1, "refused_total": 0,
                     "disconnects_with_leases_total": 0}
    # The RAM tier of the engine's layout: five stored, four read; the absent chunk was never
    # read (the store knows the tier does not hold it), so no read missed.
    assert after[tier("puts_total")] == 5
    assert after[tier("hits_total")] == 4
    assert after[tier("misses_total")] == 0
    assert after[tier("evictions_total")] == 0
    assert after[tier("corrupt_reads_total")] == 0
    assert after[tier("dropped_writes_total")] == 0
    assert after[tier("lookup_timeouts_total")] == 0
    assert after[tier("chunks")] == 5
    assert after[tier("used_bytes")] == 5 * SLOT_BYTES
    assert after[tier("capacity_bytes")] == 16 * SLOT_BYTES
    assert after[tier("policy_horizon_ops")] == 0  # prefix, learned after 256 reuses
    # The one Borrow, timed, from RAM alone; the tier's read and write seconds exported.
    borrows = {source: after[("kvtier_node_borrow_seconds_count",
                              (("node", name), ("source", source)))] for source in ("ram", "below")}
    assert borrows == {"ram": 1, "below": 0}
    assert after[("kvtier_node_borrow_seconds_bucket",
                  (("le", "+Inf"), ("node", name), ("source", "ram")))] == 1
    assert after[tier("read_seconds_total")] >= 0 and after[tier("write_seconds_total")] >= 0
    # Every loan released; one engine, on the connections its threads opened; one layout.
    assert after[node_sample("leases", name)] == 0
    assert after[node_sample("engines", name)] == 1
    assert after[node_sample("connections", name)] >= 1
    assert after[node_sample("layouts", name)] == 1
    assert after[("kvtier_node_info", (("generation", node.status()["generation"]),
                                       ("node", name)))] == 1
    client.close()


def test_a_metrics_port_in_use_is_a_clear_error(tmp_path: Path, socket_path: Path,
                                                node_name: str):
    config = write_config(tmp_path / "node.json", node_tiers(tmp_path, ram_chunks=4))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvtier.node", "serve",
             "--config", str(config), "--socket", str(socket_path), "--name", node_name,
             "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr
    assert "in use" in result.stderr
    assert not socket_path.exists()  # stopped before the node opened its socket
