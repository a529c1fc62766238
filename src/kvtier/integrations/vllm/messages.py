"""The messages between the connector's scheduler side and its workers, once per engine step.

vLLM carries them: the scheduler's plan (`KVTierMetadata`) goes to every worker with the step's
scheduler output; each worker's report (`KVTierWorkerMetadata`) comes back with the step's
model output, merged across tensor-parallel ranks by `aggregate`.

A failed load leaves blocks unfilled, and vLLM still runs that step's forward over them (it
recomputes them in a later step). So every store names the blocks loaded by recent steps that
its request's prefix depends on (`ChunkTransfer.depends_on`): a worker refuses a store that
depends on a block whose load failed and the scheduler has not yet acknowledged
(`KVTierMetadata.acked_failed_blocks`), reports it `skipped`, and the scheduler plans it again
once the recomputation has run.

Once, as the engine starts, each worker tells the scheduler the fingerprint of the model it built
(`WorkerIdentity`, vLLM's connector handshake): see `KVTierConnector.set_xfer_handshake_metadata`.

Primitives: `KVTierMetadata`, `KVTierWorkerMetadata`, `WorkerIdentity` (and `ChunkTransfer`,
`chunk_meta`, re-exported from transfers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent
from kvtier.integrations.vllm.transfers import ChunkTransfer, LoadSample, chunk_meta

__all__ = ["ChunkTransfer", "KVTierMetadata", "KVTierWorkerMetadata", "WorkerIdentity",
           "chunk_meta"]


@dataclass(slots=True)
class KVTierMetadata(KVConnectorMetadata):
    """Scheduler -> worker plan for one engine step."""

    # Loads, per request, in chunk order; done before the forward pass.
    loads: dict[str, list[ChunkTransfer]] = field(default_factory=dict)
    # Loads of requests waiting for them (vLLM's WAITING_FOR_REMOTE_KVS): started this step,
    # done on the worker's load thread while the engine runs, reported by `get_finished`.
    async_loads: dict[str, list[ChunkTransfer]] = field(default_factory=dict)
    # Per request of `loads` / `async_loads`, the seconds its load may take from its start
    # (its expected recompute: the load-or-recompute rule, scheduler/offer.py): what has not
    # landed by then is recomputed (lost as load_too_slow). Absent: no limit.
    load_budgets_s: dict[str, float] = field(default_factory=dict)
    # Stores of chunks that this step's forward completes; done after the forward pass.
    stores: list[ChunkTransfer] = field(default_factory=list)
    # Whether `stores` run on the worker's store thread while the engine goes on
    # (config.STORE_MODES) rather than before the step returns.
    stores_async: bool = False
    # Requests that ended since the last plan whose blocks vLLM keeps until the workers report
    # them (vLLM's finished_sending): stores planned for them may still be reading the blocks.
    # Each was planned in an earlier step than this one, so its gathers are done once the
    # worker has joined the earlier steps' stores (it does, and reports them, this step).
    held: set[str] = field(default_factory=set)
    # Requests this step's schedule preempted: vLLM may give their blocks to other requests,
    # written by this step's forward, so stores still reading them finish first.
    preempted: set[str] = field(default_factory=set)
    # Blocks whose failed load the scheduler has learned of (vLLM recomputes them from this
    # step on): stores need no longer avoid them.
    acked_failed_blocks: set[int] = field(default_factory=set)
    # Chunks kvtier holds already, of requests with retain_s / ttl_s: their pin and expiry
    # are extended (TieredStore.retain), e.g. a warm-up of a prompt stored before.
    retains: list[ChunkTransfer] = field(default_factory=list)
    # Chunks below RAM of requests that found a hit but are still waiting for vLLM's blocks:
    # read into the RAM tier ahead of their load (worker's prefetch thread), so that the
    # load, once the blocks come, is a memcpy.
    # With each chunk's tenant (a tier that seals it opens it with the tenant's key).
    prefetch: list[ChunkTransfer] = field(default_factory=list)
    # Models with state layers: (state group, source, target) blocks of a state to copy before
    # this step's forward (an asynchronous hit's state into the block its first step reads:
    # groups.py).
    state_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # The plan's number (the scheduler counts its plans from 1): the workers report the
    # newest plan whose stores are all done (`KVTierWorkerMetadata.stores_through`).
    step: int = 0
    # The engine's cache was reset (a weight update in place) since the last plan: each
    # worker retires what its own tiers hold (TieredStore.retire) before this plan's stores.
    retire: bool = False

    def transfers(self) -> list[ChunkTransfer]:
        """Every chunk this plan loads, stores or prefetches."""
        loads = [t for ts in (*self.loads.values(), *self.async_loads.values()) for t in ts]
        return loads + self.stores + self.prefetch


@dataclass(slots=True)
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler report for one engine step."""

    stored: set[ChunkKey] = field(default_factory=set)  # keys now held by kvtier
    missing: set[ChunkKey] = field(default_factory=set)  # keys a load did not find
    removed: set[ChunkKey] = field(default_factory=set)  # keys no tier holds any more
    # Stores refused because their KV was computed over a failed load: plan them again.
    skipped: set[ChunkKey] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)  # blocks whose load failed
    events: list[StoreEvent] = field(default_factory=list)  # per-tier stores and removals
    # Models with state layers: chunks stored or loaded without the state at their end (a
    # hit never ends on one: scheduler/statelayers.py).
    without_state: set[ChunkKey] = field(default_factory=set)
    # Complete loads, timed (load_mode "auto" weighs the next hits by them: loadcost.py).
    load_samples: list[LoadSample] = field(default_factory=list)
    # Tier -> its expected seconds per chunk restored, estimated at start-up from its link
    # (core.tier.LinkProbe) before any load is timed: the rule's prior (loadcost.py).
    tier_priors_s: dict[str, float] = field(default_factory=dict)
    # The newest plan (`KVTierMetadata.step`) whose stores are all done, reported or
    # dropped; -1: none yet. vLLM's V2 runner with speculative decoding runs a step's stores
    # (wait_for_save) after the step's report is built, so "done" is the workers' to say.
    stores_through: int = -1

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        # Tensor parallel: a chunk is usable only when every rank stored its shard, and
        # unusable as soon as one rank lost it. Ranks report the same events: keep one.
        assert isinstance(other, KVTierWorkerMetadata)
        return KVTierWorkerMetadata(stored=self.stored & other.stored,
                                    without_state=self.without_state | other.without_state,
                                    missing=self.missing | other.missing,
                                    removed=self.removed | other.removed,
                                    skipped=self.skipped | other.skipped,
                                    failed_blocks=self.failed_blocks | other.failed_blocks,
                                    events=list(dict.fromkeys(self.events + other.events)),
                                    load_samples=self.load_samples + other.load_samples,
                                    tier_priors_s=_slowest(self.tier_priors_s,
                                                           other.tier_priors_s),
                                    stores_through=min(self.stores_through,
                                                       other.stores_through))


def _slowest(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Each tier's slower estimate of two ranks' (a load waits for its slowest rank)."""
    return {tier: max(a.get(tier, 0.0), b.get(tier, 0.0)) for tier in a.keys() | b.keys()}


@dataclass(frozen=True, slots=True)
class WorkerIdentity(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once its KV caches are registered: the fingerprint of the model it
    built (core/fingerprint.py `ModelFingerprint`'s fields), which names its tiers' namespace."""

    fingerprint: str
    weight_files: int
