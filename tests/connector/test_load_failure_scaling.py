"""What a worker report of failed chunks costs the scheduler: the requests that planned them
are found through the index of their keys (plannedkeys.py), so a report naming a few chunks
visits those, however many requests run. Before: every report with a missing or refused
chunk walked every live request's planned keys (256 requests of 64k tokens: 1.3 ms a report,
every step while a tier kept failing).

Pure logic on real vLLM `Request`s, driven as vLLM's scheduler drives the connector (no
engine). No timings: the (key, request) pairs a report visits are counted
(`LoadFailures.keys_visited`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.scheduler.requeststate import RequestState

CHUNK, BLOCK = 64, 32
CHUNKS = 8  # each prompt's full chunks; one block and a token follow (a one-block tail)
PROMPT_TOKENS = CHUNKS * CHUNK + BLOCK + 1


class Engine:
    """A connector scheduler and its requests, each prefilled in one step."""

    def __init__(self) -> None:
        self.sched = ConnectorScheduler(
            ConnectorConfig.parse({"tokens_per_chunk": CHUNK, "tail_chunks": True}),
            block_size=BLOCK, model_id="tiny", layout_digest="0" * 32,
            locator=ChunkLocator({}, max_keys=1 << 16))
        self.next_block = 0
        self.step_no = 0

    def prefill(self, prompts: dict[str, list[int]]) -> KVTierMetadata:
        """Admit the prompts (misses) and run their whole prefills in one step."""
        new = []
        for rid, tokens in prompts.items():
            req = Request(rid, tokens, SamplingParams(max_tokens=8), None)
            external, _ = self.sched.get_num_new_matched_tokens(req, 0)
            assert external == 0
            blocks = list(range(self.next_block, self.next_block + len(tokens) // BLOCK + 1))
            self.next_block += len(blocks)
            self.sched.update_state_after_alloc(
                req, SimpleNamespace(get_block_ids=lambda b=blocks: (b,)), 0)
            new.append(SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=0))
        output = SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                  num_computed_tokens=[],
                                                  resumed_req_ids=set()),
            num_scheduled_tokens={rid: len(tokens) for rid, tokens in prompts.items()},
            preempted_req_ids=set())
        meta = self.sched.build_connector_meta(output)  # type: ignore[arg-type]
        self.step_no = meta.step
        return meta

    def report(self, **fields: Any) -> int:
        """A worker's report; the (key, request) pairs it visited."""
        before = self.sched._failures.keys_visited
        fields.setdefault("stores_through", self.step_no)
        self.sched.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(**fields)))
        return self.sched._failures.keys_visited - before

    def state(self, rid: str) -> RequestState:
        return next(s for s in self.sched._requests if s.request.request_id == rid)

    def keys(self, rid: str) -> list[ChunkKey]:
        return self.state(rid).keys


def prompts(count: int, shared: int = 0) -> dict[str, list[int]]:
    """`count` prompts, their first `shared` chunks alike, the rest their own."""
    common = list(range(shared * CHUNK))
    return {f"r{i}": common + list(range(10**6 * (i + 1), 10**6 * (i + 1)
                                          + PROMPT_TOKENS - len(common)))
            for i in range(count)}


@pytest.mark.parametrize("live", [4, 64])
def test_a_report_of_failed_chunks_visits_those_chunks_not_every_request(live: int) -> None:
    """One refused store and one missing load among `live` requests: 2 visits, 4 or 64
    running, and only the two requests that planned them are planned again from there."""
    engine = Engine()
    meta = engine.prefill(prompts(live))
    assert len(meta.stores) == live * (CHUNKS + 1)  # each one's chunks and its tail
    assert all(engine.state(f"r{i}").num_planned_chunks == CHUNKS for i in range(live))
    visited = engine.report(skipped={engine.keys("r0")[5]}, missing={engine.keys("r1")[2]})
    assert visited == 2
    assert engine.state("r0").num_planned_chunks == 5
    assert not engine.state("r0").load_failed  # a refused store: its load did not fail
    assert engine.state("r1").num_planned_chunks == 2 and engine.state("r1").load_failed
    assert all(engine.state(f"r{i}").num_planned_chunks == CHUNKS
               and not engine.state(f"r{i}").load_failed for i in range(2, live))


def test_a_failed_shared_chunk_replans_every_request_that_planned_it_from_its_first() -> None:
    """Requests sharing a prefix each go back to the first failed chunk they planned; a
    refused tail is planned again by the request that planned it."""
    engine = Engine()
    engine.prefill(prompts(3, shared=4))
    keys = engine.keys("r0")
    assert engine.keys("r1")[:4] == keys[:4] and engine.keys("r2")[4] != keys[4]
    tail = next(iter(engine.state("r2").stored_tails))
    visited = engine.report(skipped={keys[6], keys[1], tail}, missing={keys[3]})
    assert visited == 3 + 3 + 1 + 1  # keys[1], keys[3]: 3 requests each; keys[6], the tail
    assert [engine.state(f"r{i}").num_planned_chunks for i in range(3)] == [1, 1, 1]
    assert all(engine.state(f"r{i}").load_failed for i in range(3))
    assert tail not in engine.state("r2").stored_tails
    assert engine.state("r0").stored_tails and engine.state("r1").stored_tails


def test_ended_requests_leave_the_index() -> None:
    """A request's keys and tails leave the index with it: a report naming them visits
    nothing, and the index is empty once every request has ended."""
    engine = Engine()
    engine.prefill(prompts(3, shared=2))
    gone = engine.keys("r0")
    for i in range(3):
        engine.sched.request_finished(engine.state(f"r{i}").request)
    assert len(engine.sched._requests._keys) == 0
    assert engine.report(missing=set(gone)) == 0


def test_an_ended_requests_final_stores_leave_nothing_in_the_index() -> None:
    """A request ends with chunks (and its tail) no plan stored: the next plan stores them
    (storeplan.py, final stores) after the request left the table. Their keys are not
    indexed then, so a report refusing those stores finds no request (before: they were
    indexed under a request the table no longer knew, and the report raised KeyError)."""
    engine = Engine()
    tokens = prompts(1)["r0"]
    req = Request("r0", tokens, SamplingParams(max_tokens=8), None)
    external, _ = engine.sched.get_num_new_matched_tokens(req, 0)
    assert external == 0
    blocks = list(range(len(tokens) // BLOCK + 4))
    engine.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)
    engine.sched.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        scheduled_new_reqs=[SimpleNamespace(req_id="r0", block_ids=(blocks,),
                                            num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={"r0": CHUNK}, preempted_req_ids=set()))
    # It decoded past its prompt, into a chunk its lookup had no key for, and ends.
    req.append_output_token_ids(list(range(CHUNK + BLOCK)))
    req.num_computed_tokens = len(req.all_token_ids) - 1
    assert engine.sched.request_finished(req)  # held: its final stores are planned
    final = engine.sched.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={}, preempted_req_ids=set()))
    assert len(final.stores) == CHUNKS + 1 + 1  # its unstored chunks, the new one, its tail
    assert len(engine.sched._requests._keys) == 0
    assert engine.report(skipped={t.key for t in final.stores}, stores_through=final.step) == 0
