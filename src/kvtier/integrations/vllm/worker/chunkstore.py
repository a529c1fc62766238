"""What the connector's worker and its movers need of kvtier's store (`ChunkStore`):
`TieredStore` (core/store.py) provides it in-process, `NodeStore` (node/client.py) in node
mode. Optional abilities (`TieredStore`'s): `LinkMeasuring`, the speed of its remote tiers'
links, the load-or-recompute rule's prior (issue 45); `LocalLookup`, whether any tier holds a
chunk as far as RAM can tell without I/O (the worker reports an evicted chunk no tier holds
in the report of the step that evicted it).

Primitives: `ChunkStore`, `LinkMeasuring`, `LocalLookup`.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from kvtier.core.keys import ChunkKey
from kvtier.core.loans import Lending
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import ChunkView, PendingPut, StoreEvent, StoreStats
from kvtier.core.tier import LinkSpeed


class ChunkStore(Protocol):
    """The part of kvtier's store the worker and the movers use."""

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> str | None: ...

    def borrow(self, key: ChunkKey, spare: memoryview,
               meta: ChunkMeta = DEFAULT_META) -> AbstractContextManager[ChunkView | None]: ...

    def lend_as_landed(self, keys: Sequence[ChunkKey], spares: MutableSequence[memoryview],
                       metas: Sequence[ChunkMeta] = (), *, in_order: bool = False,
                       until: float | None = None) -> Lending[ChunkView]: ...

    def plan_puts(self, keys: Sequence[ChunkKey], metas: Sequence[ChunkMeta]) -> None:
        """A step's stores are about to `put_from` / `putting` these keys, in this order."""

    def put(self, key: ChunkKey, data: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool: ...

    def put_from(self, key: ChunkKey, fill: Callable[[memoryview], None],
                 spare: memoryview, meta: ChunkMeta = DEFAULT_META) -> bool: ...

    def putting(self, key: ChunkKey, spare: memoryview,
                meta: ChunkMeta = DEFAULT_META) -> AbstractContextManager[PendingPut]: ...

    def retain(self, key: ChunkKey, meta: ChunkMeta) -> int: ...

    def retire(self) -> int: ...

    def contains(self, key: ChunkKey) -> bool: ...

    def stats(self) -> StoreStats: ...

    def take_events(self) -> list[StoreEvent]: ...

    def close(self, flush_timeout_s: float | None = None) -> None: ...

    def flush(self, timeout_s: float | None = None) -> bool: ...


@runtime_checkable
class LinkMeasuring(Protocol):
    """A store that measures its remote tiers' links (`TieredStore.measure_links`)."""

    def measure_links(self) -> dict[str, LinkSpeed]: ...


@runtime_checkable
class LocalLookup(Protocol):
    """A store that tells, without I/O, whether a chunk is held when its RAM tier and
    write-behind queues can tell (`TieredStore.contains_without_io`; None: ask `contains`)."""

    def contains_without_io(self, key: ChunkKey) -> bool | None: ...
