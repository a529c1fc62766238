"""The shared tier's sampled eviction (kvtier.tiers.files.victims, issue 28): exact LRU on a small
tree, close to LRU on a large one, and a bounded number of stats however full a shard
directory is."""

from __future__ import annotations

import os
import random
from pathlib import Path

import blake3

from kvtier.core.keys import ChunkKey
from kvtier.tiers.files.chunktree import chunk_parts
from kvtier.tiers.files.fsops import FsOps
from kvtier.tiers.files.victims import SAMPLE_FILES, VictimSampler

DIGEST = "ab" * 16


def make(root: Path, key: bytes, mtime: float) -> None:
    parts = chunk_parts(DIGEST, ChunkKey(key))
    path = root.joinpath(*parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    os.utime(path, (mtime, mtime))


def hashed(i: int) -> bytes:
    return blake3.blake3(i.to_bytes(8, "little")).digest(16)


def test_a_small_tree_is_evicted_in_exact_lru_order(tmp_path: Path) -> None:
    for i in range(5):
        make(tmp_path, hashed(i), 1000.0 + 10 * ((i * 3) % 5))  # ages shuffled across shards
    sampler = VictimSampler(tmp_path, FsOps(), random.Random(1))
    order = []
    for _ in range(5):
        victim = sampler.take()
        assert victim is not None
        os.unlink(tmp_path.joinpath(*victim.parts()))  # as the tier's eviction does
        order.append(victim.mtime)
    assert order == sorted(order) and sampler.take() is None


def test_a_large_tree_gives_victims_from_its_oldest_files(tmp_path: Path) -> None:
    """1,500 files of distinct ages: 100 victims, each among the oldest half, most among
    the oldest fifth (each is one of the oldest 16 of a random 64)."""
    total = 1500
    ages = list(range(total))
    random.Random(2).shuffle(ages)
    for i, age in enumerate(ages):
        make(tmp_path, hashed(i), 1_000_000.0 + age)
    sampler = VictimSampler(tmp_path, FsOps(), random.Random(3))
    ranks = []
    for _ in range(100):
        victim = sampler.take()
        assert victim is not None
        ranks.append((victim.mtime - 1_000_000.0) / total)
    assert max(ranks) < 0.5 and sum(ranks) / len(ranks) < 0.2, sorted(ranks)[-10:]


def test_a_full_shard_directory_costs_a_bounded_number_of_stats(tmp_path: Path) -> None:
    """500 files in one shard directory (as ~1,500 are at 10^8 chunks): one sample stats at
    most SAMPLE_FILES of them."""
    for i in range(500):
        make(tmp_path, bytes([7, 7, 7, 7]) + hashed(i)[4:], 1000.0 + i)
    ops = FsOps()
    sampler = VictimSampler(tmp_path, ops, random.Random(4))
    assert sampler.take() is not None and sampler.samples == 1
    assert ops.snapshot().stats <= SAMPLE_FILES
