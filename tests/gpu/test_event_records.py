"""An event's record is CUDA's on both devices: the stand-in's must not order work that a
GPU leaves unordered, or a mover bug would pass CI and corrupt KV on the first GPU.

CUDA waits (`cudaStreamWaitEvent`) for the record an event had when the wait was queued: a
wait queued before the record waits for nothing, and one queued before a second record waits
for the first only; a record made again un-reaches the event until its stream gets there.
Before, the stand-in looked at the event when its stream reached the wait (a wait queued too
early waited for a record made after it) and kept one flag for all records (a record made
again was reached at once). Each body runs on a GPU too (`backend`), where it checks that
CUDA behaves as these tests say."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from gpurig import SLEEP_CYCLES_PER_S, Backend

from kvtier.integrations.vllm.worker.device import Event

HELD_S = 3.0  # how long a GPU's held stream sleeps (the stand-in's waits for its release)


def _hold(backend: Backend, stream: object) -> Callable[[], None]:
    """Queue work on `stream` that runs until the returned call (on a GPU: for HELD_S)."""
    if backend.cuda:
        backend.device.run(stream, lambda: torch.cuda._sleep(int(HELD_S * SLEEP_CYCLES_PER_S)))
        return lambda: None
    gate = threading.Event()
    backend.device.enqueue(stream, lambda: gate.wait(timeout=60))  # a kernel until release
    return gate.set


def _reached_within(event: Event, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _mark(backend: Backend, stream: object) -> Event:
    event: Event = backend.device.new_event()
    backend.device.record(event, stream)
    return event


def test_a_wait_queued_before_the_events_record_waits_for_nothing(backend: Backend) -> None:
    device = backend.device
    waiting, slow = device.new_stream("waiting"), device.new_stream("slow")
    event = device.new_event()
    device.wait(waiting, event)  # not recorded yet: nothing to wait for
    release = _hold(backend, slow)
    try:
        device.record(event, slow)
        after = _mark(backend, waiting)
        # a GPU's hold ends by itself after HELD_S; the stand-in's only at release()
        assert _reached_within(after, HELD_S / 2 if backend.cuda else 30.0)
        assert not event.query()
    finally:
        release()
    event.synchronize()


def test_an_event_recorded_again_is_not_reached_until_its_stream_gets_there(
        backend: Backend) -> None:
    device = backend.device
    fast, slow = device.new_stream("fast"), device.new_stream("slow")
    event = _mark(backend, fast)
    event.synchronize()
    assert event.query()
    release = _hold(backend, slow)
    try:
        device.record(event, slow)
        assert not event.query()
    finally:
        release()
    event.synchronize()
    assert event.query()


def test_a_wait_keeps_the_record_made_before_it(backend: Backend) -> None:
    device = backend.device
    waiting, fast, slow = (device.new_stream(n) for n in ("waiting", "fast", "slow"))
    event = device.new_event()
    release = _hold(backend, slow)
    try:
        device.record(event, slow)
        device.wait(waiting, event)  # for the slow stream's record
        after = _mark(backend, waiting)
        device.record(event, fast)  # a record made after the wait: not the one waited for
        event.synchronize()
        assert not _reached_within(after, 0.2)
    finally:
        release()
    after.synchronize()
