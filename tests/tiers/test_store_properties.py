"""Properties of the TieredStore (memory -> disk -> shared), checked by hypothesis on random
sequences of puts, gets and lookups over a small key space, with tiers small enough that
every sequence evicts.

- What was put and is still held somewhere is got back byte for byte.
- No tier ever holds more than its capacity.
- `lookup` is always a prefix: the first num_chunks keys are all held (each by the tier it
  names, and gettable), and the next one is held by no tier.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tierkit import key, tier_settings, tiny_layout

from kvtier.core.store import TieredStore
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout(4)  # 1 KiB chunks
KEYS = 12


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 7 + bytes((i * 13 + j) % 256
                                        for j in range(LAYOUT.bytes_per_chunk - 7))


def _store(root: Path, eviction: str) -> TieredStore:
    tiers = [tier_settings("memory", root, LAYOUT, 2, eviction=eviction),
             tier_settings("disk", root, LAYOUT, 4, eviction=eviction, o_direct="off"),
             tier_settings("shared", root, LAYOUT, 6)]
    return open_store(StoreConfig.parse({"tiers": tiers, "io_threads": 2}), LAYOUT)


def _held(store: TieredStore, i: int) -> list[str]:
    return [t.name for t in store.tiers if t.contains(key(i))]


def _check_capacity(store: TieredStore, root: Path) -> None:
    for stats in store.stats().tiers:
        assert stats.used_bytes <= stats.capacity_bytes, stats
    for kind in ("disk", "shared"):
        on_disk = sum(p.stat().st_size for p in (root / kind).rglob("*.kvc"))
        capacity = next(s.capacity_bytes for s in store.stats().tiers if s.name == kind)
        assert on_disk <= capacity, (kind, on_disk, capacity)


def _check_lookup(store: TieredStore, keys: list[int]) -> None:
    result = store.lookup([key(i) for i in keys])
    assert result.num_chunks == len(result.tiers)
    for i, tier_name in zip(keys, result.tiers):
        assert tier_name == _held(store, i)[0], "lookup must name the fastest holder"
    if result.num_chunks < len(keys):
        assert _held(store, keys[result.num_chunks]) == [], "lookup stopped at a held key"
    out = bytearray(LAYOUT.bytes_per_chunk)
    for i in keys[: result.num_chunks]:
        # A read from a lower tier promotes the chunk into the tiers above it behind the read
        # (write-behind), whose eviction may drop a key this loop reads next: let it land
        # first, or the read races it.
        assert store.flush(timeout_s=10)
        if not _held(store, i):
            continue  # evicted by an earlier read's promotion: a miss, as allowed
        assert store.get_into(key(i), memoryview(out)) is not None
        assert bytes(out) == payload(i)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, KEYS - 1)),
        st.tuples(st.just("get"), st.integers(0, KEYS - 1)),
        st.tuples(st.just("lookup"), st.lists(st.integers(0, KEYS - 1), min_size=1,
                                              max_size=5)),
    ),
    min_size=1, max_size=25,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, eviction=st.sampled_from(["lru", "arc"]))
def test_store_properties_hold_for_any_sequence_of_operations(
    ops: list[tuple[str, object]], eviction: str,
) -> None:
    """A random workload against a 2/4/6-chunk store: after every step, capacity holds;
    a get returns data exactly when some tier holds the key, and then the right bytes;
    lookups are prefixes of keys that really can be read."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = _store(root, eviction)
        try:
            out = bytearray(LAYOUT.bytes_per_chunk)
            for op, arg in ops:
                if op == "put":
                    assert store.put(key(arg), memoryview(payload(arg)))  # type: ignore[arg-type]
                    assert store.tiers[0].contains(key(arg))  # type: ignore[arg-type]
                elif op == "get":
                    held = _held(store, arg)  # type: ignore[arg-type]
                    served = store.get_into(key(arg), memoryview(out))  # type: ignore[arg-type]
                    assert served == (held[0] if held else None)
                    if served:
                        assert bytes(out) == payload(arg)  # type: ignore[arg-type]
                else:
                    _check_lookup(store, arg)  # type: ignore[arg-type]
                assert store.flush(timeout_s=10)
                _check_capacity(store, root)
            # Everything still held anywhere reads back exactly.
            for i in range(KEYS):
                assert store.flush(timeout_s=10)  # the promotions of the reads before
                if _held(store, i):
                    assert store.get_into(key(i), memoryview(out)) is not None
                    assert bytes(out) == payload(i)
            assert store.flush(timeout_s=10)
            _check_capacity(store, root)
        finally:
            store.close()


def test_a_chunk_put_recently_is_in_every_tier_after_the_writes_behind_land(
    tmp_path: Path,
) -> None:
    """put writes the top tier at once and the others behind; after flush all three hold
    it, and a get from a store whose faster tiers lost it promotes it back up."""
    store = _store(tmp_path, "lru")
    with store:
        store.put(key(1), memoryview(payload(1)))
        assert store.flush(timeout_s=10)
        assert _held(store, 1) == ["memory", "disk", "shared"]
        store.tiers[0].delete(key(1))
        store.tiers[1].delete(key(1))
        out = bytearray(LAYOUT.bytes_per_chunk)
        assert store.get_into(key(1), memoryview(out)) == "shared"
        assert bytes(out) == payload(1)
        assert store.flush(timeout_s=10)
        assert _held(store, 1) == ["memory", "disk", "shared"]
        assert store.lookup([key(1), key(2)]).tiers == ("memory",)
