"""What one engine step's stores did (`StoreJob`): the result both movers of a step's stores
hand back, the store thread on the CPU (worker.py) and the copy streams on a GPU (cuda.py),
so that the worker joins, reports and counts them in one way.

Primitives: `StoreJob`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.integrations.vllm.messages import ChunkTransfer


@dataclass(frozen=True, slots=True)
class StoreJob:
    """One step's stores, done."""

    stored: list[ChunkTransfer]  # the chunks the top tier now holds (or held already)
    seconds: float  # from the first gather to the last put
    mode: str  # "sync" (the step waited for them) or "async" (they ran while it went on)
