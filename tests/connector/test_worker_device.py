"""The connector's worker on a device (the CUDA path), driven as vLLM drives it, on the CPU
stand-in device (kvtier/testing/standin.py: streams are threads whose work runs late, events are
flags, "device" memory starts poisoned).

vLLM's KV is emulated as vLLM 0.33 hands it to a connector on CUDA (FlashAttention's LBNHC,
kvtier/testing/vllmviews.py); the forward is work queued on the compute stream, slowed so that
anything not ordered after it runs before it. Each case runs the worker's own hooks in vLLM's
order (begin_step, load, store, finish_step, take_report) and checks bytes:

  - a step's stores, handed to the store thread, hold what that step's forward wrote, and the
    model runner's calls return before the forward has even run;
  - an asynchronous load from the disk tier (a restarted engine) reads on the load thread and
    is reported finished only with its blocks filled;
  - a request held for its stores is handed back (finished_sending) only after its gather:
    vLLM then frees and overwrites its blocks, and the stored chunk is still right.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tierkit import key

from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker, PagedKV
from kvtier.testing.standin import StandInDevice
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

LAYERS, BLOCKS, HEADS, BS, DIM = 2, 32, 2, 16, 8
BPC = 2  # blocks per chunk


class Engine:
    """vLLM's KV on the stand-in device and a worker over it."""

    def __init__(self, root: Path, compute_delay_s: float = 0.03,
                 store_delay_s: float = 0.002) -> None:
        spec = VllmCacheSpec(BS, HEADS, DIM, DIM, torch.bfloat16)
        self.kv = vllm_kv_caches(spec, LAYERS, BLOCKS, "LBNHC", fill=False)
        self.device = StandInDevice(seed=3, delays={"compute": compute_delay_s,
                                                    "store": store_delay_s})
        paged = PagedKV(self.kv, BS, content="halves", torch_ops=True)
        layout = paged.layout(BS * BPC)
        store = open_store(StoreConfig.parse({"tiers": [
            {"kind": "memory", "capacity": "1MiB", "pin": "off"},
            {"kind": "disk", "path": str(root / "disk"), "capacity": "16MiB"}]}), layout)
        self.worker = ConnectorWorker(paged, layout, store, device=self.device)
        self.forwards_run = 0

    def forward(self, blocks: range, generation: int) -> None:
        """A forward that writes value(b, generation) into `blocks` (queued, runs late)."""
        def write() -> None:
            for t in self.kv.values():
                for b in blocks:
                    t[b] = value(b, generation)
            self.forwards_run += 1
        self.device.forward(write)

    def holds(self, blocks: range, expected: int, offset: int = 0) -> bool:
        return all(torch.all(t[b] == value(b - offset, expected))
                   for t in self.kv.values() for b in blocks)

    def close(self) -> None:
        self.worker.close(flush_timeout_s=5)
        self.device.close()


def value(block: int, generation: int) -> float:
    return float((generation * 41 + block) % 250 + 1)


def chunks(first_block: int, count: int, key_base: int = 0) -> list[ChunkTransfer]:
    return [ChunkTransfer(key=key(key_base + i),
                          block_ids=tuple(range(first_block + i * BPC,
                                                first_block + (i + 1) * BPC)))
            for i in range(count)]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(tmp_path)
    yield e
    e.close()


def test_a_steps_stores_hold_what_its_forward_wrote_and_never_stall_the_runner(
        tmp_path: Path) -> None:
    engine = Engine(tmp_path, compute_delay_s=0.3)
    try:
        stores_hold_their_forward(engine)
    finally:
        engine.close()


def stores_hold_their_forward(engine: Engine) -> None:
    w = engine.worker
    plan = KVTierMetadata(stores=chunks(0, 4), stores_async=True, step=1)
    w.begin_step(plan)
    engine.forward(range(8), 1)  # runs 150-300 ms later
    w.store(plan)  # wait_for_save
    assert w.finish_step(set()) == set()
    assert engine.forwards_run == 0  # the runner's hooks returned before the forward ran
    w.begin_step(KVTierMetadata(step=2))
    w.finish_step(set())  # step 2 ends: step 1's job joined
    report = w.take_report()
    assert report is not None and report.stored == {t.key for t in plan.stores}
    assert report.stores_through == 1
    # Load the chunks back into other blocks: they hold what the forward wrote.
    w.load(KVTierMetadata(loads={"r": [ChunkTransfer(key=t.key, block_ids=tuple(
        b + 16 for b in t.block_ids)) for t in plan.stores]}))
    engine.device.drain()
    assert engine.holds(range(16, 24), 1, offset=16)


def test_an_async_load_from_disk_is_reported_only_with_its_blocks_filled(
        tmp_path: Path) -> None:
    first = Engine(tmp_path)
    first.forward(range(8), 2)
    first.device.drain()
    plan = KVTierMetadata(stores=chunks(0, 4), step=1)
    first.worker.store(plan)  # synchronous
    first.close()  # flushes the disk tier
    again = Engine(tmp_path, compute_delay_s=0.002)
    try:
        w = again.worker
        loads = [ChunkTransfer(key=t.key, block_ids=tuple(b + 16 for b in t.block_ids))
                 for t in plan.stores]
        w.begin_step(KVTierMetadata(async_loads={"r": loads}, step=1))  # the load thread
        deadline = time.monotonic() + 10
        finished: set[str] = set()
        while not finished and time.monotonic() < deadline:
            finished = w.take_finished_loads()
            time.sleep(0.001)
        assert finished == {"r"}
        assert again.holds(range(16, 24), 2, offset=16)  # no drain: done when reported
        assert w.take_failed_block_ids() == set()
    finally:
        again.close()


def held_request(engine: Engine) -> bool:
    """Whether the chunk of a request held for its store holds what its forward wrote."""
    w = engine.worker
    plan = KVTierMetadata(stores=chunks(0, 2), stores_async=True, step=1)
    w.begin_step(plan)
    engine.forward(range(4), 3)
    w.store(plan)
    w.finish_step(set())
    # The request ended in step 1: vLLM holds its blocks until finished_sending.
    w.begin_step(KVTierMetadata(held={"done"}, step=2))
    assert w.finish_step({"done"}) == {"done"}
    engine.forward(range(4), 9)  # vLLM frees the blocks; another request writes them
    engine.device.drain()
    w.load(KVTierMetadata(loads={"r": [ChunkTransfer(key=t.key, block_ids=tuple(
        b + 16 for b in t.block_ids)) for t in plan.stores]}))
    engine.device.drain()
    return engine.holds(range(16, 20), 3, offset=16)


def test_a_held_request_is_handed_back_only_after_its_gather(tmp_path: Path) -> None:
    engine = Engine(tmp_path, store_delay_s=0.05)  # the gather runs late
    try:
        assert held_request(engine)
    finally:
        engine.close()


def test_handed_back_before_its_gather_the_chunk_is_stored_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a step's end that joins no store job (the bug the worker's epochs
    prevent) hands the blocks back while the gather is still queued."""
    monkeypatch.setattr(ConnectorWorker, "finish_stores",
                        lambda self, before_epoch=None: None)
    engine = Engine(tmp_path, store_delay_s=0.05)
    try:
        assert not held_request(engine)
    finally:
        monkeypatch.undo()
        engine.close()


def test_an_async_hits_state_is_placed_in_compute_stream_order(tmp_path: Path) -> None:
    """begin_step copies an asynchronously loaded state (block 5) into the block the step's
    forward reads it from (block 6) on the compute stream: after the work queued before it
    (here a slow forward still writing block 6, which vLLM freed and handed on) and before
    the forward queued after it. Copied at once on the host, the late forward overwrote it."""
    spec = VllmCacheSpec(BS, HEADS, DIM, DIM, torch.bfloat16)
    kv = vllm_kv_caches(spec, LAYERS, BLOCKS, "LBNHC", fill=False)
    state = torch.zeros(BLOCKS, 64, dtype=torch.uint8)  # one state layer, 64 bytes a block
    device = StandInDevice(seed=3, delays={"compute": 0.03})
    paged = PagedKV(kv, BS, content="halves", torch_ops=True, null_block=0,
                    states=[[[state]]])
    layout = paged.layout(BS * BPC)
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": "1MiB", "pin": "off"}]}), layout)
    worker = ConnectorWorker(paged, layout, store, device=device)
    try:
        state[5] = 7  # the load thread's load, done when reported
        device.forward(lambda: state[6].fill_(9))  # earlier work on block 6, runs late
        worker.begin_step(KVTierMetadata(state_copies=[(0, 5, 6)], step=1))
        seen: list[torch.Tensor] = []
        device.forward(lambda: seen.append(state[6].clone()))
        device.drain()
        assert torch.all(seen[0] == 7)
    finally:
        worker.close(flush_timeout_s=5)
        device.close()
