"""A request's tail (the full blocks past its last full chunk, keys.tail_key) that the node holds
only below its RAM (its disk tier, once RAM evicted it) is found by a lookup and loaded, as a
full chunk there is. Before, the scheduler asked only the node's RAM for tails (in node mode
its index of what it stored does not answer: the node evicts without telling), so such a tail
was a miss on every engine, the engine that stored it included: its blocks were recomputed,
and stored again (a RAM slot and a copy for a chunk the node held).

A real `kvtier node serve` process with a RAM of 4 chunks and a disk tier; the scheduler of an
engine in node mode (`ConnectorScheduler`, its locator as the connector builds it), driven as
vLLM's scheduler drives it; the chunks its plan names stored through the node by another
engine's store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from nodekit import NodeProcess, connect, key, node_tiers, payload, put_chunks, wait_for
from vllm import SamplingParams
from vllm.v1.request import Request

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator, LookupStatus
from kvtier.core.retention import DEFAULT_META
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.messages import KVTierMetadata
from kvtier.integrations.vllm.scheduler.connector_scheduler import ConnectorScheduler
from kvtier.node.client import NodeClient
from kvtier.node.nodestore import NodeStore
from kvtier.node.probe import NodeProbe
from kvtier.node.protocol import BELOW_TIER, RAM_TIER
from kvtier.node.server import NodeServer

pytestmark = pytest.mark.timeout(120)
BLOCK, CHUNK = 32, 128  # tails of 1-3 blocks
PROMPT = 360  # chunks 0-1 (256 tokens), then a tail of 3 blocks (96): 352 loadable


def _scheduler(socket_path: Path, client: NodeClient) -> ConnectorScheduler:
    """An engine's scheduler in node mode, its locator as the connector builds it: the node's
    RAM asked inline, every tier of the node off the scheduler's thread."""
    locator = ChunkLocator({RAM_TIER: NodeProbe([client]),
                            BELOW_TIER: NodeProbe([client], ram_only=False)},
                           max_keys=1024, index_first=False)
    config = ConnectorConfig.parse({"tokens_per_chunk": CHUNK, "node": str(socket_path)})
    return ConnectorScheduler(config, block_size=BLOCK, model_id="tiny",
                              layout_digest="0" * 32, locator=locator)


def _prompt(rid: str) -> Request:
    return Request(rid, list(range(1000, 1000 + PROMPT)), SamplingParams(max_tokens=4), None)


def _lookup(sched: ConnectorScheduler, req: Request) -> int:
    """vLLM's lookup of `req`, asked again each step while kvtier answers RETRY."""
    answer: list[int | None] = [None]

    def answered() -> bool:
        answer[0] = sched.get_num_new_matched_tokens(req, 0)[0]
        return answer[0] is not None

    wait_for(answered, 30, "the lookup's answer")
    assert answer[0] is not None
    return answer[0]


def _prefill(sched: ConnectorScheduler, req: Request) -> KVTierMetadata:
    """`req` missed and was computed in one step: the step's plan (its stores)."""
    blocks = list(range(PROMPT // BLOCK + 1))
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(blocks,),
                                            num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: PROMPT}, preempted_req_ids=set())
    return sched.build_connector_meta(output)  # type: ignore[arg-type]


def _put(store: NodeStore, keys: list[ChunkKey]) -> list[bool]:
    """A step's stores through the node, as a worker's: what each put returned."""
    store.plan_puts(keys, [DEFAULT_META] * len(keys))
    return [store.put(k, memoryview(payload(i))) for i, k in enumerate(keys)]


def test_a_tail_the_node_holds_below_its_ram_is_found_and_loaded(
        tmp_path: Path, start_node: Callable[..., NodeProcess]) -> None:
    node = start_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16))
    socket_path = node.socket_path
    # Engine A: the prompt misses; its plan stores chunks 0-1 and the prompt's tail.
    a_client, a_store = connect(socket_path, timeout_s=30, engine="engine-a")
    engine_a = _scheduler(socket_path, a_client)
    first = _prompt("a")
    assert _lookup(engine_a, first) == 0
    stores = _prefill(engine_a, first).stores
    assert [len(t.block_ids) for t in stores] == [4, 4, 3]
    keys = [t.key for t in stores]
    tail = keys[2]
    assert _put(a_store, keys) == [True] * 3
    wait_for(lambda: _disk_chunks(node) == 3, 30, "the disk tier's writes")
    # Other prompts fill the node's RAM of 4: the three are on its disk only.
    assert put_chunks(a_store, range(100, 104)) == [True] * 4
    assert NodeProbe([a_client]).contains_many(keys) == [False] * 3
    assert NodeProbe([a_client], ram_only=False).contains_many(keys) == [True] * 3

    # The same prompt again, on engine A: its hit ends at the tail's last block, the tail
    # found on the node's disk (before: 256, the tail recomputed).
    assert _lookup(engine_a, _prompt("a2")) == 352
    # And on engine B (an engine of its own: it stored nothing).
    b_client, b_store = connect(socket_path, timeout_s=30, engine="engine-b")
    assert _lookup(_scheduler(socket_path, b_client), _prompt("b")) == 352
    # The load of the tail comes from below the node's RAM, whole.
    with b_store.lend_as_landed([tail], [memoryview(bytearray(4096))],
                                in_order=True) as lending:
        (loan,) = list(lending)
        with loan:
            assert (loan.view.tier, bytes(loan.view.data)) == (BELOW_TIER, payload(2))
    # Loaded, it is in the node's RAM again: a store of it copies nothing (HELD).
    reserved = node.status()["counters"]["reserved_chunks"]
    assert _put(b_store, [tail]) == [True]
    assert node.status()["counters"]["reserved_chunks"] == reserved


def _disk_chunks(node: NodeProcess) -> int:
    (layout,) = node.status()["layouts"].values()
    chunks: int = layout["tiers"][1]["chunks"]
    return chunks


def test_a_stalled_tier_below_ram_costs_a_tails_lookup_its_deadline_only(
        tmp_path: Path, in_process_node: Callable[..., AbstractContextManager[NodeServer]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's disk tier stops answering (a fault injected: its lookup waits): a tail's
    lookup below RAM is RETRY until the locator's deadline, then a miss, and no slow probe is
    started while that one is stuck (the scheduler goes on with the node's RAM)."""
    with in_process_node(node_tiers(tmp_path, ram_chunks=4, disk_chunks=16)) as node:
        client, _ = connect(node.config.socket_path, timeout_s=30)
        assert client.welcomed() is not None  # the layout's store is built
        locator = ChunkLocator({RAM_TIER: NodeProbe([client]),
                                BELOW_TIER: NodeProbe([client], ram_only=False)},
                               max_keys=1024, timeout_s=0.5, index_first=False)
        (layout,) = node.layouts.served().values()
        release = threading.Event()
        monkeypatch.setattr(layout.store.tiers[1], "contains", lambda _key: release.wait(30))
        tails = [key(7), key(8)]
        try:
            assert locator.first_held(tails, "r") is LookupStatus.RETRY
            wait_for(lambda: locator.first_held(tails, "r") is None, 10, "the deadline")
            assert locator.timeouts == 1
            assert locator.first_held(tails, "r2") is None  # stuck: not asked again
        finally:
            release.set()
