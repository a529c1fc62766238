"""The benchmarks' node (`kvtier.tools.bench.node.BenchNode`): a `kvtier node serve` process
that a benchmark restarts to empty its RAM while its tiers below RAM keep their chunks
(`kvtier bench interference --config kvtier-node`: the prefixes then come back from below
RAM, as in process), its slabs removed when it stops.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nodekit import connect, key, memory_tier, put_chunks, shm_files, short_dir, wait_for

from kvtier.errors import NodeUnavailable
from kvtier.node.client import NodeProbe, node_status
from kvtier.tools.bench.node import restartable_node

pytestmark = pytest.mark.timeout(180)


def test_a_restarted_bench_node_has_an_empty_ram_and_its_disk_tier(tmp_path: Path) -> None:
    disk = {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB"}
    with restartable_node(short_dir(tmp_path) / "node", 16 * 8192, [disk]) as node:
        client, engine = connect(node.socket_path, timeout_s=30, retry_s=0.1)
        assert put_chunks(engine, range(4)) == [True] * 4
        assert engine.flush(timeout_s=30)
        node.restart()

        def every_tier() -> list[bool] | None:
            try:
                return NodeProbe([client], ram_only=False).contains_many(
                    [key(i) for i in range(4)])
            except NodeUnavailable:
                return None  # the engine's client waits out its back-off

        assert wait_for(every_tier, 30, "the engine's reconnection") == [True] * 4  # the disk's
        assert memory_tier(node_status(node.socket_path))["chunks"] == 0
        assert NodeProbe([client]).contains_many([key(0)]) == [False]  # not in RAM
        name = node.name
    assert shm_files(name) == []
