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
chunk). `stalls` counts what would stall a GPU's host (below): "sync", a `run` whose work
waited for its stream, and "pageable", a copy between device memory and host memory not from
`pinned`.

A piece of work queued with `run` is split as CUDA splits it (standinwork.py): its host side
(Python, index building, views, allocations) runs at `run` on the caller's thread, and only its
tensor ops run late on the stream; so a closure that reads Python state set after `run`
returns sees it as a GPU's launch would (not at all). Host memory (memory torch did not
allocate: the store's slots and spares, numpy's index arrays, `pinned`) that a queued op reads
or writes is snapshotted at `run` (a buffer it overwrites is poisoned first), and a buffer
the host changed before the stream got to the op is `HostBufferRaced`, raised at `close`: on
a GPU the DMA would have moved the wrong bytes. An op whose value the host needs (`.item()`,
a data-dependent shape) is a host sync, as on CUDA, counted in `stalls["sync"]` (a GPU's
stall); a copy between device memory and host memory that is not the device's `pinned` is
counted in `stalls["pageable"]` (a GPU's driver stages it, synchronously). `enqueue` (and
`forward`) queue a closure whole instead: a test's stand-in for a kernel (a sleep, a gate,
vLLM's forward) that runs when the stream gets to it.

What it still cannot show: a queued op keeps the host tensors it reads alive until it runs,
where a GPU's DMA keeps nothing alive: a buffer freed after `run` (its last tensor gone, its
memory given back to a pool or unmapped) is read intact here and freed there; the movers keep
each host buffer lent (`Loan.release_after`) or mapped (node/dma.py) until the work's event,
and torch's pinned memory is kept by its caching allocator until the copy is done. A snapshot
compares bytes: a buffer rewritten with the same bytes is not a race here (nor wrong there).
`pinned` is not page-locked: a copy a GPU would stage is counted, not slowed (`kvtier bench
copy` measures that on a GPU). A factory op inside `run` (`torch.zeros`) fills at `run`,
where CUDA fills on the stream.

Primitives: `StandInDevice`, `StandInEvent`, `StandInStream`, `POISON` (standinwork.py's).
"""

from __future__ import annotations

import mmap
import queue
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from kvtier.testing.standinwork import POISON, DeferredOp, Recorder, warm_up

__all__ = ["POISON", "StandInDevice", "StandInEvent", "StandInStream"]


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


class _Ops:
    """The tensor ops one `run` recorded, run in order when their stream gets to them."""

    def __init__(self, ops: list[DeferredOp]) -> None:
        self._ops = ops

    def __call__(self) -> None:
        errors = []
        for op in self._ops:  # each runs (and ends its host accesses) even after an error
            try:
                op()
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]


class StandInDevice:
    """`kvtier.integrations.vllm.device.Device` on the CPU (see the module docstring)."""

    name = "stand-in device (CPU threads)"

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002,
                 delays: dict[str, float] | None = None, split_work: bool = True) -> None:
        """`split_work`: `run` splits its work as CUDA does and checks the host buffers it
        touches (see the module docstring); False: it queues the work whole, to run late
        (`kvtier bench mover`: its figures are the mover's host work, not the stand-in's
        recording of tensor ops and its snapshots, which cost more than CUDA's launches)."""
        self._rng = random.Random(seed)
        self._delays = delays or {}
        self._max_delay_s = max_delay_s
        self._split_work = split_work
        if split_work:
            warm_up()
        self._lock = threading.Lock()
        self.streams: list[StandInStream] = []
        self.compute = self._stream("compute")
        self.waits = 0  # stream waits queued (a test can see that the mover orders its work)
        self.calls: Counter[str] = Counter()  # calls made of it, by kind
        self.stalls: Counter[str] = Counter()  # host syncs and pageable copies in `run`s
        # Host spans queued ops read and write, with how many ops each (standinwork.py).
        self._pending_lock = threading.Lock()
        self._pending: dict[bool, Counter[tuple[int, int]]] = {False: Counter(), True: Counter()}
        self._pinned: set[tuple[int, int]] = set()  # spans of live `pinned` allocations

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
        """Run `work`'s host side now and queue its tensor ops on `stream` (see the module
        docstring); an exception of the host side is raised here, as CUDA's launch errors."""
        self.calls["run"] += 1
        if not self._split_work:
            stream.put(work)
            return
        recorder = Recorder(self, lambda ops: stream.put(_Ops(ops)),
                            lambda: _reach(self._marked(stream)))
        try:
            with recorder:
                work()
        finally:
            recorder.flush()
            if recorder.syncs:
                self.stalls["sync"] += recorder.syncs
            if recorder.pageable:
                self.stalls["pageable"] += recorder.pageable

    def enqueue(self, stream: Any, work: Callable[[], Any]) -> None:
        """Queue `work` whole on `stream`: it runs when the stream gets there (a test's
        kernel: a sleep, a gate, a check of the bytes at that point)."""
        stream.put(work)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def pinned(self, nbytes: int) -> torch.Tensor:
        """Host memory (not torch's: a mapping), filled with the poison byte, known as
        pinned until it is freed (copies from it are not `stalls["pageable"]`)."""
        tensor = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]
        start = tensor.data_ptr()
        with self._pending_lock:
            self._pinned.add((start, start + nbytes))
        weakref.finalize(tensor, self._unpin, (start, start + nbytes)).atexit = False
        return tensor.fill_(POISON)

    def _unpin(self, where: tuple[int, int]) -> None:
        with self._pending_lock:
            self._pinned.discard(where)

    def is_pinned(self, where: tuple[int, int]) -> bool:
        """Whether `where` lies in one of the device's `pinned` allocations."""
        start, end = where
        with self._pending_lock:
            return any(s <= start and end <= e for s, e in self._pinned)

    def forward(self, work: Callable[[], Any]) -> None:
        """Queue a piece of vLLM's forward on the compute stream (a test's model), whole."""
        self.compute.put(work)

    # -- the host spans queued ops touch (standinwork.Pending) -------------------------------
    def note(self, spans: list[tuple[int, int]], writes: bool, add: bool) -> None:
        """Count (`add`) or uncount queued ops' reads or writes of host `spans`."""
        with self._pending_lock:
            counts = self._pending[writes]
            for where in spans:
                counts[where] += 1 if add else -1
                if counts[where] <= 0:
                    del counts[where]

    def overlaps(self, where: tuple[int, int], writes_only: bool) -> bool:
        """Whether a queued op writes (or, unless `writes_only`, reads) bytes of `where`."""
        start, end = where
        with self._pending_lock:
            kinds = [self._pending[True]] + ([] if writes_only else [self._pending[False]])
            return any(s < end and start < e for counts in kinds for s, e in counts)

    def _marked(self, stream: StandInStream) -> threading.Event:
        """A flag its stream sets when it gets there (not a `record`: not one of `calls`)."""
        reached = threading.Event()
        stream.put(reached.set)
        return reached

    def drain(self) -> None:
        """Wait until every stream has run what is queued on it so far."""
        for stream in list(self.streams):
            _reach(self._marked(stream))

    def take_errors(self) -> list[BaseException]:
        """What the streams' work raised so far, oldest first per stream (then forgotten: a
        test that expects an error takes it, and `close` raises the rest)."""
        taken = []
        for stream in list(self.streams):
            taken += stream.errors
            stream.errors = []
        return taken

    def close(self) -> None:
        """Stop the streams; raise what any of their work raised."""
        for stream in self.streams:
            stream.close()
        errors = [e for s in self.streams for e in s.errors]
        if errors:
            raise errors[0]
