"""vLLM 0.33's hook orders, replayed end to end through one scheduler side and one worker side
(issue 23: the V2 model runner, asynchronous scheduling, speculative decoding).

One `ConnectorScheduler` plans; one `ConnectorWorker` (CPU `PagedKV`, a real memory tier and a
disk tier on tmp_path) runs each plan; each worker report goes back in a real
`KVConnectorOutput`. The hooks are called on `KVTierConnector` itself (connector.py: bind ->
begin_step, wait_for_save -> store, get_finished -> finish_step of the bound plan's `held`,
build_connector_worker_meta -> take_report), in the orders vLLM 0.33 calls them:

  (a) the V1 runner, synchronous scheduling (vLLM's CPU backend today):
      kv_connector_model_runner_mixin.py `_get_kv_connector_output`: bind, start_load_kv,
      forward, wait_for_save, get_finished, report, clear; the scheduler learns the step's
      outcome (request ends, update_connector_output) before it plans the next step.
  (b) the V2 runner, asynchronous scheduling: gpu/kv_connector.py `ActiveKVConnector`
      pre_forward / post_forward (the worker order of (a)), but the scheduler plans step N+1
      before it has seen step N's outcome (async_scheduler.py, EngineCore's batch queue).
  (c) the V2 runner with a speculator (gpu/model_runner.py: defer_kv_finalize): post_forward
      builds the report (get_finished, build_connector_worker_meta) BEFORE wait_for_save;
      finalize_step runs wait_for_save and clear after the drafter; a step without a forward
      goes through no_forward, undeferred. With asynchronous scheduling (issue 23's users)
      and, to compare hook orders alone, without.

The workload: requests that share a 2-chunk prefix (up to four compute the same chunk, in the
same plan or while its store is in flight), later requests that load it, and requests whose
last step completes a chunk (with asynchronous stores vLLM keeps their blocks, "held", until
get_finished reports them). vLLM's side is emulated where it matters: blocks of an ended
request are overwritten (zeros) as soon as vLLM may hand them out again (when get_finished
reports a held request; for the others, before the first step planned after the end), freed
blocks are handed out again first, and the store thread is as slow as the worker lets it be (a
job runs only when the model runner waits for it: fault injection). Decode steps compute one
token (drafts change what a step computes, not the hook order).

Checks: (1) no chunk is planned for storing twice; (2) every chunk planned is reported stored
and held by both tiers with the bytes of its blocks right after its step's forward; (3) a held
request is reported finished only after every store job reading its blocks has run (and so its
zeroed blocks never reach the store: 2); (4) hook order (c) stores what (a) stores under the
same scheduling. Two cases put back the rules from before 8071d8a, one at a time, and show the
checks fail: the end of a step that joins every store job but the newest (held requests
released before their gather: 3 and 2, under deferred finalize), and a scheduler that takes a
step's stores as done once its outcome arrives (chunks planned twice: 1, under asynchronous
scheduling with or without deferred finalize).

A synchronous load that fails or is rejected (issue 41, contract c; vllm#49250): a chunk of a
later request's hit is deleted, or its disk copy damaged, once the plan that loads it is built.
The blocks a load is to write hold garbage until it writes them; a forward that reads such
KV writes wrong values (`TAINTED`) and samples a wrong token. vLLM 0.33's side
(scheduler.py `_handle_invalid_blocks`, policy "recompute"): the step's `invalid_block_ids`
truncate each running request's num_computed_tokens at its first invalid block; under async
scheduling the next plan was built before, and its step runs over the unfilled blocks too.
Tokens of the steps planned before the rewind are discarded (0.33 skips the failed step's;
it still delivers the one in flight behind it, vLLM's part of vllm#49250, not kvtier's).
Checks: the blocks reported are those of the load from its first unfilled block; no forward
after the rewind reads anything but the miss path's KV; no token sampled over bad KV is kept;
every chunk stored holds the miss path's bytes (stores over the unfilled blocks refused:
`depends_on`, `acked_failed_blocks`) and is planned again only once refused or missing; a
later request loads the chunks stored again. Controls take kvtier's guards out one at a time.
A hit vLLM refuses (0 external tokens) is computed as a miss.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator
from kvtier.core.threads import IOPool
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.connector import KVTierConnector
from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.worker import connector_worker as worker_module
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker, PagedKV
from kvtier.tiers import open_store

CHUNK, BLOCK = 64, 32  # two vLLM blocks a chunk
LAYERS, HEADS, DIM, NUM_BLOCKS = 2, 2, 16, 64
PREFILL_CHUNK = 96  # vLLM's chunked prefill: prompt tokens a request computes per step
MAX_STEPS = 120


@dataclass(frozen=True)
class Order:
    """How vLLM 0.33 drives the connector (see the module docstring)."""

    async_scheduling: bool  # the scheduler plans step N+1 before step N's outcome arrives
    defer_finalize: bool  # V2 runner with a speculator: wait_for_save after the report


ORDERS = {
    "a-v1-sync-scheduling": Order(async_scheduling=False, defer_finalize=False),
    "b-v2-async-scheduling": Order(async_scheduling=True, defer_finalize=False),
    "c-v2-spec-decode-async-scheduling": Order(async_scheduling=True, defer_finalize=True),
    "c-v2-spec-decode-sync-scheduling": Order(async_scheduling=False, defer_finalize=True),
}
A, B, C, C_SYNC = ORDERS


# -- the workload -----------------------------------------------------------------------------

SHARED = list(range(1000, 1128))  # a 2-chunk prefix


@dataclass(frozen=True)
class Spec:
    """A request: arrives at plan `arrive`, samples `num_outputs` tokens, ends by a stop token
    ("eos": under async scheduling vLLM schedules it one step past its end) or by max_tokens
    ("length": it does not)."""

    rid: str
    arrive: int
    prompt: list[int]
    num_outputs: int
    ends_by: str

    @property
    def tokens(self) -> list[int]:
        outputs = [50_000 + 1_000 * int(self.rid[1:]) + i for i in range(self.num_outputs)]
        return self.prompt + outputs


def own(n: int, first: int) -> list[int]:
    return list(range(first, first + n))


WORKLOAD = [
    # Two prompts with the shared prefix in the same steps: both complete its chunks. r1's
    # chunk 2 is completed by its last step (computing position 191): held in every order.
    Spec("r1", 1, SHARED + own(40, 2000), 25, "eos"),
    # Max tokens: its last chunk is completed one step before its end.
    Spec("r2", 1, SHARED + own(20, 3000), 46, "length"),
    # The prefix again while its stores are in flight (or not yet reported).
    Spec("r3", 2, SHARED + own(70, 4000), 2, "length"),
    Spec("r7", 3, SHARED + own(20, 3000), 10, "length"),  # r2's prompt, resubmitted
    Spec("r5", 4, own(100, 5000), 29, "eos"),  # no shared prefix; its end completes chunk 1
    Spec("r8", 5, own(100, 8000), 29, "length"),  # the same, ended by max_tokens (xfail)
    # Later: the prefix is stored and reported, so these load it.
    Spec("r4", 7, SHARED + own(10, 6000), 20, "length"),
    Spec("r6", 12, SHARED + own(64, 4000) + own(5, 7000), 3, "length"),  # r3's first 3 chunks
]


def kv_values(tokens: list[int]) -> torch.Tensor:
    """What the forward writes at each position: a function of the token and the position
    (equal prefixes, equal chunks); never 0, so a zeroed block shows; exact in bfloat16."""
    return torch.tensor([(t * 7 + p * 3) % 199 + 1 for p, t in enumerate(tokens)],
                        dtype=torch.float32)


# What blocks hold that no forward or load of theirs wrote (newly allocated blocks: another
# request's old KV, anything), and what a forward writes where it read such KV: neither is a
# value kv_values gives (1..199, plus the layer), and both are exact in bfloat16.
GARBAGE, TAINTED = 250.0, 240.0


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def miss_chunk(tokens: list[int], chunk: int, blocks: int = CHUNK // BLOCK) -> torch.Tensor:
    """The bytes of chunk `chunk` of `tokens` (or of its tail of `blocks` blocks) as the miss
    path computes it (every position's KV from its forward, kv_values), gathered as the
    worker gathers a chunk."""
    values = kv_values(tokens)[chunk * CHUNK:chunk * CHUNK + blocks * BLOCK]
    kv = {name: (values + i).to(torch.bfloat16).view(blocks, 1, BLOCK, 1)
          .expand(blocks, HEADS, BLOCK, 2 * DIM).contiguous()
          for i, name in enumerate(layer_names())}
    paged = PagedKV(kv, BLOCK)
    out = torch.empty(paged.layout(CHUNK).bytes_per_chunk, dtype=torch.uint8)
    paged.gather(tuple(range(blocks)), out)
    return out


@dataclass(frozen=True)
class Damage:
    """A synchronous load that does not give vLLM the KV kvtier offered (vllm#49250):
    "delete": chunk `chunk` of request `rid`'s hit is deleted from every tier after the plan
    that loads it was built (an eviction or a gc racing the load): the chunks before it
    load, it and those after it fail. "corrupt": its disk file is damaged (a byte flipped:
    the checksum rejects it) and the RAM copy gone. "refuse": vLLM takes none of the hit
    (0.33's scheduler drops an offered hit after the lookup: skip_reading_prefix_cache, a
    local partial block longer than the hit, the aux-output connector's cap, the SWA replay
    window) and calls update_state_after_alloc with 0 external tokens."""

    rid: str
    chunk: int
    how: str


# -- vLLM's side ------------------------------------------------------------------------------

class LateStoreThread:
    """The worker's store thread at its slowest (fault injection): a job runs when the model
    runner waits for it (`result()`: a step's end, a preemption, close) and never sooner."""

    def __init__(self) -> None:
        self.jobs: list[LateJob] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> LateJob:
        job = LateJob(fn, args)
        self.jobs.append(job)
        return job

    def reading(self, blocks: set[int]) -> bool:
        """Whether a job that has not run yet reads any of `blocks`."""
        return any(not job.done and any(blocks.intersection(t.block_ids) for t in job.args[0])
                   for job in self.jobs)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        return None


class LateJob:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args, self.done, self.value = fn, args, False, None

    def result(self) -> Any:
        if not self.done:
            self.value, self.done = self.fn(*self.args), True
        return self.value


def connector(*, scheduler: ConnectorScheduler | None = None,
              worker: ConnectorWorker | None = None) -> KVTierConnector:
    """KVTierConnector of one role around `scheduler` or `worker`: the hooks are the shell's
    own code; its __init__ (which reads a VllmConfig to build these two) is skipped."""
    shell = KVTierConnector.__new__(KVTierConnector)
    shell._scheduler, shell._worker, shell._connector_metadata = scheduler, worker, None
    return shell


@dataclass
class Running:
    spec: Spec
    request: Request
    blocks: list[int]
    values: torch.Tensor  # kv_values of its tokens
    computed: int  # vLLM's num_computed_tokens (advanced when a step is scheduled)
    hit: int  # tokens it loaded from kvtier
    finished: bool = False
    # A load of it failed and vLLM has not rewound it yet: its forwards read unfilled blocks.
    poisoned: bool = False
    # vLLM rewound it when it had built this many plans: the steps of those plans ran (or
    # run, in flight) over the unfilled blocks; their outputs are discarded.
    stale_through: int = 0


@dataclass
class Step:
    """A plan and what vLLM scheduled with it: (request id, computed before, tokens)."""

    number: int
    meta: KVTierMetadata
    scheduled: list[tuple[str, int, int]]
    finished_req_ids: set[str]
    has_sync_kv_loads: bool
    # Blocks of its loads from the first one no load wrote (vLLM must recompute them).
    unfilled: set[int] = field(default_factory=set)
    tainted: set[str] = field(default_factory=set)  # requests whose forward read such KV


@dataclass
class Findings:
    """What a replay saw."""

    planned: list[ChunkKey] = field(default_factory=list)  # every store of every plan
    reported: set[ChunkKey] = field(default_factory=set)  # reported stored
    wrong_bytes: list[tuple[str, ChunkKey]] = field(default_factory=list)  # (tier, key)
    early_releases: list[str] = field(default_factory=list)  # held, released before a gather
    stale_reads: list[str] = field(default_factory=list)  # a forward read wrong KV
    held: set[str] = field(default_factory=set)  # requests vLLM kept the blocks of
    loads: int = 0  # requests that loaded a hit
    reused: int = 0  # requests given blocks another request had
    # a chunk (its tokens from the first) -> the requests that computed it (not loaded)
    computed_by: Counter[tuple[int, ...]] = field(default_factory=Counter)
    # Failed loads: (step, its loads' blocks from the first one no load wrote, vLLM's
    # invalid_block_ids), for every step with either
    load_errors: list[tuple[int, set[int], set[int]]] = field(default_factory=list)
    rewinds: list[tuple[str, int, int, int]] = field(default_factory=list)  # rid, step, from, to
    tainted_reads: list[tuple[str, int]] = field(default_factory=list)  # (rid, step)
    wrong_outputs: list[str] = field(default_factory=list)  # a token sampled over bad KV kept
    never_rewound: list[str] = field(default_factory=list)  # poisoned at the end
    skipped: set[ChunkKey] = field(default_factory=set)  # stores the workers refused
    missing: set[ChunkKey] = field(default_factory=set)  # loads that found nothing
    last_read: dict[str, tuple[int, bool]] = field(default_factory=dict)  # (prefix, intact)

    def planned_twice(self) -> list[ChunkKey]:
        return [key for key, n in Counter(self.planned).items() if n > 1]

    def contended(self) -> int:
        """Chunks that two requests or more computed (each could have planned it)."""
        return sum(n > 1 for n in self.computed_by.values())


class Replay:
    """vLLM's engine around the connector: its scheduler (admission, chunked prefill, decode,
    request ends, block frees) and its model runner (the hook order, a forward that writes
    each computed position's KV)."""

    def __init__(self, order: Order, store_mode: str, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch, workload: list[Spec] | None = None,
                 damage: Damage | None = None) -> None:
        self.order = order
        self.workload = WORKLOAD if workload is None else workload
        self.damage = damage
        self.damaged: ChunkKey | None = None
        self.late = LateStoreThread()
        monkeypatch.setattr(worker_module, "IOPool", lambda threads, name, cores: self.late
                            if name == "kvtier-store" else IOPool(threads, name, cores))
        self.kv = {name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
                   for name in layer_names()}
        self.paged = PagedKV(self.kv, BLOCK)
        self.layout = self.paged.layout(CHUNK)
        config = ConnectorConfig.parse({
            "tokens_per_chunk": CHUNK, "load_mode": "sync", "store_mode": store_mode,
            # Every hit loaded: the workload counts its loads, and on a loaded machine the
            # load-or-recompute rule may rightly recompute a disk hit of this tiny model.
            "load_when": "always",
            "tiers": [{"kind": "memory", "capacity": "1MiB"},
                      {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"}]})
        self.store = open_store(config.store, self.layout)
        self.scheduler = connector(scheduler=ConnectorScheduler(
            config, block_size=BLOCK, model_id="tiny", layout_digest="0" * 32,
            locator=ChunkLocator({}, max_keys=1024)))
        self.connector_worker = ConnectorWorker(self.paged, self.layout, self.store)
        self.worker = connector(worker=self.connector_worker)
        self.found = Findings()
        self.reference: dict[ChunkKey, torch.Tensor] = {}  # a chunk's bytes, the miss path's
        self.requests: dict[str, Running] = {}
        self.free_blocks = list(range(NUM_BLOCKS))  # the last freed are handed out first
        self.used: set[int] = set()
        self.to_zero: list[tuple[int, list[int]]] = []  # (freed after plan, blocks)
        self.finished_since_plan: set[str] = set()
        self.released: set[str] = set()  # held requests get_finished reported
        self.plans = 0

    # -- the scheduler (vLLM's Scheduler.schedule / update_from_output) ------------------

    def schedule(self) -> Step:
        self.plans += 1
        new, cached, hit_any = [], [], False
        for r in self.requests.values():
            n = self.tokens_to_schedule(r)
            if n:
                cached.append((r, n))
        for spec in self.workload:
            if spec.arrive == self.plans:
                r = self.admit(spec)
                hit_any |= r.hit > 0
                new.append((r, min(len(spec.prompt) - r.computed, PREFILL_CHUNK)))
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.spec.rid, block_ids=(r.blocks,),
                                                num_computed_tokens=r.computed)
                                for r, _ in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r.spec.rid for r, _ in cached], new_block_ids=[None] * len(cached),
                num_computed_tokens=[r.computed for r, _ in cached], resumed_req_ids=set()),
            num_scheduled_tokens={r.spec.rid: n for r, n in new + cached},
            preempted_req_ids=set())
        meta = self.scheduler.build_connector_meta(output)  # type: ignore[arg-type]
        assert isinstance(meta, KVTierMetadata) and meta.step == self.plans
        self.found.planned += [t.key for t in meta.stores]
        scheduled = [(r.spec.rid, r.computed, n) for r, n in new + cached]
        for r, n in new + cached:
            r.computed += n
            r.request.num_computed_tokens = r.computed  # as vLLM's scheduler advances it
        finished, self.finished_since_plan = self.finished_since_plan, set()
        return Step(self.plans, meta, scheduled, finished, hit_any)

    def tokens_to_schedule(self, r: Running) -> int:
        prompt = len(r.spec.prompt)
        if r.finished:
            return 0
        if r.computed < prompt:
            return min(prompt - r.computed, PREFILL_CHUNK)
        # Decode, a token a step, up to the last output's position but one (that step samples
        # the last output); under async scheduling vLLM learns of a stop token a step late
        # and schedules the request once more, for the last output's position.
        end = len(r.spec.tokens) - (0 if self.order.async_scheduling
                                    and r.spec.ends_by == "eos" else 1)
        return 1 if r.computed < end else 0

    def admit(self, spec: Spec) -> Running:
        request = Request(spec.rid, list(spec.prompt),
                          SamplingParams(max_tokens=spec.num_outputs), None)
        hit, load_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        assert hit is not None and not load_async
        if self.damage is not None and self.damage.how == "refuse" \
                and spec.rid == self.damage.rid:
            assert hit > 0
            hit = 0  # vLLM drops the hit: no external tokens
        need = -(-len(spec.tokens) // BLOCK)
        blocks, self.free_blocks = self.free_blocks[-need:], self.free_blocks[:-need]
        assert len(blocks) == need, "the block pool ran out"
        self.found.reused += not self.used.isdisjoint(blocks)
        self.used.update(blocks)
        self.scheduler.update_state_after_alloc(
            request, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)  # type: ignore[arg-type]
        self.found.loads += hit > 0
        r = Running(spec, request, blocks, kv_values(spec.tokens), computed=hit, hit=hit)
        self.requests[spec.rid] = r
        return r

    def update(self, step: Step, output: KVConnectorOutput) -> None:
        """A step's outcome: sampled tokens, request ends (each asks request_finished), then
        the connector's output and the blocks of the held requests reported finished. Blocks
        that failed to load rewind the requests holding them first, as vLLM 0.33 does."""
        invalid = set(output.invalid_block_ids or ())
        if step.unfilled or invalid:
            self.found.load_errors.append((step.number, set(step.unfilled), invalid))
        if invalid:
            self.rewind(step, invalid)
        for rid, computed, n in step.scheduled:
            r = self.requests[rid]
            if r.finished or computed + n < len(r.spec.prompt):
                continue  # a step past the end (output dropped), or a prefill chunk
            if step.number <= r.stale_through:
                # Planned before vLLM rewound the request: the step whose load failed (0.33
                # skips the requests its invalid blocks rewound) and, under async scheduling,
                # the step in flight behind it. 0.33 still delivers the latter's token (vLLM's
                # part of vllm#49250, fixed by vllm#49252): the miss path discards it.
                continue
            if rid in step.tainted:
                self.found.wrong_outputs.append(f"{rid} at step {step.number}")
            r.request.append_output_token_ids(r.spec.tokens[len(r.request.all_token_ids)])
            if len(r.request.output_token_ids) == r.spec.num_outputs:
                self.end(r)
        self.scheduler.update_connector_output(output)
        assert isinstance(output.kv_connector_worker_meta, KVTierWorkerMetadata | None)
        if output.kv_connector_worker_meta is not None:
            self.found.reported |= output.kv_connector_worker_meta.stored
            self.found.skipped |= output.kv_connector_worker_meta.skipped
            self.found.missing |= output.kv_connector_worker_meta.missing
        for rid in output.finished_sending or ():
            assert rid in self.found.held
            self.released.add(rid)
            self.free_blocks += self.requests[rid].blocks  # zeroed when reported (execute)

    def rewind(self, step: Step, invalid: set[int]) -> None:
        """vLLM 0.33's Scheduler._handle_invalid_blocks with kv_load_failure_policy
        "recompute" (kvtier's): `_update_requests_with_invalid_blocks` over the running
        requests truncates each one's num_computed_tokens at its first invalid block among
        those computed before the step (num_computed_tokens less the step's tokens: under
        async scheduling it counts the step in flight too, as 0.33's does), a block shared by
        two requests recomputed by the first."""
        scheduled = {rid: n for rid, _, n in step.scheduled}
        marked: set[int] = set()
        for r in self.requests.values():
            if r.finished:
                continue
            before = r.computed - scheduled.get(r.spec.rid, 0)
            affected, truncated = False, False
            for idx, block in zip(range(-(-before // BLOCK)), r.blocks):
                if block not in invalid:
                    continue
                affected = True
                if block in marked:
                    continue
                marked.add(block)
                if not truncated:
                    truncated = True
                    self.found.rewinds.append((r.spec.rid, step.number, r.computed,
                                               idx * BLOCK))
                    r.computed = idx * BLOCK
            if affected:
                if not truncated:
                    r.computed = before
                r.request.num_computed_tokens = r.computed
                r.poisoned, r.stale_through = False, self.plans

    def end(self, r: Running) -> None:
        r.finished = True
        self.finished_since_plan.add(r.spec.rid)
        held, _ = self.scheduler.request_finished(r.request, r.blocks)
        if held:
            self.found.held.add(r.spec.rid)
        else:  # free: the next plan may hand them out; the steps planned already still run
            self.free_blocks += r.blocks
            self.to_zero.append((self.plans, r.blocks))

    # -- the model runner (the hook order) --------------------------------------------------

    def execute(self, step: Step) -> KVConnectorOutput:
        w, meta = self.worker, step.meta
        # Blocks freed before this plan was built may hold another request's KV by now.
        for after, blocks in [z for z in self.to_zero if z[0] < step.number]:
            self.zero(blocks)
            self.to_zero.remove((after, blocks))
        forward = bool(step.scheduled)
        # Without a forward: V1's kv_connector_no_forward, V2's no_forward (never deferred).
        defer = self.order.defer_finalize and forward
        self.apply_damage(step)
        # Newly allocated blocks hold anything: what no load writes stays garbage.
        loading = {b for ts in meta.loads.values() for t in ts for b in t.written_blocks()}
        self.fill(loading, GARBAGE)
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if step.has_sync_kv_loads:
            w.start_load_kv(None)  # type: ignore[arg-type]
        else:
            assert not meta.loads
        # Blocks no load wrote, and from the first of them on, every block of the request's
        # load (those vLLM must recompute, written or not: the loads' reads run in parallel,
        # a chunk after a failed one may land).
        first = next(iter(self.kv.values()))
        for transfers in meta.loads.values():
            blocks = [b for t in transfers for b in t.written_blocks()]
            unfilled = [i for i, b in enumerate(blocks) if bool((first[b] == GARBAGE).any())]
            if unfilled:
                step.unfilled.update(blocks[unfilled[0]:])
        for r in self.requests.values():
            r.poisoned |= not step.unfilled.isdisjoint(r.blocks)
        if forward:
            self.forward(step)
        if not step.has_sync_kv_loads:
            w.start_load_kv(None)  # type: ignore[arg-type]
        if not defer:
            w.wait_for_save()
        results = w.get_transfer_results(step.finished_req_ids)
        for rid in results.finished_sending:  # vLLM frees its blocks now
            blocks = set(self.requests[rid].blocks)
            if self.late.reading(blocks):
                self.found.early_releases.append(rid)
            self.zero(blocks)
        output = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                   finished_recving=results.finished_recving or None,
                                   invalid_block_ids=w.get_block_ids_with_load_errors())
        assert not output.finished_recving
        output.kv_connector_stats = w.get_kv_connector_stats()
        output.kv_cache_events = w.get_kv_connector_kv_cache_events()
        output.kv_connector_worker_meta = w.build_connector_worker_meta()
        if not defer:
            w.clear_connector_metadata()
        else:  # finalize_step, after the drafter
            w.wait_for_save()
            w.clear_connector_metadata()
        return output

    def forward(self, step: Step) -> None:
        """Check that each request's computed (or loaded) KV is intact, write the KV of the
        positions the step computes, and keep the bytes of the chunks the plan stores."""
        for rid, computed, n in step.scheduled:
            r = self.requests[rid]
            blocks = torch.tensor(r.blocks)
            intact = all(torch.equal(layer[:, 0, :, 0][blocks].reshape(-1)[:computed].float(),
                                     r.values[:computed] + i)
                         for i, layer in enumerate(self.kv.values()))
            self.found.last_read[rid] = (computed, intact)
            if not intact:
                if r.poisoned or step.number <= r.stale_through:
                    # Over blocks a failed load left unfilled, before vLLM's rewind took
                    # effect: what it computes is wrong, and must go nowhere.
                    step.tainted.add(rid)
                    self.found.tainted_reads.append((rid, step.number))
                else:
                    self.found.stale_reads.append(f"{rid} at step {step.number}")
            positions = torch.arange(computed, computed + n)
            for i, layer in enumerate(self.kv.values()):
                value = (torch.full((n,), TAINTED) if rid in step.tainted
                         else r.values[positions] + i).to(layer.dtype).view(-1, 1, 1)
                layer[blocks[positions // BLOCK], :, positions % BLOCK, :] = value
            for end in range(CHUNK, computed + n + 1, CHUNK):
                if end > computed and end > r.hit:
                    self.found.computed_by[tuple(r.spec.tokens[:end])] += 1
        for transfer in step.meta.stores:
            expected = self.miss_chunk_of(step, transfer.block_ids)
            assert torch.equal(self.reference.setdefault(transfer.key, expected), expected)

    def miss_chunk_of(self, step: Step, block_ids: tuple[int, ...]) -> torch.Tensor:
        """The miss path's bytes of the chunk a store of `step` reads from `block_ids`: that
        chunk of the request the plan stored it for (one it schedules, or one ended since
        the last plan), the newest holding those blocks."""
        bpc = CHUNK // BLOCK
        scheduled = {rid for rid, _, _ in step.scheduled}
        for r in reversed(self.requests.values()):
            if not r.finished and r.spec.rid not in scheduled:
                continue
            for chunk in range(-(-len(r.blocks) // bpc)):
                # A chunk, or a tail (fewer blocks: keys.tail_key).
                first = chunk * bpc
                if tuple(r.blocks[first:first + len(block_ids)]) == tuple(block_ids):
                    return miss_chunk(r.spec.tokens, chunk, len(block_ids))
        raise AssertionError(f"no request holds the blocks {block_ids} of a planned store")

    def zero(self, blocks: set[int] | list[int]) -> None:
        self.fill(blocks, 0.0)

    def fill(self, blocks: set[int] | list[int], value: float) -> None:
        for layer in self.kv.values():
            layer[list(blocks)] = value

    def apply_damage(self, step: Step) -> None:
        """Damage the chunk of `self.damage` once the plan that loads it is built."""
        damage = self.damage
        if damage is None or damage.how == "refuse" or self.damaged is not None \
                or damage.rid not in step.meta.loads:
            return
        self.damaged = key = step.meta.loads[damage.rid][damage.chunk].key
        memory, disk = self.store.tiers
        assert self.store.flush(5.0) and memory.contains(key) and disk.contains(key)
        memory.delete(key)
        if damage.how == "delete":
            disk.delete(key)
        else:
            assert damage.how == "corrupt", damage.how
            with open(disk.files.path_of(key), "r+b") as file:  # type: ignore[attr-defined]
                file.seek(-1, os.SEEK_END)
                last = file.read(1)
                file.seek(-1, os.SEEK_END)
                file.write(bytes([last[0] ^ 0xFF]))

    # -- the engine loop --------------------------------------------------------------------

    def idle(self) -> bool:
        return (self.plans >= max(s.arrive for s in self.workload)
                and all(r.finished for r in self.requests.values())
                and len(self.requests) == len(self.workload)
                and set(self.found.planned) <= self.found.reported
                and not self.late.reading(set(range(NUM_BLOCKS)))
                and self.found.held <= self.released)

    def run(self) -> Findings:
        try:
            if self.order.async_scheduling:
                # EngineCore.step_with_batch_queue: plan N+1 is built while step N runs, and
                # step N's outcome is learnt after it.
                step = self.schedule()
                output = self.execute(step)
                for _ in range(MAX_STEPS):
                    following = self.schedule()
                    self.update(step, output)
                    if self.idle():  # `following` has nothing left to do
                        break
                    step, output = following, self.execute(following)
                else:
                    raise AssertionError("the replay did not settle")
            else:
                for _ in range(MAX_STEPS):
                    step = self.schedule()
                    self.update(step, self.execute(step))
                    if self.idle():
                        break
                else:
                    raise AssertionError("the replay did not settle")
            self.check_stored_bytes()
            self.found.never_rewound = [r.spec.rid for r in self.requests.values()
                                        if r.poisoned]
        finally:
            self.connector_worker.close(flush_timeout_s=5)
        return self.found

    def check_stored_bytes(self) -> None:
        assert self.store.flush(5.0)
        out = torch.empty(self.layout.bytes_per_chunk, dtype=torch.uint8)
        for key in dict.fromkeys(self.found.planned):
            for tier in self.store.tiers:
                got = tier.get_into(key, out.numpy().data)
                if not got or not torch.equal(out, self.reference[key]):
                    self.found.wrong_bytes.append((tier.name, key))


def replay(order: str, store_mode: str, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Findings:
    return Replay(ORDERS[order], store_mode, tmp_path / f"{order}-{store_mode}",
                  monkeypatch).run()


def assert_clean(found: Findings) -> None:
    assert found.planned_twice() == []  # 1
    assert set(found.planned) <= found.reported  # 2
    assert found.wrong_bytes == []  # 2, and 3 (a block zeroed under a gather shows here)
    assert found.early_releases == []  # 3
    assert found.stale_reads == []


# -- the cases --------------------------------------------------------------------------------

@pytest.mark.parametrize("store_mode", ["sync", "async"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_every_chunk_is_planned_once_and_stored_with_its_bytes(
        order: str, store_mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = replay(order, store_mode, tmp_path, monkeypatch)
    # The workload asks the questions: chunks that several requests computed (each could
    # have planned them), hits loaded, freed blocks handed out again and (asynchronous
    # stores) requests whose last step completed a chunk, held by vLLM for its store.
    assert found.contended() >= 2 and max(found.computed_by.values()) >= 3
    assert found.loads >= 2 and found.reused >= 2
    if store_mode == "async":
        assert found.held >= {"r1", "r5"}
    elif order == A:  # synchronous stores and scheduling: every chunk stored in its step
        assert not found.held
    # (Async scheduling: a request whose last step completed a chunk is held for its store
    # planned at its end, whatever the store mode.)
    assert len(set(found.planned)) >= 8
    assert_clean(found)


@pytest.mark.parametrize("store_mode", ["sync", "async"])
def test_deferred_finalize_stores_what_the_v1_order_stores(
        store_mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same scheduling, the other hook order: the same chunks stored."""
    v1 = replay(A, store_mode, tmp_path, monkeypatch)
    assert set(replay(C_SYNC, store_mode, tmp_path, monkeypatch).planned) == set(v1.planned)
    v2 = replay(B, store_mode, tmp_path, monkeypatch)
    assert set(replay(C, store_mode, tmp_path, monkeypatch).planned) == set(v2.planned)


def test_async_scheduling_stores_a_requests_last_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under async scheduling a plan is built before the token its step samples is known: the
    chunk a request's last step completes is planned by request_finished (which holds the
    request's blocks one plan longer), so a request ended by max_tokens stores it too."""
    v1, v2 = (replay(order, "async", tmp_path, monkeypatch) for order in (A, B))
    assert_clean(v1)
    assert_clean(v2)
    assert set(v2.planned) == set(v1.planned)


def finish_step_before_8071d8a(self: ConnectorWorker, held: set[str]) -> set[str]:
    """The end of a step before 8071d8a: join every store job but the one handed over since
    the previous step's end, taken for this step's own. (One bind between two ends: a job of
    epoch `_epoch - 1` or later was handed over since.) Under deferred finalize that job is
    the previous step's, and it may read a held request's blocks."""
    saving = self._saving
    current = saving.pop() if saving and saving[-1][0] >= self._epoch - 1 else None
    self.finish_stores()
    if current is not None:
        saving.append(current)
    self._epoch += 1
    return held


@pytest.mark.parametrize("order", [C, C_SYNC])
def test_the_checks_catch_the_end_of_step_rule_before_8071d8a(
        order: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ConnectorWorker, "finish_step", finish_step_before_8071d8a)
    # Right for the V1 order, where a step's own job is handed over before its end.
    assert_clean(replay(A, "async", tmp_path, monkeypatch))
    # Deferred finalize: held requests are released while the job that reads their blocks
    # waits; their blocks, zeroed by then, are what the job stores.
    found = replay(order, "async", tmp_path, monkeypatch)
    assert {"r1", "r5"} <= set(found.early_releases)
    assert {tier for tier, _ in found.wrong_bytes} == {"memory", "disk"}
    assert found.planned_twice() == []  # the scheduler waited for stores_through


def assume_stores_done_before_8071d8a(real: Callable[..., None]) -> Callable[..., None]:
    """update_connector_output as before 8071d8a: a step's stores count as done once its
    outcome arrives (synchronous stores) or the next step's does (asynchronous), whatever the
    workers say (`stores_through`)."""

    def update(self: ConnectorScheduler, output: KVConnectorOutput) -> None:
        report = output.kv_connector_worker_meta or KVTierWorkerMetadata()
        assert isinstance(report, KVTierWorkerMetadata)
        report.stores_through = self._step - (1 if self._stores.stores_async else 0)
        output.kv_connector_worker_meta = report
        real(self, output)

    return update


@pytest.mark.parametrize(("order", "store_mode"), [
    (B, "sync"), (B, "async"), (C, "sync"), (C, "async"), (C_SYNC, "sync")])
def test_the_checks_catch_stores_assumed_done_before_8071d8a(
        order: str, store_mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ConnectorScheduler, "update_connector_output",
                        assume_stores_done_before_8071d8a(ConnectorScheduler.update_connector_output))
    # Right for the V1 order with synchronous scheduling.
    assert_clean(replay(A, store_mode, tmp_path, monkeypatch))
    # With the outcome a step late (async scheduling), or the report built before the stores
    # run (deferred finalize), a step's chunks leave the in-flight list before they are
    # stored: the next request that computes the prefix plans them again.
    assert replay(order, store_mode, tmp_path, monkeypatch).planned_twice()


# -- a synchronous load that fails (issue 41, contract c: vllm#49250) -------------------------

# r1 stores the shared prefix; r9 loads it while r5 runs beside it. Its load is damaged
# (Damage): the step that loads it runs its forward over the unfilled blocks (and completes
# chunk 2 over them, a store kvtier must refuse), and under async scheduling so does the
# step planned behind it (chunk 3, likewise). r10 comes back for r9's first four chunks once
# r9 has recomputed them: it loads what kvtier stored again.
R9_PROMPT = SHARED + own(140, 9000)
FAILURE_WORKLOAD = [
    Spec("r1", 1, SHARED + own(40, 2000), 25, "eos"),
    Spec("r5", 4, own(100, 5000), 29, "eos"),
    Spec("r9", 8, R9_PROMPT, 6, "length"),
    Spec("r10", 20, R9_PROMPT[:4 * CHUNK] + own(10, 10_000), 3, "length"),
]
DAMAGES = {
    # A held chunk deleted before r9 loads it: chunk 0 loads, 1 does not.
    "failed": Damage("r9", 1, "delete"),
    # vllm#49250's case: the whole load rejected before any KV is copied (its first chunk's
    # checksum fails): vLLM rewinds r9 to 0.
    "rejected": Damage("r9", 0, "corrupt"),
}


def failure_replay(order: str, store_mode: str, damage: Damage, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> Findings:
    return Replay(ORDERS[order], store_mode, tmp_path / f"{order}-{store_mode}-{damage.how}",
                  monkeypatch, workload=FAILURE_WORKLOAD, damage=damage).run()


def assert_miss_path(found: Findings) -> None:
    """What vLLM 0.33 gets from kvtier after a failed synchronous load is what a miss gives:
    the blocks reported invalid are exactly those of the failed loads from their first block
    that no load wrote (vLLM recomputes from there), every step's; the requests
    holding them are rewound, no token sampled over them is kept, and no later forward reads
    anything but the miss path's KV; every chunk stored holds the miss path's bytes (none
    computed over the unfilled blocks), and a chunk is planned again only after a worker
    refused its store or found it missing."""
    assert [(step, unfilled) for step, unfilled, invalid in found.load_errors
            if unfilled != invalid] == []
    assert found.never_rewound == []
    assert found.wrong_outputs == []
    assert found.stale_reads == []
    assert found.wrong_bytes == []
    assert set(found.planned) <= found.reported
    assert found.early_releases == []
    assert [key for key in found.planned_twice()
            if key not in found.skipped | found.missing] == []


@pytest.mark.parametrize("store_mode", ["sync", "async"])
@pytest.mark.parametrize("case", list(DAMAGES))
@pytest.mark.parametrize("order", list(ORDERS))
def test_a_failed_synchronous_load_gives_the_miss_paths_outputs_and_kv(
        order: str, case: str, store_mode: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    damage = DAMAGES[case]
    found = failure_replay(order, store_mode, damage, tmp_path, monkeypatch)
    assert_miss_path(found)
    # The failure happened where it matters: r9's load stopped at the damaged chunk, vLLM
    # rewound r9 to it (0.33: the first invalid block), r9's forward read the unfilled blocks
    # (and, with async scheduling, the forward of the step planned before the rewind), the
    # workers refused the chunks computed over them and stored them once recomputed.
    [(step, _, invalid)] = found.load_errors
    r9_blocks = 2 * (CHUNK // BLOCK)  # its hit: the two chunks of the shared prefix
    assert len(invalid) == r9_blocks - damage.chunk * (CHUNK // BLOCK)
    [(rid, rewound_at, _, to)] = found.rewinds
    assert (rid, rewound_at, to) == ("r9", step, damage.chunk * CHUNK)
    tainted = {s for r, s in found.tainted_reads if r == "r9"}
    async_scheduling = ORDERS[order].async_scheduling
    assert tainted == ({step, step + 1} if async_scheduling else {step})
    r9_tokens = FAILURE_WORKLOAD[2].tokens
    assert len(found.skipped) == (2 if async_scheduling else 1)  # chunk 2 (and 3)
    assert found.skipped <= found.reported
    assert found.missing and found.missing <= found.reported
    # r9's last forward read its whole prefix intact: the miss path's KV; r10 loaded r9's
    # four chunks, the damaged one among them, as stored again, and read them intact.
    assert found.last_read["r9"] == (len(r9_tokens) - 2, True)  # its last step
    assert found.last_read["r10"][1] and found.loads == 2


@pytest.mark.parametrize("order", [A, B])
def test_a_hit_vllm_refuses_is_computed_as_a_miss(
        order: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's scheduler may drop a hit kvtier offered (update_state_after_alloc with 0
    external tokens): nothing is loaded, r9 computes its prompt and stores the chunks kvtier
    does not hold."""
    found = failure_replay(order, "async", Damage("r9", 0, "refuse"), tmp_path, monkeypatch)
    assert_clean(found)
    assert found.load_errors == [] and found.rewinds == [] and found.tainted_reads == []
    assert found.loads == 1  # r10 only
    assert found.last_read["r9"] == (len(FAILURE_WORKLOAD[2].tokens) - 2, True)


def stores_unguarded(self: ConnectorWorker, stores: list[Any]) -> list[Any]:
    """_safe_stores without its guard: stores computed over a failed load are kept."""
    return stores


def failed_blocks_unreported(self: ConnectorWorker) -> set[int]:
    """take_failed_block_ids that reports nothing: vLLM never rewinds the request."""
    self._failed_block_ids = set()
    return set()


def failed_chunk_blocks_only(real: Callable[..., set[int]]) -> Callable[..., set[int]]:
    """take_failed_block_ids that reports the first failed chunk's blocks alone."""

    def take(self: ConnectorWorker) -> set[int]:
        return set(sorted(real(self))[:CHUNK // BLOCK])

    return take


@pytest.mark.parametrize("order", [A, B])
@pytest.mark.parametrize("case", list(DAMAGES))
def test_the_checks_catch_a_worker_without_its_guards(
        order: str, case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks fail where kvtier's guards are taken out, one at a time."""
    damage = DAMAGES[case]
    # Stores over the unfilled blocks not refused: chunks of garbage KV, with valid
    # checksums, in both tiers.
    with monkeypatch.context() as patch:
        patch.setattr(ConnectorWorker, "_safe_stores", stores_unguarded)
        found = failure_replay(order, "async", damage, tmp_path / "unguarded", monkeypatch)
        assert {tier for tier, _ in found.wrong_bytes} == {"memory", "disk"}
        assert found.skipped == set()
    # The failed blocks not reported: vLLM keeps r9's tokens sampled over garbage, and never
    # rewinds it.
    with monkeypatch.context() as patch:
        patch.setattr(ConnectorWorker, "take_failed_block_ids", failed_blocks_unreported)
        found = failure_replay(order, "async", damage, tmp_path / "unreported", monkeypatch)
        assert found.wrong_outputs and found.never_rewound == ["r9"]
    # Only the failed chunk's blocks reported, not the later chunks' (rejected: chunk 1 is
    # unfilled too).
    if case == "rejected":
        with monkeypatch.context() as patch:
            patch.setattr(ConnectorWorker, "take_failed_block_ids",
                          failed_chunk_blocks_only(ConnectorWorker.take_failed_block_ids))
            found = failure_replay(order, "async", damage, tmp_path / "partial", monkeypatch)
            assert [s for s, unfilled, invalid in found.load_errors if unfilled != invalid]
