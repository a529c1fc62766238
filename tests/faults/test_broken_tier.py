"""A tier whose methods raise (a bug, a dead NFS mount, a crashed server) costs the store
hits, never the caller: the store logs it, skips that tier for the call, and serves from
the others; when the tier recovers, it is used again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tierkit import key, tier_settings

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import TieredStore
from kvtier.core.tier import Tier, TierResult, TierStats
from kvtier.tiers import build_tier, store_settings
from kvtier.tiers.storeconfig import StoreConfig


class BrokenTier:
    """Wraps a real tier; while `broken`, every data-path call raises `error`."""

    def __init__(self, inner: Tier, error: Exception) -> None:
        self.inner, self.error, self.name = inner, error, inner.name
        # The facts of the kind it wraps (kvtier.core.tier.Tier), as a wrapper must.
        self.medium, self.locality = inner.medium, inner.locality
        self.has_path, self.has_server = inner.has_path, inner.has_server
        self.capacity_split_by_rank = inner.capacity_split_by_rank
        self.broken = True
        self.calls = 0

    def _check(self) -> None:
        if self.broken:
            self.calls += 1
            raise self.error

    def contains(self, key: ChunkKey) -> bool:
        self._check()
        return self.inner.contains(key)

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        self._check()
        return self.inner.get_into(key, out, meta)

    def put(self, key: ChunkKey, data: memoryview,
            meta: ChunkMeta = DEFAULT_META) -> TierResult:
        self._check()
        return self.inner.put(key, data, meta)

    def delete(self, key: ChunkKey) -> bool:
        self._check()
        return self.inner.delete(key)

    def stats(self) -> TierStats:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def payload(i: int, layout: KVLayout) -> bytes:
    return bytes((i * 11 + j) % 256 for j in range(layout.bytes_per_chunk))


def _store(root: Path, layout: KVLayout, broken: str, error: Exception,
           ) -> tuple[TieredStore, BrokenTier]:
    config = StoreConfig.parse({"tiers": [tier_settings(kind, root, layout, 8)
                                          for kind in ("memory", "disk", "shared")]})
    tiers: list[Tier] = [build_tier(t, layout) for t in config.tiers]
    index = [t.name for t in tiers].index(broken)
    wrapper = BrokenTier(tiers[index], error)
    assert isinstance(wrapper, Tier)
    tiers[index] = wrapper
    return TieredStore(tiers, store_settings(config)), wrapper


ERRORS = [OSError(5, "Input/output error (injected)"), RuntimeError("tier bug (injected)")]


@pytest.mark.parametrize("error", ERRORS, ids=["OSError", "RuntimeError"])
def test_a_broken_middle_tier_is_skipped_and_used_again_once_it_recovers(
    tmp_path: Path, layout: KVLayout, error: Exception, caplog: pytest.LogCaptureFixture,
) -> None:
    """The disk tier breaks: puts still succeed (RAM now, shared behind), lookups and gets
    are served by the other tiers, nothing raises, the failures are logged."""
    store, disk = _store(tmp_path, layout, "disk", error)
    with store, caplog.at_level(logging.WARNING):
        for i in range(3):
            assert store.put(key(i), memoryview(payload(i, layout)))
        assert store.flush(timeout_s=10)
        memory, _, shared = store.tiers
        assert all(shared.contains(key(i)) for i in range(3))
        memory.delete(key(0))
        assert store.lookup([key(0), key(1), key(2)]).tiers == ("shared", "memory", "memory")
        out = bytearray(layout.bytes_per_chunk)
        assert store.get_into(key(0), memoryview(out)) == "shared"
        assert bytes(out) == payload(0, layout)
        assert store.get_into(key(9), memoryview(out)) is None
        assert disk.calls > 0 and str(error) in caplog.text
        # The disk recovers: new chunks reach it again.
        disk.broken = False
        assert store.put(key(5), memoryview(payload(5, layout)))
        assert store.flush(timeout_s=10)
        assert disk.inner.contains(key(5))


@pytest.mark.parametrize("error", ERRORS, ids=["OSError", "RuntimeError"])
def test_a_broken_top_tier_does_not_stop_puts_or_gets(
    tmp_path: Path, layout: KVLayout, error: Exception, caplog: pytest.LogCaptureFixture,
) -> None:
    """The RAM tier raises on everything: put reports the chunk not stored in the top tier
    (False, no exception) yet the lower tiers still receive it, and gets are served from
    disk - the failed promotion into RAM is only logged."""
    store, _memory = _store(tmp_path, layout, "memory", error)
    with store, caplog.at_level(logging.WARNING):
        assert store.put(key(1), memoryview(payload(1, layout))) is False
        assert store.flush(timeout_s=10)
        assert store.lookup([key(1)]).tiers == ("disk",)
        out = bytearray(layout.bytes_per_chunk)
        assert store.get_into(key(1), memoryview(out)) == "disk"
        assert bytes(out) == payload(1, layout)
        spares = [memoryview(out), memoryview(bytearray(layout.bytes_per_chunk))]
        with store.lend_as_landed([key(1), key(2)], spares) as lending:
            assert [loan.view.tier for loan in lending] == ["disk"]
            assert lending.stopped_at == 1
        assert str(error) in caplog.text
        stats = store.stats()
        assert stats.tiers[0].name == "memory"
        assert stats.failures["memory"]["raised"] >= 3  # the put, and two failed promotions


def test_a_broken_bottom_tier_costs_only_its_own_copies(tmp_path: Path,
                                                        layout: KVLayout) -> None:
    """The shared directory is gone (every call raises): the write-behind thread survives
    its failures and the disk tier keeps being written and read."""
    store, shared = _store(tmp_path, layout, "shared", OSError(116, "Stale file handle"))
    with store:
        for i in range(4):
            assert store.put(key(i), memoryview(payload(i, layout)))
        assert store.flush(timeout_s=10)
        assert all(store.tiers[1].contains(key(i)) for i in range(4))
        assert store.lookup([key(i) for i in range(5)]).num_chunks == 4
        shared.broken = False
        store.put(key(7), memoryview(payload(7, layout)))
        assert store.flush(timeout_s=10)
        assert shared.inner.contains(key(7))
