"""Capacities mean one thing at any tensor-parallel size: the total of one engine, like vLLM's
`cpu_bytes_to_use` / `--kv-offloading-size` (issue 11, item 4). An operator who configures a
memory tier of 8 MiB on a TP 4 engine gets 8 MiB of RAM in all, not 8 MiB per rank (32 MiB).

Each rank builds its store from `StoreConfig.per_rank(world)`: tiers that a rank enforces on
its own chunks (memory, disk, redis with a bound) get an even share; a shared directory's quota
is one ledger that every writer enforces together, so every rank enforces the whole of it.
No vLLM here: the stores are built as the connector's worker builds them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.layout import KVLayout
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.tiers import open_store
from kvtier.tiers.files.disk import DiskTier
from kvtier.tiers.storeconfig import StoreConfig

MIB = 1024**2


def _config(root: Path) -> StoreConfig:
    return StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": "8MiB"},
        {"kind": "disk", "path": str(root / "disk"), "capacity": "64MiB"},
        {"kind": "shared", "path": str(root / "shared"), "capacity": "1GiB"},
        {"kind": "redis", "capacity": "16MiB"},
        {"kind": "redis", "name": "server-bound", "capacity": 0},
    ]})


def _layout(rank: int, world: int) -> KVLayout:
    # A model with 8 KV heads: each of `world` ranks holds 8 / world of them.
    return KVLayout(num_layers=2, num_kv_heads=8 // world, head_size=64, dtype="bfloat16",
                    tokens_per_chunk=64, tp_rank=rank, tp_world_size=world)


def test_each_rank_gets_its_share_of_the_per_rank_tiers(tmp_path: Path) -> None:
    """At TP 4, memory, disk and a bounded redis tier are split in four; the shared
    directory's quota and a redis tier left to the server's maxmemory (0) are not."""
    capacities = {t.tier_name: t.capacity for t in _config(tmp_path).per_rank(4).tiers}
    assert capacities == {"memory": 2 * MIB, "disk": 16 * MIB, "shared": 1024 * MIB,
                          "redis": 4 * MIB, "server-bound": 0}


def test_tp_1_is_the_config_itself_and_odd_sizes_round_down(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert config.per_rank(1) is config
    odd = StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": 10}]}).per_rank(3)
    assert odd.tiers[0].capacity == 3  # 3 ranks x 3 B <= 10 B: never more than configured


def test_a_positive_bound_stays_a_bound() -> None:
    """A redis tier's capacity 0 means "the server's maxmemory decides": a tiny bound split
    between many ranks must not turn into 0, i.e. into no bound of kvtier's at all."""
    tiny = StoreConfig.parse({"tiers": [{"kind": "redis", "capacity": 3}]}).per_rank(8)
    assert tiny.tiers[0].capacity == 1


@pytest.mark.parametrize("world", [0, -2, True])
def test_a_nonsense_world_size_is_a_config_error(tmp_path: Path, world: int) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        _config(tmp_path).per_rank(world)


def test_four_ranks_of_one_engine_hold_the_configured_total(tmp_path: Path) -> None:
    """The ranks' stores, built as the worker builds them, allocate 8 MiB of RAM in all, and
    each rank's disk tier keeps 64/4 MiB under its own layout directory."""
    config = StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": "8MiB"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]})
    stores = [open_store(config.per_rank(4), _layout(rank, 4)) for rank in range(4)]
    try:
        memory = [store.tiers[0] for store in stores]
        disk = [store.tiers[1] for store in stores]
        assert all(isinstance(t, DiskTier) for t in disk)
        assert sum(t.stats().capacity_bytes for t in memory) <= 8 * MIB
        assert sum(t.stats().capacity_bytes for t in memory) > 7 * MIB  # not starved either
        assert [t.stats().capacity_bytes for t in disk] == [16 * MIB] * 4
        # one layout directory per rank
        assert len({t.files.directory for t in disk if isinstance(t, DiskTier)}) == 4
    finally:
        for store in stores:
            store.close()


def test_the_scheduler_index_counts_whole_chunks() -> None:
    """The scheduler's index bound is the chunks the tiers hold together; a chunk key stands
    for one shard per rank, so the bound is the same at TP 1 and TP 4 for the same model."""
    config = ConnectorConfig.parse({"tiers": [{"kind": "memory", "capacity": "512MiB"}]})
    tp1 = config.index_keys(_layout(0, 1).bytes_per_chunk)
    tp4 = config.index_keys(sum(_layout(rank, 4).bytes_per_chunk for rank in range(4)))
    assert tp1 == tp4 == 512 * MIB // _layout(0, 1).bytes_per_chunk
