"""What the scheduler side knows of each request vLLM runs: its chunk keys and its blocks.

Scheduler side, one thread. A request is entered at its first lookup and removed when it
ends. Its keys live in a namespace (model, layout, weights, cache salt, LoRA adapter, chunk
byte order and block size), so that two requests share a key only when their KV is equal,
and are extended chunk by chunk as its tokens become known (`RequestTable.keys_for`). Each
step's schedule gives it its vLLM block ids, one list per KV cache group
(`RequestTable.apply_schedule`).

Primitives: `CHUNK_ORDER`, `RecentLoads`, `RequestState`, `Tail`, `ScheduledRequest`,
`RequestTable`.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from kvtier.core.keys import ChunkKey, Namespace, chunk_keys, tail_key, tail_keys
from kvtier.errors import UncacheableRequest
from kvtier.integrations.vllm.badparams import IgnoredParams
from kvtier.integrations.vllm.config import RequestControls
from kvtier.integrations.vllm.metrics import StatsDelta
from kvtier.integrations.vllm.scheduler.losthits import LookupHit
from kvtier.integrations.vllm.scheduler.plannedkeys import PlannedKeys
from kvtier.integrations.vllm.scheduler.request_keys import (
    LoadedAdapters,
    chunk_extras,
    needs_chunk_extras,
    span_extras,
)
from kvtier.integrations.vllm.scheduler.routerevents import RouterEvents

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Label of the byte order inside a chunk (see paged.py); part of every key's namespace with
# the block size it depends on, so a change of order can never serve old bytes.
CHUNK_ORDER = "chunk-order=LBH2TD-v2"


@dataclass(frozen=True, slots=True)
class RecentLoads:
    """The recently loaded blocks of a request's prefix, by position (loadfailures.py)."""

    positions: tuple[int, ...] = ()  # ascending: each one's position in its group
    blocks: tuple[int, ...] = ()  # block ids, at `positions`
    since: float = math.inf  # the oldest plan that loaded one of them

    def before(self, end: int) -> tuple[int, ...]:
        """Those at positions before `end`: the blocks a chunk ending there depends on (a
        slice: the stores of a request's chunks cost no walk of its loaded blocks each)."""
        return self.blocks[:bisect_left(self.positions, end)]

    def upto(self, end: int) -> RecentLoads:
        """Those at positions before `end`."""
        cut = bisect_left(self.positions, end)
        if cut == len(self.positions):
            return self
        return RecentLoads(self.positions[:cut], self.blocks[:cut], self.since)


@dataclass(slots=True)
class RequestState:
    """One running request, as the scheduler side plans its loads and stores."""

    request: Request
    controls: RequestControls
    namespace: Namespace
    # The sampling params `controls` were read from: a streaming-input session (vLLM's
    # resumable request) gets each input piece's own, kv_transfer_params with them
    # (`RequestTable.state` reads them again when this is no longer the request's).
    controls_source: object = None
    keys: list[ChunkKey] = field(default_factory=list)
    # Its vLLM block ids, one list per KV cache group (none before its first step).
    block_ids: list[list[int]] = field(default_factory=list)
    # Local (vLLM prefix cache) tokens at the last lookup; loads start there.
    lookup_computed_tokens: int = 0
    # Chunks already planned (loaded, stored or found in the index).
    num_planned_chunks: int = 0
    # Its KV depends on something kvtier cannot key: never looked up, never stored.
    uncacheable: bool = False
    # Its last lookup's hit is loaded asynchronously (the request waits for it).
    load_async: bool = False
    # A load of it failed: it is recomputed, never looked up again (a tier that failed once,
    # e.g. stalled, would fail again and keep the request waiting).
    load_failed: bool = False
    # The plan (step number) that last stored a chunk of it; -1: none.
    last_store_step: int = -1
    # Its last lookup's load-or-recompute decisions, chunks by (tier, reason) (offer.py),
    # counted when vLLM allocates its blocks.
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Its last lookup's hit, found and offered (losthits.py), counted when vLLM allocates
    # its blocks; None: no lookup found anything since.
    lookup_hit: LookupHit | None = None
    # Its last lookup's hit ends in a chunk's tail (keys.tail_key): that tail; else None.
    tail: Tail | None = None
    # Tails planned for storing, by key (not stored twice by one request).
    stored_tails: set[ChunkKey] = field(default_factory=set)
    # Its prompt's tail was planned (once its prompt was computed: storeplan.py).
    prompt_tail_planned: bool = False
    # Its leading blocks already checked for recent loads, and those of them found recently
    # loaded (LoadFailures.recent_loads): a held block is never loaded into, so each is
    # checked once, not every plan. Reset with its blocks.
    loads_checked_blocks: int = 0
    recent_loads: RecentLoads = field(default_factory=RecentLoads)

    @property
    def has_extras(self) -> bool:
        """Whether its chunks carry extra key bytes (multimodal, prompt embeds:
        request_keys.py), asked of the request each time: a streaming-input session (vLLM's
        resumable request, one id for all its input chunks) may bring its first image with a
        later input chunk, and the chunks after it were keyed as text (a text request of the
        same token ids then loaded the image's KV: tests/engine/test_streaming_sessions.py)."""
        return needs_chunk_extras(self.request)

    def set_block_ids(self, block_ids: list[list[int]]) -> None:
        """Its blocks are now `block_ids` (a first step, a resume, a preemption): none of
        them is checked for recent loads yet."""
        self.block_ids = block_ids
        self.loads_checked_blocks = 0
        self.recent_loads = RecentLoads()


@dataclass(frozen=True, slots=True)
class Tail:
    """The first `num_blocks` blocks of chunk `chunk` of a request, under their tail key."""

    chunk: int
    num_blocks: int
    key: ChunkKey


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A request a step schedules, with its blocks taken in."""

    state: RequestState
    computed_tokens: int  # tokens whose KV is computed once the step has run
    # A request's first step (vLLM's scheduled_new_reqs): its computed tokens before it.
    first_step_from: int | None = None


class RequestTable:
    """The running requests by id, and the keys of their chunks (scheduler thread)."""

    def __init__(self, *, tokens_per_chunk: int, block_size: int, model_id: str,
                 layout_digest: str, weights_fingerprint: str | None, group_label: str | None,
                 kv_role: str | None, stats: StatsDelta, events: RouterEvents) -> None:
        """`group_label`: the model's KV cache groups in the namespace (groups.py), if any;
        `kv_role` is vLLM's (RequestControls.within_role); `events` keeps the token ids of
        new chunks when router events are enabled."""
        self._tokens_per_chunk = tokens_per_chunk
        self._block_size = block_size
        self._model_id = model_id
        self._layout_digest = layout_digest
        self._weights_fingerprint = weights_fingerprint
        self._group_label = group_label
        self._kv_role = kv_role
        self._stats = stats
        self._events = events
        self._requests: dict[str, RequestState] = {}
        # Each key of their chains and tails -> the requests that have it (plannedkeys.py).
        self._keys = PlannedKeys()
        # Set by a cache reset (a weight update in place): in every key's namespace from then
        # on, so that no chunk stored before is ever found again (`start_epoch`).
        self._epoch: str | None = None
        self._adapters = LoadedAdapters()
        # Bad kv_transfer_params of API users: each field's first at warning (badparams.py).
        self._ignored = IgnoredParams(logger)

    def state(self, request: Request) -> RequestState:
        """The request's state, entered on first sight; its controls read again when a
        streaming-input session's next piece brought new sampling params (module doc)."""
        state = self._requests.get(request.request_id)
        if state is None:
            namespace, keyed = self._namespace(request)
            if not keyed:
                self._stats.add("uncacheable_requests", 1)
            state = RequestState(request=request, namespace=namespace,
                                 controls=self._controls(request.kv_transfer_params),
                                 controls_source=request.sampling_params,
                                 uncacheable=not keyed)
            self._requests[request.request_id] = state
        elif request.sampling_params is not state.controls_source:
            # vLLM replaces a session's sampling params with each input piece's
            # (Scheduler._update_request_as_session) but leaves `request.kv_transfer_params`
            # the first piece's: the piece's own switches are in its extra_args (a later
            # piece's skip_store stops stores from then on: test_streaming_controls.py).
            params = request.sampling_params
            extra = params.extra_args if params is not None else None
            state.controls = self._controls(extra.get("kv_transfer_params") if extra else None)
            state.controls_source = params
        return state

    def _controls(self, params: Any) -> RequestControls:
        """The switches of `params` (a request's kv_transfer_params) within the engine's
        role, bad values counted as ignored."""
        ignored = self._ignored.count
        controls = RequestControls.from_params(params, self._ignored)
        if self._ignored.count > ignored:
            self._stats.add("ignored_request_params", self._ignored.count - ignored)
        return controls.within_role(self._kv_role)

    def pop(self, request_id: str) -> RequestState | None:
        """Forget an ended request (its chunks' token ids for router events too); its state,
        if it was known."""
        self._events.forget(request_id)
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._keys.forget_chunks(request_id, state.keys)
            self._keys.forget_tails(request_id)
        return state

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._requests.values())

    def chunk_holders(self, key: ChunkKey) -> Iterator[tuple[RequestState, int]]:
        """The requests whose chain has chunk `key`, with its position there (planned or
        not: `RequestState.num_planned_chunks` says)."""
        for request_id, position in self._keys.chunk_holders(key).items():
            yield self._requests[request_id], position  # live: see `_live`

    def tail_holders(self, key: ChunkKey) -> Iterator[RequestState]:
        """The requests that found tail `key` at a lookup or planned its store (some may
        have neither now: a later lookup found another, or a report dropped it)."""
        for request_id in self._keys.tail_holders(key):
            yield self._requests[request_id]  # live: see `_live`

    def note_tail(self, state: RequestState, key: ChunkKey) -> None:
        """The request found tail `key` (its `tail`) or planned its store (`stored_tails`):
        indexed, for reports that name it (`tail_holders`)."""
        if self._live(state):
            self._keys.add_tail(state.request.request_id, key)

    def _live(self, state: RequestState) -> bool:
        """Whether `state` is a running request's (not one that ended: its final stores
        are planned after `pop`, and a key indexed then would stay, naming a request this
        table no longer knows)."""
        return self._requests.get(state.request.request_id) is state

    def others_have_blocks(self, request_id: str) -> bool:
        """Whether a request other than `request_id` runs (holds blocks)."""
        return any(other.block_ids for req_id, other in self._requests.items()
                   if req_id != request_id)

    def keys_for(self, state: RequestState, num_chunks: int) -> list[ChunkKey]:
        """The first `num_chunks` chunk keys of the request's tokens (extends the chain);
        none once the request is found uncacheable (marked and counted here, once)."""
        if state.uncacheable:
            return []
        tpc = self._tokens_per_chunk
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
            if self._events.enabled:
                self._events.remember(state.request, new_keys, tokens, parent)
            if self._live(state):
                self._keys.add_chunks(state.request.request_id, have, new_keys)
            state.keys.extend(new_keys)
        return state.keys[:num_chunks]

    def tail_keys(self, state: RequestState, chunk: int, max_blocks: int) -> list[Tail]:
        """The tails of chunk `chunk` of the request's tokens, of `max_blocks` blocks down to
        1 (fewer where its tokens end sooner; none past blocks a chunk - 1, or once the request
        is found uncacheable)."""
        tpc, bs = self._tokens_per_chunk, self._block_size
        start = chunk * tpc
        tokens = state.request.all_token_ids
        most = min(max_blocks, tpc // bs - 1, (len(tokens) - start) // bs)
        if most < 1 or len(self.keys_for(state, chunk)) < chunk or state.uncacheable:
            return []  # too few tokens, or uncacheable (keys_for finds it out)
        parent = state.keys[chunk - 1] if chunk else None
        if not state.has_extras:
            keys = tail_keys(tokens[start:start + most * bs], state.namespace, bs, parent)
            return [Tail(chunk, m, keys[m - 1]) for m in range(most, 0, -1)]
        tails = []
        for m in range(most, 0, -1):
            try:
                extra = span_extras(state.request, start, start + m * bs, bs)
            except UncacheableRequest:
                return []  # its full chunks' keys say so (keys_for)
            tails.append(Tail(chunk, m, tail_key(tokens[start:start + m * bs], state.namespace,
                                                 m, parent, extra)))
        return tails

    def remember_tail(self, state: RequestState, tail: Tail) -> None:
        """Keep a tail's token ids for the router events of its store, or of its promotion
        into RAM by a hit's read (when enabled)."""
        if self._events.enabled:
            start = tail.chunk * self._tokens_per_chunk
            tokens = state.request.all_token_ids[start:start + tail.num_blocks * self._block_size]
            parent = state.keys[tail.chunk - 1] if tail.chunk else None
            self._events.remember(state.request, [tail.key], tokens, parent)

    def start_epoch(self, epoch: str) -> int:
        """The engine's weights changed in place (vLLM's reset_cache): keys from now on live
        in a namespace that names `epoch`, so no chunk stored before is found again. A request
        known now that holds KV computed before (computed tokens, or an asynchronous load of
        old chunks on its way) is never stored or looked up again: its KV is the old weights'
        (counted as uncacheable). Others (waiting, or preempted by the reset: their KV is
        gone) are keyed anew. The requests holding KV (and so vLLM's blocks: its own reset
        failed while they do)."""
        self._epoch = epoch
        holding = 0
        for state in self._requests.values():
            if state.request.num_computed_tokens > 0 \
                    or state.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                holding += 1
                if not state.uncacheable:
                    self._stats.add("uncacheable_requests", 1)
                state.uncacheable = True
            else:
                state.namespace, keyed = self._namespace(state.request)
                if not keyed and not state.uncacheable:
                    self._stats.add("uncacheable_requests", 1)
                    state.uncacheable = True
                self._keys.forget_chunks(state.request.request_id, state.keys)
                self._keys.forget_tails(state.request.request_id)
                state.keys.clear()
                state.stored_tails.clear()
                state.num_planned_chunks = 0
        return holding

    def apply_schedule(self, output: SchedulerOutput) -> list[ScheduledRequest]:
        """Take in a step's schedule: preempted requests lose their blocks, scheduled ones
        gain theirs (a resumed one gets a full new list). The scheduled requests known here,
        new ones first, as vLLM lists them."""
        self._adapters.new_step()
        for req_id in output.preempted_req_ids or ():
            if req_id in self._requests:
                # Its blocks are freed; the resumed request gets a full new block list, and
                # chunks it had not stored yet are stored when recomputed.
                self._requests[req_id].set_block_ids([])
                self._requests[req_id].num_planned_chunks = 0
        scheduled: list[ScheduledRequest] = []
        for new in output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.set_block_ids([list(ids) for ids in new.block_ids])
                computed = new.num_computed_tokens + output.num_scheduled_tokens[new.req_id]
                scheduled.append(ScheduledRequest(state, computed, new.num_computed_tokens))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.set_block_ids([list(ids) for ids in new_blocks] if new_blocks else [])
            elif new_blocks:
                if not state.block_ids:
                    state.set_block_ids([[] for _ in new_blocks])
                for ids, more in zip(state.block_ids, new_blocks):
                    ids.extend(more)
            computed = cached.num_computed_tokens[i] + output.num_scheduled_tokens[req_id]
            scheduled.append(ScheduledRequest(state, computed))
        return scheduled

    def adapter_unchanged(self, state: RequestState) -> bool:
        """Whether the request's KV is still its keys' (its LoRA adapter's files unchanged
        since its id was loaded: `LoadedAdapters`); if not, it is marked uncacheable and
        counted. True for a request without an adapter."""
        lora = state.request.lora_request
        if lora is None or state.uncacheable:
            return not state.uncacheable
        try:
            self._adapters.identity(lora)
        except UncacheableRequest:
            self._stats.add("uncacheable_requests", 1)
            state.uncacheable = True
            return False
        return True

    def _namespace(self, request: Request) -> tuple[Namespace, bool]:
        """The request's namespace, and whether its KV can be keyed in it (not: its LoRA
        adapter's weights are unknown, `LoadedAdapters`)."""
        extra = [CHUNK_ORDER, f"block-size={self._block_size}"]
        keyed = True
        if self._epoch is not None:
            extra.append(f"epoch={self._epoch}")
        if self._group_label is not None:
            extra.append(self._group_label)
        if request.lora_request is not None:
            # The adapter's content as its workers loaded it (request_keys.LoadedAdapters): a
            # name re-pointed at another adapter never reuses the old adapter's KV; one adapter
            # at two paths shares it.
            try:
                extra += self._adapters.identity(request.lora_request)
            except UncacheableRequest:
                keyed = False
        return Namespace(model_id=self._model_id, layout_digest=self._layout_digest,
                         weights_fingerprint=self._weights_fingerprint,
                         cache_salt=request.cache_salt, extra=tuple(extra)), keyed
