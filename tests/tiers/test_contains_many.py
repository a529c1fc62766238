"""`TieredStore.contains_many` (what a `kvtier node` answers an engine's lookup with) says of
each key what `contains` says, asking a remote tier once for all the keys rather than once per
key: a lookup a scheduler waits for costs one round trip to Redis, not one per chunk (with a
redis tier behind a slow link, per-key lookups stalled every running stream: issue 43)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tierkit import key, tier_settings, tiny_layout

from kvtier.tiers import open_store
from kvtier.tiers.redis.tier import RedisTier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()


@pytest.mark.parametrize("kind", ["redis"])
def test_each_key_as_contains_says_with_one_batch_per_remote_tier(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = StoreConfig.parse({"tiers": [
        tier_settings("memory", tmp_path, LAYOUT, 2),
        tier_settings("disk", tmp_path, LAYOUT, 8),
        tier_settings(kind, tmp_path, LAYOUT, 8)]})
    with open_store(config, LAYOUT) as store:
        for i in range(5):
            assert store.put(key(i), memoryview(bytes([i]) * LAYOUT.bytes_per_chunk))
        store.flush()
        store.tiers[1].delete(key(1))  # on redis only, below RAM
        store.tiers[2].delete(key(3))  # on the disk only
        keys = [key(i) for i in (0, 1, 2, 3, 4, 99)]
        one_by_one = [store.contains(k) for k in keys]
        calls: dict[str, int] = {"contains": 0, "contains_many": 0}

        def counted(name: str) -> Any:
            real = getattr(RedisTier, name)

            def call(self: RedisTier, *args: Any) -> Any:
                calls[name] += 1
                return real(self, *args)
            return call

        for name in calls:
            monkeypatch.setattr(RedisTier, name, counted(name))
        assert store.contains_many(keys) == one_by_one
        assert one_by_one == [True, True, True, True, True, False]
        assert calls == {"contains": 0, "contains_many": 1}
