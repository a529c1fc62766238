"""The doctor reads the facts about a tier kind from its class (`kvtier.core.tier.Tier`): a
new kind added to the registry is checked by its facts without an edit of doctor.py (split
from tests/tiers/test_tier_facts.py, which holds the other readers: KV events, the TP
capacity split).
"""

from __future__ import annotations

import sys
from typing import ClassVar, Literal

import pytest

from kvtier.core.tier import Locality, Medium
from kvtier.tiers.example import ExampleTier
from kvtier.tiers.registry import TIER_CLASSES
from kvtier.tiers.storeconfig import StoreConfig, TierSettings
from kvtier.tools.ops.doctor import check_memory, check_redis, check_tier_paths


class VaultTierConfig(TierSettings):
    """A remote kind the registry does not list: added by the test only."""

    kind: Literal["vault"]
    url: str = "vault://kv.example:7000"


class VaultTier(ExampleTier):
    """The example tier, as if it reached a server every engine shares."""

    medium: ClassVar[Medium] = Medium.STORAGE
    locality: ClassVar[Locality] = Locality.REMOTE
    has_path: ClassVar[bool] = False
    has_server: ClassVar[bool] = True
    capacity_split_by_rank: ClassVar[bool] = False
    config_model = VaultTierConfig  # type: ignore[assignment]


@pytest.fixture
def vault(monkeypatch: pytest.MonkeyPatch) -> StoreConfig:
    """Kind "vault" registered (one registry line, as a new tier kind is added), and a store
    with a memory tier above a vault tier."""
    monkeypatch.setitem(TIER_CLASSES, "vault", f"{__name__}:VaultTier")
    assert sys.modules[__name__].VaultTier is VaultTier
    return StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "4MiB"},
                                        {"kind": "vault", "name": "far", "capacity": "8MiB"}]})


def test_the_doctor_checks_a_new_kind_by_its_facts(vault: StoreConfig) -> None:
    """A server kind is the doctor's to reach (skipped: not a Redis server); it has no
    directory to check and takes no host RAM."""
    store = vault.model_dump()
    assert check_tier_paths(store) == []
    assert "want 4.0 MiB" in check_memory(store).detail  # the memory tier's, not the vault's
    [server] = check_redis(store)
    assert server.status == "skip" and server.name.startswith("vault ")
