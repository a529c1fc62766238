"""What the worker asks of a mover (`ChunkMover`), and what one step's stores did (`StoreJob`).

The worker (worker.py) decides what moves, when and on which thread; a mover moves the bytes
between kvtier's store and vLLM's blocks. Two movers implement one protocol: cpu.py for KV in
host memory (vLLM's CPU backend: copies done when the call returns) and streams.py for KV on
a device (CUDA: copies queued on side streams, ordered by events). The worker's plan, threads,
joins and reports are the same for both.

Primitives: `ChunkMover`, `StoreJob`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import MutableSequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.integrations.vllm.transfers import ChunkTransfer, LoadSample
from kvtier.integrations.vllm.worker.device import Event


@dataclass(frozen=True, slots=True)
class StoreJob:
    """One step's stores, done."""

    stored: list[ChunkTransfer]  # the chunks copied into the top tier, which holds them now
    seconds: float  # from the first gather to the last put
    mode: str  # "sync" (the step waited for them) or "async" (they ran while it went on)
    # The chunks the store held already (`PendingPut.held`: nothing copied, or nothing
    # written by a top tier without slots; stored before by this engine, or through a node
    # by another): held all the same, but not written now.
    held: list[ChunkTransfer] = field(default_factory=list)


class ChunkMover(Protocol):
    """Loads and stores of chunks between a store and vLLM's blocks."""

    # Complete loads, timed (load_mode "auto": loadcost.py); any thread appends, the
    # worker's report takes them.
    samples: deque[LoadSample]

    def mark(self) -> Event | None:
        """The point in vLLM's work (its compute stream) that a load or store started now on
        another thread must come after; None where copies need no ordering (CPU). Model
        runner thread."""
        ...

    def load(self, transfers: list[ChunkTransfer], spares: MutableSequence[memoryview],
             after: Event | None = None, wait: bool = True, until: float | None = None) -> int:
        """Copy a request's chunks, in order, from the store into their blocks, slower tiers'
        reads landing in `spares` (the caller's buffers); the number loaded before the first
        miss. `after`: see `mark` (None: marked now, on the calling thread). `wait`: return
        once the blocks hold the chunks (a load thread); False: once vLLM's next forward is
        ordered after the copies (the model runner's thread). `until` (time.monotonic; None:
        no limit): a chunk not landed by then is a miss, and so is every one after it (a
        load worth no more than its recompute: issue 45); no chunk is written after the
        call returns."""
        ...

    def store(self, transfers: list[ChunkTransfer], mode: str,
              after: Event | None = None) -> StoreJob:
        """Gather and put `transfers` in order, after `after` (see `mark`); a chunk that
        fails is logged and not stored. `mode`: "sync" (the model runner's thread) or
        "async" (the store thread)."""
        ...

    def release(self) -> None:
        """Return what finished copies held (model runner thread, once a step)."""
        ...

    def close(self) -> None:
        """Wait for every queued copy."""
        ...
