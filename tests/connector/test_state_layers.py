"""The scheduler's record of chunks without a state (models with state layers): a hit never
ends on one, and a later report of the same chunk stored with a state does not undo it (a store
of a chunk a tier holds rewrites nothing: the stateless copy may be what the next load reads).
Guards the second failed load test_state_models' restart test once saw (issue 41)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.core.keys import ChunkKey
from kvtier.integrations.vllm.groups import ChunkGroups
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.statelayers import StateLayers

GROUPS = ChunkGroups(layer_names=(("attn",),), kinds=("full",),
                     state_layer_names=(("conv",),), state_group_ids=(1,),
                     attention_group_ids=(0,), state_bytes_per_layer=64)
KEYS = [ChunkKey(bytes([i]) * 16) for i in range(4)]


def test_a_hit_backs_off_over_a_chunk_found_without_its_state_for_good() -> None:
    layers = StateLayers(GROUPS, block_size=16)
    assert layers.hit_end(KEYS, 4) == 4  # unknown: tried
    layers.learn(KVTierWorkerMetadata(without_state={KEYS[3]}))
    assert layers.hit_end(KEYS, 4) == 3
    layers.learn(KVTierWorkerMetadata())  # a later report (e.g. its recompute's store)
    assert layers.hit_end(KEYS, 4) == 3
    layers.learn(KVTierWorkerMetadata(without_state={KEYS[2]}))
    assert layers.hit_end(KEYS, 4) == 2
