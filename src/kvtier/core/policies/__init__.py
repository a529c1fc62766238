"""Eviction policies and admission, shared by every tier that needs them.

A policy tracks which resident keys to evict first; tiers own the data and the locking.
`make_policy` builds one in `Generations` (generations.py), so that a tier can retire what it
holds at once (a weight update in place).

Policies: "lru" (lru.py), "arc" (arc.py), "prefix" (prefix.py: leaves of the tree of held
prefixes first, by recency and uses; it needs each chunk's parent, `insert(key, parent)`);
clock.py is the disk tier's LRU.

Primitives: `EvictionPolicy` (protocol), `make_policy`, `POLICIES`, `Generations`,
`AdmissionFilter`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

from kvtier.core.policies.admission import AdmissionFilter
from kvtier.core.policies.arc import ARCPolicy
from kvtier.core.policies.generations import Generations
from kvtier.core.policies.lru import LRUPolicy
from kvtier.core.policies.prefix import PrefixPolicy
from kvtier.core.policies.reusegaps import ReuseGaps
from kvtier.errors import ConfigError

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol[K]):
    """Orders resident keys (of type K, e.g. ChunkKey) for eviction. Not thread-safe: the
    owning tier locks."""

    def insert(self, key: K, parent: K | None = None) -> None:
        """A key became resident; `parent`: the chunk its prefix ends with (None: a first
        chunk, or unknown). Only prefix-aware policies use it."""

    def touch(self, key: K) -> None:
        """A resident key was read."""

    def remove(self, key: K) -> None:
        """A key left for another reason than eviction (delete, corruption)."""

    def evict(self, keep: Callable[[K], bool] | None = None) -> K | None:
        """Choose the next victim and forget it as resident; None when nothing is resident.
        `keep`: residents that must stay now (a chunk being read) are passed over, resident
        and ranked as they were; None when every resident is kept."""

    def __len__(self) -> int: ...


POLICIES = ("lru", "arc", "prefix")


def make_policy(name: str, capacity_chunks: int) -> Generations[K]:
    """Return a new policy by name (one of POLICIES) for a tier of `capacity_chunks`, in
    generations; its key type is the one the caller's annotation asks for.

    Raises:
        ConfigError: unknown policy name.
    """
    if name == "lru":
        return Generations(LRUPolicy)
    if name == "arc":
        return Generations(lambda: ARCPolicy(capacity_chunks))
    if name == "prefix":  # a reset keeps what was learned of the traffic's reuse gaps
        gaps = ReuseGaps()
        return Generations(lambda: PrefixPolicy(capacity_chunks, gaps=gaps))
    raise ConfigError("eviction", name, f"one of {POLICIES}")


__all__ = ["POLICIES", "ARCPolicy", "AdmissionFilter", "EvictionPolicy", "Generations", "LRUPolicy",
           "PrefixPolicy", "make_policy"]
