"""Eviction in generations: retire every resident key at once, in O(1).

After a weight update in place (vLLM's `reset_prefix_cache(reset_connector=True)`) the chunks a
tier holds can no longer be offered to this engine: their keys belong to the old weights. They
are kept (a restart on the old weights may use them) but must leave before anything stored
since. `Generations` wraps any policy: `retire()` closes the current generation, and the next
victim is always taken from the oldest generation that still holds keys, in that generation's
own policy order. A key's generation is found in O(1), so reads and removals cost the same
however many resets have happened; a generation is dropped as soon as it is empty. After each
removal or eviction `left_retired` says whether the key left a retired generation: a router
told at the reset that every chunk held then is gone is not told again
(kvtier.core.tier.TierEvents).

Primitives: `Generations`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from kvtier.core.policies import EvictionPolicy

K = TypeVar("K", bound=Hashable)


class Generations(Generic[K]):
    """An `EvictionPolicy` whose resident keys can all be retired at once. Not thread-safe:
    the owning tier locks.

    A key's generation is recorded only while retired generations hold keys: a key without a
    record is in the oldest generation. So a tier that is never reset pays nothing (a disk
    tier's index must fit millions of chunks), and one reset costs a small int a key stored
    until the retired chunks are gone."""

    def __init__(self, make: Callable[[], EvictionPolicy[K]]) -> None:
        """`make`: builds the policy of one generation (e.g. `LRUPolicy`)."""
        self._make = make
        self._current = 0
        # Generations oldest first (a dict keeps insertion order); the last is the current one.
        self._generations: dict[int, EvictionPolicy[K]] = {0: make()}
        self._generation_of: dict[K, int] = {}
        # Whether the key the last `remove` or `evict` took out was resident in a retired
        # generation (False where `remove` found it nowhere: a pinned chunk, out of the policy).
        self.left_retired = False

    def insert(self, key: K, parent: K | None = None) -> None:
        """A key became resident (again: a retired key stored anew joins the current one),
        extending `parent` (for a prefix-aware policy; None: unknown)."""
        if len(self._generations) > 1:
            previous = self._generation_of.get(key, self._oldest)
            if previous != self._current:
                self._generations[previous].remove(key)  # a no-op where it is not resident
                self._generation_of[key] = self._current
                self._drop_if_empty(previous)
        self._generations[self._current].insert(key, parent)

    def touch(self, key: K) -> None:
        """A resident key was read: it moves within its own generation."""
        self._generations[self._generation_of.get(key, self._oldest)].touch(key)

    def remove(self, key: K) -> None:
        """A key left for another reason than eviction; `left_retired` says from where."""
        generation = self._generation_of.pop(key, self._oldest)
        policy = self._generations[generation]
        retired = generation != self._current
        resident = len(policy) if retired else 0
        policy.remove(key)  # a no-op where it is not resident
        self.left_retired = retired and len(policy) < resident
        self._drop_if_empty(generation)

    def evict(self, keep: Callable[[K], bool] | None = None) -> K | None:
        """The next victim not kept: from the oldest generation holding one (`left_retired`:
        a retired one)."""
        self.left_retired = False
        for generation, policy in list(self._generations.items()):
            key = policy.evict(keep)
            if key is not None:
                self._generation_of.pop(key, None)
                self.left_retired = generation != self._current
                self._drop_if_empty(generation)
                return key
            self._drop_if_empty(generation)
        return None

    def retire(self) -> None:
        """Every key resident now is evicted before any key inserted from now on."""
        if len(self._generations[self._current]) == 0:
            return  # nothing to retire: no empty generation piles up
        self._current += 1
        self._generations[self._current] = self._make()

    @property
    def horizon_ops(self) -> float:
        """The current generation's reuse horizon in operations, where its policy learns one
        (`PrefixPolicy`, 0.0 until it has seen enough reuses); 0.0 for the others."""
        return float(getattr(self._generations[self._current], "horizon_ops", 0.0))

    @property
    def retired(self) -> int:
        """Keys resident in retired generations."""
        return len(self) - len(self._generations[self._current])

    @property
    def _oldest(self) -> int:
        return next(iter(self._generations))

    def _drop_if_empty(self, generation: int) -> None:
        if generation != self._current and len(self._generations[generation]) == 0:
            del self._generations[generation]
            if len(self._generations) == 1:
                self._generation_of.clear()  # every key is in the one left, the oldest

    def __len__(self) -> int:
        return sum(len(policy) for policy in self._generations.values())
