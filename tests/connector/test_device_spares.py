"""A device mover's spares stay the device's pinned memory after a read is abandoned.

A read not landed by its deadline is abandoned and its spare replaced in the caller's list
(the read may still write into the old one, core/loans.py). The replacement was plain
pageable memory whatever the spares were: on a GPU every later copy through that spare is
staged by the driver, synchronously (the inline load's thread is the model runner's), for the
rest of the worker's life. Now the spares (`spare_buffers`) carry their allocator and the
replacement comes from it; the stand-in counts the copies a GPU would stage
(`stalls["pageable"]`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from moverrig import MoverRig

from kvtier.core.keys import ChunkKey
from kvtier.core.tier import TierResult
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.cpu import spare_buffers
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.testing.standin import StandInDevice


def test_a_spare_replaced_after_an_abandoned_read_is_pinned_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = {f"l{i}": torch.randint(0, 255, (16, 2, 4, 8), dtype=torch.uint8) for i in range(2)}
    paged = PagedKV(kv, 4, content="halves", torch_ops=True)
    device = StandInDevice(seed=8)
    pinned: list[torch.Tensor] = []  # what the device allocated as pinned spares

    def allocate(nbytes: int) -> torch.Tensor:
        pinned.append(device.pinned(nbytes))
        return pinned[-1]

    with MoverRig(tmp_path, device, paged, tokens_per_chunk=8, ram_chunks=0) as rig:
        stored = [ChunkTransfer(ChunkKey(bytes([i]) * 16), (2 * i, 2 * i + 1)) for i in range(2)]
        assert len(rig.mover.store(stored, "sync").stored) == 2
        assert rig.store.flush(10)
        disk, gate = rig.store.tiers[0], threading.Event()
        read = disk.get_into

        def stalled_read(key: ChunkKey, *args: Any) -> TierResult:
            if key == stored[1].key:  # the fault: this read outlasts the load's budget
                gate.wait(10)
            return read(key, *args)

        monkeypatch.setattr(disk, "get_into", stalled_read)
        spares = spare_buffers(2, rig.chunk_bytes, allocate)
        before = list(spares)
        loaded = [ChunkTransfer(t.key, tuple(b + 8 for b in t.block_ids)) for t in stored]
        try:
            assert rig.mover.load(loaded, spares, wait=True,
                                  until=time.monotonic() + 0.2) == 1
        finally:
            gate.set()
        replaced = [i for i, (old, new) in enumerate(zip(before, spares)) if old is not new]
        assert replaced == [1]
        assert len(pinned) == 3  # the replacement is the device's pinned memory
        # The next loads go through both spares: no copy a GPU would stage.
        device.stalls.clear()
        assert rig.mover.load(loaded, spares, wait=True) == 2
        assert rig.mover.load(loaded[::-1], spares, wait=True) == 2
        assert device.stalls["pageable"] == 0
