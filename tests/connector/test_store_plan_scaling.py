"""What a plan's stores cost as prompts grow: each plan checks a request's new blocks for
recent loads (loadfailures.py), not its whole prefix again, and stores still name the loaded
blocks they depend on while those loads are recent.

Pure logic on real vLLM `Request`s, driven as vLLM's scheduler drives the connector (no
engine). Chunks of 64 tokens over vLLM blocks of 32. No timings: the blocks checked are
counted (`LoadFailures.blocks_checked`).
"""

from __future__ import annotations

from types import SimpleNamespace

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
from kvtier.integrations.vllm.scheduler.loadfailures import LOAD_CONFIRM_STEPS

CHUNK, BLOCK = 64, 32
STEP_TOKENS = 128  # a chunked prefill's step: 2 chunks, 4 blocks


def prompt(rid: str, num_tokens: int, first: int) -> Request:
    return Request(rid, list(range(first, first + num_tokens)), SamplingParams(max_tokens=8),
                   None)


class Scheduler:
    """A connector scheduler and the vLLM side of its conversation, enough for stores."""

    def __init__(self) -> None:
        self.locator = ChunkLocator({}, max_keys=1 << 16)
        self.sched = ConnectorScheduler(ConnectorConfig.parse({"tokens_per_chunk": CHUNK}),
                                        block_size=BLOCK, model_id="tiny",
                                        layout_digest="0" * 32, locator=self.locator)
        self.next_block = 0

    def blocks(self, count: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return ids

    def admit(self, req: Request, blocks: list[int]) -> int:
        external, _ = self.sched.get_num_new_matched_tokens(req, 0)
        assert external is not None
        self.sched.update_state_after_alloc(
            req, SimpleNamespace(get_block_ids=lambda: (blocks,)), external)
        return external

    def step(self, new: dict[str, tuple[list[int], int, int]],
             cached: dict[str, tuple[list[int], int, int]]) -> KVTierMetadata:
        """`new`/`cached`: req id -> (new block ids, computed tokens before, step tokens)."""
        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                                for r, (b, c, _) in new.items()],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=list(cached), new_block_ids=[(b,) if b else None
                                                     for b, _, _ in cached.values()],
                num_computed_tokens=[c for _, c, _ in cached.values()],
                resumed_req_ids=set()),
            num_scheduled_tokens={r: n for r, (_, _, n) in (new | cached).items()},
            preempted_req_ids=set())
        meta = self.sched.build_connector_meta(output)  # type: ignore[arg-type]
        self.sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=KVTierWorkerMetadata(
                stored={t.key for t in meta.stores}, stores_through=meta.step)))
        return meta

    def hold(self, req: Request, num_chunks: int) -> list[ChunkKey]:
        """Have kvtier hold the request's first chunks (as if an engine stored them)."""
        keys = self.sched._requests.keys_for(self.sched._requests.state(req), num_chunks)
        self.locator.record_stored(keys)
        self.sched._requests.pop(req.request_id)
        return keys


def test_a_chunked_prefill_checks_each_block_for_recent_loads_once() -> None:
    """A long prompt prefilled 128 tokens a step while other requests load every step (their
    loads are recent in every plan): each plan checks the 4 blocks its step adds (and the 4
    an earlier loader loaded, as their load is confirmed). Before: it checked the prompt's
    whole prefix each plan (a 128k-token prompt in 2k-token steps walked
    O(prompt) blocks per step, O(prompt^2) over its prefill)."""
    engine = Scheduler()
    steps = 48
    long = prompt("long", steps * STEP_TOKENS, first=0)
    assert engine.admit(long, engine.blocks(4)) == 0
    long_blocks = engine.blocks(0)
    checked_per_step = []
    for step in range(steps):
        # A request whose whole prompt but its last token is held: it loads (recent loads
        # every plan) and stores nothing itself.
        loader = prompt(f"load{step}", 2 * CHUNK + 1, first=10**6 * (step + 1))
        engine.hold(loader, 2)
        loader_blocks = engine.blocks(5)
        assert engine.admit(loader, loader_blocks) == 2 * CHUNK
        computed = step * STEP_TOKENS
        grown = engine.blocks(4) if step else []
        long_blocks += grown
        before = engine.sched._failures.blocks_checked
        meta = engine.step(new={f"load{step}": (loader_blocks, 2 * CHUNK, 1)}
                           | ({"long": (list(range(4)), 0, STEP_TOKENS)} if not step else {}),
                           cached={"long": (grown, computed, STEP_TOKENS)} if step else {})
        checked_per_step.append(engine.sched._failures.blocks_checked - before)
        assert meta.loads[f"load{step}"]
        assert len(meta.stores) >= 2  # its step's 2 chunks (the last: its prompt's tail too)
        long.num_computed_tokens = computed + STEP_TOKENS
    loader_blocks = 2 * CHUNK // BLOCK
    assert max(checked_per_step) <= STEP_TOKENS // BLOCK + loader_blocks, checked_per_step


def test_stores_name_a_requests_loaded_blocks_while_their_load_is_recent() -> None:
    """The blocks a request loaded are named by the stores of its next plans (a worker
    refuses them should the load fail), until the load is confirmed; checked once each."""
    engine = Scheduler()
    held = prompt("held", 4 * CHUNK, first=0)
    engine.hold(held, 4)
    req = prompt("a", 16 * CHUNK, first=0)
    blocks = engine.blocks(10)
    assert engine.admit(req, blocks) == 4 * CHUNK
    loaded = tuple(blocks[:8])
    meta = engine.step(new={"a": (blocks, 4 * CHUNK, CHUNK)}, cached={})
    [store] = meta.stores
    assert store.block_ids == tuple(blocks[8:10]) and store.depends_on == loaded
    computed = 5 * CHUNK
    for step in range(1, 2 * LOAD_CONFIRM_STEPS):
        grown = engine.blocks(2)
        meta = engine.step(new={}, cached={"a": (grown, computed, CHUNK)})
        [store] = meta.stores
        assert store.block_ids == tuple(grown)
        assert store.depends_on == (loaded if step < LOAD_CONFIRM_STEPS else ()), step
        computed += CHUNK
        req.num_computed_tokens = computed


def test_a_big_loads_blocks_are_looked_at_a_few_times_not_every_plan() -> None:
    """A 64-chunk hit loads 128 blocks, then the prompt's rest is prefilled 128 tokens a step:
    its loaded blocks are looked at when the store that depends on them is planned, once more
    when their load is confirmed, and as that plan forgets them; its new blocks once each.
    Before: every plan walked every recent load (4 plans) and, per request storing, its
    recently loaded blocks again."""
    engine = Scheduler()
    hit_chunks, rest_steps = 64, 8
    engine.hold(prompt("held", hit_chunks * CHUNK, first=0), hit_chunks)
    req = prompt("a", hit_chunks * CHUNK + rest_steps * STEP_TOKENS, first=0)
    loaded_blocks = hit_chunks * CHUNK // BLOCK
    blocks = engine.blocks(loaded_blocks + 4)
    assert engine.admit(req, blocks) == hit_chunks * CHUNK
    computed = hit_chunks * CHUNK
    meta = engine.step(new={"a": (blocks, computed, STEP_TOKENS)}, cached={})
    assert [t.depends_on for t in meta.stores] == [tuple(blocks[:loaded_blocks])] * 2
    for _ in range(rest_steps - 1):
        computed += STEP_TOKENS
        req.num_computed_tokens = computed
        engine.step(new={}, cached={"a": (engine.blocks(4), computed, STEP_TOKENS)})
    prompt_blocks = len(req.prompt_token_ids) // BLOCK
    assert engine.sched._failures.blocks_checked <= prompt_blocks + 2 * loaded_blocks
