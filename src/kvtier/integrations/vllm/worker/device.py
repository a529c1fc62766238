"""The device under the connector's stream mover (streams.py): what it needs of a GPU — streams,
events, buffers — as a small protocol with one real implementation, `CudaDevice`.

The protocol is CUDA's ordering model and nothing more: work (`run`) is queued on a stream and
runs in order on that stream, asynchronously to the host; an event recorded on a stream is
reached when the stream's earlier work has run; a stream can be made to wait for an event, and
the host can wait for one or ask whether it was reached. The compute stream is the one vLLM's
forward runs on (`compute_stream`). Because the mover only orders its copies through this
protocol, the same mover code runs in CI against a CPU stand-in (kvtier/testing/standin.py:
a `run`'s host side at once and its copies later on threads, events as flags, random delays),
where every ordering bug a GPU would show — a slot reused before its copy ended, a block
freed before its gather, a forward started before its load, work that reads Python state
set after its `run` — corrupts data a test checks or is named (`HostBufferRaced`).

Primitives: `Device`, `Stream`, `Event`, `CudaDevice`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class Event(Protocol):
    """A point in a stream's work."""

    def query(self) -> bool:
        """Whether the stream has reached it (True when never recorded, like CUDA's)."""
        ...

    def synchronize(self) -> None:
        """Wait on the calling thread until the stream has reached it."""
        ...


class Stream(Protocol):
    """An in-order queue of device work (opaque to the mover)."""


class Device(Protocol):
    """Streams, events and buffers of one device (see the module docstring)."""

    name: str

    def new_stream(self, name: str = "") -> Stream:
        """A stream of its own; `name` says what it carries ("load", "load copy", ...)."""
        ...

    def compute_stream(self) -> Stream:
        """The stream the calling thread's kernels go to (vLLM's forward, on its thread)."""
        ...

    def new_event(self) -> Event: ...

    def record(self, event: Event, stream: Stream) -> None:
        """Mark the end of the work queued on `stream` so far."""
        ...

    def wait(self, stream: Stream, event: Event) -> None:
        """Make `stream`'s later work wait until `event` is reached (the host goes on)."""
        ...

    def run(self, stream: Stream, work: Callable[[], Any]) -> None:
        """Queue `work` (tensor ops: copies, gathers, scatters) on `stream`."""
        ...

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer on the device."""
        ...

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer the device copies to and from asynchronously."""
        ...


class CudaDevice:
    """`Device` over torch.cuda: streams and events are CUDA's; `run` enqueues the work's
    kernels and copies on the stream (they run when the GPU reaches them)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.name = f"{device} ({torch.cuda.get_device_name(device)})"

    def new_stream(self, name: str = "") -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: Event, stream: Stream) -> None:
        assert isinstance(event, torch.cuda.Event) and isinstance(stream, torch.cuda.Stream)
        event.record(stream)

    def wait(self, stream: Stream, event: Event) -> None:
        assert isinstance(event, torch.cuda.Event) and isinstance(stream, torch.cuda.Stream)
        stream.wait_event(event)

    def run(self, stream: Stream, work: Callable[[], Any]) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        # A thread of kvtier's (load, store) may not have vLLM's rank's device current: it is
        # made current for the work. Not through torch.cuda.device / torch.cuda.stream: their
        # device lookups were a third of a 2 MiB chunk's store in a profile on an H200.
        previous_device = torch.cuda.current_device()
        if previous_device != self.index:
            torch.cuda.set_device(self.index)
        previous = torch.cuda.current_stream(self.index)
        torch.cuda.set_stream(stream)
        try:
            work()
        finally:
            torch.cuda.set_stream(previous)
            if previous_device != self.index:
                torch.cuda.set_device(previous_device)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
