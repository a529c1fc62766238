"""The scheduler side's part for models with state layers (Mamba/SSM, short convolution,
linear attention: groups.py's "state groups").

Scheduler side, one thread. A hit of such a model must end on a chunk whose record holds the
state at its end: chunks the workers reported without one are not hit ends (`hit_end` backs
off over them); chunks of unknown state (found by a probe: stored before a restart, or by
another engine) are tried, and reported when they have none. A load writes the hit's last
state into the blocks the request's first step reads it from (`plan_load`); an asynchronous
hit learns that block only when the request is scheduled, so its state is copied there then
(`take_copies`, `KVTierMetadata.state_copies`).

Primitives: `StateLayers`, `STATELESS_MAX_KEYS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkIndex
from kvtier.integrations.vllm.groups import NULL_BLOCK, ChunkGroups
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierWorkerMetadata

# Chunks remembered as having no state at their end.
STATELESS_MAX_KEYS = 1 << 17


@dataclass(frozen=True, slots=True)
class _PendingCopy:
    """An asynchronous hit's state, to copy once its request is scheduled."""

    hit_tokens: int  # where the hit ends: the request's computed tokens at its first step
    sources: tuple[int, ...]  # per state group, the block the load writes the state into


class StateLayers:
    """Hit ends and state placement of a model's state groups (scheduler thread)."""

    def __init__(self, groups: ChunkGroups, block_size: int) -> None:
        self.enabled = bool(groups.state_layer_names)  # the model has state layers
        self._groups = groups
        self._block_size = block_size
        self._stateless = ChunkIndex(STATELESS_MAX_KEYS)
        self._copies: dict[str, _PendingCopy] = {}  # by request id, until it is scheduled

    def hit_end(self, keys: list[ChunkKey], num_chunks: int) -> int:
        """The chunks of a hit of `num_chunks` of `keys` that end on a chunk with a state:
        back off over chunks known to have none (all of them without state layers)."""
        if self.enabled:
            while num_chunks and keys[num_chunks - 1] in self._stateless:
                num_chunks -= 1
        return num_chunks

    def plan_load(self, request_id: str, transfers: list[ChunkTransfer],
                  per_group: tuple[list[int], ...], end_tokens: int, load_async: bool) -> None:
        """Make the hit's last chunk (`transfers[-1]`, ending at `end_tokens`) bring the
        state at its end into the hit's last block and the next, of every state group
        (`per_group`: the request's blocks, per vLLM group); nothing without state layers."""
        if not self.enabled:
            return
        last = end_tokens // self._block_size  # the block after the hit's last one
        targets = tuple(ids[i] if i < len(ids) else NULL_BLOCK
                        for ids in self._groups.state_ids(per_group) for i in (last - 1, last))
        transfers[-1] = dataclasses.replace(transfers[-1], state_blocks=targets)
        if load_async:
            # The block after the hit is allocated when the request is scheduled: the state
            # is copied there then (take_copies).
            self._copies[request_id] = _PendingCopy(end_tokens, targets[::2])

    def take_copies(self, request_id: str, block_ids: list[list[int]],
                    computed_tokens: int) -> list[tuple[int, int, int]]:
        """(state group, source, target) blocks that put an asynchronous hit's state into the
        block the request's first step reads it from (the block after the hit's last:
        groups.py); none when the load failed (the request starts over)."""
        pending = self._copies.pop(request_id, None)
        if pending is None or pending.hit_tokens != computed_tokens:
            return []
        after = computed_tokens // self._block_size
        return [(g, source, ids[after]) for g, (source, ids)
                in enumerate(zip(pending.sources, self._groups.state_ids(block_ids), strict=True))
                if source != NULL_BLOCK and after < len(ids) and ids[after] != NULL_BLOCK]

    def learn(self, report: KVTierWorkerMetadata) -> None:
        """Take in which chunks the workers found without a state. A chunk once found without
        one stays so here, whatever a later store says: a store of a chunk a tier holds
        already rewrites nothing (a stateless copy on disk outlives a stateful one in RAM),
        and a stateful store reported after the stateless load of the same chunk would
        otherwise make the next hit end there, and fail, again (a miss costs less)."""
        for key in report.without_state:
            self._stateless.add(key)

    def forget(self, request_id: str) -> None:
        """The request ended."""
        self._copies.pop(request_id, None)
