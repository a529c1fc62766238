"""Facts about a tier kind are attributes of its class (`kvtier.core.tier.Tier`): every
registered class states every one, and what reads them (KV events, doctor, the TP capacity
split) follows a new kind's class without being edited (the doctor's reading:
tests/tools/test_doctor_tier_facts.py).
"""

from __future__ import annotations

import pytest

from kvtier.core.tier import Locality, Medium, Tier
from kvtier.tiers.registry import TIER_CLASSES, tier_class
from kvtier.tiers.storeconfig import StoreConfig

# The class attributes the contract declares (ClassVar annotations of the Tier protocol).
FACTS = sorted(name for name, annotation in Tier.__annotations__.items()
               if str(annotation).startswith("ClassVar"))
TYPES = {"medium": Medium, "locality": Locality}


def test_the_contract_declares_the_facts_events_doctor_and_the_simulator_read() -> None:
    assert {"medium", "locality", "has_path", "has_server", "capacity_split_by_rank"} <= set(FACTS)


@pytest.mark.parametrize("tier_kind", sorted(TIER_CLASSES))
def test_every_registered_tier_class_declares_every_fact(tier_kind: str) -> None:
    cls = tier_class(tier_kind)
    for fact in FACTS:
        assert fact in vars(cls), f"{cls.__name__} does not state {fact}"
        assert isinstance(getattr(cls, fact), TYPES.get(fact, bool)), (cls, fact)
    assert not (cls.has_path and cls.has_server), "a tier has a directory or a server"
    path_field = "path" in cls.config_model.model_fields
    assert cls.has_path == path_field, f"{cls.__name__}.has_path but its config's `path`"


def test_a_new_remote_kind_is_reported_remote_by_the_kv_events(vault: StoreConfig) -> None:
    """vLLM KV events take medium and locality from the tier's class: a remote kind added to
    the registry is REMOTE STORAGE, the memory tier LOCAL CPU, with no edit of events.py."""
    pytest.importorskip("vllm")
    from kvtier.core.keys import ChunkKey
    from kvtier.core.store import StoreEvent
    from kvtier.core.tier import EventKind
    from kvtier.integrations.vllm.scheduler.events import kv_events
    from kvtier.tiers.eventfacts import ChunkTokens

    key = ChunkKey(bytes(16))
    kinds = {t.tier_name: t.kind for t in vault.tiers}  # what the connector hands the scheduler
    events = kv_events([StoreEvent(EventKind.REMOVED, key, "far"),
                        StoreEvent(EventKind.REMOVED, key, "memory")],
                       ChunkTokens(), kinds, tokens_per_chunk=16)
    assert [(e.medium, e.locality, e.ownership) for e in events] == [
        ("STORAGE", "REMOTE", "kvtier/far"), ("CPU", "LOCAL", "kvtier/memory")]


def test_a_new_kind_decides_its_own_tp_capacity_split(vault: StoreConfig) -> None:
    """`capacity_split_by_rank` is read from the class: the vault's capacity is not split."""
    ranks = vault.per_rank(2)
    assert [t.capacity for t in ranks.tiers] == [2 << 20, 8 << 20]
