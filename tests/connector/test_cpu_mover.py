"""The CPU mover's loads from a slow tier (cpu.py): each chunk is scattered as its read lands,
the first landed first, and the next reads run while chunks are scattered (issue 26: a disk
hit's copy no longer waits for its reads, nor its reads for its copy, nor a chunk for a read
that lands late). Real disk tier, real paged KV in vLLM 0.33's layout; the disk's reads are
gated (fault injection) to fix their order."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.core.keys import ChunkKey
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.connector_worker import load_batch_for
from kvtier.integrations.vllm.worker.cpu import CpuChunkMover, spare_buffers
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

BLOCK, CHUNK, CHUNKS, SPARES = 16, 32, 8, 4


@pytest.fixture
def rig(tmp_path: Path) -> Any:
    per_chunk = CHUNK // BLOCK
    kv = vllm_kv_caches(VllmCacheSpec(BLOCK, 2, 64, 64, torch.bfloat16), 2,
                        2 * CHUNKS * per_chunk + 1, "LBNHC")
    for view in kv.values():
        view.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
    paged = PagedKV(kv, BLOCK, content="halves", torch_ops=False)
    layout = paged.layout(CHUNK)
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 2 * 4096 * -(-layout.bytes_per_chunk // 4096),
         "pin": "off"},  # two chunks: the loads' chunks come from the disk
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}), layout)
    mover = CpuChunkMover(paged, store, layout.bytes_per_chunk, lambda _k, _s: None)
    stored = [ChunkTransfer(key=ChunkKey(os.urandom(16)),
                            block_ids=tuple(range(i * per_chunk, (i + 1) * per_chunk)))
              for i in range(CHUNKS)]
    mover.store(stored, "sync")
    assert store.flush(timeout_s=10)
    half = CHUNKS * per_chunk
    loads = [ChunkTransfer(key=t.key, block_ids=tuple(b + half for b in t.block_ids))
             for t in stored]
    for t in loads:
        store.tiers[0].delete(t.key)
    yield paged, store, mover, loads, half
    store.close()


def _gate_reads(store: Any, loads: list[ChunkTransfer], monkeypatch: pytest.MonkeyPatch,
                held: int, until: tuple[str, int]) -> list[tuple[str, int]]:
    """Hold chunk `held`'s disk read until the event `until` (("start" | "end", chunk)) has
    happened (at most 5 s: a test fails, it does not hang); the reads' events, in order."""
    index = {t.key: i for i, t in enumerate(loads)}
    events: list[tuple[str, int]] = []
    happened = threading.Event()
    disk = store.tiers[1]
    read = disk.get_into

    def note(event: tuple[str, int]) -> None:
        events.append(event)
        if event == until:
            happened.set()

    def gated_read(key: ChunkKey, *args: Any) -> Any:
        i = index[key]
        note(("start", i))
        if i == held:
            happened.wait(5)
        try:
            return read(key, *args)
        finally:
            note(("end", i))

    monkeypatch.setattr(disk, "get_into", gated_read)
    return events


def _loaded(paged: PagedKV, chunks: int, half: int) -> bool:
    """Whether the first `chunks` loaded chunks' blocks hold the stored chunks' bytes."""
    blocks = chunks * (CHUNK // BLOCK)
    return all(torch.equal(v.view(torch.uint8)[:blocks], v.view(torch.uint8)[half:half + blocks])
               for v in paged.block_views)


@pytest.mark.parametrize(("held", "until", "before"), [
    (3, ("start", 4), ("end", 3)),  # the next chunk is read while earlier ones are scattered
    (1, ("end", 5), ("end", 1)),  # a read that lands late holds up no other
])
def test_reads_run_on_while_chunks_are_scattered_and_none_waits_for_a_late_one(
        rig: Any, monkeypatch: pytest.MonkeyPatch, held: int, until: tuple[str, int],
        before: tuple[str, int]) -> None:
    """Chunk `held`'s read is held until `until` has happened, which must come `before`.
    Chunk 3 held until chunk 4's read starts: with 4 spares the mover reads chunks 0-3 at
    once and chunk 4 as soon as one of them is scattered (a mover that waits for its reads'
    last before reading the next never starts chunk 4 first). Chunk 1 held until chunk 5's
    read ends: chunks 0, 2 and 3 are scattered as they land and their spares read chunks 4-6
    meanwhile (a mover that takes chunks in order, or a batch at a time, reads chunk 5 only
    after chunk 1 has landed)."""
    paged, store, mover, loads, half = rig
    events = _gate_reads(store, loads, monkeypatch, held=held, until=until)
    spares = spare_buffers(SPARES, paged.layout(CHUNK).bytes_per_chunk)
    assert mover.load(loads, spares) == CHUNKS
    assert events.index(until) < events.index(before)
    assert _loaded(paged, CHUNKS, half)


def test_chunks_before_a_miss_are_loaded_even_when_they_land_after_it(
        rig: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk 2 is corrupt on disk (a byte flipped: its checksum fails) and chunk 1's read
    lands after chunk 2's miss is known: the load still scatters chunk 1, and returns 2
    (chunks 0 and 1 loaded; vLLM recomputes from chunk 2)."""
    paged, store, mover, loads, half = rig
    with open(store.tiers[1].files.path_of(loads[2].key), "r+b") as file:
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 0xFF]))
    events = _gate_reads(store, loads, monkeypatch, held=1, until=("end", 2))
    spares = spare_buffers(SPARES, paged.layout(CHUNK).bytes_per_chunk)
    assert mover.load(loads, spares) == 2
    assert events.index(("end", 2)) < events.index(("end", 1))
    assert _loaded(paged, 2, half)
    assert len(spares) == SPARES


def test_a_miss_stops_the_load_and_no_read_outlives_it(
        rig: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk 1 is gone: the load stops there (1 loaded), and the reads already started for
    the batches after it have all ended when `load` returns (they write into the caller's
    spares, which the next load reuses)."""
    paged, store, mover, loads, _half = rig
    store.tiers[1].delete(loads[1].key)
    running = set()
    lock = threading.Lock()
    disk = store.tiers[1]
    read = disk.get_into

    def tracked_read(key: ChunkKey, *args: Any) -> Any:
        with lock:
            running.add(key)
        try:
            return read(key, *args)
        finally:
            with lock:
                running.discard(key)

    monkeypatch.setattr(disk, "get_into", tracked_read)
    spares = spare_buffers(SPARES, paged.layout(CHUNK).bytes_per_chunk)
    assert mover.load(loads, spares) == 1
    assert running == set()
    assert len(spares) == SPARES


def test_disk_reads_land_straight_in_the_spares(
        rig: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spares are page-aligned, so each disk read lands in its spare (O_DIRECT where the
    filesystem allows it) and is verified there: no staging buffer and no second copy. With
    torch-allocated spares (64-byte aligned) every read went through the staging buffer."""
    paged, store, mover, loads, _half = rig
    files = store.tiers[1].files
    decode = files.encoder.decode
    in_place: list[bool] = []

    def spied(key: ChunkKey, header: Any, body: memoryview, out: memoryview,
              *args: Any) -> None:
        address = np.frombuffer(body, dtype=np.uint8).ctypes.data
        in_place.append(address == np.frombuffer(out, dtype=np.uint8).ctypes.data)
        decode(key, header, body, out, *args)

    monkeypatch.setattr(files.encoder, "decode", spied)
    spares = spare_buffers(SPARES, paged.layout(CHUNK).bytes_per_chunk)
    assert all(np.frombuffer(s, dtype=np.uint8).ctypes.data % 4096 == 0 for s in spares)
    assert mover.load(loads, spares) == CHUNKS
    assert in_place == [True] * CHUNKS  # every chunk was read from the disk, in place


def test_a_load_without_spares_is_refused(rig: Any) -> None:
    """No spare to read into: an error, not a load that reports chunks it never read."""
    _paged, _store, mover, loads, _half = rig
    with pytest.raises(ValueError, match="spare"):
        mover.load(loads, [])


@pytest.mark.parametrize(("io_threads", "chunk_mib", "reads"), [
    (16, 2, 16), (16, 4, 8), (16, 32, 8), (4, 2, 4), (64, 0.5, 64), (64, 1, 32)])
def test_a_load_reads_more_small_chunks_at_once_within_the_read_threads(
        io_threads: int, chunk_mib: float, reads: int) -> None:
    """8 reads at once, more of chunks under 4 MiB (32 MiB in flight), never more than the
    store's read threads."""
    assert load_batch_for(io_threads, int(chunk_mib * 2**20)) == reads


def test_a_disk_only_store_reports_chunks_it_held_as_held_not_stored(tmp_path: Path) -> None:
    """A disk-only store (`tiers: [disk]`: no slots, each chunk gathered into the mover's
    buffer and put): a step storing 4 chunks of which 2 were stored by the step before
    reports those 2 as `held` (the worker's `already_held_tokens`), the other 2 as `stored`
    (its `stored_tokens` / `stored_bytes`)."""
    per_chunk = CHUNK // BLOCK
    kv = vllm_kv_caches(VllmCacheSpec(BLOCK, 2, 64, 64, torch.bfloat16), 2, 4 * per_chunk,
                        "LBNHC")
    paged = PagedKV(kv, BLOCK, content="halves", torch_ops=False)
    layout = paged.layout(CHUNK)
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]}), layout)
    mover = CpuChunkMover(paged, store, layout.bytes_per_chunk, lambda _k, _s: None)
    moved = [ChunkTransfer(key=ChunkKey(os.urandom(16)),
                           block_ids=tuple(range(i * per_chunk, (i + 1) * per_chunk)))
             for i in range(4)]
    try:
        first = mover.store(moved[:2], "sync")
        assert (first.stored, first.held) == (moved[:2], [])
        again = mover.store(moved, "sync")
        assert (again.held, again.stored) == (moved[:2], moved[2:])
    finally:
        store.close()
