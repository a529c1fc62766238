"""The device mover's ordering (integrations/vllm/worker/streams.py), on a CPU stand-in for the GPU.

The mover orders its copies only through the Device protocol; kvtier/testing/standin.py runs
each stream's work on a thread, late and in random order across streams, in poisoned "device"
memory. vLLM's KV is emulated as vLLM 0.33 hands it to a connector on CUDA (FlashAttention's
LBNHC views, kvtier/testing/vllmviews.py), written and read by a "forward" queued on the compute
stream. Each scenario checks bytes:

  - a store gathers what the forward queued before it wrote (not what the blocks held);
  - a forward queued after an inline load reads the loaded KV;
  - a load thread's load (from disk, below RAM) is complete when it returns;
  - an inline load keeps its RAM slot borrowed until its copy has run, though a promotion
    from disk (a host write no stream orders) wants the slot meanwhile;
  - many chunks pass through two staging buffers from two threads at once;
  - a store's DMA copies its chunk once gathered, a load's scatter waits for its DMA (each on
    its own stream), and a store keeps a chunk per staging buffer in flight;
and each scenario is run once more on a device that drops the mover's waits (or answers every
event "done"), where it must fail: the checks can fail, and it is the waits that pass them.

No vLLM, no GPU: pure torch and kvtier's store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from moverrig import MoverRig, NoCopyWaits, NoWaits
from tierkit import key

from kvtier.errors import HostBufferRaced
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.cpu import spare_buffers
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.testing.standin import StandInDevice, StandInEvent
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches

LAYERS, BLOCKS, HEADS, BS, DIM = 3, 48, 2, 16, 8
BPC = 2  # blocks per chunk
CHUNKS = 6


class Rig(MoverRig):
    """vLLM's KV on the stand-in device, a store, and the mover between them."""

    def __init__(self, tmp: Path, device: StandInDevice, ram_chunks: int = 16,
                 staging: int = 2, batch: int | None = None) -> None:
        spec = VllmCacheSpec(BS, HEADS, DIM, DIM, torch.bfloat16)
        self.kv = vllm_kv_caches(spec, LAYERS, BLOCKS, "LBNHC", fill=False)
        super().__init__(tmp, device, PagedKV(self.kv, BS, content="halves", torch_ops=True),
                         BS * BPC, ram_chunks, staging=staging, batch=batch)

    def write(self, blocks: range, generation: int) -> None:
        """What a forward writes: block b of every layer holds value(b, generation)."""
        for t in self.kv.values():
            for b in blocks:
                t[b] = value(b, generation)


def value(block: int, generation: int) -> float:
    return float((generation * 53 + block) % 250 + 1)  # exact in bf16


def transfers(first_block: int, count: int = CHUNKS, key_base: int = 0) -> list[ChunkTransfer]:
    return [ChunkTransfer(key=key(key_base + i),
                          block_ids=tuple(range(first_block + i * BPC,
                                                first_block + (i + 1) * BPC)))
            for i in range(count)]


def blocks_hold(rig: Rig, blocks: range, expected: Callable[[int], float]) -> list[int]:
    """The blocks of `blocks` whose bytes are not all `expected(b)` (in any layer)."""
    return [b for b in blocks
            if any(not torch.all(t[b] == expected(b)) for t in rig.kv.values())]


def stored_chunks_hold(rig: Rig, moved: list[ChunkTransfer],
                       expected: Callable[[int], float]) -> list[int]:
    """The chunks whose stored bytes are not their blocks' `expected` values."""
    bad = []
    for i, transfer in enumerate(moved):
        out = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
        if rig.store.get_into(transfer.key, out.numpy().data) is None:
            bad.append(i)
            continue
        chunk = rig.paged.chunk_view(out)  # [L, bpc, H, kv, r, n, D]
        if any(not torch.all(chunk[:, j] == expected(b))
               for j, b in enumerate(transfer.block_ids)):
            bad.append(i)
    return bad


# -- scenarios: each returns what went wrong ------------------------------------------------
def store_after_forward(rig: Rig) -> list[int]:
    """The forward writes generation 1 (slowly); the store planned after it must hold it."""
    rig.device.forward(lambda: rig.write(range(BLOCKS), 1))
    moved = transfers(0)
    with ThreadPoolExecutor(1) as store_thread:  # the worker's store thread
        job = store_thread.submit(rig.mover.store, moved, "async", rig.mover.mark()).result()
    assert len(job.stored) == CHUNKS
    return stored_chunks_hold(rig, moved, lambda b: value(b, 1))


def forward_after_inline_load(rig: Rig) -> list[int]:
    """Chunks in RAM load inline into blocks 24+; a forward queued next reads them."""
    rig.write(range(BLOCKS), 2)
    moved = transfers(0)
    rig.mover.store(moved, "sync")
    rig.write(range(24, BLOCKS), 9)  # what the blocks held before the load
    seen: dict[str, torch.Tensor] = {}
    loaded = rig.mover.load(transfers(24), rig.spares, wait=False)
    assert loaded == CHUNKS
    rig.device.forward(lambda: seen.update({n: t.clone() for n, t in rig.kv.items()}))
    rig.device.drain()
    rig.mover.release()
    return [b for b in range(24, 24 + CHUNKS * BPC)
            if any(not torch.all(t[b] == value(b - 24, 2)) for t in seen.values())]


def load_thread_from_disk(rig: Rig, tmp: Path) -> list[int]:
    """Chunks only on disk (a restarted engine) load on a load thread; done when it returns."""
    rig.write(range(BLOCKS), 3)
    moved = transfers(0)
    rig.mover.store(moved, "sync")
    assert rig.store.flush(10)
    rig.close()
    with Rig(tmp, StandInDevice(seed=7, delays={"load": 0.01})) as again:
        with ThreadPoolExecutor(1) as load_thread:
            loaded = load_thread.submit(again.mover.load, transfers(24), again.spares,
                                        again.mover.mark(), True).result()
        assert loaded == CHUNKS
        # No drain: the load thread's call has waited for its copies.
        return blocks_hold(again, range(24, 24 + CHUNKS * BPC), lambda b: value(b - 24, 3))


def borrowed_slot_outlives_eviction(rig: Rig) -> list[int]:
    """RAM holds one chunk. Each step a chunk is stored and loaded inline (its copy runs
    late), the step ends (`release`), and the prefetch thread reads another chunk from disk,
    a promotion into RAM: a host write, not ordered by any stream. The loading chunk's slot
    must stay lent (not reused) until its copy has run."""
    other = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
    rig.write(range(40, 42), 30)
    rig.paged.gather((40, 41), other)
    for i in range(4):  # other requests' chunks, on disk only
        assert rig.store.tiers[1].put(key(300 + i), other.numpy().data).ok
    for i in range(4):
        rig.write(range(2), 20 + i)
        rig.mover.store([ChunkTransfer(key=key(200 + i), block_ids=(0, 1))], "sync")
        assert rig.store.flush(10)  # RAM's one slot may still be lent: then it is on disk
        target = ChunkTransfer(key=key(200 + i), block_ids=(24 + 2 * i, 25 + 2 * i))
        assert rig.mover.load([target], rig.spares, wait=False) == 1
        rig.mover.release()  # the step ends
        read = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
        assert rig.store.get_into(key(300 + i), read.numpy().data) is not None  # prefetch
    rig.device.drain()
    rig.mover.release()
    return blocks_hold(rig, range(24, 32), lambda b: value(b % 2, 20 + (b - 24) // 2))


# -- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_a_store_gathers_what_the_forward_before_it_wrote(tmp_path: Path, seed: int) -> None:
    with Rig(tmp_path, StandInDevice(seed=seed, delays={"compute": 0.05})) as rig:
        assert store_after_forward(rig) == []


def test_without_the_stream_wait_the_store_reads_the_blocks_too_early(tmp_path: Path) -> None:
    with Rig(tmp_path, NoWaits(delays={"compute": 0.5})) as rig:
        assert store_after_forward(rig) != []


def test_a_store_that_fails_to_queue_a_gather_drops_that_chunk_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose gather cannot be queued (raises) is not stored (logged; a future miss),
    its reservation and staging buffer come back, and the chunks around it are stored whole."""
    with Rig(tmp_path, StandInDevice(seed=2)) as rig:
        rig.write(range(BLOCKS), 6)
        run, gathers = rig.device.run, [0]

        def failing(stream: Any, work: Callable[[], Any]) -> None:
            if stream.name == "store":  # a gather: the third chunk's fails
                gathers[0] += 1
                if gathers[0] == 3:
                    raise RuntimeError("injected: the gather could not be queued")
            run(stream, work)

        monkeypatch.setattr(rig.device, "run", failing)
        moved = transfers(0)
        job = rig.mover.store(moved, "sync")
        assert [t.key for t in job.stored] == [t.key for i, t in enumerate(moved) if i != 2]
        assert not rig.store.contains(moved[2].key)
        again = transfers(0, key_base=100)
        assert len(rig.mover.store(again, "sync").stored) == CHUNKS
        assert stored_chunks_hold(rig, moved[:2] + moved[3:] + again,
                                  lambda b: value(b, 6)) == []


# A slow gather behind a fast DMA, a slow DMA ahead of a fast scatter: each copy must wait for
# the work on its other side, on another stream.
SLOW_GATHER = {"store": 0.03, "store copy": 0.0, "compute": 0.0}
SLOW_DMA_IN = {"load copy": 0.03, "load": 0.0, "compute": 0.0}


@pytest.mark.parametrize("seed", range(2))
def test_a_stores_dma_copies_the_gathered_chunk(tmp_path: Path, seed: int) -> None:
    with Rig(tmp_path, StandInDevice(seed=seed, delays=SLOW_GATHER)) as rig:
        assert store_after_forward(rig) == []


def test_without_the_copy_wait_a_store_copies_its_buffer_before_the_gather(
        tmp_path: Path) -> None:
    with Rig(tmp_path, NoCopyWaits(delays=SLOW_GATHER)) as rig:
        assert store_after_forward(rig) != []


@pytest.mark.parametrize("seed", range(2))
def test_a_loads_scatter_waits_for_its_dma(tmp_path: Path, seed: int) -> None:
    with Rig(tmp_path, StandInDevice(seed=seed, delays=SLOW_DMA_IN)) as rig:
        assert forward_after_inline_load(rig) == []


def test_without_the_copy_wait_a_load_scatters_before_its_dma_landed(tmp_path: Path) -> None:
    with Rig(tmp_path, NoCopyWaits(delays=SLOW_DMA_IN)) as rig:
        assert forward_after_inline_load(rig) != []


def test_a_store_keeps_a_chunk_per_staging_buffer_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store thread reserves the next chunks' places and queues their copies before it
    waits for the oldest DMA: as many chunks in flight as staging buffers (2), each stored
    whole. One at a time, a store ran at 0.1-0.6x a raw copy on an H200."""
    with Rig(tmp_path, StandInDevice(seed=3, delays={"store copy": 0.01})) as rig:
        putting, open_now, most = rig.store.putting, [0], [0]

        @contextmanager
        def counted(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with putting(*args, **kwargs) as put:
                open_now[0] += 1
                most[0] = max(most[0], open_now[0])
                try:
                    yield put
                finally:
                    open_now[0] -= 1

        monkeypatch.setattr(rig.store, "putting", counted)
        rig.write(range(BLOCKS), 4)
        moved = transfers(0)
        assert len(rig.mover.store(moved, "sync").stored) == CHUNKS
        assert most[0] == 2 and open_now[0] == 0
        assert stored_chunks_hold(rig, moved, lambda b: value(b, 4)) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_forward_after_an_inline_load_reads_the_loaded_kv(tmp_path: Path, seed: int) -> None:
    with Rig(tmp_path, StandInDevice(seed=seed, delays={"load": 0.02, "compute": 0.0})) as rig:
        assert forward_after_inline_load(rig) == []
        assert rig.device.waits > 0


def test_without_the_compute_wait_the_forward_reads_stale_blocks(tmp_path: Path) -> None:
    with Rig(tmp_path, NoWaits(delays={"load": 0.5, "compute": 0.0})) as rig:
        assert forward_after_inline_load(rig) != []


def test_a_load_threads_load_from_disk_is_complete_when_it_returns(tmp_path: Path) -> None:
    assert load_thread_from_disk(Rig(tmp_path, StandInDevice(seed=5)), tmp_path) == []


@pytest.mark.parametrize("seed", range(2))
def test_an_inline_loads_ram_slot_stays_lent_until_its_copy_ran(tmp_path: Path,
                                                                seed: int) -> None:
    with Rig(tmp_path, StandInDevice(seed=seed, delays={"load": 0.02}), ram_chunks=1) as rig:
        assert borrowed_slot_outlives_eviction(rig) == []


def test_a_slot_given_back_before_its_copy_ran_is_overwritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event answers "reached" (a mover that trusts `query` blindly): the RAM slot is
    given back and evicted before the slow copy reads it; the device names the race (the
    slot changed between the copy's `run` and its turn on the stream)."""
    with Rig(tmp_path, StandInDevice(delays={"load": 0.05}), ram_chunks=1) as rig:
        monkeypatch.setattr(StandInEvent, "query", lambda self: True)
        assert borrowed_slot_outlives_eviction(rig) != []
        monkeypatch.undo()
        assert any(isinstance(e, HostBufferRaced) for e in rig.device.take_errors())


def test_many_chunks_through_two_staging_buffers(tmp_path: Path) -> None:
    """24 chunks (12x the staging buffers) inline and on a load thread at once: every byte
    lands, no buffer is used by two copies at once."""
    with Rig(tmp_path, StandInDevice(seed=11, delays={"load": 0.003}), ram_chunks=32) as rig:
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
