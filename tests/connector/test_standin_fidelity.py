"""The stand-in device fails the movers' bugs a GPU would show: deliberately wrong movers, each
beside its right form.

On CUDA, `Device.run` runs the work's host side at once (its launches read Python state and
build indices then) and only its kernels and DMAs later; a DMA reads or writes host memory
when the copy engine gets to it, and nothing keeps that memory as it was meanwhile. The
stand-in ran each queued closure whole and late, so a closure that read state set after
`run` returned passed here and failed on a GPU. Each scenario below is one such mistake;
each runs the same steps right, which must pass.

A stream held by a gate (`enqueue`: a kernel that runs until the test opens it) makes "the
device has not got there yet" certain, not a matter of delays.
"""

from __future__ import annotations

import mmap
import threading
from collections import deque
from pathlib import Path

import pytest
import torch
from moverrig import MoverRig

from kvtier.core.keys import ChunkKey
from kvtier.core.loans import Loan
from kvtier.core.store import ChunkView
from kvtier.errors import HostBufferRaced
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.device import Event
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.integrations.vllm.worker.streams import StreamChunkMover
from kvtier.testing.standin import POISON, StandInDevice

SIZE = 64  # bytes a chunk in the hand-made scenarios


def chunk(n: int) -> torch.Tensor:
    return torch.full((SIZE,), n, dtype=torch.uint8)


def held(device: StandInDevice, name: str) -> tuple[object, threading.Event]:
    """A stream whose work waits until the returned gate is set."""
    stream = device.new_stream(name)
    gate = threading.Event()
    device.enqueue(stream, lambda: gate.wait(timeout=30))
    return stream, gate


@pytest.mark.parametrize("wrong", [False, True])
def test_a_copy_listed_after_run_is_not_launched(wrong: bool) -> None:
    """A mover that fills the list its queued work copies after `run` returned: on a GPU the
    launch saw an empty list and copied nothing. The stand-in ran the closure late and
    copied it all; now the slot keeps its poison."""
    device = StandInDevice(seed=1)
    stream, gate = held(device, "load copy")
    slot, host = device.empty(SIZE), device.pinned(SIZE)
    host.copy_(chunk(7))
    hosts = [] if wrong else [host]

    def dma() -> None:
        for h in hosts:
            slot.copy_(h, non_blocking=True)

    device.run(stream, dma)
    if wrong:
        hosts.append(host)  # too late: the copies were launched at `run`
    gate.set()
    device.drain()
    assert torch.equal(slot, chunk(7)) is not wrong
    assert torch.equal(slot, torch.full((SIZE,), POISON, dtype=torch.uint8)) is wrong
    device.close()


@pytest.mark.parametrize("wrong", [False, True])
def test_a_spare_refilled_before_its_copys_event_is_a_race(wrong: bool) -> None:
    """A mover that reads two chunks through one spare and refills it for the second before
    the first's copy event (the right one waits for it): the first copy reads the second
    chunk. The device names the race and leaves the slot poisoned."""
    device = StandInDevice(seed=2)
    stream, gate = held(device, "load copy")
    spare, slots = device.pinned(SIZE), [device.empty(SIZE), device.empty(SIZE)]
    for i, slot in enumerate(slots):
        spare.copy_(chunk(10 + i))  # the read lands in the spare
        device.run(stream, lambda slot=slot: slot.copy_(spare, non_blocking=True))
        done = device.new_event()
        device.record(done, stream)
        if i == 0:
            gate.set()
        if not wrong:
            done.synchronize()
    device.drain()
    raced = [e for e in device.take_errors() if isinstance(e, HostBufferRaced)]
    assert bool(raced) is wrong
    assert torch.equal(slots[0], chunk(10)) is not wrong
    assert torch.equal(slots[1], chunk(11))
    device.close()


@pytest.mark.parametrize("wrong", [False, True])
def test_a_host_slot_read_before_its_dma_event_reads_poison(wrong: bool) -> None:
    """A store that commits a slot before its DMA's event (the right one waits): on a GPU it
    reads what the slot held before, which may be the very bytes (a chunk stored again) and
    pass by luck. The stand-in poisons a DMA's host destination at `run`."""
    device = StandInDevice(seed=3)
    stream, gate = held(device, "store copy")
    gathered, slot = device.empty(SIZE), device.pinned(SIZE)
    gathered.copy_(chunk(5))
    slot.copy_(chunk(5))  # the slot held this chunk already
    device.run(stream, lambda: slot.copy_(gathered, non_blocking=True))
    done = device.new_event()
    device.record(done, stream)
    if not wrong:
        gate.set()
        done.synchronize()
    committed = slot.clone()
    gate.set()
    device.drain()
    assert torch.equal(committed, chunk(5)) is not wrong
    device.close()


def test_a_value_the_host_reads_inside_run_is_a_counted_sync() -> None:
    """`.item()` inside queued work waits for the stream, as on CUDA (a stall): it is
    counted, and it sees the bytes the stream's earlier work wrote."""
    device = StandInDevice(seed=4, max_delay_s=0.01)
    stream = device.new_stream("load")
    slot, seen = device.empty(SIZE), []

    def work() -> None:
        slot.fill_(3)
        seen.append(int(slot[0]))

    device.run(stream, work)
    assert seen == [3] and device.stalls["sync"] == 1
    device.close()


@pytest.mark.parametrize("wrong", [False, True])
def test_a_copy_from_host_memory_not_pinned_is_counted(wrong: bool) -> None:
    """A DMA from pageable memory (a buffer not of the device's `pinned`) is, on a GPU,
    staged by the driver synchronously: counted, where one from pinned memory is not."""
    device = StandInDevice(seed=9)
    stream = device.new_stream("load copy")
    slot = device.empty(SIZE)
    host = torch.frombuffer(mmap.mmap(-1, SIZE), dtype=torch.uint8) if wrong \
        else device.pinned(SIZE)
    host.copy_(chunk(4))
    device.run(stream, lambda: slot.copy_(host, non_blocking=True))
    device.drain()
    assert torch.equal(slot, chunk(4))
    assert device.stalls["pageable"] == int(wrong)
    device.close()


def test_the_movers_store_and_load_without_a_host_sync(tmp_path: Path) -> None:
    """The device mover's queued work never needs a value of the device's (a GPU would stall
    the thread that queues it): its stores and loads, inline and on a thread, count no
    sync, and the bytes come back."""
    kv = {f"l{i}": torch.randint(0, 255, (16, 2, 4, 8), dtype=torch.uint8).view(torch.bfloat16)
          for i in range(2)}
    paged = PagedKV(kv, 4, content="halves", torch_ops=True)
    device = StandInDevice(seed=5)
    with MoverRig(tmp_path, device, paged, tokens_per_chunk=8, staging=4, batch=2) as rig:
        stored = [ChunkTransfer(ChunkKey(bytes([i]) * 16), (2 * i, 2 * i + 1)) for i in range(3)]
        assert len(rig.mover.store(stored, "sync").stored) == 3
        loaded = [ChunkTransfer(t.key, tuple(b + 8 for b in t.block_ids)) for t in stored]
        assert rig.mover.load(loaded[:2], rig.spares, wait=False) == 2
        assert rig.mover.load(loaded[2:], rig.spares, wait=True) == 1
        device.drain()
        rig.mover.release()
        assert device.stalls["sync"] == 0
        for view in (v.view(torch.uint8) for v in paged.block_views):  # bytes: NaNs differ
            assert torch.equal(view[8:14], view[0:6])


class LateListMover(StreamChunkMover):
    """The device mover with a deliberate bug: a batch's host tensors are listed after the
    copy's `run` (a GPU launched no copy; the stand-in ran the closure late, and passed)."""

    def _queue_loads(self, loans: list[Loan[ChunkView]], transfers: list[ChunkTransfer],
                     copies: deque[tuple[Event, torch.Tensor]], inline: bool) -> None:
        device, batches, size = self._device, self._batches, self._chunk_bytes
        plan = batches.plan_scatter([transfers[loan.index] for loan in loans])
        slot = self._free_slot(copies, inline)
        hosts: list[torch.Tensor] = []

        def dma() -> None:
            for i, host in enumerate(hosts):
                slot[i * size:(i + 1) * size].copy_(host, non_blocking=True)

        device.run(self._load_copy_stream, dma)
        hosts += [torch.frombuffer(loan.view.data, dtype=torch.uint8) for loan in loans]
        copied = device.new_event()
        device.record(copied, self._load_copy_stream)
        device.wait(self._load_stream, copied)
        device.run(self._load_stream, lambda: batches.scatter(plan, slot))
        done = device.new_event()
        device.record(done, self._load_stream)
        copies.append((done, slot))
        for loan in loans:
            loan.release_after(done)


class EarlyReleaseMover(StreamChunkMover):
    """The device mover with a deliberate bug: each loan ends as soon as its copy is queued,
    not at its event, so the lending reads the next chunk into a spare whose copy is still
    queued."""

    def _queue_loads(self, loans: list[Loan[ChunkView]], transfers: list[ChunkTransfer],
                     copies: deque[tuple[Event, torch.Tensor]], inline: bool) -> None:
        super()._queue_loads(loans, transfers, copies, inline)
        for loan in loans:
            loan.release()


def load_through(tmp: Path, mover_type: type[StreamChunkMover], device: StandInDevice,
                 ram_chunks: int) -> tuple[list[int], list[BaseException]]:
    """Store 6 chunks, load them through a `mover_type` as its load thread does (4 spares, batches
    of one chunk): the blocks whose bytes came back wrong, and what the device raised."""
    kv = {f"l{i}": torch.randint(0, 255, (32, 2, 4, 8), dtype=torch.uint8) for i in range(2)}
    paged = PagedKV(kv, 4, content="halves", torch_ops=True)
    with MoverRig(tmp, device, paged, tokens_per_chunk=8, ram_chunks=ram_chunks) as rig:
        stored = [ChunkTransfer(ChunkKey(bytes([i]) * 16), (2 * i, 2 * i + 1)) for i in range(6)]
        assert len(rig.mover.store(stored, "sync").stored) == 6
        assert rig.store.flush(10)
        rig.mover.close()
        rig.mover = mover_type(paged, rig.store, rig.chunk_bytes, lambda _k, _s: None,
                               device, staging=2, batch=1)
        loaded = [ChunkTransfer(t.key, tuple(b + 16 for b in t.block_ids)) for t in stored]
        rig.mover.load(loaded, rig.spares, wait=True)  # as the load thread does
        device.drain()
        wrong = [b for b in range(12)
                 if any(not torch.equal(t[b + 16], t[b]) for t in kv.values())]
        return wrong, device.take_errors()


def test_a_real_mover_listing_its_copies_after_run_loads_wrong_bytes(tmp_path: Path) -> None:
    """The chunks lent from RAM; the wrong mover's copies were never launched."""
    assert load_through(tmp_path / "right", StreamChunkMover, StandInDevice(seed=6), 16) \
        == ([], [])
    wrong, _ = load_through(tmp_path / "wrong", LateListMover, StandInDevice(seed=6), 16)
    assert wrong == list(range(12))


def test_a_real_mover_ending_its_loans_early_is_named_a_race(tmp_path: Path) -> None:
    """From disk (no RAM: every chunk read into one of 4 spares), the load stream slow: the
    fifth chunk is read into the first's spare while its copy is queued."""
    right = StandInDevice(seed=7, delays={"load": 0.05})
    assert load_through(tmp_path / "right", StreamChunkMover, right, 0) == ([], [])
    wrong = StandInDevice(seed=7, delays={"load": 0.05})
    blocks, raised = load_through(tmp_path / "wrong", EarlyReleaseMover, wrong, 0)
    assert blocks != [] and any(isinstance(e, HostBufferRaced) for e in raised)
