"""The device mover in batches (issue 47), on the CPU stand-in device: a batch of chunks takes
one index upload, one gather or scatter, and one event per copy stream, and the stream
protocol's guarantees hold for it as for one chunk (test_stream_mover.py's scenarios, run here
with batches of 4 chunks in 2 or 3 staging buffers), each with its control on a device that
drops the waits it relies on:

  - a store gathers what the forward before it wrote, DMAs the gathered batch, and commits
    none of a batch's chunks before the batch's DMAs are done;
  - a forward after an inline load reads the loaded KV; a load's scatter waits for its DMAs;
  - an inline batch's RAM slots stay lent until its copy has run;
  - a miss in the middle of a batch is a miss for that chunk and the ones after it; a chunk
    whose place cannot be reserved is dropped alone, a batch whose gather cannot be queued
    is dropped whole, and what they held comes back;
  - batches from two threads at once share the staging buffers.

No vLLM, no GPU: pure torch and kvtier's store.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from moverrig import NoCopyWaits, NoWaits
from test_stream_mover import (
    BLOCKS,
    BPC,
    CHUNKS,
    SLOW_DMA_IN,
    SLOW_GATHER,
    Rig,
    blocks_hold,
    forward_after_inline_load,
    stored_chunks_hold,
    transfers,
    value,
)
from tierkit import key

from kvtier.errors import HostBufferRaced
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.cpu import spare_buffers
from kvtier.testing.standin import StandInDevice, StandInEvent, StandInStream

BATCH = 4  # chunks a batch: CHUNKS (6) go as a batch of 4 and a batch of 2


def batched(tmp: Path, device: StandInDevice, ram_chunks: int = 16, buffers: int = 2) -> Rig:
    return Rig(tmp, device, ram_chunks, staging=buffers * BATCH, batch=BATCH)


class EarlyDone(StandInDevice):
    """A device whose events on the store copy stream are reached when recorded, before the
    DMAs queued ahead of them have run (a mover that commits on such an event commits a
    chunk whose bytes are not in place)."""

    def record(self, event: Any, stream: StandInStream) -> None:
        super().record(event, stream)
        if stream.name == "store copy":
            event._reached.set()


def store_after_forward(rig: Rig) -> list[int]:
    """The forward writes generation 1 (slowly); the store planned after it must hold it,
    its chunks readable as soon as the store returns."""
    rig.device.forward(lambda: rig.write(range(BLOCKS), 1))
    moved = transfers(0)
    with ThreadPoolExecutor(1) as store_thread:
        job = store_thread.submit(rig.mover.store, moved, "async", rig.mover.mark()).result()
    assert len(job.stored) == CHUNKS
    return stored_chunks_hold(rig, moved, lambda b: value(b, 1))


# -- the stream protocol, in batches -------------------------------------------------------
@pytest.mark.parametrize("seed", range(2))
def test_a_batched_store_gathers_what_the_forward_before_it_wrote(tmp_path: Path,
                                                                  seed: int) -> None:
    with batched(tmp_path, StandInDevice(seed=seed, delays={"compute": 0.05})) as rig:
        assert store_after_forward(rig) == []


def test_without_the_stream_wait_a_batched_store_reads_the_blocks_too_early(
        tmp_path: Path) -> None:
    with batched(tmp_path, NoWaits(delays={"compute": 0.5})) as rig:
        assert store_after_forward(rig) != []


def test_a_batched_stores_dmas_copy_the_gathered_batch(tmp_path: Path) -> None:
    with batched(tmp_path, StandInDevice(seed=1, delays=SLOW_GATHER)) as rig:
        assert store_after_forward(rig) == []


def test_without_the_copy_wait_a_batched_store_copies_before_the_gather(tmp_path: Path) -> None:
    with batched(tmp_path, NoCopyWaits(delays=SLOW_GATHER)) as rig:
        assert store_after_forward(rig) != []


def test_no_chunk_of_a_batch_is_committed_before_the_batchs_dmas_ran(tmp_path: Path) -> None:
    slow_dma = {"store copy": 0.03, "store": 0.0, "compute": 0.0}
    with batched(tmp_path, StandInDevice(seed=2, delays=slow_dma)) as rig:
        assert store_after_forward(rig) == []


def test_committed_on_an_event_reached_too_early_a_batch_holds_stale_bytes(
        tmp_path: Path) -> None:
    slow_dma = {"store copy": 0.03, "store": 0.0, "compute": 0.0}
    with batched(tmp_path, EarlyDone(seed=2, delays=slow_dma)) as rig:
        assert store_after_forward(rig) != []
        rig.device.drain()  # the DMAs land in slots the store handed out: let them finish


@pytest.mark.parametrize("seed", range(2))
def test_a_forward_after_a_batched_inline_load_reads_the_loaded_kv(tmp_path: Path,
                                                                  seed: int) -> None:
    delays = {"load": 0.02, "compute": 0.0}
    with batched(tmp_path, StandInDevice(seed=seed, delays=delays)) as rig:
        assert forward_after_inline_load(rig) == []


def test_without_the_compute_wait_a_batched_load_is_read_stale(tmp_path: Path) -> None:
    with batched(tmp_path, NoWaits(delays={"load": 0.5, "compute": 0.0})) as rig:
        assert forward_after_inline_load(rig) != []


def test_a_batched_loads_scatter_waits_for_its_dmas(tmp_path: Path) -> None:
    with batched(tmp_path, StandInDevice(seed=4, delays=SLOW_DMA_IN)) as rig:
        assert forward_after_inline_load(rig) == []


def test_without_the_copy_wait_a_batched_load_scatters_before_its_dmas(tmp_path: Path) -> None:
    with batched(tmp_path, NoCopyWaits(delays=SLOW_DMA_IN)) as rig:
        assert forward_after_inline_load(rig) != []


def batch_slots_outlive_eviction(rig: Rig) -> list[int]:
    """RAM holds a batch (4 chunks). Each step a batch is stored and loaded inline (its copy
    runs late), the step ends (`release`) and the prefetch thread reads 4 other chunks from
    disk into RAM (host writes no stream orders). The loading batch's slots must stay lent
    until its copy has run."""
    other = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
    rig.write(range(44, 46), 30)
    rig.paged.gather((44, 45), other)
    for i in range(8):  # other requests' chunks, on disk only
        assert rig.store.tiers[1].put(key(300 + i), other.numpy().data).ok
    for step in range(2):
        rig.write(range(8), 20 + step)
        stored = [ChunkTransfer(key=key(200 + 4 * step + i), block_ids=(2 * i, 2 * i + 1))
                  for i in range(BATCH)]
        rig.mover.store(stored, "sync")
        assert rig.store.flush(10)  # RAM's slots may still be lent: then they are on disk
        targets = [ChunkTransfer(key=t.key, block_ids=tuple(b + 24 + 8 * step
                                                            for b in t.block_ids))
                   for t in stored]
        assert rig.mover.load(targets, rig.spares, wait=False) == BATCH
        rig.mover.release()  # the step ends
        for i in range(BATCH):  # the prefetch
            read = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
            assert rig.store.get_into(key(300 + 4 * step + i), read.numpy().data) is not None
    rig.device.drain()
    rig.mover.release()
    return blocks_hold(rig, range(24, 40), lambda b: value((b - 24) % 8, 20 + (b - 24) // 8))


def test_a_batched_inline_loads_ram_slots_stay_lent_until_its_copy_ran(tmp_path: Path) -> None:
    with batched(tmp_path, StandInDevice(seed=1, delays={"load": 0.02}),
                 ram_chunks=BATCH) as rig:
        assert batch_slots_outlive_eviction(rig) == []


def test_a_batchs_slots_given_back_before_its_copy_ran_are_overwritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with batched(tmp_path, StandInDevice(delays={"load": 0.05}), ram_chunks=BATCH) as rig:
        monkeypatch.setattr(StandInEvent, "query", lambda self: True)
        assert batch_slots_outlive_eviction(rig) != []
        monkeypatch.undo()
        assert any(isinstance(e, HostBufferRaced) for e in rig.device.take_errors())


# -- failures within a batch ---------------------------------------------------------------
@pytest.mark.parametrize("inline", [True, False])
def test_a_miss_in_a_batch_loads_the_chunks_before_it(tmp_path: Path, inline: bool) -> None:
    """Chunk 2 of 6 is in no tier: the load reports 2, and those 2 are in their blocks."""
    with batched(tmp_path, StandInDevice(seed=3, delays={"load": 0.01})) as rig:
        rig.write(range(BLOCKS), 7)
        moved = transfers(0)
        assert len(rig.mover.store(moved, "sync").stored) == CHUNKS
        assert rig.store.flush(10)
        for tier in rig.store.tiers:
            tier.delete(moved[2].key)
        rig.write(range(24, BLOCKS), 9)
        targets = transfers(24)
        with ThreadPoolExecutor(1) as load_thread:
            loaded = rig.mover.load(targets, rig.spares, wait=False) if inline else \
                load_thread.submit(rig.mover.load, targets, rig.spares, rig.mover.mark(),
                                   True).result()
        assert loaded == 2
        rig.device.drain()
        rig.mover.release()
        assert blocks_hold(rig, range(24, 24 + 2 * BPC), lambda b: value(b - 24, 7)) == []


def test_a_chunk_whose_place_cannot_be_reserved_is_dropped_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with batched(tmp_path, StandInDevice(seed=5)) as rig:
        rig.write(range(BLOCKS), 6)
        putting, calls = rig.store.putting, [0]

        def failing(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected: no place for this chunk")
            return putting(*args, **kwargs)

        monkeypatch.setattr(rig.store, "putting", failing)
        moved = transfers(0)
        job = rig.mover.store(moved, "sync")
        assert [t.key for t in job.stored] == [t.key for i, t in enumerate(moved) if i != 1]
        assert stored_chunks_hold(rig, moved[:1] + moved[2:], lambda b: value(b, 6)) == []


def test_a_batch_whose_gather_cannot_be_queued_is_dropped_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first batch's gather raises: its 4 chunks are not stored (logged; future misses),
    the second batch is, and what the first held (places, staging buffer) comes back."""
    with batched(tmp_path, StandInDevice(seed=2)) as rig:
        rig.write(range(BLOCKS), 6)
        run, gathers = rig.device.run, [0]

        def failing(stream: Any, work: Callable[[], Any]) -> None:
            if stream.name == "store":
                gathers[0] += 1
                if gathers[0] == 1:
                    raise RuntimeError("injected: the gather could not be queued")
            run(stream, work)

        monkeypatch.setattr(rig.device, "run", failing)
        moved = transfers(0)
        job = rig.mover.store(moved, "sync")
        assert [t.key for t in job.stored] == [t.key for t in moved[BATCH:]]
        assert not any(rig.store.contains(t.key) for t in moved[:BATCH])
        again = transfers(0, key_base=100)
        assert len(rig.mover.store(again, "sync").stored) == CHUNKS
        assert stored_chunks_hold(rig, moved[BATCH:] + again, lambda b: value(b, 6)) == []


# -- what a batch costs the host -----------------------------------------------------------
def test_a_batch_takes_one_index_upload_one_kernel_and_two_events(tmp_path: Path) -> None:
    """6 chunks in batches of 4 and 2: two gathers (one index upload and one index kernel
    each), two DMA runs, an event per copy stream a batch; the loads the same."""
    with batched(tmp_path, StandInDevice(seed=6)) as rig:
        rig.write(range(BLOCKS), 8)
        rig.device.calls.clear()
        assert len(rig.mover.store(transfers(0), "sync").stored) == CHUNKS
        assert dict(rig.mover.index_counts) == {"index uploads": 2, "index kernels": 2}
        # mark (1 event, 1 record), its wait; per batch 2 runs, 2 events and records, 1 wait
        assert dict(rig.device.calls) == {"event": 5, "record": 5, "wait": 3, "run": 4}
        rig.mover.index_counts.clear()
        rig.device.calls.clear()
        assert rig.mover.load(transfers(24), rig.spares, wait=True) == CHUNKS
        assert dict(rig.mover.index_counts) == {"index uploads": 2, "index kernels": 2}
        assert dict(rig.device.calls) == {"event": 5, "record": 5, "wait": 3, "run": 4}
        assert blocks_hold(rig, range(24, 24 + CHUNKS * BPC), lambda b: value(b - 24, 8)) == []


def test_batches_from_two_threads_share_the_staging_buffers(tmp_path: Path) -> None:
    """12 chunks, inline and on a load thread at once, in batches through 3 buffers: every
    byte lands."""
    with batched(tmp_path, StandInDevice(seed=11, delays={"load": 0.003}), ram_chunks=32,
                 buffers=3) as rig:
        rig.write(range(BLOCKS), 5)
        moved = transfers(0, count=12)
        rig.mover.store(moved, "sync")
        targets = [ChunkTransfer(key=t.key, block_ids=tuple(b + 24 for b in t.block_ids))
                   for t in moved]
        rig.write(range(24, BLOCKS), 9)
        thread_spares = spare_buffers(4, rig.chunk_bytes, rig.device.pinned)
        with ThreadPoolExecutor(1) as load_thread:
            other = load_thread.submit(rig.mover.load, targets[6:], thread_spares,
                                       rig.mover.mark(), True)
            assert rig.mover.load(targets[:6], rig.spares, wait=False) == 6
            assert other.result() == 6
        rig.device.drain()
        rig.mover.release()
        assert blocks_hold(rig, range(24, 48), lambda b: value(b - 24, 5)) == []


def test_a_load_thread_takes_back_the_buffers_of_done_inline_loads(tmp_path: Path) -> None:
    """An inline load of 8 chunks leaves both buffers with its two batches (its loans wait
    for the step's `release`); a load thread that needs a buffer takes one back once those
    copies are done, without waiting for the model runner's next step."""
    with batched(tmp_path, StandInDevice(seed=3, delays={"load": 0.005}), ram_chunks=32) as rig:
        rig.write(range(BLOCKS), 5)
        moved = transfers(0, count=12)
        rig.mover.store(moved, "sync")
        targets = [ChunkTransfer(key=t.key, block_ids=tuple(b + 24 for b in t.block_ids))
                   for t in moved]
        assert rig.mover.load(targets[:8], rig.spares, wait=False) == 8
        thread_spares = spare_buffers(4, rig.chunk_bytes, rig.device.pinned)
        with ThreadPoolExecutor(1) as load_thread:
            assert load_thread.submit(rig.mover.load, targets[8:], thread_spares,
                                      rig.mover.mark(), True).result(timeout=20) == 4
        rig.device.drain()
        rig.mover.release()
        assert blocks_hold(rig, range(24, 48), lambda b: value(b - 24, 5)) == []


@pytest.mark.parametrize("ram_chunks", [16, 0], ids=["ram", "disk-only"])
def test_chunks_the_store_holds_already_are_held_not_stored(tmp_path: Path,
                                                            ram_chunks: int) -> None:
    """A step's chunks of which the store holds some already: those are `held` (not counted
    as written: tests/node/test_node_held_stores.py; with RAM nothing is copied, a disk-only
    store finds them held by its put), the rest `stored`."""
    with batched(tmp_path, StandInDevice(seed=4), ram_chunks=ram_chunks) as rig:
        rig.write(range(BLOCKS), 5)
        moved = transfers(0)
        first = rig.mover.store(moved[:2], "sync")
        assert ([t.key for t in first.stored], first.held) == ([t.key for t in moved[:2]], [])
        again = rig.mover.store(moved, "sync")
        assert [t.key for t in again.held] == [t.key for t in moved[:2]]
        assert [t.key for t in again.stored] == [t.key for t in moved[2:]]
        assert stored_chunks_hold(rig, moved, lambda b: value(b, 5)) == []
