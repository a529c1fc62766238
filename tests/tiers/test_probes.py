"""Probes: how vLLM's scheduler (a process without the tiers) finds chunks that a worker or
another engine stored, through the disk, shared and redis tiers, with no side effects.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from tierkit import key

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.locator import ChunkLocator, Located, LookupStatus
from kvtier.tiers import build_probe, open_store
from kvtier.tiers.storeconfig import StoreConfig

RANKS = [KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_chunk=16, tp_rank=r, tp_world_size=2) for r in range(2)]


def located_once_ready(locator: ChunkLocator, keys: list[ChunkKey]) -> Located:
    """The locator's answer once its probes on a thread have finished (RETRY until then)."""
    for _ in range(500):
        located = locator.locate("req", keys)
        if located.status is not LookupStatus.RETRY:
            return located
        time.sleep(0.01)
    raise AssertionError("the probes did not answer in 5 s")


def _tier(kind: str, tmp_path: Path, redis_url: str) -> dict[str, object]:
    if kind == "redis":
        return {"kind": "redis", "url": redis_url, "capacity": 0}
    return {"kind": kind, "path": str(tmp_path / kind), "capacity": "1MiB"}


@pytest.mark.parametrize("kind", ["disk", "shared", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_chunk_counts_only_once_every_tp_rank_stored_its_shard(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Rank 0 stores chunks 0-2, rank 1 only chunks 0-1: the scheduler sees a 2-chunk prefix."""
    redis_url = request.getfixturevalue("redis_url") if kind == "redis" else ""
    config = StoreConfig.parse({"tiers": [_tier(kind, tmp_path, redis_url)]})
    for layout, stored in zip(RANKS, (3, 2)):
        with open_store(config, layout) as store:
            for i in range(stored):
                store.put(key(i), memoryview(np.full(layout.bytes_per_chunk, i, np.uint8)))
    probe = build_probe(config.tiers[0], RANKS)
    assert probe is not None
    assert [probe.contains(key(i)) for i in range(4)] == [True, True, False, False]
    locator = ChunkLocator({"tier": probe}, max_keys=100)
    keys = [key(i) for i in range(4)]
    if not probe.blocking_ok:  # shared and redis probes run on a thread: ask until ready
        assert locator.locate("req", keys).status is LookupStatus.RETRY
    assert located_once_ready(locator, keys) == Located(LookupStatus.HIT, 2)
    # Found chunks are remembered: the next lookup is answered from the index alone.
    assert locator.index.prefix_length(keys) == 2
    locator.close()


def test_memory_tiers_have_no_probe() -> None:
    config = StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}]})
    assert build_probe(config.tiers[0], RANKS) is None


@pytest.mark.redis
def test_a_remote_probe_finds_a_long_prefix_in_a_few_round_trips(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix of 40 chunks held in redis (then 10 not held), behind a disk tier holding the
    first 3: the redis probe is asked in batches of 8, 16, 32 keys (one pipelined round trip
    each), never key by key; the disk probe key by key, as before. The answer is the same as
    asking each key alone. The calls are counted by wrappers that delegate: they change
    nothing."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                      tokens_per_chunk=16)
    configs = {kind: StoreConfig.parse({"tiers": [_tier(kind, tmp_path, redis_url)]})
               for kind in ("disk", "redis")}
    for kind, held in (("disk", 3), ("redis", 40)):
        with open_store(configs[kind], layout) as store:
            for i in range(held):
                store.put(key(i), memoryview(np.full(layout.bytes_per_chunk, i, np.uint8)))
    probes = {kind: build_probe(configs[kind].tiers[0], [layout]) for kind in configs}
    [remote] = probes["redis"].tiers  # type: ignore[union-attr]
    asked: list[int] = []
    batch = remote.contains_many
    monkeypatch.setattr(remote, "contains_many", lambda ks: asked.append(len(ks)) or batch(ks))
    monkeypatch.setattr(remote, "contains", lambda k: pytest.fail("asked key by key"))
    locator = ChunkLocator(probes, max_keys=1000)  # type: ignore[arg-type]
    keys = [key(i) for i in range(50)]
    assert located_once_ready(locator, keys) == Located(LookupStatus.HIT, 40)
    # the disk probe runs inline first (keys 0-2); the rest on the probe thread: keys 3-10,
    # 11-26, then 27-49 (32 asked for, 23 left)
    assert asked == [8, 16, 23]
    assert [locator.index.found_in(k) for k in keys[:4]] == ["disk"] * 3 + ["redis"]
    locator.close()
