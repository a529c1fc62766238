"""A memory tier larger than the host can map is a ConfigError naming its capacity, not an
OSError's traceback.

The README's server command asks for a 64GiB memory tier; pasted on a 23 GiB host (overcommit
heuristic: one mapping larger than RAM and swap is refused) the engine's workers died on
`OSError: [Errno 12] Cannot allocate memory` from the slab's mmap, a traceback that named no
setting. The fault is injected (mmap raising ENOMEM): a real mapping that large would, on a
host that overcommits always, be committed by the background prefault until the OOM killer
came."""

from __future__ import annotations

import errno
import mmap

import pytest
from tierkit import tiny_layout

from kvtier.errors import ConfigError
from kvtier.tiers import memory, open_store
from kvtier.tiers.memory import MemoryTier, MemoryTierConfig
from kvtier.tiers.storeconfig import StoreConfig


def refuse_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(fileno: int, length: int, *args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(memory.mmap, "mmap", refused)


def test_a_slab_the_host_cannot_map_names_the_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_mapping(monkeypatch)
    config = MemoryTierConfig(kind="memory", capacity="64GiB", pin="off")
    with pytest.raises(ConfigError) as raised:
        MemoryTier(config, tiny_layout())
    assert raised.value.field == "memory.capacity"
    assert "64.0 GiB" in str(raised.value) and "RAM" in str(raised.value.allowed)


def test_the_store_config_names_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_mapping(monkeypatch)
    config = StoreConfig.parse({"tiers": [{"kind": "memory", "name": "ram",
                                           "capacity": "64GiB", "pin": "off"}]})
    with pytest.raises(ConfigError, match=r"ram\.capacity"):
        open_store(config, tiny_layout())


def test_another_mapping_error_is_not_taken_for_a_capacity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def failed(fileno: int, length: int, *args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(memory.mmap, "mmap", failed)
    with pytest.raises(OSError) as raised:
        MemoryTier(MemoryTierConfig(kind="memory", capacity="1MiB", pin="off"), tiny_layout())
    assert not isinstance(raised.value, ConfigError)
