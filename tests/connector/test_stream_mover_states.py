"""State layers through the device mover (integrations/vllm/worker/streams.py), on the CPU stand-in.

A hybrid model's chunk carries, after its KV, a state region: a flag and one block's state of
every state layer (paged.py, groups.py). The device mover moves it in the same staging buffer
and the same queued work as the KV, so the same waits order it. Here vLLM's KV (FlashAttention's
LBNHC views) sits beside two gated-DeltaNet-like state layers, each a page a block holding a
bf16 conv state and a float32 recurrent state (and padding, never written), on the stand-in
device, whose streams run their work late on threads in poisoned memory. Scenarios, each on
bytes:

  - a store gathers the KV and the state the forward queued before it wrote;
  - a forward queued after an inline load reads the loaded KV and state (in the hit's last
    block and the next), and the state notes say which chunks held one;
  - a load thread's load from disk puts the states back bit for bit when it returns;
  - a chunk stored without a state stops a load that needs one there (the count), writing
    nothing of it, and is noted stateless; one that needs none loads past it;
and the ordering scenarios once more on a device that drops the mover's waits, where they
must fail.

No vLLM, no GPU: pure torch and kvtier's store.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from moverrig import MoverRig, NoWaits
from tierkit import key

from kvtier.core.keys import ChunkKey
from kvtier.integrations.vllm.groups import NULL_BLOCK, STATE_FLAG_BYTES
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.testing.standin import StandInDevice
from kvtier.testing.vllmviews import VllmCacheSpec, vllm_kv_caches

LAYERS, BLOCKS, HEADS, BS, DIM = 2, 48, 2, 16, 8
BPC = 2  # blocks per chunk
CHUNKS = 4
STATE_LAYERS = 2
CONV_BYTES, SSM_BYTES, PAGE_BYTES = 3 * 24 * 2, 2 * 8 * 8 * 4, 1024  # a page, padded
USED = CONV_BYTES + SSM_BYTES  # a page's state bytes (the rest is padding)
LOADED = 25  # loads write blocks from here on


class Rig(MoverRig):
    """vLLM's KV and state pages on the stand-in device, a store, the mover between them."""

    def __init__(self, tmp: Path, device: StandInDevice) -> None:
        spec = VllmCacheSpec(BS, HEADS, DIM, DIM, torch.bfloat16)
        self.kv = vllm_kv_caches(spec, LAYERS, BLOCKS, "LBNHC", fill=False)
        self.pages = [torch.zeros(BLOCKS, PAGE_BYTES, dtype=torch.uint8)
                      for _ in range(STATE_LAYERS)]
        layers = [[page[:, :CONV_BYTES].view(torch.bfloat16).view(BLOCKS, 3, 24),
                   page[:, CONV_BYTES:USED].view(torch.float32).view(BLOCKS, 2, 8, 8)]
                  for page in self.pages]
        paged = PagedKV(self.kv, BS, content="halves", torch_ops=True, null_block=NULL_BLOCK,
                        states=[layers])
        assert paged.state_bytes == STATE_FLAG_BYTES + STATE_LAYERS * USED
        self.notes: list[tuple[ChunkKey, bool]] = []
        super().__init__(tmp, device, paged, BS * BPC,
                         note_state=lambda k, s: self.notes.append((k, s)))

    def write(self, blocks: range, generation: int) -> None:
        """What a forward writes: block b's KV (every layer) and state (every state layer)."""
        for t in self.kv.values():
            for b in blocks:
                t[b] = value(b, generation)
        for page in self.pages:
            for b in blocks:
                page[b, :USED] = state_byte(b, generation)


def value(block: int, generation: int) -> float:
    return float((generation * 53 + block) % 250 + 1)  # exact in bf16


def state_byte(block: int, generation: int) -> int:
    return (generation * 31 + block * 7) % 251 + 1


def stored(first: int = 1, count: int = CHUNKS, base: int = 0) -> list[ChunkTransfer]:
    """Chunks of blocks first.., each with the state at its end (in its last block)."""
    return [ChunkTransfer(key=key(base + i),
                          block_ids=tuple(range(first + i * BPC, first + (i + 1) * BPC)),
                          state_blocks=(first + (i + 1) * BPC - 1,))
            for i in range(count)]


def loads(moved: list[ChunkTransfer], first: int = LOADED) -> list[ChunkTransfer]:
    """The same chunks into the blocks from `first` on; the last one's state goes into the
    hit's last block and the next (groups.py)."""
    out = [ChunkTransfer(key=t.key, block_ids=tuple(range(first + i * BPC,
                                                          first + (i + 1) * BPC)))
           for i, t in enumerate(moved)]
    end = first + len(moved) * BPC
    out[-1] = ChunkTransfer(key=out[-1].key, block_ids=out[-1].block_ids,
                            state_blocks=(end - 1, end))
    return out


def wrong_blocks(kv: dict[str, torch.Tensor], source: int, target: int, count: int,
                 generation: int) -> list[int]:
    """Target blocks whose KV is not their source block's `value` (at `generation`)."""
    return [target + j for j in range(count)
            if any(not torch.all(t[target + j] == value(source + j, generation))
                   for t in kv.values())]


def wrong_states(pages: list[torch.Tensor], blocks: list[int], source: int,
                 generation: int) -> list[int]:
    """`blocks` whose state bytes are not block `source`'s state (at `generation`)."""
    return [b for b in blocks
            if any(not torch.all(p[b, :USED] == state_byte(source, generation))
                   for p in pages)]


# -- scenarios: each returns what went wrong ------------------------------------------------
def store_after_forward(rig: Rig) -> list[str]:
    """The forward writes generation 1 (slowly); the store planned after it must hold its KV
    and its state."""
    rig.write(range(BLOCKS), 0)
    rig.device.forward(lambda: rig.write(range(BLOCKS), 1))
    moved = stored()
    with ThreadPoolExecutor(1) as store_thread:  # the worker's store thread
        job = store_thread.submit(rig.mover.store, moved, "async", rig.mover.mark()).result()
    assert len(job.stored) == CHUNKS
    assert rig.notes == [(t.key, True) for t in moved]
    bad = []
    out = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
    for t in moved:
        assert rig.store.get_into(t.key, out.numpy().data) is not None
        assert rig.paged.has_state(out)
        chunk = rig.paged.chunk_view(out)
        if any(not torch.all(chunk[:, j] == value(b, 1)) for j, b in enumerate(t.block_ids)):
            bad.append(f"kv {t.block_ids}")
        region = out[-rig.paged.state_bytes + STATE_FLAG_BYTES:]
        if not torch.all(region == state_byte(t.state_blocks[0], 1)):
            bad.append(f"state {t.state_blocks}")
    return bad


def forward_after_inline_load(rig: Rig) -> list[str]:
    """Chunks in RAM load inline into blocks 25+, the last one's state into the hit's last
    block and the next; a forward queued next reads them (the KV and the state)."""
    rig.write(range(BLOCKS), 2)
    moved = stored()
    rig.mover.store(moved, "sync")
    rig.write(range(LOADED, BLOCKS), 9)  # what the blocks held before the load
    rig.notes.clear()
    seen_kv: dict[str, torch.Tensor] = {}
    seen_pages: list[torch.Tensor] = []
    assert rig.mover.load(loads(moved), rig.spares, wait=False) == CHUNKS
    rig.device.forward(lambda: (seen_kv.update({n: t.clone() for n, t in rig.kv.items()}),
                                seen_pages.extend(p.clone() for p in rig.pages)))
    rig.device.drain()
    rig.mover.release()
    assert rig.notes == [(t.key, True) for t in moved]
    end = LOADED + CHUNKS * BPC
    last_state = moved[-1].state_blocks[0]
    return [f"kv {b}" for b in wrong_blocks(seen_kv, 1, LOADED, CHUNKS * BPC, 2)] \
        + [f"state {b}" for b in wrong_states(seen_pages, [end - 1, end], last_state, 2)]


# -- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_a_store_gathers_the_kv_and_the_state_the_forward_wrote(tmp_path: Path,
                                                                 seed: int) -> None:
    with Rig(tmp_path, StandInDevice(seed=seed, delays={"compute": 0.05})) as rig:
        assert store_after_forward(rig) == []


# The negative controls' stand-in work lasts long enough (0.5 s) that a thread scheduled late
# on a loaded machine still sees it unfinished: with 0.05 s, a store thread that ran 50 ms late
# read the fresh states and the control failed (once, in CI beside the engine lane).
def test_without_the_stream_wait_the_store_gathers_stale_states(tmp_path: Path) -> None:
    with Rig(tmp_path, NoWaits(delays={"compute": 0.5})) as rig:
        assert any(b.startswith("state") for b in store_after_forward(rig))


@pytest.mark.parametrize("seed", range(3))
def test_a_forward_after_an_inline_load_reads_the_loaded_kv_and_state(tmp_path: Path,
                                                                      seed: int) -> None:
    with Rig(tmp_path, StandInDevice(seed=seed, delays={"load": 0.02, "compute": 0.0})) as rig:
        assert forward_after_inline_load(rig) == []


def test_without_the_compute_wait_the_forward_reads_stale_states(tmp_path: Path) -> None:
    with Rig(tmp_path, NoWaits(delays={"load": 0.5, "compute": 0.0})) as rig:
        assert any(b.startswith("state") for b in forward_after_inline_load(rig))


def test_a_load_threads_load_from_disk_restores_the_states_bit_for_bit(tmp_path: Path) -> None:
    """Random state bytes (every bit pattern, padding apart), stored, evicted from RAM, and
    loaded back on a load thread: in place when the call returns, padding untouched."""
    with Rig(tmp_path, StandInDevice(seed=5, delays={"load": 0.01})) as rig:
        gen = torch.Generator().manual_seed(4)
        for page in rig.pages:
            page.copy_(torch.randint(0, 256, page.shape, generator=gen, dtype=torch.uint8))
        rig.write(range(1, LOADED), 3)  # the KV (and states, overwritten next)
        for page in rig.pages:
            page[:, :USED] = torch.randint(0, 256, (BLOCKS, USED), generator=gen,
                                           dtype=torch.uint8)
        before = [p.clone() for p in rig.pages]
        moved = stored()
        rig.mover.store(moved, "sync")
        assert rig.store.flush(10)
        for t in moved:
            rig.store.tiers[0].delete(t.key)
        targets = loads(moved)
        with ThreadPoolExecutor(1) as load_thread:
            loaded = load_thread.submit(rig.mover.load, targets, rig.spares, rig.mover.mark(),
                                        True).result()
        assert loaded == CHUNKS
        end = LOADED + CHUNKS * BPC
        source = moved[-1].state_blocks[0]
        for page, old in zip(rig.pages, before, strict=True):
            for block in (end - 1, end):  # no drain: the call waited for its copies
                assert torch.equal(page[block, :USED], old[source, :USED])
                assert torch.equal(page[block, USED:], old[block, USED:])  # padding
            others = [b for b in range(BLOCKS) if b not in (end - 1, end)]
            assert torch.equal(page[others], old[others])
        assert wrong_blocks(rig.kv, 1, LOADED, CHUNKS * BPC, 3) == []


def test_a_chunk_without_its_state_stops_a_load_that_needs_one(tmp_path: Path) -> None:
    """Chunk 1 was stored where vLLM kept no state (its state block null). A hit ending on
    it stops there: chunk 0 is loaded (the count is 1), nothing of chunk 1 is written, and
    it is noted stateless; a hit that ends later loads through it."""
    with Rig(tmp_path, StandInDevice(seed=3, delays={"load": 0.01})) as rig:
        rig.write(range(BLOCKS), 4)
        moved = stored(count=3)
        moved[1] = ChunkTransfer(key=moved[1].key, block_ids=moved[1].block_ids,
                                 state_blocks=(NULL_BLOCK,))
        rig.mover.store(moved, "sync")
        assert rig.notes == [(moved[0].key, True), (moved[1].key, False),
                             (moved[2].key, True)]
        rig.write(range(LOADED, BLOCKS), 9)
        rig.device.drain()
        before_kv = {n: t.clone() for n, t in rig.kv.items()}
        before_pages = [p.clone() for p in rig.pages]
        rig.notes.clear()
        assert rig.mover.load(loads(moved[:2]), rig.spares, wait=False) == 1
        rig.device.drain()
        rig.mover.release()
        assert rig.notes == [(moved[0].key, True), (moved[1].key, False)]
        assert wrong_blocks(rig.kv, 1, LOADED, BPC, 4) == []  # chunk 0
        untouched = range(LOADED + BPC, BLOCKS)
        assert all(torch.equal(t[untouched], before_kv[n][untouched])
                   for n, t in rig.kv.items())
        assert all(torch.equal(p, old) for p, old in zip(rig.pages, before_pages, strict=True))

        # Ending on chunk 2 (with its state), chunk 1 loads like any inner chunk.
        assert rig.mover.load(loads(moved), rig.spares, wait=False) == 3
        rig.device.drain()
        rig.mover.release()
        end = LOADED + 3 * BPC
        assert wrong_blocks(rig.kv, 1, LOADED, 3 * BPC, 4) == []
        assert wrong_states(rig.pages, [end - 1, end], moved[2].state_blocks[0], 4) == []
