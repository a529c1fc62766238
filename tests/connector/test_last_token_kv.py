"""kvtier never stores a chunk whose last slot vLLM has not computed (vllm#54288).

A request's last sampled token has no KV: it was sampled by the forward at the position before
it, and the request ends before any forward runs at its own position. vllm#54288 (vLLM's
offloading connector, `_build_store_jobs`) offloaded a finished request up to `num_tokens`,
so a request whose prompt and output end exactly on a block boundary stored a full block
whose last slot held nothing of that token (under speculative decoding: a rejected draft's
KV), keyed by a hash of legitimate token ids: every later request replaying them (the next
turn of a chat) loaded it. kvtier's chunks are keyed the same way, so the same bug would
poison every tier below RAM, across restarts and nodes.

vLLM's scheduler is emulated step by step around one `ConnectorScheduler`, with vLLM's own
objects (`Request`, `SchedulerOutput`, `NewRequestData`, `CachedRequestData`): each step
advances `num_computed_tokens` as `Scheduler._update_after_schedule` does, its forward writes
the KV of the positions it computes, and its outcome appends the sampled token and ends the
request (`request_finished`) by a stop token or by max_tokens, with synchronous scheduling
(vLLM's CPU backend) or asynchronous (CUDA: the next plan is built before the outcome, and a
request ended by a stop token is scheduled once past its end). The check: each store a plan
carries names only positions some forward has written by the time that plan's step runs.

The last case puts vllm#54288's rule in (final stores up to `num_tokens`) and shows the check
catches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.scheduler.storeplan import StorePlanner

CHUNK, BLOCK = 64, 32
BPC = CHUNK // BLOCK
PROMPT = 100
MAX_STEPS = 100


@dataclass
class Running:
    request: Request
    blocks: list[int]
    num_outputs: int  # tokens it samples before it ends
    ends_by: str  # "eos" (a stop token) or "length" (max_tokens)
    written: set[int] = field(default_factory=set)  # positions whose KV a forward wrote
    finished: bool = False


@dataclass
class Findings:
    stored: dict[str, set[int]] = field(default_factory=dict)  # request -> chunks stored
    unwritten: list[str] = field(default_factory=list)  # stores of unwritten slots


class Emulation:
    """vLLM's scheduler and model runner around kvtier's scheduler side."""

    def __init__(self, *, async_scheduling: bool, store_mode: str) -> None:
        config = ConnectorConfig.parse({"tokens_per_chunk": CHUNK, "store_mode": store_mode})
        self.sched = ConnectorScheduler(config, block_size=BLOCK, model_id="tiny",
                                        layout_digest="0" * 32,
                                        locator=ChunkLocator({}, max_keys=1024))
        self.async_scheduling = async_scheduling
        self.running: dict[str, Running] = {}
        self.found = Findings()
        self.first_blocks = 0

    def add(self, rid: str, num_outputs: int, ends_by: str) -> None:
        request = Request(rid, list(range(5000 + 1000 * len(self.running),
                                          5000 + 1000 * len(self.running) + PROMPT)),
                          SamplingParams(max_tokens=num_outputs), None)
        hit, _ = self.sched.get_num_new_matched_tokens(request, 0)
        assert hit == 0
        need = -(-(PROMPT + num_outputs) // BLOCK)
        blocks = list(range(self.first_blocks, self.first_blocks + need))
        self.first_blocks += need
        self.sched.update_state_after_alloc(request, _Blocks(blocks), 0)  # type: ignore[arg-type]
        self.running[rid] = Running(request, blocks, num_outputs, ends_by)
        self.found.stored[rid] = set()

    # -- vLLM's scheduler ---------------------------------------------------------------

    def tokens_to_schedule(self, r: Running) -> int:
        req = r.request
        if r.finished:
            return 0
        if req.num_computed_tokens < PROMPT:
            return PROMPT - req.num_computed_tokens
        # Decode: the position of the last known token. Under async scheduling vLLM learns
        # of a stop token a step late and schedules the request once past its end (that step
        # computes the last token's slot; its output is dropped); max_tokens it knows ahead.
        end = PROMPT + r.num_outputs - (0 if self.async_scheduling and r.ends_by == "eos"
                                        else 1)
        return 1 if req.num_computed_tokens < end else 0

    def schedule(self) -> tuple[KVTierMetadata, list[tuple[Running, int, int]]]:
        output = SchedulerOutput.make_empty()
        cached = CachedRequestData.make_empty()
        scheduled = []
        for r in self.running.values():
            n = self.tokens_to_schedule(r)
            if not n:
                continue
            req = r.request
            if req.num_computed_tokens == 0:
                output.scheduled_new_reqs.append(
                    NewRequestData.from_request(req, (list(r.blocks),)))
            else:
                cached.req_ids.append(req.request_id)
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(req.num_computed_tokens)
                cached.num_output_tokens.append(len(req.output_token_ids))
            output.num_scheduled_tokens[req.request_id] = n
            scheduled.append((r, req.num_computed_tokens, n))
        output.scheduled_cached_reqs = cached
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        meta = self.sched.build_connector_meta(output)
        assert isinstance(meta, KVTierMetadata)
        for r, _, n in scheduled:  # Scheduler._update_after_schedule
            r.request.num_computed_tokens += n
        return meta, scheduled

    def update(self, meta: KVTierMetadata, scheduled: list[tuple[Running, int, int]]) -> None:
        """The step's outcome: sampled tokens (a step that ends a prefill or decodes samples
        one), request ends, then the workers' report (every planned chunk stored)."""
        for r, computed, n in scheduled:
            req = r.request
            if r.finished or computed + n < PROMPT:
                continue  # a step past the end (its output dropped), or a prefill chunk
            req.append_output_token_ids(7)
            if len(req.output_token_ids) == r.num_outputs:
                r.finished = True
                self.sched.request_finished(req)
        self.sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=KVTierWorkerMetadata(
                stored={t.key for t in meta.stores}, stores_through=meta.step)))

    # -- vLLM's model runner --------------------------------------------------------------

    def execute(self, meta: KVTierMetadata, scheduled: list[tuple[Running, int, int]]) -> None:
        """The forward writes the positions the step computes; then (wait_for_save) the
        plan's stores read their blocks."""
        for r, computed, n in scheduled:
            r.written.update(range(computed, computed + n))
        for transfer in meta.stores:
            r, chunk = self.owner(transfer.block_ids)
            if len(transfer.block_ids) == BPC:  # a chunk, not a tail (keys.tail_key)
                self.found.stored[r.request.request_id].add(chunk)
            slots = range(chunk * CHUNK, chunk * CHUNK + len(transfer.block_ids) * BLOCK)
            missing = [p for p in slots if p not in r.written]
            if missing:
                self.found.unwritten.append(
                    f"{r.request.request_id} chunk {chunk}: positions {missing} never computed")

    def owner(self, block_ids: tuple[int, ...]) -> tuple[Running, int]:
        for r in self.running.values():
            if block_ids[0] in r.blocks:
                first = r.blocks.index(block_ids[0])
                assert tuple(r.blocks[first:first + len(block_ids)]) == block_ids
                return r, first // BPC
        raise AssertionError(f"blocks {block_ids} belong to no request")

    def run(self) -> Findings:
        step, idle = self.schedule(), 0
        for _ in range(MAX_STEPS):
            self.execute(*step)
            if self.async_scheduling:
                # EngineCore's batch queue: plan N+1 is built before step N's outcome.
                following = self.schedule()
                self.update(*step)
            else:
                self.update(*step)
                following = self.schedule()
            step = following
            if all(r.finished for r in self.running.values()) and not step[1]:
                idle += 1
                if idle == 3:  # the plans after the ends (their final stores) have run
                    return self.found
        raise AssertionError("the emulation did not settle")


class _Blocks:
    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.blocks,)


SETTINGS = [(sched, store, ends)
            for sched in ("sync-scheduling", "async-scheduling")
            for store in ("sync", "async")
            for ends in ("eos", "length")]


def emulate(scheduling: str, store_mode: str, ends_by: str) -> Findings:
    emulation = Emulation(async_scheduling=scheduling == "async-scheduling",
                          store_mode=store_mode)
    # "edge": prompt + output end on a chunk boundary (128 tokens): chunk 1's last slot is
    # the last sampled token's. "past": one token more: chunk 1 is whole (its last slot was
    # computed by the step that sampled token 128).
    emulation.add("edge", 2 * CHUNK - PROMPT, ends_by)
    emulation.add("past", 2 * CHUNK - PROMPT + 1, ends_by)
    return emulation.run()


@pytest.mark.parametrize(("scheduling", "store_mode", "ends_by"), SETTINGS)
def test_a_request_ending_on_a_chunk_boundary_never_stores_its_last_chunk(
        scheduling: str, store_mode: str, ends_by: str) -> None:
    found = emulate(scheduling, store_mode, ends_by)
    assert found.unwritten == []
    assert found.stored["edge"] == {0}  # chunk 1 ends on the token no forward ran at
    assert found.stored["past"] == {0, 1}  # stored, not over-cautious


def final_stores_up_to_num_tokens(self: StorePlanner, state: object, step: int) -> bool:
    """vllm#54288's rule: an ended request's KV counted up to `num_tokens`."""
    request = state.request  # type: ignore[attr-defined]
    before = len(self._final_stores)
    self.plan(state, request.num_tokens, self._final_stores, step)  # type: ignore[arg-type]
    return len(self._final_stores) > before


@pytest.mark.parametrize(("scheduling", "store_mode", "ends_by"), SETTINGS)
def test_the_check_catches_final_stores_up_to_num_tokens(
        scheduling: str, store_mode: str, ends_by: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(StorePlanner, "_plan_final_stores", final_stores_up_to_num_tokens)
    found = emulate(scheduling, store_mode, ends_by)
    if scheduling == "async-scheduling" and ends_by == "eos":
        # vLLM ran one step past the end: the last slot was computed after all.
        assert found.unwritten == []
    else:
        assert found.unwritten == [
            "edge chunk 1: positions [127] never computed"]
