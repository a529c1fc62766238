"""The benchmarks' node (`kvtier.tools.bench.node.BenchNode`): a `kvtier node serve` process
that a benchmark restarts to empty its RAM while its tiers below RAM keep their chunks
(`kvtier bench interference --config kvtier-node`: the prefixes then come back from below
RAM, as in process), its slabs removed when it stops.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tierkit import key, tiny_layout

from kvtier.core.retention import DEFAULT_META
from kvtier.errors import NodeUnavailable
from kvtier.node.client import NodeClient, node_status
from kvtier.node.nodestore import NodeStore
from kvtier.node.probe import NodeProbe
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.shmslab import SHM_DIR
from kvtier.tools.bench.node import restartable_node

pytestmark = pytest.mark.timeout(180)
LAYOUT = tiny_layout()


def _every_tier(client: NodeClient, keys: list[bytes]) -> list[bool] | None:
    try:
        return NodeProbe([client], ram_only=False).contains_many(keys)
    except NodeUnavailable:
        return None  # the client waits out its back-off


def test_a_restarted_bench_node_has_an_empty_ram_and_its_disk_tier(tmp_path: Path) -> None:
    disk = {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB"}
    keys = [key(i) for i in range(4)]
    with restartable_node(tmp_path / "node", 16 * LAYOUT.bytes_per_chunk, [disk]) as node:
        client = NodeClient(node.socket_path, LAYOUT, NamespaceInfo("bench-restart", "", 0),
                            timeout_s=30, retry_s=0.1)
        engine = NodeStore(client, LAYOUT.bytes_per_chunk)
        engine.plan_puts(keys, [DEFAULT_META] * len(keys))
        assert all(engine.put(k, memoryview(bytes([i]) * LAYOUT.bytes_per_chunk))
                   for i, k in enumerate(keys))
        assert engine.flush(timeout_s=30)
        node.restart()
        deadline = time.monotonic() + 30
        while (held := _every_tier(client, keys)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held == [True] * 4  # from the disk tier, which kept them
        (layout,) = node_status(node.socket_path)["layouts"].values()
        assert layout["tiers"][0]["chunks"] == 0  # RAM empty
        assert NodeProbe([client]).contains_many([keys[0]]) == [False]
        name = node.name
    assert not list(SHM_DIR.glob(f"kvtier-{name}-*"))
