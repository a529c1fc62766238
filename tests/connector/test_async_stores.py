"""Asynchronous stores on the worker (issue 13): a step's gathers run on the store thread while
the engine goes on, and no block is handed back to vLLM while a gather may still read it.

Pure torch on CPU tensors shaped like vLLM's CPU backend and a real memory (and disk) tier; no
engine (tests/engine/test_async_stores_e2e.py drives real vLLM). A gather is held at a gate
(fault injection: the store thread made slow) so that each case decides what runs while it is
in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tierkit import key

from kvtier.integrations.vllm.messages import ChunkTransfer, KVTierMetadata
from kvtier.integrations.vllm.worker.connector_worker import ConnectorWorker, PagedKV
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

LAYERS, BLOCKS, HEADS, BS, DIM = 2, 8, 2, 32, 16
TOKENS_PER_CHUNK = 64  # two blocks


class Gate:
    """Holds every gather of the store thread until opened (the store thread made slow)."""

    def __init__(self, paged: PagedKV) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        gather = paged.gather

        def held_gather(*args: object, **kwargs: object) -> None:
            if threading.current_thread().name.startswith("kvtier-store"):
                self.entered.set()
                assert self.opened.wait(10)
            gather(*args, **kwargs)  # type: ignore[arg-type]

        paged.gather = held_gather  # type: ignore[method-assign]

    def open_after(self, seconds: float) -> None:
        threading.Timer(seconds, self.opened.set).start()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[ConnectorWorker, dict[str, torch.Tensor], Gate]]:
    gen = torch.Generator().manual_seed(7)
    kv = {f"model.layers.{i}.self_attn.attn":
          torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=gen).to(torch.bfloat16)
          for i in range(LAYERS)}
    paged = PagedKV(kv, BS)
    layout = paged.layout(TOKENS_PER_CHUNK)
    tiers = [{"kind": "memory", "capacity": "1MiB"},
             {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"}]
    w = ConnectorWorker(paged, layout, open_store(StoreConfig.parse({"tiers": tiers}), layout))
    gate = Gate(paged)
    yield w, kv, gate
    gate.opened.set()
    w.close(flush_timeout_s=5)


def stores(*chunks: tuple[int, tuple[int, ...]]) -> KVTierMetadata:
    return KVTierMetadata(stores=[ChunkTransfer(key=key(i), block_ids=blocks)
                                  for i, blocks in chunks], stores_async=True)


def timed(fn: Callable[[], object]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def blocks_of(kv: dict[str, torch.Tensor], blocks: tuple[int, ...]) -> list[torch.Tensor]:
    return [t[list(blocks)].clone() for t in kv.values()]


def loaded_back(w: ConnectorWorker, kv: dict[str, torch.Tensor], i: int) -> list[torch.Tensor]:
    """Chunk `i` loaded from the store into blocks 6 and 7, as they then hold it."""
    w.load(KVTierMetadata(loads={"r": [ChunkTransfer(key=key(i), block_ids=(6, 7))]}))
    return blocks_of(kv, (6, 7))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timing
def test_a_steps_stores_run_off_the_step_and_are_reported_by_the_next_steps_end(setup) -> None:  # type: ignore[no-untyped-def]
    w, kv, gate = setup
    original = blocks_of(kv, (0, 1))
    # Step 1: the store is handed over; the step returns while the gather is held.
    assert timed(lambda: w.store(stores((1, (0, 1))))) < 1.0
    assert gate.entered.wait(5)
    assert w.finish_step(set()) == set()  # step 1's own job is not waited for
    assert w.take_report() is None  # nor reported
    # Step 2 ends: step 1's job is joined (waited for: it is still held) and reported.
    gate.open_after(0.3)
    assert timed(lambda: w.finish_step(set())) >= 0.25
    report = w.take_report()
    assert report is not None and report.stored == {key(1)}
    assert same(loaded_back(w, kv, 1), original)


@pytest.mark.parametrize("wait", [True, False], ids=["preemption-waits", "control-no-wait"])
def test_preempted_blocks_are_read_before_they_can_be_overwritten(setup, wait: bool) -> None:  # type: ignore[no-untyped-def]
    """A preemption (vLLM's handle_preemptions, before the forward that may reuse the blocks)
    waits for the gather, then the forward overwrites the blocks. The control skips the wait:
    the block is stored wrong, so the hazard is real and the case can fail."""
    w, kv, gate = setup
    original = blocks_of(kv, (2, 3))
    w.store(stores((2, (2, 3))))
    assert gate.entered.wait(5)
    if wait:
        gate.open_after(0.3)
        assert timed(w.finish_stores) >= 0.25
    for t in kv.values():
        t[[2, 3]] = 0
    gate.opened.set()
    w.finish_stores()
    assert same(loaded_back(w, kv, 2), original) is wait


def test_held_requests_are_reported_at_the_end_of_the_next_step(setup) -> None:  # type: ignore[no-untyped-def]
    """A request that ended in the step that stored it is held (vLLM keeps its blocks); the
    next plan names it, and that step's end reports it with its stores done."""
    w, _, gate = setup
    w.store(stores((4, (0, 1))))
    assert w.finish_step(set()) == set()
    gate.open_after(0.2)
    assert w.finish_step({"done-req"}) == {"done-req"}  # waited for the gather first
    report = w.take_report()
    assert report is not None and report.stored == {key(4)}


def test_a_store_that_raises_is_a_miss_and_the_engine_goes_on(setup) -> None:  # type: ignore[no-untyped-def]
    w, _, gate = setup
    gate.opened.set()
    w.store(stores((5, (0, 1)), (6, (99, 100))))  # block 99 does not exist: the gather raises
    w.finish_stores()
    report = w.take_report()
    assert report is not None and report.stored == {key(5)}


def test_close_finishes_the_stores_in_flight_down_to_the_disk(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w, _, gate = setup
    w.store(stores((7, (0, 1))))
    assert gate.entered.wait(5)
    gate.open_after(0.3)
    w.close(flush_timeout_s=5)  # the engine shuts down with a store in flight
    assert len(list((tmp_path / "disk").rglob("*.kvc"))) == 1


def test_sync_stores_are_done_and_reported_in_their_step(setup) -> None:  # type: ignore[no-untyped-def]
    w, _, _ = setup
    w.store(KVTierMetadata(stores=[ChunkTransfer(key=key(8), block_ids=(0, 1))]))
    report = w.take_report()
    assert report is not None and report.stored == {key(8)}
