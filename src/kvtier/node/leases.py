"""What a node's lease holds, and how one ends. A lease is a `Lending` (chunks lent to an
engine for a load) or `Puts` (slots reserved for its stores); it ends at the engine's Release
or commits, or with its connection, so an engine killed mid-load or mid-store leaks nothing;
a lending also when it is held past the node's `lease_timeout_s` (`overdue`: an engine
frozen or hung), its slots' stamps telling the engine, if it wakes, that its copies may be
another chunk's.

Primitives: `Lease`, `Puts`, `end_lease`, `overdue`, `spare_buffers`, `sendable`,
`chunks_held`, `held_by`.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from kvtier.core.loans import Lending
from kvtier.core.store import ChunkView, PendingPut
from kvtier.node.protocol import MAX_FRAME


@dataclass
class Puts:
    """Slots reserved by one `Reserve`: each a `putting` block left open until its commit."""

    blocks: list[tuple[AbstractContextManager[PendingPut], PendingPut] | None]
    open: int
    chunk_bytes: int


@dataclass(slots=True)
class Lease:
    """A lease as the node keeps it: its connection, what it holds, and since when
    (time.monotonic)."""

    owner: int
    held: Lending[ChunkView] | Puts
    since: float


def overdue(lease: Lease, now: float, timeout_s: float) -> bool:
    """Whether `lease` is one the node takes back at `now`: a lending held past `timeout_s`.
    Never reserved slots: an engine frozen before its write into one may write it when it
    wakes, so a slot given to another chunk meanwhile would hold a mix of both (no stamp read
    after a write could undo it); they stay the engine's until its commit or its
    connection's end (docs/node.md)."""
    return not isinstance(lease.held, Puts) and now - lease.since > timeout_s


def spare_buffers(count: int, chunk_bytes: int) -> list[memoryview]:
    """`count` page-aligned buffers of `chunk_bytes`, all in one anonymous mapping (its pages
    taken only when a read writes them). A mapping each, as before, let one Borrow of as many
    keys as a frame holds take the process's `vm.max_map_count`: every other engine's next
    buffer failed (ENOMEM) and its connection dropped (tests/node/test_node_borrow_mappings.py).

    Raises:
        OSError: ENOMEM, the mapping is larger than the kernel allows (the connection ends).
    """
    stride = -(-chunk_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    whole = memoryview(mmap.mmap(-1, count * stride))
    return [whole[i * stride:i * stride + chunk_bytes] for i in range(count)]


def chunks_held(held: Lending[ChunkView] | Puts) -> int:
    """The chunks a lease holds: its loans not released, or its slots not committed."""
    return held.open if isinstance(held, Puts) else held.outstanding


def held_by(holders: Iterable[tuple[str, Lending[ChunkView] | Puts]]
            ) -> dict[str, dict[str, int]]:
    """What each engine of `holders` (engine, lease) holds: {engine: {"leases", "chunks"}}, the
    status's `held`. A frozen engine (SIGSTOP, a hung process) keeps its reserved slots until
    its connection ends, or, where the node closed it for a reply never read, until its
    process is gone (quarantine.py); its lendings until lease_timeout_s (docs/node.md)."""
    held: dict[str, dict[str, int]] = {}
    for engine, lease in holders:
        mine = held.setdefault(engine, {"leases": 0, "chunks": 0})
        mine["leases"] += 1
        mine["chunks"] += chunks_held(lease)
    return held


def sendable(put: PendingPut) -> bool:
    """Whether a chunk RAM has no slot for can come with its commit (a frame's bound)."""
    return put.data is not None and len(put.data) < MAX_FRAME // 2


def end_lease(held: Lending[ChunkView] | Puts) -> None:
    """End a lease: a lending's loans released; reserved slots never committed given back."""
    if isinstance(held, Puts):
        for taken in held.blocks:
            if taken is not None:
                taken[1].cancel()
                taken[0].__exit__(None, None, None)
        held.blocks.clear()
    else:
        held.close()
