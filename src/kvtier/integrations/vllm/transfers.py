"""One chunk to move between kvtier and vLLM's paged KV (`ChunkTransfer`), as the scheduler
plans it and the workers' movers carry it out, and the tenant, pin and expiry it is stored
with (`chunk_meta`); one complete load as a worker timed it (`LoadSample`), which the
scheduler weighs its next hits by (scheduler/loadcost.py). Free of vLLM, so that the movers
(worker/cpu.py, worker/streams.py) run and are tested where vLLM is not installed
(scripts/gpu-check.sh).

Primitives: `ChunkTransfer`, `chunk_meta`, `LoadSample`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from kvtier.core.keys import ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.integrations.vllm.groups import NULL_BLOCK


@dataclass(frozen=True, slots=True)
class ChunkTransfer:
    """One chunk to move between kvtier and vLLM's paged KV."""

    key: ChunkKey
    # vLLM block ids holding the chunk's tokens, in token order (tokens_per_chunk/block_size
    # of them), of each KV cache group, concatenated (groups.py; one group: a plain model).
    block_ids: tuple[int, ...]
    # Loads only: blocks before this index already hold valid KV (a local prefix-cache hit,
    # possibly shared with other requests) and must not be written.
    first_block: int = 0
    # Stores only: blocks of the request's prefix (this chunk's included) that kvtier loaded
    # in a step whose outcome the scheduler may not know yet. A failed one makes the store
    # unsafe: its KV was computed over unfilled blocks.
    depends_on: tuple[int, ...] = ()
    # The request's cache salt (its tenant), or None: passed down with every store, load and
    # prefetch of the chunk as `chunk_meta(...).tenant` (its tenant_id), so that a tier that
    # encrypts at rest seals and opens it with that tenant's key (kvtier.core.sealing).
    tenant: str | None = None
    # The request's kv_transfer_params.retain_s / ttl_s (config.RequestControls): a store
    # pins / dates the chunk (kvtier.core.retention.ChunkMeta), a load extends its pin.
    retain_s: float | None = None
    ttl_s: float | None = None
    groups: int = 1  # KV cache groups in block_ids
    # Models with state layers (groups.py): a store's state blocks (one per state group, the
    # state at the chunk's end; the null block for none), or a load's targets of the state
    # of a hit's last chunk (two per state group: the hit's last block and the next).
    state_blocks: tuple[int, ...] = ()
    # Stores only: the key of the chunk before it in its prompt (None: the first chunk), for
    # the "prefix" eviction policy (ChunkMeta.parent).
    parent: ChunkKey | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks of the chunk's tokens (per group)."""
        return len(self.block_ids) // self.groups

    def written_blocks(self) -> list[int]:
        """The blocks a load of it writes: from `first_block` on in every group, but vLLM's
        null block (below a sliding window), which no request owns."""
        per = self.num_blocks
        return [b for g in range(self.groups)
                for b in self.block_ids[g * per + self.first_block:(g + 1) * per]
                if self.groups == 1 or b != NULL_BLOCK]


def chunk_meta(transfer: ChunkTransfer) -> ChunkMeta:
    """The tenant (`tenant_id` of its cache salt), pin, expiry and parent of a planned chunk,
    dated now: what every tier call about it carries (`DEFAULT_META` for a first chunk of the
    default tenant with neither: the tiers' defaults apply)."""
    if transfer.tenant is None and transfer.retain_s is None and transfer.ttl_s is None:
        return DEFAULT_META if transfer.parent is None else ChunkMeta(parent=transfer.parent)
    meta = ChunkMeta.for_request(transfer.tenant, transfer.retain_s, transfer.ttl_s,
                                 time.time())
    return meta if transfer.parent is None else replace(meta, parent=transfer.parent)


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One request's complete load, as a worker timed it."""

    chunks: tuple[tuple[str, int], ...]  # (tier name, chunks it lent or failed to)
    seconds: float  # from the first read to the last scatter, or to the failed read
    # It stopped at a read that a tier failed (its last chunk's). A load stopped at its
    # deadline is not failed: its time so far over the chunks it lent and the one it waited
    # for is a lower bound of the tier's cost (issue 45).
    failed: bool = False
    # Of `seconds`, the time spent waiting for the tiers' reads (the rest: the copy into
    # vLLM's blocks): where a hit's time goes, on /metrics as load_read_seconds.
    read_s: float = 0.0

    @staticmethod
    def since(started_s: float, chunks: Mapping[str, int], read_s: float,
              failed: bool = False) -> LoadSample:
        """A load of `chunks` (tier -> count) that started at `started_s` (perf_counter)
        and ends now, `read_s` of it waiting for reads."""
        return LoadSample(tuple(chunks.items()), time.perf_counter() - started_s, failed,
                          read_s)
