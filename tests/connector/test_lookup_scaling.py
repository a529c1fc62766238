"""What asking again about a waiting request costs as its hit grows: vLLM asks each step a
request waits for blocks (a long prompt under memory pressure), and its hit's read-ahead
(loadplan.py: prefetch into RAM) is kept as its keys, not rebuilt chunk by chunk each time.

Pure logic on real vLLM `Request`s (no engine). Chunks of 64 tokens over vLLM blocks of 32.
No timings: the chunk transfers the scheduler side builds are counted.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request

from kvtier.core.locator import ChunkLocator
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.scheduler import loadplan
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.integrations.vllm.transfers import ChunkTransfer

CHUNK, BLOCK = 64, 32
EMPTY_STEP = SimpleNamespace(
    scheduled_new_reqs=[], num_scheduled_tokens={}, preempted_req_ids=set(),
    scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                          num_computed_tokens=[], resumed_req_ids=set()))


def test_a_waiting_requests_lookups_build_only_the_chunks_each_plan_reads_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 96-chunk hit below RAM, asked about 8 times while its request waits: each plan reads
    ahead the next PREFETCH_PER_STEP of its chunks, in order, each naming its parent, and no
    lookup builds a transfer per chunk of the hit. Before: each lookup built 96."""
    built: list[ChunkTransfer] = []

    def counted(**fields: object) -> ChunkTransfer:
        built.append(ChunkTransfer(**fields))  # type: ignore[arg-type]
        return built[-1]

    monkeypatch.setattr(loadplan, "ChunkTransfer", counted)
    locator = ChunkLocator({}, max_keys=1 << 12)
    sched = ConnectorScheduler(ConnectorConfig.parse({"tokens_per_chunk": CHUNK}),
                               block_size=BLOCK, model_id="tiny", layout_digest="0" * 32,
                               locator=locator)
    num_chunks = 3 * loadplan.PREFETCH_PER_STEP
    req = Request("a", list(range(num_chunks * CHUNK + 1)), SamplingParams(max_tokens=8), None)
    keys = sched._requests.keys_for(sched._requests.state(req), num_chunks)
    locator.record_stored(keys)  # held, in a tier below RAM as far as it knows
    prefetched = []
    for _ in range(8):
        before = len(built)
        assert sched.get_num_new_matched_tokens(req, 0) == (num_chunks * CHUNK, False)
        meta = sched.build_connector_meta(EMPTY_STEP)  # type: ignore[arg-type]
        assert len(built) - before <= loadplan.PREFETCH_PER_STEP
        prefetched += meta.prefetch
    assert [t.key for t in prefetched] == keys
    assert [t.parent for t in prefetched] == [None, *keys[:-1]]
