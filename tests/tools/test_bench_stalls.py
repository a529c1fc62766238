"""The benchmarks' stall watcher (`kvtier.tools.bench.serving.stalls`), a real process: stopped
with SIGSTOP for a while, it sees the stop as a machine stall would look to it (it could not
run, and was not waiting for a core); kept off its core by a real-time spinner, it sees a stall
held by other work (it queued through it); it ignores what is not a stall, keeps half-written
lines out, and does not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from kvtier.tools.bench.serving.stalls import STALL_S, TICK_S, Stall, StallWatch, watching

T = TypeVar("T")
STOP_S = 0.4


def _wait_for(predicate: Callable[[], T], what: str, timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout_s} s")
        time.sleep(0.02)
    return value


def test_a_stopped_stretch_is_a_stall_that_covers_it() -> None:
    with watching() as watch:
        _wait_for(watch._log.exists, "watcher's log")  # it runs its loop
        stopped_s = time.monotonic()
        os.kill(watch._proc.pid, signal.SIGSTOP)
        time.sleep(STOP_S)
        resumed_s = time.monotonic()
        os.kill(watch._proc.pid, signal.SIGCONT)
        stalls = _wait_for(lambda: [s for s in watch.stalls(stopped_s, resumed_s)
                                    if s.seconds >= STOP_S - TICK_S], "stall of the stop")
        (stall,) = stalls
        assert stall.overlaps(stopped_s, resumed_s) and stall.end_s >= resumed_s
        assert watch.stalls(resumed_s + 60, resumed_s + 120) == []  # nothing in the future
        # Stopped, it was not runnable: the stop is not queued time (what follows the
        # SIGCONT, and the ticks around it, may be on a busy machine: 38 ms of a 0.4 s stall
        # beside CI's other lane; were the stop counted queued, nothing would be left).
        assert stall.queued_s is not None
        assert stall.seconds - stall.queued_s >= STOP_S / 2


# The spinner: pinned to the watcher's core, then real-time (SCHED_FIFO), it runs until done
# and nothing of normal priority runs on that core meanwhile.
SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
"""


def test_a_stall_held_by_other_work_says_so() -> None:
    if os.geteuid() != 0:
        pytest.skip("a real-time spinner needs root (CAP_SYS_NICE)")
    with watching() as watch:
        _wait_for(watch._log.exists, "watcher's log")
        core = min(os.sched_getaffinity(watch._proc.pid))
        os.sched_setaffinity(watch._proc.pid, {core})
        began_s = time.monotonic()
        subprocess.run([sys.executable, "-c", SPIN, str(core), str(STOP_S)], check=True,
                       timeout=60)
        stall = _wait_for(lambda: [s for s in watch.stalls(began_s, time.monotonic())
                                   if s.seconds >= STALL_S], "stall of the spin")[0]
        # Queued while the spinner held its core; the other core idled or ran other work.
        assert stall.cause in ("host", "busy") and stall.queued_s is not None
        assert stall.queued_s <= stall.seconds + TICK_S


def test_stalls_are_read_as_written_and_a_partial_line_waits() -> None:
    with watching(stall_s=3600.0) as watch:  # no real stall is this long
        _wait_for(watch._log.exists, "watcher's log")
        with watch._log.open("a") as log:
            log.write("10.0 10.5 0.4 0.3 0.0.\n20.0 20.25 - - -.\n30.0 30.5 0.1 0.2 -")
        assert watch.stalls() == [Stall(10.0, 10.5, 0.4, 0.3, 0.0), Stall(20.0, 20.25)]
        assert watch.stalls(10.4, 19.0) == [Stall(10.0, 10.5, 0.4, 0.3, 0.0)]
        assert watch.stalls(10.5, 20.0) == []  # touching ends do not overlap
    assert Stall(10.0, 10.5, 0.1).shifted(9.0) == Stall(1.0, 1.5, 0.1)
    assert Stall(10.0, 10.5).seconds == pytest.approx(0.5)
    causes = [Stall(0.0, 0.5, queued, idle).cause
              for queued, idle in ((0.1, 0.0), (0.4, 0.3), (0.4, 0.1), (0.4, None), (None, 1.0))]
    assert causes == ["stopped", "host", "busy", None, None]
    assert STALL_S > 5 * TICK_S  # a stall is well past a late tick


def test_the_watcher_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    parent = subprocess.run(
        [sys.executable, "-c",
         "import os, pathlib\n"
         "from kvtier.tools.bench.serving.stalls import StallWatch\n"
         f"watch = StallWatch(pathlib.Path({str(tmp_path)!r}) / 'stalls.log')\n"
         "print(watch._proc.pid, flush=True)\n"
         "os._exit(0)  # no stop(): a bench killed, maybe before the watcher ran"],
        capture_output=True, text=True, timeout=60, check=True)
    pid = int(parent.stdout.split()[0])

    def gone() -> bool:  # exited: no such process, or a zombie no one reaps (a bare PID 1)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        return stat.rpartition(")")[2].split()[0] in ("Z", "X")

    _wait_for(gone, "exit of the orphaned watcher")
    assert tmp_path.is_dir()  # a folder the watch was only given stays


def test_a_killed_benchs_watch_leaves_no_folder(tmp_path: Path) -> None:
    """A bench killed inside `watching()` (no `finally` runs) left its kvtier-stalls-*
    folder in the temp dir; the orphaned watcher removes it."""
    parent = subprocess.run(
        [sys.executable, "-c",
         "import os\n"
         "from kvtier.tools.bench.serving.stalls import watching\n"
         "with watching() as watch:\n"
         "    print(watch._log.parent, flush=True)\n"
         "    os._exit(0)  # as SIGKILL would"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    folder = Path(parent.stdout.split()[0])
    assert folder.parent == tmp_path and folder.name.startswith("kvtier-stalls-")
    _wait_for(lambda: not folder.exists(), "removal of the killed bench's folder")


def test_a_watch_stopped_twice_is_stopped(tmp_path: Path) -> None:
    watch = StallWatch(tmp_path / "stalls.log")
    watch.stop()
    watch.stop()
    assert watch._proc.returncode is not None
