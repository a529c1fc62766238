"""A CPU stand-in for a GPU under kvtier's stream mover (integrations/vllm/worker/streams.py): CI's
device (tests/connector/test_stream_mover.py) and `kvtier bench mover`'s.

It keeps CUDA's ordering model and makes every breach of it visible: each stream is a thread
that runs its queued work in order, each piece after a random delay (seeded: between half
the stream's maximum and its maximum), so work runs
late and streams overtake each other; an event is a flag its stream sets when it reaches it;
`wait` queues a wait for the flag on the stream. As CUDA's, an event's record is the one
made last when it is used: `wait` and `synchronize` wait for the record made before the call
(none: nothing to wait for, even if the event is recorded before the stream gets there), and
a record made again un-reaches the event until its stream gets to it. "Device memory" is
host memory, filled with a poison byte when allocated. So a copy that reads a host buffer
after its borrow ended, a gather that runs before the forward that writes its blocks, or a
forward that reads blocks before their load has run, reads the wrong bytes, and the tests
that check the bytes fail.

`delays` maps a stream's name ("compute", or the name the mover gives it: "load", "load copy",
"store", "store copy") to its maximum delay in seconds (default: the delay of its first word's
stream, "load" for "load copy", else `max_delay_s`), so a test can make one stream slow on
purpose. Each event remembers the stream it was recorded on (a test's device can tell which
wait is which). `calls` counts the calls made of it by kind ("event", "record", "wait",
"run"): on a GPU each is a CUDA call of the host's (`kvtier bench mover` reports them a
chunk).

What it cannot show, and the movers keep to by construction: a queued piece of work is a
Python closure run whole when its stream gets to it, where CUDA runs its host side (the
launches, the index uploads) at `run` and only the kernels and DMAs later. So a closure that
reads Python state set after `run` returns would pass here and not on a GPU, and a closure
keeps the host tensors it names alive here, where a GPU's DMA keeps nothing alive (a buffer
freed after `run` is read freed): the movers build every closure's inputs before `run`, and
keep each host buffer lent (`Loan.release_after`) or mapped (node/dma.py) until the work's
event. `pinned` is pageable memory: on a GPU a copy from pageable memory is correct, staged
by the driver, and slower (`kvtier bench copy` measures it there, not here).

Primitives: `StandInDevice`, `StandInEvent`, `StandInStream`, `POISON`.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

POISON = 0xA5


class StandInEvent:
    """An event: reached when its stream has run everything queued before its last `record`."""

    def __init__(self) -> None:
        # The flag of its last record, set when its stream gets there; None: never recorded.
        # A new flag each record (CUDA's re-record): a wait queued before keeps the old one.
        self._reached: threading.Event | None = None
        self.stream: StandInStream | None = None  # where it was last recorded

    def query(self) -> bool:
        return self._reached is None or self._reached.is_set()

    def synchronize(self) -> None:
        _reach(self._reached)


def _reach(reached: threading.Event | None) -> None:
    """Wait for a record's flag (None: never recorded, nothing to wait for)."""
    if reached is not None and not reached.wait(timeout=30):
        raise TimeoutError("stand-in event never reached (a stream is stuck)")


class StandInStream:
    """A thread running queued work in order, each piece after a random delay."""

    def __init__(self, name: str, max_delay_s: float, rng: random.Random) -> None:
        self.name = name
        self._max_delay_s = max_delay_s
        self._rng = rng
        self._work: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=f"standin-{name}", daemon=True)
        self._thread.start()

    def put(self, work: Callable[[], Any]) -> None:
        self._work.put(work)

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            time.sleep(self._rng.uniform(self._max_delay_s / 2, self._max_delay_s))
            try:
                work()
            except BaseException as error:  # surfaced by StandInDevice.close
                self.errors.append(error)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=30)


class StandInDevice:
    """`kvtier.integrations.vllm.device.Device` on the CPU (see the module docstring)."""

    name = "stand-in device (CPU threads)"

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002,
                 delays: dict[str, float] | None = None) -> None:
        self._rng = random.Random(seed)
        self._delays = delays or {}
        self._max_delay_s = max_delay_s
        self._lock = threading.Lock()
        self.streams: list[StandInStream] = []
        self.compute = self._stream("compute")
        self.waits = 0  # stream waits queued (a test can see that the mover orders its work)
        self.calls: Counter[str] = Counter()  # calls made of it, by kind

    def _stream(self, name: str) -> StandInStream:
        with self._lock:
            # "load copy" is delayed as "load" unless it is named on its own.
            delay = self._delays.get(name, self._delays.get(name.split(" ")[0],
                                                            self._max_delay_s))
            stream = StandInStream(name, delay, random.Random(self._rng.random()))
            self.streams.append(stream)
        return stream

    def new_stream(self, name: str = "") -> StandInStream:
        return self._stream(name or "other")

    def compute_stream(self) -> StandInStream:
        return self.compute

    def new_event(self) -> StandInEvent:
        self.calls["event"] += 1
        return StandInEvent()

    def record(self, event: Any, stream: Any) -> None:
        self.calls["record"] += 1
        event._reached = reached = threading.Event()
        event.stream = stream
        stream.put(reached.set)

    def wait(self, stream: Any, event: Any) -> None:
        self.waits += 1
        self.calls["wait"] += 1
        # The record made before this call, as CUDA's cudaStreamWaitEvent: one made after
        # it (a wait queued too early) is not waited for.
        reached = event._reached
        stream.put(lambda: _reach(reached))

    def run(self, stream: Any, work: Callable[[], Any]) -> None:
        self.calls["run"] += 1
        stream.put(work)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def forward(self, work: Callable[[], Any]) -> None:
        """Queue a piece of vLLM's forward on the compute stream (a test's model)."""
        self.compute.put(work)

    def drain(self) -> None:
        """Wait until every stream has run what is queued on it so far."""
        for stream in list(self.streams):
            reached = threading.Event()  # not through `record`: not one of `calls`
            stream.put(reached.set)
            _reach(reached)

    def close(self) -> None:
        """Stop the streams; raise what any of their work raised."""
        for stream in self.streams:
            stream.close()
        errors = [e for s in self.streams for e in s.errors]
        if errors:
            raise errors[0]
