"""Where the scheduler expects a hit's chunk to be loaded from (`LoadPlanner.sources`): in
process, a chunk the workers stored is in RAM until their events say otherwise; in node mode
(`stores_stay` False) no event comes when another engine's stores evict it from the node's
RAM, so the tier the lookup found it in decides (RAM, or below it), as the load-or-recompute
rule weighs a hit by its tier's cost.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.core.keys import ChunkKey
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.loadplan import LoadPlanner
from kvtier.node.protocol import BELOW_TIER, RAM_TIER

KEY = ChunkKey(bytes(16))


@pytest.mark.parametrize(("stores_stay", "expected"), [(True, RAM_TIER), (False, BELOW_TIER)])
def test_a_stored_chunk_is_expected_where_the_lookup_found_it_in_node_mode(
        stores_stay: bool, expected: str) -> None:
    planner = LoadPlanner("async", [RAM_TIER, BELOW_TIER], several_groups=False,
                          tokens_per_chunk=256, stores_stay=stores_stay)
    planner.learn(KVTierWorkerMetadata(stored={KEY}))
    assert planner.sources([KEY], lambda _key: BELOW_TIER) == [expected]
    assert planner.sources([KEY], lambda _key: RAM_TIER) == [RAM_TIER]
