"""A tier kind the registry does not list, "vault" (the example tier, as if it reached a server
every engine shares), for the tests that add a kind the way a new tier is added: one registry
line (tests/tiers/test_tier_facts.py, tests/tools/test_doctor_tier_facts.py). Registered by
tests/conftest.py's `vault` fixture. Not named conftest.py: see tierkit.py.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from kvtier.core.tier import Locality, Medium
from kvtier.tiers.example import ExampleTier
from kvtier.tiers.storeconfig import TierSettings


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
