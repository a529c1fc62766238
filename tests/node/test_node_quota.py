"""Per-engine quotas in the node's RAM (`engine_quota` of its memory tier): an engine at its
limit evicts its own least recently used chunks, so one engine's flood of new prompts cannot
push a neighbour's warm set out; without a quota the same flood evicts the neighbour's (the
tier's LRU): the test's control. A chunk the neighbour reads is recent for the engine that
stored it. Each engine's part is in the status document and on the node's /metrics. An
engine's config that sets a quota is refused (in process there is one writer).

An in-process node (`running_node`): the RAM tier's accounting, not the process boundary, is
what is tested; engines are two clients that name themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from nodekit import LAYOUT, SLOT_BYTES, connect, key, lend, node_tiers, put_chunks

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.node.metrics import NodeCollector
from kvtier.node.probe import NodeProbe
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)

RAM_CHUNKS = 8


def _tiers(tmp_path: Path, quota: dict[str, Any] | None) -> dict[str, Any]:
    config = node_tiers(tmp_path, ram_chunks=RAM_CHUNKS)
    if quota is not None:
        config["tiers"][0]["engine_quota"] = quota
    return config


@pytest.mark.parametrize("quota", [{"share": 0.5}, None], ids=["quota", "no-quota"])
def test_an_engine_at_its_quota_evicts_its_own_chunks_not_its_neighbours(
        tmp_path: Path, quota: dict[str, Any] | None,
        in_process_node: Callable[..., AbstractContextManager[NodeServer]]):
    with in_process_node(_tiers(tmp_path, quota)) as node:
        client_a, engine_a = connect(node.config.socket_path, engine="engine-a")
        _, engine_b = connect(node.config.socket_path, engine="engine-b")
        probe = NodeProbe([client_a])

        # B's warm set (the oldest chunks), then A's first prompt: the RAM tier is full.
        assert put_chunks(engine_b, range(4)) == [True] * 4
        assert put_chunks(engine_a, range(10, 14)) == [True] * 4
        # A floods: four more chunks.
        assert put_chunks(engine_a, range(20, 24)) == [True] * 4

        b_kept = probe.contains_many([key(i) for i in range(4)])
        a_first = probe.contains_many([key(i) for i in range(10, 14)])
        a_flood = probe.contains_many([key(i) for i in range(20, 24)])
        assert a_flood == [True] * 4
        engines = node.status()["layouts"][LAYOUT.digest()]["engines"]
        if quota is None:  # the tier's LRU: B's older warm set went
            assert (b_kept, a_first) == ([False] * 4, [True] * 4)
            assert engines == {}
            return
        assert (b_kept, a_first) == ([True] * 4, [False] * 4)
        assert engines["engine-a"]["quota_bytes"] == RAM_CHUNKS * SLOT_BYTES // 2
        assert engines["engine-a"]["used_bytes"] == 4 * SLOT_BYTES
        assert (engines["engine-a"]["chunks"], engines["engine-a"]["evictions"]) == (4, 4)
        assert (engines["engine-b"]["chunks"], engines["engine-b"]["evictions"]) == (4, 0)
        samples = {(s.name, s.labels["engine"]): s.value
                   for family in NodeCollector(node.status).collect()
                   for s in family.samples if "engine" in s.labels}
        assert samples[("kvtier_node_engine_chunks", "engine-a")] == 4
        assert samples[("kvtier_node_engine_used_bytes", "engine-b")] == 4 * SLOT_BYTES
        assert samples[("kvtier_node_engine_evictions_total", "engine-a")] == 4

        # B reads A's chunk 20: recent for A's quota, so A's next store evicts 21 instead.
        assert [i for i, _ in lend(engine_b, [key(20)]).chunks] == [0]
        assert put_chunks(engine_a, [30]) == [True]
        assert probe.contains_many([key(20), key(21), key(30)]) == [True, False, True]
        assert probe.contains_many([key(i) for i in range(4)]) == [True] * 4


def test_an_engine_config_with_an_engine_quota_is_refused():
    with pytest.raises(ConfigError) as raised:
        ConnectorConfig.parse({"tiers": [
            {"kind": "memory", "capacity": "1GiB", "engine_quota": {"share": 0.5}}]})
    message = str(raised.value)
    assert "tiers[0].engine_quota" in message and "'share': 0.5" in message
    assert "kvtier node" in message
