"""Scheduler side of the kvtier connector: decides what to load and what to store.

Runs in vLLM's engine-core process, on its main (scheduler) thread; never touches KV bytes
and never does blocking I/O. `ConnectorScheduler` answers vLLM's scheduler hooks and turns
them into a per-step plan (`KVTierMetadata`) that the worker side executes, with a few
collaborators, each owning its state:
  - `RequestTable` (requeststate.py): per running request, its chunk keys and vLLM blocks
    (and, in plannedkeys.py, key -> the requests that have it);
  - `LoadPlanner` (loadplan.py): how much of a hit to load (load or recompute, by measured
    cost: offer.py), inline or asynchronous, pending loads, prefetch;
  - `StorePlanner` (storeplan.py): stores per plan, in-flight keys, held requests;
  - `LoadFailures` (loadfailures.py): what keeps a failed load out of the cache;
  - `LookupHit` (losthits.py): a hit found and offered, for the tokens lost by reason;
  - `StateLayers` (statelayers.py): hit ends and states of models with state layers;
  - `RouterEvents` (routerevents.py): KV events for cache-aware routers.

What kvtier holds is known here through a `ChunkLocator`: an index fed by the keys the
workers report as stored (`KVTierWorkerMetadata`) and forgotten when a worker reports a key
missing, plus probes of the tiers this process can see (disk and shared directories), which
find chunks stored before a restart or by another engine. The bytes live in the workers'
`TieredStore`s.

Primitives: `ConnectorScheduler`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import TYPE_CHECKING, Literal

from kvtier.core.locator import ChunkLocator, LookupStatus
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.groups import ChunkGroups
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, StatsDelta
from kvtier.integrations.vllm.scheduler.chunkinfos import RECENT_CHUNKS
from kvtier.integrations.vllm.scheduler.loadfailures import LoadFailures
from kvtier.integrations.vllm.scheduler.loadplan import LoadPlanner
from kvtier.integrations.vllm.scheduler.losthits import LookupHit
from kvtier.integrations.vllm.scheduler.requeststate import RequestState, RequestTable, Tail
from kvtier.integrations.vllm.scheduler.routerevents import RouterEvents
from kvtier.integrations.vllm.scheduler.statelayers import StateLayers
from kvtier.integrations.vllm.scheduler.storeplan import StorePlanner, stores_async

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier.node.probe import NodeProbe

logger = logging.getLogger(__name__)
# Plans after a request ended during which vLLM's scheduler waits for the blocks kept for it
# rather than preempt a running request: they normally come back within two or three (the
# stores of its last chunks are planned in the next plan and joined by the end of the one
# after it); a tier stalling them must not hold the engine back for long.
PENDING_FREE_PLANS = 8


class ConnectorScheduler:
    """Scheduler-side logic behind KVTierConnector's scheduler hooks (one thread)."""

    def __init__(self, config: ConnectorConfig, *, block_size: int, model_id: str,
                 layout_digest: str, locator: ChunkLocator,
                 weights_fingerprint: str | None = None,
                 tier_kinds: dict[str, str] | None = None, emit_events: bool = False,
                 kv_role: str | None = "kv_both", groups: ChunkGroups | None = None,
                 node: NodeProbe | None = None, recent_chunks: int = RECENT_CHUNKS) -> None:
        """`kv_role` is vLLM's: a "kv_producer" never loads (every lookup answers 0), a
        "kv_consumer" never stores (RequestControls.within_role). `groups`: the model's KV
        cache groups (groups.py); None: one group. `emit_events`: vLLM publishes KV events
        (--kv-events-config); `tier_kinds`: tier name -> kind, for them. `node`: node mode's
        node, which publishes its tiers' events itself (RouterEvents.describe).
        `recent_chunks`: ended requests' chunks whose token ids events keep (chunkinfos.py)."""
        config = config.for_block_size(block_size)
        groups = groups or ChunkGroups(layer_names=((),), kinds=("full",))
        # Several KV cache groups in vLLM (attention and state): loads are asynchronous.
        several_groups = groups.count + len(groups.state_group_ids) > 1
        # Hits end at a block boundary (a chunk's tail) but with several KV cache groups.
        tails = config.tail_chunks and not several_groups
        self._tails = tails
        self._tokens_per_chunk = config.tokens_per_chunk
        self._block_size = block_size
        self._groups = groups
        self._locator = locator
        self._stats = StatsDelta()
        self._step = 0  # plans built so far: the number of the last one
        self._events = RouterEvents(emit_events, tier_kinds or {}, config.tokens_per_chunk,
                                    node, config.event_block_size, config.pool_events,
                                    recent_chunks)
        self._requests = RequestTable(
            tokens_per_chunk=config.tokens_per_chunk, block_size=block_size,
            model_id=model_id, layout_digest=layout_digest,
            weights_fingerprint=weights_fingerprint, group_label=groups.label(),
            kv_role=kv_role, stats=self._stats, events=self._events)
        self._states = StateLayers(groups, block_size)
        self._loads = LoadPlanner(config.load_mode,
                                  config.tier_names(),
                                  several_groups, config.tokens_per_chunk,
                                  config.load_when_for(kv_role),
                                  stores_stay=not config.node)
        self._failures = LoadFailures()
        self._retire = False  # a cache reset since the last plan (reset_cache)
        # Ended requests whose blocks vLLM keeps until the workers report them (finished
        # sending or receiving), with the plan they ended after: vLLM's own cache reset fails
        # while any does, and its scheduler waits for them rather than preempt
        # (has_pending_block_frees).
        self._kept: dict[str, int] = {}
        # Requests whose asynchronous load is not reported done (finished_recving) yet: vLLM
        # keeps the blocks of one that ends meanwhile until it is (its finish_requests).
        self._receiving: set[str] = set()
        self._stores = StorePlanner(
            tokens_per_chunk=config.tokens_per_chunk, block_size=block_size, groups=groups,
            stores_async=stores_async(config.store_mode, several_groups, kv_role),
            tails=tails,
            locator=locator, requests=self._requests, failures=self._failures,
            stats=self._stats)

    # -- lookup ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` that kvtier can load, and whether the load is
        asynchronous; (None, False) while a slow tier is still being asked (vLLM asks again
        later)."""
        state = self._requests.state(request)
        state.lookup_computed_tokens = num_computed_tokens
        state.lookup_hit = None
        if state.controls.skip_load or state.load_failed:
            return 0, False
        if not self._requests.adapter_unchanged(state):  # its LoRA adapter's files changed
            return 0, False  # since its keys were made: its KV is not theirs any more
        # The last token is always recomputed: vLLM needs its logits.
        loadable_tokens = request.num_tokens - 1
        keys = self._requests.keys_for(state, loadable_tokens // self._tokens_per_chunk)
        if state.uncacheable:
            return 0, False
        located = self._locator.locate(request.request_id, keys)
        if located.status is LookupStatus.RETRY:
            if not self._locator.index_first:
                # Node mode: the tails after the chunks known held so far are asked of the
                # node's tiers below RAM meanwhile, so that where its probe finds no more
                # chunks (a miss, most often) their answer comes with its own.
                self._tail_hit(state, located.num_chunks, loadable_tokens)
            return None, False
        num_chunks = self._states.hit_end(keys, located.num_chunks)
        # Past the full chunks held, the longest tail of the next chunk held (a hit ends at
        # a block boundary: keys.tail_key).
        tail = self._tail_hit(state, num_chunks, loadable_tokens)
        if tail is LookupStatus.RETRY:
            return None, False
        hit_tokens = num_chunks * self._tokens_per_chunk + self._tail_tokens(tail)
        self._stats.add("lookup_tokens", max(0, request.num_tokens - num_computed_tokens))
        self._stats.add("lookup_hit_tokens", max(0, hit_tokens - num_computed_tokens))
        if hit_tokens <= num_computed_tokens:
            return 0, False
        first_chunk = num_computed_tokens // self._tokens_per_chunk
        hit_keys = keys[first_chunk:num_chunks] + ([tail.key] if tail else [])
        sources = self._loads.sources(hit_keys, self._locator.found_in)
        # Load or recompute: the part of the hit expected to load faster (offer.py).
        cut = self._loads.cut(sources, num_computed_tokens, hit_tokens)
        if tail is None or cut.num_chunks < len(hit_keys):
            tail = None
            num_chunks = self._states.hit_end(keys, first_chunk + cut.num_chunks)
            hit_keys = keys[first_chunk:num_chunks]
        offered_tokens = num_chunks * self._tokens_per_chunk + self._tail_tokens(tail)
        state.tail = tail
        if tail is not None:
            self._requests.note_tail(state, tail.key)
            # Its read from a tier below RAM promotes it: the stored event needs its tokens,
            # which its store's request may have taken long ago (full chunks': keys_for).
            self._requests.remember_tail(state, tail)
        # Counted once vLLM allocates (a lookup may repeat): losthits.py.
        state.decisions = cut.decisions
        state.lookup_hit = LookupHit(
            found_tokens=hit_tokens - num_computed_tokens,
            offered_tokens=max(0, offered_tokens - num_computed_tokens))
        if offered_tokens <= num_computed_tokens:
            return 0, False
        if request.skip_reading_prefix_cache:
            # vLLM computes such a request whole (prompt logprobs need the logits of every
            # prompt token; token-wise pooling, every hidden state) and its scheduler drops a
            # connector's hit for it (0.32, 0.33): kvtier offers none itself, reads nothing
            # ahead for it, and the hit is counted lost as declined (losthits.py).
            return 0, False
        # A scan of the running requests, made only where the answer is weighed.
        others_running = (self._loads.by_cost
                          and self._requests.others_have_blocks(request.request_id))
        state.load_async = self._loads.loads_async(sources[:len(hit_keys)], others_running)
        self._loads.want(request.request_id, hit_keys, request.cache_salt,
                         keys[first_chunk - 1] if first_chunk else None)
        return offered_tokens - num_computed_tokens, state.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load of the tokens vLLM accepted, into the blocks it allocated."""
        self._loads.forget(request.request_id)  # loaded now, not ahead
        state = self._requests.state(request)
        for (tier, reason), chunks in state.decisions.items():
            self._stats.add("tier_hit_decisions", chunks, f"{tier}/{reason}")
        state.decisions.clear()
        if state.lookup_hit is not None:
            for reason, tokens in state.lookup_hit.lost(num_external_tokens).items():
                self._stats.add("lost_hit_tokens", tokens, reason)
            state.lookup_hit = None
        if num_external_tokens == 0:
            return
        per_group = blocks.get_block_ids()
        start = state.lookup_computed_tokens
        end = start + num_external_tokens
        tail = state.tail
        assert end % self._tokens_per_chunk == 0 or (
            tail is not None and end == tail.chunk * self._tokens_per_chunk
            + self._tail_tokens(tail)), "a kvtier hit ends on a chunk or its tail"
        transfers = self._load_transfers(state, self._groups.attention_ids(per_group),
                                         start, end)
        # The hit's last chunk brings the state at its end (models with state layers).
        self._states.plan_load(request.request_id, transfers, per_group, end, state.load_async)
        self._loads.add_load(request.request_id, transfers, state.load_async, start, end)
        if state.load_async:
            self._stats.add("async_loads", 1)
            self._receiving.add(request.request_id)
        state.num_planned_chunks = max(state.num_planned_chunks, end // self._tokens_per_chunk)

    # -- per step -------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        """This step's plan: the pending loads, and stores of chunks the step completes."""
        self._loads.observe_plan(time.monotonic(), *_step_shape(scheduler_output))
        self._step += 1
        meta = KVTierMetadata(step=self._step,
                              preempted=set(scheduler_output.preempted_req_ids or ()),
                              retire=self._retire)
        self._retire = False
        self._loads.start_plan(meta)
        self._failures.start_plan(meta)
        self._stores.start_plan(meta)
        for scheduled in self._requests.apply_schedule(scheduler_output):
            if scheduled.first_step_from is not None:
                meta.state_copies += self._states.take_copies(
                    scheduled.state.request.request_id, scheduled.state.block_ids,
                    scheduled.first_step_from)
            self._stores.plan(scheduled.state, scheduled.computed_tokens, meta.stores,
                              self._step)
        meta.retains = self._stores.take_retains()
        self._events.describe(transfer.key for transfer in meta.stores)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn which chunks the workers stored, which loads found nothing, and which ended
        requests' blocks vLLM frees now."""
        for request_id in (output.finished_sending or set()) | (output.finished_recving or set()):
            self._kept.pop(request_id, None)
        self._receiving -= output.finished_recving or set()
        report = output.kv_connector_worker_meta
        if not isinstance(report, KVTierWorkerMetadata):
            return
        self._stores.learn(report)
        self._locator.record_stored(report.stored)
        self._loads.learn(report)
        self._states.learn(report)
        self._locator.record_missing(report.missing)
        self._locator.record_missing(report.removed)  # evicted from every tier
        self._events.learn(report.events)
        self._failures.learn(report, self._requests)

    def request_finished(self, request: Request) -> bool:
        """Forget the request; whether vLLM must keep its blocks until the workers report it
        (vLLM's finished_sending: StorePlanner.end_request)."""
        state = self._requests.pop(request.request_id)
        held = self._stores.end_request(request.request_id, state, self._step)
        # Its load not reported done, or its stores, hold its blocks. (Not its status: vLLM
        # marks it finished before it calls here, WAITING_FOR_REMOTE_KVS or not.)
        loading = request.request_id in self._receiving
        self._receiving.discard(request.request_id)
        if held or loading:
            self._kept[request.request_id] = self._step
        # A request ends as a step's output is taken in: that step's time, before any idle.
        self._loads.step_ended(time.monotonic())
        self._loads.end(request.request_id)
        self._states.forget(request.request_id)
        self._locator.forget(request.request_id)
        return held

    def has_pending_block_frees(self) -> bool:
        """Whether blocks kept for ended requests come back soon: those kept for their stores
        (or a load) within the last `PENDING_FREE_PLANS` plans. vLLM's scheduler, finding no
        block for a running request, then waits a step for them rather than preempt one (its
        KV recomputed); blocks kept longer (a stalled tier) no longer hold it back."""
        return any(self._step - step <= PENDING_FREE_PLANS for step in self._kept.values())

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True), e.g. after a weight update in
        place: from now on no chunk stored before is offered to this engine, from any tier.
        O(1) here, no I/O: keys take a new epoch (a random one, so that no other engine or
        later reset can share it), the index stops answering for old keys by construction,
        and the next plan has each worker retire what its own tiers hold (they leave first
        when space is needed; shared tiers keep them for engines on the old weights). A
        restart reading the same checkpoint files again is back in the first epoch and hits
        them. True: the reset cannot fail (vLLM reads False as a failed reset).

        vLLM's own reset, just before, failed if a request held blocks: then it announced
        nothing cleared, and routers still credit the retired chunks until they leave."""
        epoch = uuid.uuid4().hex
        holding = self._requests.start_epoch(epoch)
        # The old chunks are never announced stored again, nor removed after a clear.
        self._events.reset(cleared=not holding and not self._kept)
        self._loads.forget_all()
        self._retire = True
        self._stats.add("cache_resets", 1)
        logger.info("kvtier: cache reset: chunks stored before are no longer offered to this "
                    "engine (epoch %s)", epoch[:12])
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (vLLM's connector take_events)."""
        return self._events.take()

    def take_stats(self) -> KVTierConnectorStats | None:
        """Lookup counter deltas since the last call, and the measured costs of a restore
        per tier and of a recompute (vLLM's get_kv_connector_stats)."""
        per_1k = 1000 / self._tokens_per_chunk
        for tier in self._loads.costs.tiers:
            chunk_s = self._loads.costs.chunk_s(tier)
            if chunk_s is not None and math.isfinite(chunk_s):
                self._stats.set_gauge("tier_restore_seconds_per_1k_tokens", tier,
                                      chunk_s * per_1k)
        recompute_s = self._loads.steps.recompute_s(0, 1000)
        if recompute_s is not None:
            self._stats.set_gauge("recompute_seconds_per_1k_tokens", "", recompute_s)
        return self._stats.take()

    def close(self) -> None:
        """Close the locator (its probes: their connections and threads) and the router
        events' socket. Scheduler thread."""
        self._locator.close()
        self._events.close()

    # -- helpers --------------------------------------------------------------------------

    def _tail_hit(self, state: RequestState, num_chunks: int, loadable_tokens: int
                  ) -> Tail | Literal[LookupStatus.RETRY] | None:
        """The longest tail of chunk `num_chunks` (the first not held) that kvtier holds and
        that ends by `loadable_tokens`; None: none, or tails are off for this model (several
        KV cache groups: hits end at chunk boundaries there); RETRY: a slow probe is asking
        (node mode: the node's tiers below RAM)."""
        if not self._tails or self._states.enabled:
            return None
        start = num_chunks * self._tokens_per_chunk
        tails = self._requests.tail_keys(state, num_chunks,
                                         (loadable_tokens - start) // self._block_size)
        if not tails:
            return None
        held = self._locator.first_held([t.key for t in tails], state.request.request_id)
        if held is None or held is LookupStatus.RETRY:
            return held
        return tails[held]

    def _tail_tokens(self, tail: Tail | None) -> int:
        return tail.num_blocks * self._block_size if tail is not None else 0

    def _load_transfers(self, state: RequestState, block_ids: list[list[int]], start: int,
                        end: int) -> list[ChunkTransfer]:
        """The loads of the request's tokens `start`..`end` (a hit: full chunks, then maybe
        the tail of the next, `state.tail`), into `block_ids` (per attention group); blocks
        before `start` hold vLLM's own prefix and are not written. Each names its parent, as
        its store did: a chunk promoted from a lower tier into a "prefix" policy's tier
        extends its prefix there (a root, its parent would be a leaf to evict first)."""
        tpc, bpc = self._tokens_per_chunk, self._tokens_per_chunk // self._block_size
        controls = state.controls
        chunks = [(chunk, state.keys[chunk], bpc) for chunk in range(start // tpc, end // tpc)]
        if end % tpc and state.tail is not None:
            chunks.append((state.tail.chunk, state.tail.key, state.tail.num_blocks))
        return [ChunkTransfer(key=key,
                              block_ids=ChunkGroups.flat(block_ids, chunk * bpc, blocks),
                              groups=self._groups.count,
                              first_block=max(0, start // self._block_size - chunk * bpc),
                              tenant=state.request.cache_salt,
                              retain_s=controls.retain_s_for(chunk * tpc
                                                             + blocks * self._block_size),
                              ttl_s=controls.ttl_s,
                              parent=state.keys[chunk - 1] if chunk else None)
                for chunk, key, blocks in chunks]


def _step_shape(output: SchedulerOutput) -> tuple[int, float]:
    """A step's scheduled tokens and their mean position in their prompts."""
    tokens, weighted = 0, 0.0
    starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    for req_id, count in output.num_scheduled_tokens.items():
        tokens += count
        weighted += count * (starts.get(req_id, 0) + (count - 1) / 2)
    return tokens, weighted / tokens if tokens else 0.0
