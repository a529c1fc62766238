"""Whether the machine stopped while a benchmark measured (`StallWatch`).

A small process of its own wakes every TICK_S and writes down each wake that came STALL_S or
more late: a stretch in which an ordinary process (nice 0, nothing to do but wake) could not
run. The kernel's scheduler gives a runnable process of a fairly weighted group a turn within
a few tens of milliseconds; a gap of STALL_S means that the machine itself stopped (a virtual
machine paused by its host), or that the process's group had a small share of the cores
(cgroups, and with Linux's autogroup, sessions: a group's share on a core follows where its
tasks' load lies). A request whose time spans such a gap measured that, not the code.

A process, not a thread: a thread of the bench would wait for its interpreter's lock and its
event loop, and report the bench's own pauses as the machine's. It writes to a file as it
goes (a line per stall, in `time.monotonic()` seconds, the same clock in every process of the
machine) and exits when its parent does.

Each stall says what went on through it (`Stall.cause`), from the watcher's own scheduler
statistics (/proc/self/schedstat: its time runnable on a run queue, `queued_s`) and the
machine's CPU times (/proc/stat: the cores' idle time, `idle_s`, and the host's steal time,
`steal_s`, where the host reports it):
  - "stopped": it was not runnable for most of it: its timer fired late, as when the whole
    machine stops;
  - "host": it was runnable while a core sat idle, which the guest's scheduler never allows:
    the host had taken the virtual CPUs (this project's VMs count no steal time);
  - "busy": it was runnable while both cores ran other work: its group's small share (above),
    or the host's preemption charged to the work it interrupted (not told apart without
    steal time).
Seen here (31st session): 22 stalls in 16 runs of `kvtier bench interference`, every one of
them "busy": with autogroup on, the bench's session (then the node, redis-server and the
proxy too) waited behind the vLLM server's, busy-polling on both cores, for up to 1.75 s.
Those now run in sessions of their own, and the runs since have had none (docs/
performance.md, "The machine's stalls, explained").

Primitives: `StallWatch` (`watching()`: a context manager), `Stall`, `TICK_S`, `STALL_S`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
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
    queued_s: float | None = None  # of it, the watcher runnable on a run queue
    idle_s: float | None = None  # the cores' idle time meanwhile, summed over them
    steal_s: float | None = None  # the time the host took from the cores, summed
    # (None: not known)

    @property
    def cause(self) -> str | None:
        """"stopped", "host" or "busy" (see the module docstring); None where not known."""
        if self.queued_s is None:
            return None
        if self.queued_s < self.seconds / 2:
            return "stopped"
        if self.idle_s is None:
            return None
        return "host" if self.idle_s >= self.seconds / 2 else "busy"

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

    def __init__(self, log: Path, tick_s: float = TICK_S, stall_s: float = STALL_S, *,
                 owns_folder: bool = False) -> None:
        """`owns_folder`: the log's folder is the watch's own, which the watcher removes if
        the process that started it ends without `stop()` (a bench killed)."""
        self._log = log
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(log), repr(tick_s), repr(stall_s),
             str(os.getpid()), str(int(owns_folder))],
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
    """A `StallWatch` for the block's time; its process and its file removed afterwards (by
    the watcher, if this process is killed: a kvtier-stalls-* stayed in the temp dir)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-stalls-") as directory:
        watch = StallWatch(Path(directory) / "stalls.log", tick_s, stall_s, owns_folder=True)
        try:
            yield watch
        finally:
            watch.stop()


def _parse(line: str) -> Stall | None:
    """A line of the log as a `Stall`; None for a line still being written (no end mark)."""
    fields = line.removesuffix(".").split()
    if not line.endswith(".") or len(fields) != 5:
        return None
    start, end, *counters = fields
    queued, idle, steal = (None if f == "-" else float(f) for f in counters)
    return Stall(float(start), float(end), queued, idle, steal)


class _Counters:
    """What the watcher reads at every tick, in seconds (None where the kernel does not say):
    its own time queued to run, the cores' idle time and the host's steal time. A few
    microseconds a read."""

    def __init__(self) -> None:
        self._schedstat = _open("/proc/self/schedstat")
        self._stat = _open("/proc/stat")
        self._tick_s = 1 / os.sysconf("SC_CLK_TCK")  # /proc/stat's unit (USER_HZ)

    def read(self) -> tuple[float | None, float | None, float | None]:
        # schedstat: "run wait slices", in ns; /proc/stat's first line: "cpu user nice system
        # idle iowait irq softirq steal ...", in USER_HZ
        wait = _fields(self._schedstat, (1,))
        cpu = _fields(self._stat, (4, 5, 8))
        return (None if wait is None else wait[0] * 1e-9,
                None if cpu is None else (cpu[0] + cpu[1]) * self._tick_s,
                None if cpu is None else cpu[2] * self._tick_s)


def _open(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _fields(fd: int | None, indexes: tuple[int, ...]) -> list[int] | None:
    """Integer fields of the first line of the file open at `fd`."""
    if fd is None:
        return None
    try:
        line = os.pread(fd, 512, 0).split(b"\n", 1)[0].split()
        return [int(line[i]) for i in indexes]
    except (OSError, IndexError, ValueError):
        return None


def _deltas(after: tuple[float | None, ...], before: tuple[float | None, ...]) -> str:
    return " ".join("-" if a is None or b is None else f"{a - b:.6f}"
                    for a, b in zip(after, before, strict=True))


def _watch(log: Path, tick_s: float, stall_s: float, parent: int, owns_folder: bool) -> None:
    """The watcher's loop (its own process): a line "start end queued idle steal." per late
    wake (see `Stall`; "-" where not known, the "." once the line is whole), while `parent`
    (its starter's pid, given: one gone before this process ran is not its parent any more)
    lives; then, with `owns_folder`, the log's folder removed (`stop()` ends this process
    first: its starter removes the folder then)."""
    try:
        _write_stalls(log, tick_s, stall_s, parent)
    finally:
        if owns_folder:
            shutil.rmtree(log.parent, ignore_errors=True)


def _write_stalls(log: Path, tick_s: float, stall_s: float, parent: int) -> None:
    counters = _Counters()
    with log.open("a") as out:
        last, read = time.monotonic(), counters.read()
        while os.getppid() == parent:
            time.sleep(tick_s)
            now, now_read = time.monotonic(), counters.read()
            if now - last - tick_s >= stall_s:
                out.write(f"{last + tick_s:.6f} {now:.6f} {_deltas(now_read, read)}.\n")
                out.flush()
            last, read = now, now_read


if __name__ == "__main__":
    _watch(Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]),
           sys.argv[5] == "1")
