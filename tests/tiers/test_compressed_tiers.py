"""The tiers below RAM with a codec on: disk and shared directories on tmp_path, and a real
redis-server (tests/conftest.py), each built through the registry as a store builds it.

The story: a compressed tier gives back every byte (lossless codecs), takes less room than the
payload and so holds more chunks in the same capacity, is read by engines configured with any
other codec, survives a restart, and turns damaged compressed bytes or a codec it does not
know into a counted miss (the chunk removed), never wrong KV and never an exception.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import redis
import tierkit
import xxhash
from tierkit import footprint_bytes, key, make_tier

from kvtier.core.chunkformat import HEADER_BYTES
from kvtier.core.layout import KVLayout
from kvtier.core.store import TieredStore
from kvtier.core.tier import OK, Failure, Tier
from kvtier.tiers.example import ExampleTier, ExampleTierConfig

KINDS = ["disk", "shared", pytest.param("redis", marks=pytest.mark.redis)]
LOSSLESS = ["zstd", "lz4"]
# 2 layers x 2 heads x 64 bf16, K and V: 1 KiB a token, 64 KiB a 64-token chunk (files pad
# to 4 KiB: a smaller chunk would hide what compression saves)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16",
                  tokens_per_chunk=64)


def kv(i: int, layout: KVLayout = LAYOUT) -> bytes:
    """KV-like bf16 content for chunk i (distinct per i, compressible like real KV)."""
    rng = np.random.default_rng(i)
    values = rng.standard_normal(layout.bytes_per_chunk // 2) * (1 + i % 3)
    return values.astype(ml_dtypes.bfloat16).tobytes()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        tierkit.REDIS_URL = request.getfixturevalue("redis_url")
    return str(request.param)


def tier_of(kind: str, tmp_path: Path, codec: str, capacity_chunks: int = 8,
            **options: Any) -> Tier:
    return make_tier(kind, tmp_path, LAYOUT, capacity_chunks, codec=codec, **options)


@pytest.mark.parametrize("codec", LOSSLESS)
def test_a_compressed_tier_gives_back_every_byte(kind: str, codec: str, tmp_path: Path) -> None:
    tier = tier_of(kind, tmp_path, codec)
    for i in range(4):
        assert tier.put(key(i), memoryview(kv(i))) == OK
    for i in (3, 0, 2, 1):
        out = bytearray(LAYOUT.bytes_per_chunk)
        assert tier.get_into(key(i), memoryview(out)) == OK
        assert bytes(out) == kv(i)
    stats = tier.stats()
    assert (stats.hits, stats.corrupt_reads, stats.bytes_read) == (4, 0, 4 * len(kv(0)))
    tier.close()


def stored_bytes(kind: str, tmp_path: Path) -> int:
    """What the tier's storage holds: file sizes, or the lengths of the chunks' fields."""
    if kind != "redis":
        return sum(p.stat().st_size for p in (tmp_path / kind).rglob("*.kvc"))
    client = redis.Redis.from_url(str(tierkit.REDIS_URL))
    return sum(int(client.hstrlen(name, field)) for name in client.scan_iter("kvtier:*:c")
               for field in client.hkeys(name))


@pytest.mark.parametrize("codec", [*LOSSLESS, "fp8"])
def test_compressed_chunks_take_less_room_than_the_payload(kind: str, codec: str,
                                                           tmp_path: Path) -> None:
    plain = tier_of(kind, tmp_path / "plain", "none")
    packed = tier_of(kind, tmp_path / "packed", codec)
    if kind == "redis":  # one server: measure one tier at a time
        plain.put(key(1), memoryview(kv(1)))
        plain_bytes = stored_bytes(kind, tmp_path / "plain")
        plain.delete(key(1))
        packed.put(key(1), memoryview(kv(1)))
        packed_bytes = stored_bytes(kind, tmp_path / "packed")
    else:
        plain.put(key(1), memoryview(kv(1)))
        packed.put(key(1), memoryview(kv(1)))
        plain_bytes = stored_bytes(kind, tmp_path / "plain")
        packed_bytes = stored_bytes(kind, tmp_path / "packed")
    assert packed_bytes < (0.6 if codec == "fp8" else 0.95) * plain_bytes
    out = bytearray(LAYOUT.bytes_per_chunk)
    assert packed.get_into(key(1), memoryview(out)) == OK
    if codec == "fp8":  # LOSSY: close, not equal
        got = np.frombuffer(out, ml_dtypes.bfloat16).astype(np.float32)
        want = np.frombuffer(kv(1), ml_dtypes.bfloat16).astype(np.float32)
        assert bytes(out) != kv(1) and np.abs(got - want).max() < 0.1 * np.abs(want).max()
    plain.close()
    packed.close()


@pytest.mark.parametrize("kind_", ["disk", "shared"])
def test_a_compressed_file_tier_holds_more_chunks_in_the_same_capacity(
        kind_: str, tmp_path: Path) -> None:
    """The same capacity and puts, with and without zstd: compressed, the tier keeps more
    chunks, and never more bytes than its capacity (by its stats and on disk)."""
    capacity = 8 * footprint_bytes(kind_, LAYOUT)
    most_held = {}
    for codec in ("none", "zstd"):
        tier = tier_of(kind_, tmp_path / codec, codec, capacity_chunks=8)
        most_held[codec] = 0
        for i in range(16):
            assert tier.put(key(i), memoryview(kv(i))) == OK
            assert tier.stats().used_bytes <= capacity
            assert stored_bytes(kind_, tmp_path / codec) <= capacity
            held = [j for j in range(16) if tier.contains(key(j))]
            assert tier.stats().chunks == len(held)
            most_held[codec] = max(most_held[codec], len(held))
        out = bytearray(LAYOUT.bytes_per_chunk)
        for i in held:
            assert tier.get_into(key(i), memoryview(out)) == OK and bytes(out) == kv(i)
    # (the shared tier evicts down to 90% of its quota: compare the most it held)
    assert most_held["zstd"] > most_held["none"] == 8


def test_readers_decode_what_writers_with_another_codec_stored(kind: str,
                                                               tmp_path: Path) -> None:
    """Engines sharing storage may be configured differently (a rolling change of codec; a
    disk tier restarted with another codec)."""
    codecs = ("zstd", "lz4", "none")
    for i, codec in enumerate(codecs):
        writer = tier_of(kind, tmp_path, codec)
        assert writer.put(key(i), memoryview(kv(i))) == OK
        writer.close()
    for codec in codecs:
        reader = tier_of(kind, tmp_path, codec)
        for i in range(3):
            out = bytearray(LAYOUT.bytes_per_chunk)
            assert reader.get_into(key(i), memoryview(out)) == OK and bytes(out) == kv(i)
        reader.close()


@pytest.mark.parametrize("kind_", ["disk", "shared"])
def test_compressed_chunks_survive_a_restart(kind_: str, tmp_path: Path) -> None:
    tier = tier_of(kind_, tmp_path, "lz4")
    for i in range(3):
        tier.put(key(i), memoryview(kv(i)))
    used = tier.stats().used_bytes
    tier.close()
    again = tier_of(kind_, tmp_path, "lz4")
    assert again.stats().chunks == 3 and again.stats().used_bytes == used
    assert used == stored_bytes(kind_, tmp_path) < 3 * footprint_bytes(kind_, LAYOUT)
    out = bytearray(LAYOUT.bytes_per_chunk)
    assert again.get_into(key(2), memoryview(out)) == OK and bytes(out) == kv(2)


# -- damage --------------------------------------------------------------------------------

def _header_and_body(kind: str, tier: Tier, k: bytes) -> tuple[bytes, bytes]:
    if kind == "redis":
        client = redis.Redis.from_url(str(tierkit.REDIS_URL))
        name = tier.names.chunk(k)  # type: ignore[attr-defined]
        return client.hget(name, "h"), client.hget(name, "0") or b""
    data = tier.files.path_of(k).read_bytes()  # type: ignore[attr-defined]
    return data[:HEADER_BYTES], data[HEADER_BYTES:]


def _replace(kind: str, tier: Tier, k: bytes, header: bytes, body: bytes) -> None:
    if kind == "redis":
        client = redis.Redis.from_url(str(tierkit.REDIS_URL))
        client.hset(tier.names.chunk(k), mapping={"h": header, "0": body})  # type: ignore[attr-defined]
        return
    tier.files.path_of(k).write_bytes(header + body)  # type: ignore[attr-defined]


def _with_codec(header: bytes, codec_id: int) -> bytes:
    """A version 2 header naming another codec, its header checksum valid again."""
    fields = bytearray(header[:104])  # the version 2 fields (then their checksum)
    fields[60] = codec_id
    return (bytes(fields) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(fields)))
            ).ljust(HEADER_BYTES, b"\0")


@pytest.mark.parametrize("damage", ["flipped byte", "unknown codec"])
def test_a_damaged_compressed_chunk_is_a_counted_miss_and_removed(
        kind: str, damage: str, tmp_path: Path) -> None:
    tier = tier_of(kind, tmp_path, "zstd")
    assert tier.put(key(1), memoryview(kv(1))) == OK
    assert tier.put(key(2), memoryview(kv(2))) == OK
    header, body = _header_and_body(kind, tier, key(1))
    if damage == "flipped byte":
        flipped = bytearray(body)
        flipped[100] ^= 0x04
        _replace(kind, tier, key(1), header, bytes(flipped))
    else:  # written by a newer kvtier with a codec this one does not know
        _replace(kind, tier, key(1), _with_codec(header, 77), body)
    out = bytearray(LAYOUT.bytes_per_chunk)
    result = tier.get_into(key(1), memoryview(out))
    assert result.failure is (Failure.CORRUPT if damage == "flipped byte" else Failure.CODEC)
    assert not tier.contains(key(1))
    stats = tier.stats()
    assert (stats.corrupt_reads, stats.misses) == (1, 1)
    assert tier.get_into(key(2), memoryview(out)) == OK and bytes(out) == kv(2)


def test_the_store_counts_a_codec_failure_by_reason_and_reads_the_next_tier(
        tmp_path: Path) -> None:
    """RAM lost the chunk, disk's copy has a codec this reader does not know: a miss
    counted as "codec" (vllm:kvtier_tier_failures_total{reason="codec"}), never wrong KV."""
    top = ExampleTier(ExampleTierConfig(kind="example", name="ram",
                                        capacity=4 * LAYOUT.bytes_per_chunk), LAYOUT)
    disk = tier_of("disk", tmp_path, "zstd")
    with TieredStore([top, disk]) as store:
        assert store.put(key(1), memoryview(kv(1)))
        assert store.flush(timeout_s=10)
        top.delete(key(1))
        header, body = _header_and_body("disk", disk, key(1))
        _replace("disk", disk, key(1), _with_codec(header, 200), body)
        time.sleep(0.01)
        assert store.get_into(key(1), memoryview(bytearray(LAYOUT.bytes_per_chunk))) is None
        assert store.stats().failures["disk"] == {"codec": 1}
