"""The connector's device mover (integrations/vllm/worker/streams.py, `StreamChunkMover` over
`CudaDevice`) on a real GPU, mirroring the stand-in scenarios of
tests/connector/test_stream_mover.py.

vLLM 0.33's KV caches (gpurig.CASES: every layout, MLA, kernel blocks, bf16 and fp8) are
stored from the device into a pinned memory tier (with a disk tier below it) and loaded back:
  - the stored chunks are, byte for byte, the chunk order built from vLLM's views;
  - inline loads (the model runner's thread: a forward queued next on the current stream
    reads the loaded KV), load-thread loads (done when the call returns) and loads from disk
    through pinned spares put back the source blocks' exact bytes, and a local prefix hit's
    blocks are not written;
  - a miss stops a load and writes nothing of the missing chunk;
  - a hybrid model's states (a gated-DeltaNet-like layer's conv and recurrent state) ride in
    their chunks and land bit for bit in the hit's last block and the next; a chunk stored
    without its state stops a load that needs one;
and ordering, each check also run on a device that loses the mover's waits, where it fails:
  - a store gathers what the forward queued before it wrote, not what the blocks held;
  - a forward queued after an inline load reads the loaded KV, though the load's copies run
    late (after vLLM work the load must follow);
  - an inline load's RAM slot stays lent until its copy ran;
  - many chunks pass through two staging buffers from two threads at once.

Each test runs on "cuda" (skipped without a GPU) and on "standin"
(kvtier/testing/standin.py), so
that CI executes these bodies. No vLLM. Throughput: `kvtier bench copy` (scripts/gpu-check.sh).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from gpurig import BS, CASE_IDS, CASES, SLEEP_CYCLES_PER_S, Backend, Case, reference_chunk
from tierkit import key

from kvtier.core.store import TieredStore
from kvtier.errors import HostBufferRaced
from kvtier.integrations.vllm.groups import NULL_BLOCK
from kvtier.integrations.vllm.transfers import ChunkTransfer
from kvtier.integrations.vllm.worker.cpu import spare_buffers
from kvtier.integrations.vllm.worker.paged import PagedKV
from kvtier.integrations.vllm.worker.streams import StreamChunkMover
from kvtier.testing.standin import StandInEvent
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

LAYERS, BLOCKS = 3, 64
BPC = 2  # blocks per chunk
PLAIN = CASES[0]  # LBNHC bf16: FlashAttention's layout, for the ordering scenarios


class Rig:
    """vLLM's KV on the backend's device, a store (pinned RAM over disk), the mover (2
    staging buffers of a chunk; test_cuda_batches.py: `staging` chunks in batches of `batch`)."""

    def __init__(self, backend: Backend, case: Case, tmp: Path, ram_chunks: int = 32,
                 staging: int = 2, batch: int | None = None) -> None:
        self.backend, self.case = backend, case
        self.kv = backend.kv_caches(case, LAYERS, BLOCKS)
        self.paged = backend.paged(case, self.kv)
        layout = self.paged.layout(BS * BPC)
        self.chunk_bytes = layout.bytes_per_chunk
        slot_bytes = -(-self.chunk_bytes // 4096) * 4096
        self.store: TieredStore = open_store(StoreConfig.parse({"tiers": [
            {"kind": "memory", "capacity": ram_chunks * slot_bytes, "pin": backend.pin},
            {"kind": "disk", "path": str(tmp / "disk"), "capacity": "64MiB"}]}), layout)
        self.mover = StreamChunkMover(self.paged, self.store, self.chunk_bytes,
                                      note_state=lambda _k, _s: None,
                                      device=backend.device, staging=staging, batch=batch)
        self.spares = spare_buffers(4, self.chunk_bytes, backend.device.pinned)

    def blocks(self) -> list[torch.Tensor]:
        """Every layer's blocks as uint8, block-major (views: they follow the KV)."""
        return [v.view(torch.uint8) for v in self.paged.block_views]

    def write(self, blocks: range, generation: int) -> None:
        """What a forward writes: block b of every layer holds value(b, generation)."""
        for view in self.paged.block_views:
            for b in blocks:
                view[b] = value(b, generation)

    def store_on_thread(self, moved: list[ChunkTransfer]) -> int:
        """The worker's store thread: marked on this (the runner's) thread, stored there."""
        with ThreadPoolExecutor(1) as store_thread:
            job = store_thread.submit(self.mover.store, moved, "async", self.mover.mark())
            return len(job.result().stored)

    def load_on_thread(self, moved: list[ChunkTransfer]) -> int:
        """The worker's load thread, with spares of its own: done when it returns."""
        spares = spare_buffers(4, self.chunk_bytes, self.backend.device.pinned)
        with ThreadPoolExecutor(1) as load_thread:
            return load_thread.submit(self.mover.load, moved, spares, self.mover.mark(),
                                      True).result()

    def close(self) -> None:
        self.backend.drain()
        self.mover.close()
        self.store.close()


def value(block: int, generation: int) -> float:
    return float((generation * 53 + block) % 250 + 1)  # exact in bf16 and in a byte


def transfers(first_block: int, count: int, key_base: int = 0) -> list[ChunkTransfer]:
    return [ChunkTransfer(key=key(key_base + i),
                          block_ids=tuple(range(first_block + i * BPC,
                                                first_block + (i + 1) * BPC)))
            for i in range(count)]


def moved_to(moved: list[ChunkTransfer], first_block: int) -> list[ChunkTransfer]:
    """The same chunks, loaded into the blocks from `first_block` on."""
    return [ChunkTransfer(key=t.key, block_ids=tuple(first_block + i * BPC + j
                                                     for j in range(BPC)))
            for i, t in enumerate(moved)]


def differing(after: list[torch.Tensor], before: list[torch.Tensor],
              pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (source, target) block pairs whose bytes differ in any layer."""
    return [(s, d) for s, d in pairs
            if any(not torch.equal(a[d], b[s]) for a, b in zip(after, before))]


@pytest.fixture
def rig_factory(tmp_path: Path, backend: Backend) -> Any:
    """Makes a rig on the test's backend (closed before the backend is)."""
    rigs: list[Rig] = []

    def make(case: Case = PLAIN, ram_chunks: int = 32) -> Rig:
        rigs.append(Rig(backend, case, tmp_path, ram_chunks))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


# -- bytes: every vLLM 0.33 cache, stored and loaded back -----------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_chunks_stored_from_the_device_load_back_bit_exact(backend: Backend, case: Case,
                                                           rig_factory: Any) -> None:
    rig: Rig = rig_factory(case)
    source = [b.clone() for b in rig.blocks()]  # random bytes
    moved = transfers(0, 6)
    assert rig.store_on_thread(moved) == 6
    out = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
    for t in moved:  # the tier holds the chunk order a CPU engine would have stored
        assert rig.store.get_into(t.key, out.numpy().data) is not None
        assert torch.equal(out, reference_chunk(rig.kv, t.block_ids, case).cpu()), t.block_ids
    if backend.cuda:  # else the DMA from and to host memory is neither async nor direct
        assert rig.store.tiers[0].pinned  # type: ignore[attr-defined]
        with rig.store.borrow(moved[0].key, rig.spares[0]) as lent:
            assert lent is not None and torch.frombuffer(lent.data, dtype=torch.uint8).is_pinned()
        assert torch.frombuffer(rig.spares[0], dtype=torch.uint8).is_pinned()

    # Inline (chunks 0-2 into blocks 24-29): a forward queued next reads them.
    inline = moved_to(moved[:3], 24)
    assert rig.mover.load(inline, rig.spares, wait=False) == 3
    seen: list[torch.Tensor] = []
    backend.forward(lambda: seen.extend(b.clone() for b in rig.blocks()))
    backend.drain()
    rig.mover.release()
    assert differing(seen, source, [(s, s + 24) for s in range(6)]) == []

    # The load thread (chunks 3-5 into blocks 36-41): in place when the call returns.
    assert rig.load_on_thread(moved_to(moved[3:], 36)) == 3
    assert differing(rig.blocks(), source, [(s, s + 30) for s in range(6, 12)]) == []

    # From disk (RAM emptied), through pinned spares, into blocks 48-59; block 48 is a local
    # prefix hit (first_block 1): not written.
    assert rig.store.flush(10)
    for t in moved:
        rig.store.tiers[0].delete(t.key)
    from_disk = moved_to(moved, 48)
    from_disk[0] = ChunkTransfer(from_disk[0].key, from_disk[0].block_ids, first_block=1)
    before = [b.clone() for b in rig.blocks()]
    assert rig.load_on_thread(from_disk) == 6
    assert differing(rig.blocks(), source, [(s, s + 48) for s in range(1, 12)]) == []
    assert differing(rig.blocks(), before, [(48, 48)]) == []


def test_a_miss_stops_the_load_and_writes_nothing_of_it(backend: Backend,
                                                        rig_factory: Any) -> None:
    rig: Rig = rig_factory()
    moved = transfers(0, 2)
    assert rig.store_on_thread(moved) == 2
    before = [b.clone() for b in rig.blocks()]
    wanted = moved_to([moved[0], ChunkTransfer(key(99), (0, 1)), moved[1]], 24)
    assert rig.mover.load(wanted, rig.spares, wait=False) == 1
    backend.drain()
    rig.mover.release()
    assert differing(rig.blocks(), before, [(0, 24), (1, 25)]) == []  # loaded
    assert differing(rig.blocks(), before, [(b, b) for b in range(26, 30)]) == []  # untouched


def test_states_ride_with_their_chunks_bit_exact(backend: Backend, tmp_path: Path) -> None:
    """Two state layers, each a padded page a block holding a bf16 conv state and a float32
    recurrent state (vLLM's MambaSpec views), beside the KV on the device: stored from the
    device, loaded inline (a forward queued next reads the state in the hit's last block and
    the next) and on a load thread, where a hit ending on a chunk stored without a state stops
    there."""
    conv, ssm, page_bytes = 3 * 24 * 2, 2 * 8 * 8 * 4, 1024
    used = conv + ssm
    gen = torch.Generator().manual_seed(6)
    pages = [torch.randint(0, 256, (BLOCKS, page_bytes), generator=gen, dtype=torch.uint8)
             .to(backend.torch_device) for _ in range(2)]
    layers = [[p[:, :conv].view(torch.bfloat16).view(BLOCKS, 3, 24),
               p[:, conv:used].view(torch.float32).view(BLOCKS, 2, 8, 8)] for p in pages]
    kv = backend.kv_caches(PLAIN, LAYERS, BLOCKS)
    paged = PagedKV(kv, BS, PLAIN.format(), content="halves", torch_ops=True,
                    null_block=NULL_BLOCK, states=[layers])
    chunk_bytes = paged.layout(BS * BPC).bytes_per_chunk
    slot_bytes = -(-chunk_bytes // 4096) * 4096
    store = open_store(StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 16 * slot_bytes, "pin": backend.pin}]}),
        paged.layout(BS * BPC))
    notes: list[tuple[Any, bool]] = []
    mover = StreamChunkMover(paged, store, chunk_bytes,
                             note_state=lambda k, s: notes.append((k, s)),
                             device=backend.device, staging=2)
    try:
        source_kv = [v.view(torch.uint8).clone() for v in paged.block_views]
        source = [p.clone() for p in pages]
        moved = [ChunkTransfer(key(i), (1 + 2 * i, 2 + 2 * i), state_blocks=(2 + 2 * i,))
                 for i in range(3)]
        moved[1] = ChunkTransfer(moved[1].key, moved[1].block_ids, state_blocks=(NULL_BLOCK,))
        with ThreadPoolExecutor(1) as store_thread:
            job = store_thread.submit(mover.store, moved, "async", mover.mark()).result()
        assert len(job.stored) == 3
        assert notes == [(moved[0].key, True), (moved[1].key, False), (moved[2].key, True)]

        # Inline, chunks 0-2 into blocks 25-30, the state of block 6 into blocks 30 and 31.
        targets = [ChunkTransfer(t.key, (25 + 2 * i, 26 + 2 * i)) for i, t in enumerate(moved)]
        targets[-1] = ChunkTransfer(targets[-1].key, targets[-1].block_ids, state_blocks=(30, 31))
        spares = spare_buffers(4, chunk_bytes, backend.device.pinned)
        assert mover.load(targets, spares, wait=False) == 3
        seen: list[torch.Tensor] = []
        backend.forward(lambda: seen.extend(p.clone() for p in pages))
        backend.drain()
        mover.release()
        for page, old in zip(seen, source, strict=True):
            assert torch.equal(page[30:32, :used], old[6, :used].expand(2, used))
            assert torch.equal(page[:, used:], old[:, used:])  # padding: never written
            assert torch.equal(page[:30], old[:30]) and torch.equal(page[32:], old[32:])
        blocks = [v.view(torch.uint8) for v in paged.block_views]
        assert differing(blocks, source_kv, [(s, s + 24) for s in range(1, 7)]) == []

        # The load thread: a hit ending on chunk 1 (stored without its state) loads chunk 0.
        before = [p.clone() for p in pages]
        before_kv = [b.clone() for b in blocks]
        ends_stateless = [ChunkTransfer(moved[0].key, (33, 34)),
                          ChunkTransfer(moved[1].key, (35, 36), state_blocks=(36, 37))]
        with ThreadPoolExecutor(1) as load_thread:
            assert load_thread.submit(mover.load, ends_stateless, spares, mover.mark(),
                                      True).result() == 1
        assert differing(blocks, source_kv, [(1, 33), (2, 34)]) == []
        assert differing(blocks, before_kv, [(35, 35), (36, 36)]) == []
        assert all(torch.equal(p, old) for p, old in zip(pages, before, strict=True))
        assert notes[-2:] == [(moved[0].key, True), (moved[1].key, False)]
    finally:
        backend.drain()
        mover.close()
        store.close()


# -- ordering: each scenario returns what went wrong -----------------------------------------
def store_after_forward(rig: Rig) -> list[int]:
    """A long forward writes generation 1; the store planned after it must hold it."""
    rig.write(range(BLOCKS), 0)
    rig.backend.drain()
    rig.backend.busy(0.05)
    rig.backend.forward(lambda: rig.write(range(12), 1))
    moved = transfers(0, 6)
    assert rig.store_on_thread(moved) == 6
    out = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
    bad = []
    for i, t in enumerate(moved):
        assert rig.store.get_into(t.key, out.numpy().data) is not None
        chunk = rig.paged.chunk_view(out)  # [L, bpc, H, kv, r, n, D]
        if any(not torch.all(chunk[:, j] == value(b, 1)) for j, b in enumerate(t.block_ids)):
            bad.append(i)
    return bad


def forward_after_inline_load(rig: Rig) -> list[int]:
    """Two chunks (the staging buffers: the host waits for none) load inline after vLLM work
    that ends late; a forward queued next must read them, not what the blocks held."""
    rig.write(range(BLOCKS), 2)
    moved = transfers(0, 2)
    assert rig.store_on_thread(moved) == 2
    rig.write(range(24, 28), 9)
    rig.backend.drain()
    late = rig.backend.late_event(0.05)
    assert rig.mover.load(moved_to(moved, 24), rig.spares, late, wait=False) == 2
    seen: list[torch.Tensor] = []
    rig.backend.forward(lambda: seen.extend(v[24:28].clone() for v in rig.paged.block_views))
    rig.backend.drain()
    rig.mover.release()
    return [b + 24 for b in range(4) if any(not torch.all(v[b] == value(b, 2)) for v in seen)]


def borrowed_slot_outlives_eviction(rig: Rig) -> list[int]:
    """RAM holds one chunk. Each step a chunk is stored, then loaded inline after vLLM work
    that ends late; the step ends (`release`) and the prefetch reads another chunk from disk,
    a promotion into RAM (a host write no stream orders). The loading chunk's slot must stay
    lent until its copy ran."""
    other = torch.empty(rig.chunk_bytes, dtype=torch.uint8, device=rig.backend.torch_device)
    rig.write(range(40, 42), 30)
    rig.paged.gather((40, 41), other)
    for i in range(4):  # other requests' chunks, on disk only
        assert rig.store.tiers[1].put(key(300 + i), other.cpu().numpy().data).ok
    for i in range(4):
        rig.write(range(2), 20 + i)
        assert rig.store_on_thread([ChunkTransfer(key(200 + i), (0, 1))]) == 1
        target = ChunkTransfer(key(200 + i), (24 + 2 * i, 25 + 2 * i))
        late = rig.backend.late_event(0.03)
        assert rig.mover.load([target], rig.spares, late, wait=False) == 1
        rig.mover.release()  # the step ends
        read = torch.empty(rig.chunk_bytes, dtype=torch.uint8)
        assert rig.store.get_into(key(300 + i), read.numpy().data) is not None  # prefetch
        # The copy runs; the next step's store finds the RAM slot free again.
        rig.backend.drain()
        rig.mover.release()
    return [b for b in range(24, 32) if any(not torch.all(v[b] == value(b % 2, 20 + (b - 24) // 2))
                                            for v in rig.paged.block_views)]


class LosesWaits:
    """A device whose stream waits on some streams are lost (the bugs the scenarios catch)."""

    def __init__(self, inner: Any, on_compute: bool) -> None:
        self._inner, self._on_compute = inner, on_compute

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def wait(self, stream: Any, event: Any) -> None:
        if (stream == self._inner.compute_stream()) != self._on_compute:
            self._inner.wait(stream, event)


class LateCopies:
    """A device whose copies into the device (the mover's "load copy" stream) start about
    `seconds` late, as behind a busy copy engine."""

    def __init__(self, inner: Any, cuda: bool, seconds: float) -> None:
        self._inner, self._late, self._cuda = inner, set[int](), cuda
        self._pause: Callable[[], None] = (
            (lambda: torch.cuda._sleep(int(seconds * SLEEP_CYCLES_PER_S))) if cuda
            else (lambda: time.sleep(seconds)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def new_stream(self, name: str = "") -> Any:
        stream = self._inner.new_stream(name)
        if name == "load copy":
            self._late.add(id(stream))
        return stream

    def run(self, stream: Any, work: Callable[[], Any]) -> None:
        if id(stream) in self._late:  # a kernel's time: the stand-in's sleeps on its stream
            (self._inner.run if self._cuda else self._inner.enqueue)(stream, self._pause)
        self._inner.run(stream, work)


SCENARIOS: dict[str, tuple[Callable[[Rig], list[int]], bool]] = {
    # scenario, and whether its wait is the compute stream's (else the mover's streams')
    "store_after_forward": (store_after_forward, False),
    "forward_after_inline_load": (forward_after_inline_load, True),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_mover_orders_its_copies_after_vllms_work_and_vllm_after_them(
        backend: Backend, rig_factory: Any, name: str) -> None:
    assert SCENARIOS[name][0](rig_factory()) == []


@pytest.mark.parametrize("name", SCENARIOS)
def test_without_the_wait_the_scenario_reads_the_wrong_bytes(backend: Backend,
                                                            rig_factory: Any, name: str) -> None:
    scenario, on_compute = SCENARIOS[name]
    backend.device = LosesWaits(backend.device, on_compute)
    assert scenario(rig_factory()) != []


def test_an_inline_loads_ram_slot_stays_lent_until_its_copy_ran(backend: Backend,
                                                                rig_factory: Any) -> None:
    backend.device = LateCopies(backend.device, backend.cuda, 0.03)
    assert borrowed_slot_outlives_eviction(rig_factory(ram_chunks=1)) == []


def test_a_slot_given_back_before_its_copy_ran_is_overwritten(
        backend: Backend, rig_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event answers "reached": the RAM slot is given back and reused by the promotion
    before the late copy reads it. On CUDA this also shows that the copy reads the pinned
    slot asynchronously (from pageable memory it would be staged at once, and pass). The
    copy into the device starts late (its DMA waits for nothing of vLLM's: it is made late).
    The stand-in also names the race: the slot changed between the copy's `run` and its
    turn on the stream."""
    stand_in = backend.device
    backend.device = LateCopies(backend.device, backend.cuda, 0.03)
    rig = rig_factory(ram_chunks=1)
    event_type = torch.cuda.Event if backend.cuda else StandInEvent
    monkeypatch.setattr(event_type, "query", lambda self: True)
    try:
        assert borrowed_slot_outlives_eviction(rig) != []
    finally:
        monkeypatch.undo()
    if not backend.cuda:
        assert any(isinstance(e, HostBufferRaced) for e in stand_in.take_errors())


def test_many_chunks_through_two_staging_buffers(backend: Backend, rig_factory: Any) -> None:
    """12 chunks (6x the staging buffers) inline and on a load thread at once: every byte
    lands, no buffer is used by two copies at once."""
    rig: Rig = rig_factory()
    rig.write(range(BLOCKS), 5)
    moved = transfers(0, 12)
    assert rig.store_on_thread(moved) == 12
    rig.write(range(24, 48), 9)
    targets = moved_to(moved, 24)
    thread_spares = spare_buffers(4, rig.chunk_bytes, backend.device.pinned)
    with ThreadPoolExecutor(1) as load_thread:
        other = load_thread.submit(rig.mover.load, targets[6:], thread_spares,
                                   rig.mover.mark(), True)
        assert rig.mover.load(targets[:6], rig.spares, wait=False) == 6
        assert other.result() == 6
    backend.drain()
    rig.mover.release()
    assert [b for b in range(24, 48) if any(not torch.all(v[b] == value(b - 24, 5))
                                            for v in rig.paged.block_views)] == []
