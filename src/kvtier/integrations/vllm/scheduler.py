"""Scheduler side of the kvtier connector: decides what to load and what to store.

Runs in vLLM's engine-core process, on its main (scheduler) thread; never touches KV bytes
and never does blocking I/O. It keeps, per running request, the chunk keys of its tokens and
its vLLM block ids, and turns them into a per-step plan (`KVTierMetadata`) that the worker
side executes.

What kvtier holds is known here through a `ChunkLocator`: an index fed by the keys the
workers report as stored (`KVTierWorkerMetadata`) and forgotten when a worker reports a key
missing, plus probes of the tiers this process can see (disk and shared directories), which
find chunks stored before a restart or by another engine. The bytes live in the workers'
`TieredStore`s.

A load that fails leaves blocks unfilled under a forward pass that vLLM runs anyway: stores
planned before the scheduler learns of the failure name the recently loaded blocks they
depend on, so that a worker can refuse them (see messages.py); the refused chunks are planned
again and stored once vLLM has recomputed them.

Stores run on the workers' store thread (`stores_async`) unless a model's blocks may be freed
while its request runs: a request that ends while a store of it may still be reading its
blocks is held (`request_finished` returns True; vLLM frees the blocks when the workers report
it, a step later), and the workers finish the stores of preempted requests before the forward
that may overwrite their blocks.

Primitives: `ConnectorScheduler`, `stores_async`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.core.keys import ChunkKey, Namespace, chunk_keys
from kvtier.core.locator import ChunkIndex, ChunkLocator, LookupStatus
from kvtier.errors import UncacheableRequest
from kvtier.integrations.vllm.config import ConnectorConfig, RequestControls
from kvtier.integrations.vllm.events import ChunkInfo, ChunkTokens, kv_events
from kvtier.integrations.vllm.groups import NULL_BLOCK, ChunkGroups
from kvtier.integrations.vllm.loadplan import LoadPlanner
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, StatsDelta
from kvtier.integrations.vllm.request_keys import chunk_extras, needs_chunk_extras

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Label of the byte order inside a chunk (see paged.py); part of every key's namespace with
# the block size it depends on, so a change of order can never serve old bytes.
CHUNK_ORDER = "chunk-order=LBH2TD-v2"
# Engine steps during which a load's blocks count as unconfirmed (stores depending on them name
# them). vLLM reports a step's outcome before it schedules the step after next (async
# scheduling keeps one step in flight), so 2 would do; the rest is slack. A block past the
# window whose load failed was acknowledged long since (see _acked_failed_blocks).
LOAD_CONFIRM_STEPS = 4
# Chunks remembered as having no state at their end (models with state layers).
STATELESS_MAX_KEYS = 1 << 17


@dataclass(slots=True)
class _RequestState:
    request: Request
    controls: RequestControls
    namespace: Namespace
    keys: list[ChunkKey] = field(default_factory=list)
    # Its vLLM block ids, one list per KV cache group (none before its first step).
    block_ids: list[list[int]] = field(default_factory=list)
    # Local (vLLM prefix cache) tokens at the last lookup; loads start there.
    lookup_computed_tokens: int = 0
    # Chunks already planned (loaded, stored or found in the index).
    num_planned_chunks: int = 0
    # Whether its chunks carry extra key bytes (multimodal, prompt embeds: request_keys.py).
    has_extras: bool = False
    # Its KV depends on something kvtier cannot key: never looked up, never stored.
    uncacheable: bool = False
    # Its last lookup's hit is loaded asynchronously (the request waits for it).
    load_async: bool = False
    # A load of it failed: it is recomputed, never looked up again (a tier that failed once,
    # e.g. stalled, would fail again and keep the request waiting).
    load_failed: bool = False
    # The plan (step number) that last stored a chunk of it; -1: none.
    last_store_step: int = -1


def stores_async(store_mode: str, several_groups: bool, kv_role: str | None) -> bool:
    """Whether stores run on the workers' store thread (config.STORE_MODES). Never with
    several KV cache groups: a sliding-window or state group frees blocks while its request
    runs, with no hook a worker could wait in before they are written again."""
    if store_mode == "auto":
        return not several_groups and kv_role != "kv_producer"
    if store_mode == "async" and several_groups:
        logger.warning("kvtier: store_mode 'async' ignored: a model with several KV cache "
                       "groups frees blocks while its requests run; stores are synchronous")
        return False
    return store_mode == "async"


class ConnectorScheduler:
    """Scheduler-side logic behind KVTierConnector's scheduler hooks (one thread)."""

    def __init__(self, config: ConnectorConfig, *, block_size: int, model_id: str,
                 layout_digest: str, locator: ChunkLocator,
                 weights_fingerprint: str | None = None,
                 tier_kinds: dict[str, str] | None = None, emit_events: bool = False,
                 kv_role: str | None = "kv_both", groups: ChunkGroups | None = None) -> None:
        """`kv_role` is vLLM's: a "kv_producer" never loads (every lookup answers 0), a
        "kv_consumer" never stores (RequestControls.within_role). `groups`: the model's KV
        cache groups (groups.py); None: one group."""
        config.check_block_size(block_size)
        self._groups = groups or ChunkGroups(layer_names=((),), kinds=("full",))
        self._num_groups = self._groups.count  # attention groups: a chunk's block lists
        # Models with state layers: a hit ends on a chunk with the state at its end
        # (groups.py). Chunks the workers reported without one are not hit ends; chunks of
        # unknown state (found by a probe: stored before a restart, or by another engine) are
        # tried, and reported when they have none.
        self._has_state = bool(self._groups.state_layer_names)
        self._stateless = ChunkIndex(STATELESS_MAX_KEYS)
        # Requests whose asynchronous hit brought a state: (hit tokens, its blocks per state
        # group), until they are scheduled.
        self._state_copies: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._group_label = self._groups.label()
        # Several KV cache groups in vLLM (attention and state): loads are asynchronous.
        self._several_groups = self._num_groups + len(self._groups.state_group_ids) > 1
        if self._several_groups and config.load_mode == "sync":
            logger.warning("kvtier: load_mode 'sync' ignored: a model with several KV cache "
                           "groups loads asynchronously (vLLM recovers failed loads only by "
                           "request there)")
        self._stores_async = stores_async(config.store_mode, self._several_groups, kv_role)
        window = self._groups.min_window
        if window is not None and config.tokens_per_chunk > window:
            logger.warning(
                "kvtier: tokens_per_chunk %d is larger than the model's sliding window (%d "
                "tokens): a chunk whose first blocks left the window before it was complete "
                "is not stored (counted in dropped_window_chunks); set tokens_per_chunk <= %d",
                config.tokens_per_chunk, window, window)
        self._config = config
        self._kv_role = kv_role
        self._block_size = block_size
        self._blocks_per_chunk = config.tokens_per_chunk // block_size
        self._model_id = model_id
        self._layout_digest = layout_digest
        self._weights_fingerprint = weights_fingerprint
        self._locator = locator
        self._stats = StatsDelta()
        # KV events for routers (vLLM publishes them when --kv-events-config enables them).
        self._emit_events = emit_events
        self._tier_kinds = tier_kinds or {}
        self._chunk_tokens = ChunkTokens()
        self._kv_events: list[KVCacheEvent] = []
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: dict[str, list[ChunkTransfer]] = {}
        # Keys sent to workers for storing and not yet reported back (not stored twice), with
        # the step that planned them.
        self._inflight_stores: dict[ChunkKey, int] = {}
        # Requests ended since the last plan whose blocks vLLM keeps for their stores.
        self._held: set[str] = set()
        # Stores of chunks an ended request completed that no plan stored yet, for the next
        # plan; their requests are held one plan longer (`_held_later`): the plan after it.
        self._final_stores: list[ChunkTransfer] = []
        self._held_later: set[str] = set()
        # Blocks planned to be loaded -> the step that loads them, for LOAD_CONFIRM_STEPS.
        self._step = 0
        self._recent_loads: dict[int, int] = {}
        # Blocks whose failed load a worker reported, to acknowledge in the next plan.
        self._acked_failed_blocks: set[int] = set()
        # Async loads planned for the next step (request id -> chunks).
        self._pending_async: dict[str, list[ChunkTransfer]] = {}
        # Inline or async per hit, and what to read ahead into the workers' RAM tier.
        self._loads = LoadPlanner(config.load_mode, config.store.tiers[0].tier_name,
                                  self._several_groups)
        # Held chunks of requests with retain_s / ttl_s, for the next plan's `retains`.
        self._retains: list[ChunkTransfer] = []

    # -- lookup ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` that kvtier can load, and whether the load is
        asynchronous; (None, False) while a slow tier is still being asked (vLLM asks again
        later)."""
        state = self._state(request)
        state.lookup_computed_tokens = num_computed_tokens
        if state.controls.skip_load or state.load_failed:
            return 0, False
        # The last token is always recomputed: vLLM needs its logits.
        loadable_chunks = (request.num_tokens - 1) // self._config.tokens_per_chunk
        keys = self._keys_for(state, loadable_chunks)
        if state.uncacheable:
            return 0, False
        located = self._locator.locate(request.request_id, keys)
        if located.status is LookupStatus.RETRY:
            return None, False
        num_chunks = located.num_chunks
        if self._has_state:  # back off over chunks known to have no state at their end
            while num_chunks and keys[num_chunks - 1] in self._stateless:
                num_chunks -= 1
        hit_tokens = num_chunks * self._config.tokens_per_chunk
        self._stats.add("lookup_tokens", max(0, request.num_tokens - num_computed_tokens))
        self._stats.add("lookup_hit_tokens", max(0, hit_tokens - num_computed_tokens))
        if hit_tokens <= num_computed_tokens:
            return 0, False
        first_chunk = num_computed_tokens // self._config.tokens_per_chunk
        hit_keys = keys[first_chunk:num_chunks]
        # A scan of the running requests, made only where the answer is weighed.
        others_running = self._loads.by_cost and any(
            other.block_ids for req_id, other in self._requests.items()
            if req_id != request.request_id)
        state.load_async = self._loads.loads_async(hit_keys, others_running)
        self._loads.want(request.request_id, hit_keys, request.cache_salt)
        return hit_tokens - num_computed_tokens, state.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan the load of the tokens vLLM accepted, into the blocks it allocated."""
        self._loads.forget(request.request_id)  # loaded now, not ahead
        state = self._state(request)
        if num_external_tokens == 0:
            return
        tpc = self._config.tokens_per_chunk
        per_group = blocks.get_block_ids()
        block_ids = self._groups.attention_ids(per_group)
        start = state.lookup_computed_tokens
        end = start + num_external_tokens
        assert end % tpc == 0, "a kvtier hit ends on a chunk boundary"
        transfers = []
        for chunk in range(start // tpc, end // tpc):
            first = chunk * self._blocks_per_chunk
            transfers.append(ChunkTransfer(
                key=state.keys[chunk],
                block_ids=ChunkGroups.flat(block_ids, first, self._blocks_per_chunk),
                groups=self._num_groups, first_block=max(0, start // self._block_size - first),
                tenant=request.cache_salt,
                retain_s=state.controls.retain_s, ttl_s=state.controls.ttl_s,
            ))
        if self._has_state:  # the hit's last chunk brings the state at its end
            last = end // self._block_size  # the block after the hit's last one
            targets = tuple(ids[i] if i < len(ids) else NULL_BLOCK
                            for ids in self._groups.state_ids(per_group) for i in (last - 1, last))
            transfers[-1] = dataclasses.replace(transfers[-1], state_blocks=targets)
            if state.load_async:
                # The block after the hit is allocated when the request is scheduled: the
                # state is copied there then (build_connector_meta).
                self._state_copies[request.request_id] = (end, targets[::2])
        pending = self._pending_async if state.load_async else self._pending_loads
        pending[request.request_id] = transfers
        if state.load_async:
            self._stats.add("async_loads", 1)
        state.num_planned_chunks = max(state.num_planned_chunks, end // tpc)

    # -- per step -------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        """This step's plan: the pending loads, and stores of chunks the step completes."""
        self._loads.observe_plan(time.monotonic(),
                                 bool(scheduler_output.num_scheduled_tokens))
        meta = KVTierMetadata(loads=self._pending_loads, async_loads=self._pending_async,
                              acked_failed_blocks=self._acked_failed_blocks,
                              stores_async=self._stores_async, held=self._held,
                              preempted=set(scheduler_output.preempted_req_ids or ()))
        self._pending_loads, self._pending_async, self._acked_failed_blocks = {}, {}, set()
        self._held, self._held_later = self._held_later, set()
        meta.stores, self._final_stores = self._final_stores, []
        self._remember_loads(meta.loads | meta.async_loads)
        meta.step = self._step
        meta.prefetch = self._loads.take_prefetch()
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self._requests:
                # Its blocks are freed; the resumed request gets a full new block list, and
                # chunks it had not stored yet are stored when recomputed.
                self._requests[req_id].block_ids = []
                self._requests[req_id].num_planned_chunks = 0
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            meta.state_copies += self._take_state_copies(new.req_id, state.block_ids,
                                                         new.num_computed_tokens)
            computed = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._plan_stores(state, computed, meta.stores)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
            elif new_blocks:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_blocks]
                for ids, more in zip(state.block_ids, new_blocks):
                    ids.extend(more)
            computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._plan_stores(state, computed, meta.stores)
        meta.retains, self._retains = self._retains, []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn which chunks the workers stored, and which loads found nothing."""
        report = output.kv_connector_worker_meta
        if not isinstance(report, KVTierWorkerMetadata):
            return
        # The workers say which plans' stores are done, whether or not they report a key: a
        # store the tiers dropped (e.g. Redis down) reports nothing, and its key would stay
        # "in flight" forever, never stored again (tests/faults/test_engine_faults.py). Done
        # is theirs to say: vLLM's V2 runner with speculative decoding runs a step's stores
        # after the step's report (tests/unit/test_hook_orders.py).
        self._inflight_stores = {key: step for key, step in self._inflight_stores.items()
                                 if step > report.stores_through}
        for key in report.stored | report.skipped:  # reported: no longer in flight
            self._inflight_stores.pop(key, None)
        self._locator.record_stored(report.stored)
        self._loads.learn(report)
        for key in report.stored_state:
            self._stateless.discard(key)
        for key in report.without_state:
            self._stateless.add(key)
        self._locator.record_missing(report.missing)
        self._locator.record_missing(report.removed)  # evicted from every tier
        if self._emit_events:
            self._kv_events.extend(kv_events(report.events, self._chunk_tokens,
                                             self._tier_kinds, self._config.tokens_per_chunk))
        self._acked_failed_blocks |= report.failed_blocks
        replan = report.missing | report.skipped
        if replan:
            # vLLM recomputes a failed load into the same blocks, and what its forward
            # computed over them (stores the workers skipped); plan those chunks again so they
            # are stored once recomputed. Without this a corrupt or vanished chunk stayed
            # missing (the load had marked it planned), and the next request with that prefix
            # missed too (tests/vllm/test_kvtier_restart.py, damaged chunk files).
            for state in self._requests.values():
                planned = state.keys[: state.num_planned_chunks]
                failed = [i for i, key in enumerate(planned) if key in replan]
                if failed:
                    state.num_planned_chunks = failed[0]
                    state.load_failed |= not report.missing.isdisjoint(planned)

    def request_finished(self, request: Request) -> bool:
        """Forget the request; whether vLLM must keep its blocks until the workers report it
        (vLLM's finished_sending): asynchronous stores planned by the last two plans may still
        be reading them (the workers join a step's stores by the end of the next step; two:
        with vLLM's async scheduling, one plan is built ahead of the last step's outcome)."""
        state = self._requests.pop(request.request_id, None)
        held = self._stores_async and state is not None \
            and state.last_store_step >= self._step - 1
        if held:
            self._held.add(request.request_id)
        if state is not None and state.block_ids and self._plan_final_stores(state):
            # Held through the plan that stores them, to the end of the one after it (the
            # workers join a plan's stores by then, deferred finalize or not).
            self._held.discard(request.request_id)
            self._held_later.add(request.request_id)
            held = True
        if held:
            self._stats.add("held_requests", 1)
        self._pending_loads.pop(request.request_id, None)
        self._pending_async.pop(request.request_id, None)
        self._loads.forget(request.request_id)
        self._state_copies.pop(request.request_id, None)
        self._locator.forget(request.request_id)
        return held

    # -- helpers --------------------------------------------------------------------------

    def _plan_final_stores(self, state: _RequestState) -> bool:
        """Plan, for the next plan, the stores of the full chunks an ended request computed
        that no plan stored: with vLLM's async scheduling a plan is built before the token its
        step samples is known, so the chunk a request's last step completes was not planned,
        and a request ended by max_tokens has no later plan. Every token but the last sampled
        one has its KV computed by now. Whether there are any."""
        request = state.request
        computed = min(request.num_computed_tokens, len(request.all_token_ids) - 1)
        before = len(self._final_stores)
        self._plan_stores(state, computed, self._final_stores)
        return len(self._final_stores) > before

    def _take_state_copies(self, req_id: str, block_ids: list[list[int]],
                           computed_tokens: int) -> list[tuple[int, int, int]]:
        """(state group, source, target) blocks that put an asynchronous hit's state into the
        block the request's first step reads it from (the block after the hit's last:
        groups.py); none when the load failed (the request starts over)."""
        pending = self._state_copies.pop(req_id, None)
        if pending is None or pending[0] != computed_tokens:
            return []
        after = computed_tokens // self._block_size
        return [(g, source, ids[after]) for g, (source, ids)
                in enumerate(zip(pending[1], self._groups.state_ids(block_ids), strict=True))
                if source != NULL_BLOCK and after < len(ids) and ids[after] != NULL_BLOCK]

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            extra = [CHUNK_ORDER, f"block-size={self._block_size}"]
            if self._group_label is not None:
                extra.append(self._group_label)
            if request.lora_request is not None:
                # Name and path, as vLLM's block hash: a name re-pointed at another adapter
                # must not reuse the old adapter's KV.
                lora = request.lora_request
                extra += [f"lora={lora.lora_name}", f"lora-path={lora.lora_path}"]
            namespace = Namespace(model_id=self._model_id, layout_digest=self._layout_digest,
                                  weights_fingerprint=self._weights_fingerprint,
                                  cache_salt=request.cache_salt, extra=tuple(extra))
            state = _RequestState(request=request, namespace=namespace,
                                  controls=RequestControls.from_params(
                                      request.kv_transfer_params).within_role(self._kv_role),
                                  has_extras=needs_chunk_extras(request))
            self._requests[request.request_id] = state
        return state

    def _keys_for(self, state: _RequestState, num_chunks: int) -> list[ChunkKey]:
        """The first `num_chunks` chunk keys of the request's tokens (extends the chain);
        none once the request is found uncacheable (marked and counted here, once)."""
        if state.uncacheable:
            return []
        tpc = self._config.tokens_per_chunk
        have = len(state.keys)
        if num_chunks > have:
            tokens = state.request.all_token_ids[have * tpc: num_chunks * tpc]
            parent = state.keys[-1] if state.keys else None
            extras = None
            if state.has_extras:
                try:
                    extras = chunk_extras(state.request, have, num_chunks - have, tpc,
                                          self._block_size)
                except UncacheableRequest as e:
                    logger.warning("kvtier: request %s is not cached: %s",
                                   state.request.request_id, e)
                    self._stats.add("uncacheable_requests", 1)
                    state.uncacheable = True
                    return []
            new_keys = chunk_keys(tokens, state.namespace, tpc, parent=parent, extras=extras)
            if self._emit_events:
                self._remember_tokens(state, new_keys, tokens, parent)
            state.keys.extend(new_keys)
        return state.keys[:num_chunks]

    def _plan_stores(self, state: _RequestState, computed_tokens: int,
                     out: list[ChunkTransfer]) -> None:
        """Append stores of the full chunks whose KV this step's forward completes."""
        if state.controls.skip_store or state.uncacheable:
            return
        tpc = self._config.tokens_per_chunk
        attention = self._groups.attention_ids(state.block_ids) if state.block_ids else []
        states = self._groups.state_ids(state.block_ids) if state.block_ids else []
        held_blocks = len(attention[0]) if attention else 0
        limit = min(computed_tokens, len(state.request.all_token_ids),
                    held_blocks * self._block_size)
        if state.controls.max_offload_tokens is not None:
            limit = min(limit, state.controls.max_offload_tokens)
        full_chunks = limit // tpc
        if full_chunks <= state.num_planned_chunks:
            return
        keys = self._keys_for(state, full_chunks)
        if state.uncacheable:
            return
        bpc = self._blocks_per_chunk
        # Recently loaded blocks of the prefix, with their positions (usually none).
        loaded = [(i, b) for ids in attention
                  for i, b in enumerate(ids[: full_chunks * bpc])
                  if b in self._recent_loads] if self._recent_loads else []
        for chunk in range(state.num_planned_chunks, full_chunks):
            key = keys[chunk]
            if key in self._locator.index or key in self._inflight_stores:
                if state.controls.retain_s is not None or state.controls.ttl_s is not None:
                    self._retains.append(ChunkTransfer(
                        key=key, block_ids=(), tenant=state.request.cache_salt,
                        retain_s=state.controls.retain_s, ttl_s=state.controls.ttl_s))
                continue
            first = chunk * bpc
            blocks = ChunkGroups.flat(attention, first, bpc)
            if self._num_groups > 1 and NULL_BLOCK in blocks:
                # A sliding-window group let blocks of it go (groups.py): not storable.
                self._stats.add("dropped_window_chunks", 1)
                continue
            out.append(ChunkTransfer(
                key=key, block_ids=blocks, groups=self._num_groups,
                state_blocks=tuple(ids[first + bpc - 1] if first + bpc <= len(ids)
                                   else NULL_BLOCK for ids in states),
                depends_on=tuple(b for i, b in loaded if i < first + bpc),
                tenant=state.request.cache_salt,
                retain_s=state.controls.retain_s, ttl_s=state.controls.ttl_s))
            self._inflight_stores[key] = self._step
            state.last_store_step = self._step
        state.num_planned_chunks = full_chunks

    def _remember_loads(self, loads: dict[str, list[ChunkTransfer]]) -> None:
        """Count a new step; note the blocks it loads, forget loads past the window."""
        self._step += 1
        for transfers in loads.values():
            for transfer in transfers:
                for block in transfer.written_blocks():
                    self._recent_loads[block] = self._step
        if self._recent_loads:
            oldest = self._step - LOAD_CONFIRM_STEPS
            self._recent_loads = {b: s for b, s in self._recent_loads.items() if s > oldest}

    def close(self) -> None:
        self._locator.close()

    def _remember_tokens(self, state: _RequestState, keys: list[ChunkKey], tokens: Any,
                         parent: ChunkKey | None) -> None:
        """Keep the token ids of new chunks for the KV events of their later stores."""
        tpc = self._config.tokens_per_chunk
        ids = np.asarray(tokens, dtype="<i4")
        lora = state.request.lora_request.lora_name if state.request.lora_request else None
        for i, key in enumerate(keys):
            self._chunk_tokens.remember(key, ChunkInfo(
                parent=parent, token_ids=ids[i * tpc:(i + 1) * tpc].tobytes(), lora_name=lora,
                cache_salt=state.request.cache_salt))
            parent = key

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (vLLM's connector take_events)."""
        events, self._kv_events = self._kv_events, []
        return events

    def take_stats(self) -> KVTierConnectorStats | None:
        """Lookup counter deltas since the last call (vLLM's get_kv_connector_stats)."""
        return self._stats.take()
