"""The store's copies of chunks for the tiers below RAM: page-aligned, and reused.

On a miss the store copies each chunk it stores for the write-behind (the caller's buffer, or
the memory tier's slot, may be reused or evicted before the lower tiers are written). The copy
is page-aligned, so that a disk tier writes it with O_DIRECT as it is (a `bytes` copy starts
32 bytes into its object: the tier would copy it again into its staging buffer). Its memory
is reused: a fresh 2 MiB allocation comes back from the kernel as new pages often enough to
cost ~190 page faults a chunk on a VM (docs/performance.md, "A miss's store to disk").

A buffer goes back to the pool only when the last view of its copy is gone (a
`weakref.finalize` on the copy's array, which every view and array made from the copy keeps
alive), so a copy is never overwritten while a writer still reads it. The pool keeps at most
KEEP_BYTES of idle buffers (and at least MIN_KEPT of a size); the rest are freed.

Primitives: `CopyPool`.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

KEEP_BYTES = 64 << 20  # idle buffers the pool keeps, per size
MIN_KEPT = 2  # idle buffers kept of a size, however large


class CopyPool:
    """Page-aligned chunk copies whose buffers are reused (any thread)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self._keep_bytes = keep_bytes
        self._idle: dict[int, list[np.ndarray]] = {}  # size -> idle buffers
        # Reentrant: a copy's finalizer may run on a thread inside `copy` (a GC pass).
        self._lock = threading.RLock()

    def copy(self, data: memoryview) -> memoryview:
        """A page-aligned copy of `data`, read-write, valid while any view of it lives."""
        size = len(data)
        with self._lock:
            idle = self._idle.get(size)
            buffer = idle.pop() if idle else None
        if buffer is None:
            buffer = np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=np.uint8)[:size]
        copy = buffer[:]  # an array of its own over the buffer: its lifetime is the copy's
        copy[:] = np.frombuffer(data, dtype=np.uint8)
        weakref.finalize(copy, self._give_back, buffer).atexit = False
        return copy.data

    def idle(self, size: int) -> int:
        """Idle buffers of `size` bytes (for tests and metrics)."""
        with self._lock:
            return len(self._idle.get(size, ()))

    def _give_back(self, buffer: np.ndarray) -> None:
        size = len(buffer)
        with self._lock:
            idle = self._idle.setdefault(size, [])
            if len(idle) < max(MIN_KEPT, self._keep_bytes // max(size, 1)):
                idle.append(buffer)
