"""The tiers below RAM encrypting at rest: disk and shared directories on tmp_path and a real
redis-server, each built through the registry as a store builds it, with an operator secret
from an environment variable, the tenants noted as the vLLM worker notes them.

The story: two tenants' chunks are stored sealed (their bytes are not in the storage in
clear), each opens only under its own tenant's key (another key: a counted miss,
Failure.NO_KEY, and the chunk is kept for the readers that hold its key), a tampered chunk
is a counted miss (Failure.AUTH) and removed, and unsalted chunks stay in clear. (`kvtier
inspect` over an encrypting tier shows no key material: tests/tools/test_inspect_sealed.py.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import tierkit
import xxhash
from tierkit import key, make_tier

from kvtier.core.chunkformat import HEADER_BYTES
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META, ChunkMeta, tenant_id
from kvtier.core.store import TieredStore
from kvtier.core.tier import DECLINED, OK, Failure, Tier

KINDS = ["disk", "shared", pytest.param("redis", marks=pytest.mark.redis),
         pytest.param("s3", marks=pytest.mark.s3)]
SECRET = "operator-secret-for-the-sealed-tier-tests-0123456789"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16",
                  tokens_per_chunk=16)


def payload(i: int) -> bytes:
    return bytes((i * 13 + j * 7) % 251 for j in range(LAYOUT.bytes_per_chunk))


A = ChunkMeta(tenant=tenant_id("salt-a"))  # what every call about tenant a's chunks carries
B = ChunkMeta(tenant=tenant_id("salt-b"))


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVTIER_SEAL_SECRET", SECRET)
    yield


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        tierkit.REDIS_URL = request.getfixturevalue("redis_url")
    if request.param == "s3":
        tierkit.S3_ENDPOINT = request.getfixturevalue("s3_session")
    return str(request.param)


def sealed_tier(kind: str, tmp_path: Path, **options: Any) -> Tier:
    return make_tier(kind, tmp_path, LAYOUT, 8, encryption_secret_env="KVTIER_SEAL_SECRET",
                     **options)


def raw_values(kind: str, tier: Tier, k: bytes) -> tuple[bytes, bytes]:
    """The chunk as stored: (header, body)."""
    if kind == "redis":
        client = redis.Redis.from_url(str(tierkit.REDIS_URL))
        name = tier.names.chunk(k)  # type: ignore[attr-defined]
        parts = client.hlen(name) - 1
        return (client.hget(name, "h"),
                b"".join(client.hget(name, str(n)) or b"" for n in range(parts)))
    if kind == "s3":
        data = tierkit.s3_object(tier, k)
        return data[:HEADER_BYTES], data[HEADER_BYTES:]
    data = tier.files.path_of(k).read_bytes()  # type: ignore[attr-defined]
    return data[:HEADER_BYTES], data[HEADER_BYTES:]


def test_two_tenants_chunks_are_sealed_and_open_only_under_their_own_key(
        kind: str, tmp_path: Path) -> None:
    tier = sealed_tier(kind, tmp_path)
    assert tier.put(key(1), memoryview(payload(1)), A) == OK
    assert tier.put(key(2), memoryview(payload(2)), B) == OK
    for i in (1, 2):
        _, body = raw_values(kind, tier, key(i))
        assert payload(i)[:256] not in body  # not in clear in the storage
    out = bytearray(LAYOUT.bytes_per_chunk)
    assert tier.get_into(key(2), memoryview(out), B) == OK and bytes(out) == payload(2)
    # Tenant b's key for tenant a's chunk, or no tenant at all (a read that did not say
    # whose chunk it is): a miss, counted, never a's KV handed over; and not tampering (a's
    # own reader still holds the key): the chunk is kept.
    for reader in (B, DEFAULT_META):
        assert tier.get_into(key(1), memoryview(out), reader).failure is Failure.NO_KEY
        assert tier.stats().corrupt_reads == 0 and tier.contains(key(1))
    assert tier.get_into(key(1), memoryview(out), A) == OK and bytes(out) == payload(1)
    tier.close()


def test_an_engine_with_another_secret_cannot_read_them(kind: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    writer = sealed_tier(kind, tmp_path)
    assert writer.put(key(3), memoryview(payload(3)), A) == OK
    writer.close()
    monkeypatch.setenv("KVTIER_SEAL_SECRET", SECRET[::-1])
    reader = sealed_tier(kind, tmp_path)
    result = reader.get_into(key(3), memoryview(bytearray(LAYOUT.bytes_per_chunk)), A)
    assert result.failure is Failure.NO_KEY
    assert reader.contains(key(3))  # kept: engines with the first secret still read it
    reader.close()


def test_a_rotated_secrets_chunks_age_out_of_a_shared_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the secret is rotated, the chunks sealed under the old one are kept (an engine
    not yet restarted may read them) but this engine neither reads nor stores them fresh:
    the shared tier's LRU is the files' mtimes, and its reads and puts touched them, so a hot
    prefix stayed unreadable for ever and its new copy was never stored."""
    old = sealed_tier("shared", tmp_path)
    assert old.put(key(6), memoryview(payload(6)), A) == OK
    old.close()
    path = tmp_path / "shared"
    chunk = next(p for p in path.rglob("*.kvc"))
    os.utime(chunk, (1_000_000, 1_000_000))  # long unused: the first to go
    monkeypatch.setenv("KVTIER_SEAL_SECRET", SECRET[::-1])
    new = sealed_tier("shared", tmp_path)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert new.get_into(key(6), out, A).failure is Failure.NO_KEY
    assert new.put(key(6), memoryview(payload(6)), A) == DECLINED  # not stored: not ours
    assert chunk.stat().st_mtime == 1_000_000, "neither the read nor the put touched it"
    chunk.unlink()  # evicted, or removed by kvtier gc
    other = sealed_tier("shared", tmp_path)  # another engine with the new secret stores it
    assert other.put(key(6), memoryview(payload(6)), A) == OK
    other.close()
    assert new.get_into(key(6), out, A) == OK and bytes(out) == payload(6)
    assert new.put(key(6), memoryview(payload(6)), A) == OK  # one it reads: held, touched
    new.close()


def test_tampered_ciphertext_is_a_counted_miss(kind: str, tmp_path: Path) -> None:
    """Bytes changed and the stored checksums fixed up (whoever writes the storage can):
    the GCM tag catches it."""
    tier = sealed_tier(kind, tmp_path)
    for i in (4, 5):
        assert tier.put(key(i), memoryview(payload(i)), A) == OK
    header, body = raw_values(kind, tier, key(4))
    forged_body = bytearray(body)
    forged_body[5] ^= 0x80
    fields = bytearray(header[:104])
    body_bytes = int.from_bytes(fields[68:76], "little")
    fields[76:84] = xxhash.xxh3_64_intdigest(bytes(forged_body[:body_bytes])).to_bytes(
        8, "little")
    forged_header = (bytes(fields) + xxhash.xxh3_64_intdigest(bytes(fields)).to_bytes(
        8, "little")).ljust(HEADER_BYTES, b"\0")
    if kind == "redis":
        client = redis.Redis.from_url(str(tierkit.REDIS_URL))
        name = tier.names.chunk(key(4))  # type: ignore[attr-defined]
        client.hset(name, "h", forged_header)
        part = tier.part_bytes  # type: ignore[attr-defined]
        for n in range(client.hlen(name) - 1):
            client.hset(name, str(n), bytes(forged_body[n * part:(n + 1) * part]))
    elif kind == "s3":
        tierkit.s3_write(tier, key(4), forged_header + bytes(forged_body))
    else:
        tier.files.path_of(key(4)).write_bytes(  # type: ignore[attr-defined]
            forged_header + bytes(forged_body))
    out = bytearray(LAYOUT.bytes_per_chunk)
    assert tier.get_into(key(4), memoryview(out), A).failure is Failure.AUTH
    assert tier.get_into(key(5), memoryview(out), A) == OK and bytes(out) == payload(5)
    tier.close()


def test_unsalted_chunks_stay_in_clear_unless_asked(kind: str, tmp_path: Path) -> None:
    tier = sealed_tier(kind, tmp_path / "clear")
    assert tier.put(key(6), memoryview(payload(6))) == OK
    assert raw_values(kind, tier, key(6))[1].startswith(payload(6))
    tier.delete(key(6))
    sealed = sealed_tier(kind, tmp_path / "sealed", encrypt_unsalted=True)
    assert sealed.put(key(6), memoryview(payload(6))) == OK
    assert payload(6)[:256] not in raw_values(kind, sealed, key(6))[1]
    out = bytearray(LAYOUT.bytes_per_chunk)
    assert sealed.get_into(key(6), memoryview(out)) == OK and bytes(out) == payload(6)


def test_a_store_read_carries_the_tenant_and_a_keyless_read_deletes_nothing(
        kind: str, tmp_path: Path) -> None:
    """Written by one process, read by the next through a store (memory above the sealed
    tier), as a prefetch after a restart does: a read that says whose chunk it is opens it
    (and promotes it); one that does not is a miss that leaves the chunk where it is."""
    writer = sealed_tier(kind, tmp_path)
    assert writer.put(key(8), memoryview(payload(8)), A) == OK
    writer.close()
    top = make_tier("memory", tmp_path, LAYOUT, 4)
    store = TieredStore([top, sealed_tier(kind, tmp_path)])
    spare = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    with store.lend_as_landed([key(8)], [spare]) as lending:
        assert list(lending) == []
    assert store.stats().failures[store.tiers[1].name] == {"no_key": 1}
    assert store.contains(key(8))  # kept
    with store.lend_as_landed([key(8)], [spare], [A]) as lending:
        assert [bytes(loan.view.data) for loan in lending] == [payload(8)]
    assert top.contains(key(8))  # promoted
    store.close()
