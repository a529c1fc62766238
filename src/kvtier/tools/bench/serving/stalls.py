"""Whether the machine stopped while a benchmark measured (`StallWatch`).

A small process of its own wakes every TICK_S and writes down each wake that came STALL_S or
more late: a stretch in which an ordinary process (nice 0, nothing to do but wake) could not
run. On a machine that is merely busy the kernel's scheduler gives any runnable process a turn
within a few tens of milliseconds; a gap of STALL_S means that the machine itself stopped (a
virtual machine paused by its host, memory reclaim) or was held by work above the process's
priority. Every process of the benchmark, kvtier's among them, stopped as well: a request whose
time spans such a gap measured the machine, not the code (docs/performance.md, "A node's first
load": this project's VMs stop for 1-3 s at times, no steal time counted).

A process, not a thread: a thread of the bench would wait for its interpreter's lock and its
event loop, and report the bench's own pauses as the machine's. It writes to a file as it
goes (a line per stall, in `time.monotonic()` seconds, the same clock in every process of the
machine) and exits when its parent does.

Each stall says what the watcher did through it, from its own scheduler statistics
(/proc/self/schedstat): `queued_s`, the time it spent runnable on a run queue. Near the whole
stall: it woke on time and other work held both cores (the kernel's scheduler, a process of
higher priority, the host's preemption of a vCPU, counted as `steal_s` where the host reports
it); near 0: its timer itself fired late, as when the whole machine stops.

Primitives: `StallWatch` (`watching()`: a context manager), `Stall`, `TICK_S`, `STALL_S`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

TICK_S = 0.01  # the watcher wakes this often
STALL_S = 0.1  # a wake this late (past its tick) is a stall


@dataclass(frozen=True, slots=True)
class Stall:
    """A stretch in which the watcher could not run, in `time.monotonic()` seconds."""

    start_s: float  # when it should have woken
    end_s: float  # when it woke
    queued_s: float | None = None  # of it, runnable on a run queue (None: not known)
    steal_s: float | None = None  # the vCPUs' time taken by the host meanwhile, all of them

    @property
    def held(self) -> bool | None:
        """Whether other work held the cores (the watcher queued for most of the stall), not
        the machine stopped; None where not known."""
        return None if self.queued_s is None else self.queued_s >= self.seconds / 2

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    def overlaps(self, start_s: float, end_s: float) -> bool:
        return self.start_s < end_s and start_s < self.end_s

    def shifted(self, origin_s: float) -> Stall:
        """The same stall in seconds since `origin_s` (a benchmark phase's start)."""
        return replace(self, start_s=self.start_s - origin_s, end_s=self.end_s - origin_s)


class StallWatch:
    """The watcher process and what it wrote down (see the module docstring)."""

    def __init__(self, log: Path, tick_s: float = TICK_S, stall_s: float = STALL_S) -> None:
        self._log = log
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(log), repr(tick_s), repr(stall_s),
             str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def stalls(self, start_s: float = -float("inf"), end_s: float = float("inf")
               ) -> list[Stall]:
        """The stalls seen so far that overlap [start_s, end_s] (`time.monotonic()`)."""
        try:
            lines = self._log.read_text().splitlines()
        except FileNotFoundError:  # the watcher has not started writing yet
            return []
        stalls = []
        for line in lines:
            stall = _parse(line)
            if stall is not None and stall.overlaps(start_s, end_s):
                stalls.append(stall)
        return stalls

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


@contextlib.contextmanager
def watching(tick_s: float = TICK_S, stall_s: float = STALL_S) -> Iterator[StallWatch]:
    """A `StallWatch` for the block's time; its process and its file removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvtier-stalls-") as directory:
        watch = StallWatch(Path(directory) / "stalls.log", tick_s, stall_s)
        try:
            yield watch
        finally:
            watch.stop()


def _parse(line: str) -> Stall | None:
    """A line of the log as a `Stall`; None for a line still being written (no end mark)."""
    fields = line.removesuffix(".").split()
    if not line.endswith(".") or len(fields) != 4:
        return None
    start, end, queued, steal = fields
    return Stall(float(start), float(end), _seconds(queued), _seconds(steal))


def _seconds(field: str) -> float | None:
    return None if field == "-" else float(field)


class _Counters:
    """What the watcher reads at every tick: its own time queued to run and the machine's
    steal time, in seconds (None where the kernel does not say). A few microseconds a read."""

    def __init__(self) -> None:
        self._fds = {name: _open(path) for name, path in
                     (("queued", "/proc/self/schedstat"), ("steal", "/proc/stat"))}

    def read(self) -> tuple[float | None, float | None]:
        return self._field("queued", 0, 1, 1e-9), self._field("steal", 0, 8, 0.01)

    def _field(self, name: str, line: int, index: int, scale: float) -> float | None:
        fd = self._fds[name]
        if fd is None:
            return None
        try:  # steal: /proc/stat's first line "cpu user nice system idle iowait irq softirq
            # steal ...", in USER_HZ (100 on Linux); queued: schedstat's "run wait slices", ns
            return int(os.pread(fd, 512, 0).split(b"\n")[line].split()[index]) * scale
        except (OSError, IndexError, ValueError):
            return None


def _open(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _delta(after: float | None, before: float | None) -> str:
    return "-" if after is None or before is None else f"{after - before:.6f}"


def _watch(log: Path, tick_s: float, stall_s: float, parent: int) -> None:
    """The watcher's loop (its own process): a line "start end queued steal." per late wake
    (see `Stall`; "-" where not known, the "." once the line is whole), while `parent` (its
    starter's pid, given: one gone before this process ran is not its parent any more)
    lives."""
    counters = _Counters()
    with log.open("a") as out:
        last = time.monotonic()
        queued, steal = counters.read()
        while os.getppid() == parent:
            time.sleep(tick_s)
            now = time.monotonic()
            queued_now, steal_now = counters.read()
            if now - last - tick_s >= stall_s:
                out.write(f"{last + tick_s:.6f} {now:.6f} {_delta(queued_now, queued)} "
                          f"{_delta(steal_now, steal)}.\n")
                out.flush()
            last, queued, steal = now, queued_now, steal_now


if __name__ == "__main__":
    _watch(Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
