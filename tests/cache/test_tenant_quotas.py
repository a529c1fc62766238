"""Per-tenant quotas in the memory tier: one tenant's flood cannot push another's warm set out.

Tenants are cache salts (`ChunkMeta.tenant`); a tier with `tenant_quota` lets no tenant hold
more than its share (or cap), and a tenant at its limit evicts its own least recently used
chunks first. Real memory tiers, through the registry and through a `TieredStore`.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.core.retention import ChunkMeta, TenantLabels, tenant_label
from kvtier.core.store import TieredStore
from kvtier.core.tier import MetaKeeper
from kvtier.errors import ConfigError
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()
CHUNK = bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256)
A, B = ChunkMeta(tenant="salt-A"), ChunkMeta(tenant="salt-B")


def memory(tmp_path: Path, chunks: int, **options: object) -> MemoryTier:
    tier = make_tier("memory", tmp_path, LAYOUT, chunks, **options)
    assert isinstance(tier, MemoryTier) and isinstance(tier, MetaKeeper)
    return tier


def test_a_flooding_tenant_cannot_push_out_another_tenants_warm_set(tmp_path: Path) -> None:
    # 8 slots; each tenant may hold half. B stores its warm set of 4 chunks, A floods 100.
    tier = memory(tmp_path, 8, tenant_quota={"share": 0.5})
    warm = [key(i) for i in range(4)]
    for k in warm:
        assert tier.put(k, memoryview(CHUNK), B)
    for i in range(100, 200):
        assert tier.put(key(i), memoryview(CHUNK), A)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert all(tier.get_into(k, out) for k in warm)
    assert bytes(out) == CHUNK
    # A kept its 4 newest chunks and evicted its own older ones.
    assert [i for i in range(100, 200) if tier.contains(key(i))] == list(range(196, 200))
    usage = {u.tenant: u for u in tier.retention_stats().tenants}
    assert usage[tenant_label("salt-B")].chunks == 4
    assert usage[tenant_label("salt-B")].evictions == 0
    assert usage[tenant_label("salt-A")].chunks == 4
    assert usage[tenant_label("salt-A")].evictions == 96
    assert tier.retention_stats().quota_evictions == 96


def test_without_a_quota_the_same_flood_evicts_the_warm_set(tmp_path: Path) -> None:
    # The control: plain LRU lets A's flood push all of B out (so the test above can fail).
    tier = memory(tmp_path, 8)
    for i in range(4):
        tier.put(key(i), memoryview(CHUNK), B)
    for i in range(100, 200):
        tier.put(key(i), memoryview(CHUNK), A)
    assert not any(tier.contains(key(i)) for i in range(4))


def test_a_tenant_over_its_share_evicts_its_own_lru_chunk_first(tmp_path: Path) -> None:
    tier = memory(tmp_path, 8, tenant_quota={"share": 0.5})
    for i in range(4):
        tier.put(key(i), memoryview(CHUNK), A)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    assert tier.get_into(key(0), out)  # 0 is A's most recently used now
    assert tier.put(key(4), memoryview(CHUNK), A)  # A is at 4 of 8: evicts its LRU, 1
    held = [i for i in range(5) if tier.contains(key(i))]
    assert held == [0, 2, 3, 4]
    # Free slots remain (4 of 8 used): the quota, not the capacity, made the eviction.
    assert tier.stats().chunks == 4


def test_a_tenant_over_its_share_keeps_its_chunk_a_load_reads(tmp_path: Path) -> None:
    """Its least recently used chunk lent out (a load reads it in place): evicting it frees
    no slot until the loan ends, and a second of its chunks went for the put. The next one
    goes instead, and a tenant whose chunks are all lent gets no slot."""
    tier = memory(tmp_path, 8, tenant_quota={"share": 0.5})
    for i in range(4):
        tier.put(key(i), memoryview(CHUNK), A)
    out = memoryview(bytearray(LAYOUT.bytes_per_chunk))
    with tier.borrow(key(0), A) as view:  # a load reads 0 in place
        assert view is not None
        for i in (1, 2, 3):
            assert tier.get_into(key(i), out, A)  # 0 is A's least recently used again
        assert tier.put(key(4), memoryview(CHUNK), A)
        assert [i for i in range(5) if tier.contains(key(i))] == [0, 2, 3, 4]
        assert tier.stats().evictions == 1
        with tier.borrow(key(2), A), tier.borrow(key(3), A), tier.borrow(key(4), A):
            assert not tier.put(key(5), memoryview(CHUNK), A)  # every chunk of A's lent
            assert [i for i in range(6) if tier.contains(key(i))] == [0, 2, 3, 4]
    assert tier.put(key(5), memoryview(CHUNK), A) and tier.stats().evictions == 2
    assert not tier.check()


def test_a_cap_in_bytes_bounds_each_tenant(tmp_path: Path) -> None:
    slot = 4096  # one tiny chunk's slot
    tier = memory(tmp_path, 10, tenant_quota={"cap": 3 * slot})
    for i in range(6):
        tier.put(key(i), memoryview(CHUNK), A)
        tier.put(key(100 + i), memoryview(CHUNK), B)
    tier.put(key(200), memoryview(CHUNK))  # default tenant
    usage = {u.tenant: u.used_bytes for u in tier.retention_stats().tenants}
    assert usage == {tenant_label("salt-A"): 3 * slot, tenant_label("salt-B"): 3 * slot,
                     "default": slot}


def test_the_store_passes_the_tenant_down_and_counts_it(tmp_path: Path) -> None:
    tiers = [make_tier("memory", tmp_path, LAYOUT, 4, tenant_quota={"share": 0.5}),
             make_tier("example", tmp_path, LAYOUT, 64)]
    with TieredStore(tiers) as store:
        for i in range(3):
            assert store.put(key(i), memoryview(CHUNK), meta=B)
        for i in range(10, 20):
            store.put_from(key(i), lambda view: view.__setitem__(slice(None), CHUNK),
                           memoryview(bytearray(LAYOUT.bytes_per_chunk)), meta=A)
        store.flush()
        stats = store.stats()
    memory_usage = {u.tenant: u.chunks for u in stats.retention["memory"].tenants}
    # Each tenant was held to half of the 4 slots (put and put_from alike).
    assert memory_usage == {tenant_label("salt-B"): 2, tenant_label("salt-A"): 2}
    # Written behind with their tenants: the example tier below keeps them all.
    example_usage = {u.tenant: u.chunks for u in stats.retention["example"].tenants}
    assert example_usage == {tenant_label("salt-B"): 3, tenant_label("salt-A"): 10}


def test_a_tenants_puts_in_flight_at_once_count_against_its_quota(tmp_path: Path) -> None:
    """A worker keeps a step's chunks in flight at once (`putting`: their DMAs): each slot
    reserved counts against its tenant's quota until it is stored, as an engine's do. Else
    each reservation passed the check with the others uncounted, and a tenant of a quarter of
    the tier held three quarters."""
    tiers = [make_tier("memory", tmp_path, LAYOUT, 4, tenant_quota={"share": 0.25}),
             make_tier("example", tmp_path, LAYOUT, 64)]
    tier = tiers[0]
    assert isinstance(tier, MemoryTier)
    with TieredStore(tiers) as store, ExitStack() as in_flight:
        assert store.put(key(0), memoryview(CHUNK), meta=A)  # A at its one slot
        puts = [in_flight.enter_context(store.putting(
            key(i), memoryview(bytearray(LAYOUT.bytes_per_chunk)), meta=A)) for i in (1, 2, 3)]
        # The first evicted A's own chunk 0; the others find A at its quota with nothing of
        # its own left to evict: written below only (into the caller's spare).
        assert [put.in_place for put in puts] == [True, False, False]
        puts[1].cancel()
        puts[2].cancel()
        assert puts[0].data is not None
        puts[0].data[:] = CHUNK
        in_flight.close()
        assert [put.stored for put in puts] == [True, False, False]
        assert [tier.contains(key(i)) for i in range(4)] == [False, True, False, False]
        assert {u.tenant: u.chunks for u in tier.retention_stats().tenants} == {
            tenant_label("salt-A"): 1}
        # B, meanwhile, is not held back by A's reservations.
        assert store.put(key(10), memoryview(CHUNK), meta=B)
        assert tier.check() == []


def test_tenant_labels_are_bounded_and_never_the_salt() -> None:
    label = tenant_label("my-secret-salt")
    assert label.startswith("t-") and "secret" not in label
    assert tenant_label("my-secret-salt") == label  # stable
    assert tenant_label(None) == "default"
    # The process-wide table is bounded; a table of its own here, so that the 200 tenants
    # do not use up the labels of the other tests in this process.
    table = TenantLabels(32)
    labels = {table.label(f"tenant-{i}") for i in range(200)}
    assert "other" in labels and len(labels) == 33
    assert table.label("tenant-0") == tenant_label("tenant-0")  # the same label everywhere
    assert "my-secret-salt" not in repr(ChunkMeta(tenant="my-secret-salt"))


@pytest.mark.parametrize("quota, allowed", [
    ({"share": 0}, "greater than 0"),
    ({"share": 1.5}, "less than or equal to 1"),
    ({}, "exactly one of share"),
    ({"share": 0.5, "cap": "1GiB"}, "exactly one of share"),
    ({"cap": "lots"}, "size"),
    ({"cap": 0}, "greater than 0"),  # every tenant would hold nothing: the tier stores nothing
    ({"cap": "0GiB"}, "greater than 0"),
    ({"shares": 0.5}, "unknown field"),
])
def test_bad_quotas_name_the_field_and_what_is_allowed(quota: dict[str, object],
                                                       allowed: str) -> None:
    with pytest.raises(ConfigError) as raised:
        StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1GiB",
                                      "tenant_quota": quota}]})
    assert "tiers.0.memory.tenant_quota" in raised.value.field
    assert allowed in raised.value.allowed
