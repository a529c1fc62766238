"""The doctor reads the facts about a tier kind from its class (`kvtier.core.tier.Tier`): a
new kind added to the registry is checked by its facts without an edit of doctor.py (split
from tests/tiers/test_tier_facts.py, which holds the other readers: KV events, the TP
capacity split).
"""

from __future__ import annotations

from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.ops.doctor import check_memory, check_redis, check_tier_paths


def test_the_doctor_checks_a_new_kind_by_its_facts(vault: StoreConfig) -> None:
    """A server kind is the doctor's to reach (skipped: not a Redis server); it has no
    directory to check and takes no host RAM."""
    store = vault.model_dump()
    assert check_tier_paths(store) == []
    assert "want 4.0 MiB" in check_memory(store).detail  # the memory tier's, not the vault's
    [server] = check_redis(store)
    assert server.status == "skip" and server.name.startswith("vault ")
