"""Which chunks each plan stores, and which ended requests vLLM must keep blocks for.

Scheduler side, one thread. A step stores the full chunks its forward completes, but those
kvtier holds already or has sent for storing and not heard back about (`plan`), and the tails
(keys.tail_key) of the prompt once computed and of the request once ended, so that a later
hit can end at their last full block; chunks held
already of requests with retain_s / ttl_s / retain_prefixes have their pin and expiry extended
instead (`KVTierMetadata.retains`).

Stores run on the workers' store thread (`stores_async`) unless a model's blocks may be freed
while its request runs. A request that ends while a store of it may still be reading its
blocks is held (`end_request` returns True; vLLM frees the blocks when the workers report it,
a step later). With vLLM's async scheduling a plan is built before the token its step samples
is known, so the chunk a request's last step completes was not planned: an ended request's
full chunks that no plan stored are stored by the next plan, and the request is held through
the plan after it.

Primitives: `StorePlanner`, `stores_async`.
"""

from __future__ import annotations

import logging

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.groups import NULL_BLOCK, ChunkGroups
from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import StatsDelta
from kvtier.integrations.vllm.scheduler.loadfailures import LoadFailures
from kvtier.integrations.vllm.scheduler.requeststate import RequestState, RequestTable

logger = logging.getLogger(__name__)


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


class StorePlanner:
    """Stores per plan, in-flight keys, held requests and retains (scheduler thread)."""

    def __init__(self, *, tokens_per_chunk: int, block_size: int, groups: ChunkGroups,
                 stores_async: bool, locator: ChunkLocator, requests: RequestTable,
                 failures: LoadFailures, stats: StatsDelta, tails: bool = True) -> None:
        """`stores_async`: the workers run stores on their store thread (see the function);
        `locator` says which chunks kvtier holds; `failures`, which blocks stores depend on;
        `tails`: store requests' tails (config.tail_chunks; never with several KV cache
        groups)."""
        window = groups.min_window
        if window is not None and tokens_per_chunk > window:
            logger.warning(
                "kvtier: tokens_per_chunk %d is larger than the model's sliding window (%d "
                "tokens): a chunk whose first blocks left the window before it was complete "
                "is not stored (counted in dropped_window_chunks); set tokens_per_chunk <= %d",
                tokens_per_chunk, window, window)
        self.stores_async = stores_async
        self._tokens_per_chunk = tokens_per_chunk
        self._block_size = block_size
        self._blocks_per_chunk = tokens_per_chunk // block_size
        self._groups = groups
        self._num_groups = groups.count  # attention groups: a chunk's block lists
        # Tails (keys.tail_key) are stored but for models with several KV cache groups.
        self._tails = tails and groups.count + len(groups.state_group_ids) == 1
        self._locator = locator
        self._requests = requests
        self._failures = failures
        self._stats = stats
        # Keys sent to workers for storing and not yet reported back (not stored twice), with
        # the plan that sent them.
        self._inflight: dict[ChunkKey, int] = {}
        # Requests ended since the last plan whose blocks vLLM keeps for their stores.
        self._held: set[str] = set()
        # Stores of chunks an ended request completed that no plan stored yet, for the next
        # plan; their requests are held one plan longer (`_held_later`): the plan after it.
        self._final_stores: list[ChunkTransfer] = []
        self._held_later: set[str] = set()
        # Held chunks of requests with retain_s / ttl_s, for the next plan's `retains`.
        self._retains: list[ChunkTransfer] = []

    def start_plan(self, meta: KVTierMetadata) -> None:
        """Begin plan `meta`: how its stores run, the requests it holds, the final stores of
        requests ended since the last plan."""
        meta.stores_async = self.stores_async
        meta.held, self._held, self._held_later = self._held, self._held_later, set()
        meta.stores, self._final_stores = self._final_stores, []

    def take_retains(self) -> list[ChunkTransfer]:
        """The retains planned since the last call (the end of a plan)."""
        retains, self._retains = self._retains, []
        return retains

    def plan(self, state: RequestState, computed_tokens: int, out: list[ChunkTransfer],
             step: int) -> None:
        """Append to `out` stores of the request's full chunks whose KV is computed once
        `computed_tokens` are (plan number `step`), then of its prompt's tail once its prompt
        is computed."""
        if state.controls.skip_store or not self._requests.adapter_unchanged(state):
            return
        attention = self._groups.attention_ids(state.block_ids) if state.block_ids else []
        self._plan_chunks(state, computed_tokens, attention, out, step)
        prompt_tokens = state.request.num_prompt_tokens
        if computed_tokens >= prompt_tokens and not state.prompt_tail_planned:
            # The prompt's last blocks: the next turn of a chat starts with this prompt, then
            # the answer as its template re-renders it (which may differ from the ids
            # generated), so this tail may be what its hit ends with. After its parent chunk
            # (router events announce a chunk after its parent: eventblocks.ParentsFirst).
            state.prompt_tail_planned = True
            self._plan_tail(state, self._limit(state, prompt_tokens, attention), attention,
                            out, step)
            if prompt_tokens % self._block_size == 0:
                # A prompt that ends at a block's end: the same prompt again (a retry, a
                # regenerated answer) recomputes its last token, so its hit ends a block
                # sooner, in a tail one block shorter (or, at a chunk's end, in its last
                # chunk's tail), as vLLM's own prefix cache's hit would.
                self._plan_tail(state, self._limit(state, prompt_tokens - 1, attention),
                                attention, out, step)

    def _plan_chunks(self, state: RequestState, computed_tokens: int,
                     attention: list[list[int]], out: list[ChunkTransfer], step: int) -> None:
        """Append to `out` stores of the request's full chunks computed once
        `computed_tokens` are, that no plan stored yet."""
        full_chunks = self._full_chunks(state, computed_tokens, attention)
        if full_chunks <= state.num_planned_chunks:
            return
        keys = self._requests.keys_for(state, full_chunks)
        if state.uncacheable:
            return
        bpc = self._blocks_per_chunk
        states = self._groups.state_ids(state.block_ids) if state.block_ids else []
        loaded = self._failures.recent_loads(state, attention, full_chunks * bpc)
        controls = state.controls
        for chunk in range(state.num_planned_chunks, full_chunks):
            key = keys[chunk]
            retain_s = controls.retain_s_for((chunk + 1) * self._tokens_per_chunk)
            if self._stored(key):
                if retain_s is not None or controls.ttl_s is not None:
                    self._retains.append(ChunkTransfer(
                        key=key, block_ids=(), tenant=state.request.cache_salt,
                        retain_s=retain_s, ttl_s=controls.ttl_s,
                        parent=keys[chunk - 1] if chunk else None))
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
                depends_on=loaded.before(first + bpc), tenant=state.request.cache_salt,
                retain_s=retain_s, ttl_s=controls.ttl_s,
                parent=keys[chunk - 1] if chunk else None))
            self._inflight[key] = step
            state.last_store_step = step
        state.num_planned_chunks = full_chunks

    def end_request(self, request_id: str, state: RequestState | None, step: int) -> bool:
        """A request ended after plan `step`; whether vLLM must keep its blocks until the
        workers report it (vLLM's finished_sending): asynchronous stores planned by the last
        two plans may still be reading them (the workers join a plan's stores by the end of
        the next step; two: with vLLM's async scheduling, one plan is built ahead of the last
        step's outcome), or the next plan stores its last chunks."""
        held = self.stores_async and state is not None and state.last_store_step >= step - 1
        if held:
            self._held.add(request_id)
        if state is not None and state.block_ids and self._plan_final_stores(state, step):
            # Held through the plan that stores them, to the end of the one after it (the
            # workers join a plan's stores by then, deferred finalize or not).
            self._held.discard(request_id)
            self._held_later.add(request_id)
            held = True
        if held:
            self._stats.add("held_requests", 1)
        return held

    def learn(self, report: KVTierWorkerMetadata) -> None:
        """Forget the keys the workers reported, and those of plans whose stores are done."""
        # Done, whether or not a key is reported: a store the tiers dropped (e.g. Redis
        # down) reports nothing, and its key would stay "in flight" forever, never stored
        # again (tests/faults/test_engine_faults.py). Done is the workers' to say: vLLM's V2
        # runner with speculative decoding runs a step's stores after the step's report
        # (tests/connector/test_hook_orders.py).
        self._inflight = {key: step for key, step in self._inflight.items()
                          if step > report.stores_through}
        for key in report.stored | report.skipped:
            self._inflight.pop(key, None)

    def _stored(self, key: ChunkKey) -> bool:
        """Whether `key` needs no store: on its way, or stored as far as the index knows, where
        the index says what the tiers hold. Not in node mode: the node evicts chunks without a
        word to this engine, whose index then would keep a chunk it computed again from ever
        being stored again (a prompt the node lost missed on this engine for good); the node's
        Reserve answers HELD for a chunk its RAM holds, which costs no copy (one it holds only
        below RAM, which lookups find and loads promote, takes a RAM slot: the store's copy
        promotes it, and its tiers below are not written again)."""
        return key in self._inflight or (self._locator.index_first and key in self._locator.index)

    def _full_chunks(self, state: RequestState, computed_tokens: int,
                     attention: list[list[int]]) -> int:
        """The request's chunks that are full, computed once `computed_tokens` are, and held
        in its blocks (`attention`: per attention group), within its controls."""
        return self._limit(state, computed_tokens, attention) // self._tokens_per_chunk

    def _limit(self, state: RequestState, computed_tokens: int,
               attention: list[list[int]]) -> int:
        """The request's tokens computed once `computed_tokens` are and held in its blocks,
        within its controls: what its stores may cover."""
        held_blocks = len(attention[0]) if attention else 0
        limit = min(computed_tokens, len(state.request.all_token_ids),
                    held_blocks * self._block_size)
        if state.controls.max_offload_tokens is not None:
            limit = min(limit, state.controls.max_offload_tokens)
        return limit

    def _plan_tail(self, state: RequestState, limit: int, attention: list[list[int]],
                   out: list[ChunkTransfer], step: int) -> None:
        """Append to `out` the store of the tail of the request's first `limit` tokens: the
        full blocks past its last full chunk (keys.tail_key), unless kvtier holds it or it
        is on its way."""
        tpc, bs = self._tokens_per_chunk, self._block_size
        chunk, blocks = limit // tpc, limit % tpc // bs
        if not self._tails or blocks < 1:
            return
        tails = self._requests.tail_keys(state, chunk, blocks)
        if not tails or tails[0].num_blocks != blocks:
            return
        key = tails[0].key
        if key in state.stored_tails or self._stored(key):
            return
        self._requests.remember_tail(state, tails[0])
        first = chunk * self._blocks_per_chunk
        loaded = self._failures.recent_loads(state, attention, first + blocks)
        controls = state.controls
        out.append(ChunkTransfer(
            key=key, block_ids=ChunkGroups.flat(attention, first, blocks),
            depends_on=loaded.before(first + blocks), tenant=state.request.cache_salt,
            retain_s=controls.retain_s_for(limit), ttl_s=controls.ttl_s,
            parent=state.keys[chunk - 1] if chunk else None))
        self._inflight[key] = step
        state.stored_tails.add(key)
        self._requests.note_tail(state, key)
        state.last_store_step = step

    def _plan_final_stores(self, state: RequestState, step: int) -> bool:
        """Plan, for the next plan, the stores of the full chunks an ended request computed
        that no plan stored (a request ended by max_tokens has no later plan). Every token
        but the last sampled one has its KV computed by now. Whether there are any."""
        request = state.request
        computed = min(request.num_computed_tokens, len(request.all_token_ids) - 1)
        before = len(self._final_stores)
        self.plan(state, computed, self._final_stores, step)
        if not (state.controls.skip_store or state.uncacheable):
            # Its last blocks, for the next turn of a chat (or this prompt again, answered
            # anew) to hit up to its last full block, not its last full chunk.
            attention = self._groups.attention_ids(state.block_ids)
            self._plan_tail(state, self._limit(state, computed, attention), attention,
                            self._final_stores, step)
        return len(self._final_stores) > before
