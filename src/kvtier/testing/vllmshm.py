"""The shared memory files vLLM's engines leave in /dev/shm, found and removed.

At tensor parallel size > 1 on the CPU backend, each worker creates a file of its own for
the ranks' all-reduce (`vllm_dist_<ident>-tp:0-[0-1]-cpushm_<rank>`, 4 MiB at TP 2: vLLM's
C++ SHMManager, csrc/cpu/shm.cpp, behind `_CPUSHMDistributed` in
vllm/distributed/device_communicators/cpu_communicator.py) and maps every rank's. The file
is unlinked by the manager's destructor, which a worker ended by its executor's shutdown
never runs: every TP engine left its files behind (tests/engine/test_tensor_parallel.py:
two a run). An engine's files are known by the mappings of its processes while it runs
(their names carry its own identifier), and removed once all of them are gone: no other
process's file is touched, nor one a process still maps.

At any size, an engine whose model runs in a worker process of its own (vLLM's multiproc
executor: the offline engines of kvtier.testing.engines) has its engine core create the
workers' RPC queue, a 160 MiB `psm_*` file (Python's `SharedMemory`: `ShmRingBuffer` of
vllm/distributed/device_communicators/shm_broadcast.py), unlinked only by that object's
`__del__`, which the engine core's exit never runs: the file stayed for the rest of the
process (`kvtier bench codecs --quick --ttft 1024`: 4 engines, 640 MiB of /dev/shm), and at
its exit Python's resource tracker, which the engine's processes share with this one,
removed them with "There appear to be 4 leaked shared_memory objects to clean up at
shutdown". Such a file is removed here too, and the tracker told (`unregister`) it is gone.

Primitives: `vllm_shm_maps`, `remove_when_gone`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
PREFIX = "vllm_dist_"  # vLLM's collectives' files (named after its file-store rendezvous)
TRACKED_PREFIX = "psm_"  # Python's SharedMemory (vLLM's message queues), resource-tracked
GONE_TIMEOUT_S = 10.0  # how long the engine's processes may take to end after its shutdown


def vllm_shm_maps(pids: Iterable[int]) -> dict[int, set[Path]]:
    """For each of `pids` that maps files of /dev/shm named `vllm_dist_*` or `psm_*` now,
    those files (read from /proc/<pid>/maps: a process gone, or not this user's to read, maps
    none)."""
    maps: dict[int, set[Path]] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]  # the mapped file, if any
                if path and path[0].startswith((f"{SHM_DIR}/{PREFIX}",
                                                 f"{SHM_DIR}/{TRACKED_PREFIX}")):
                    maps.setdefault(pid, set()).add(
                        Path(path[0].removesuffix(" (deleted)")))
    return maps


def remove_when_gone(maps: Mapping[int, Iterable[Path]],
                     timeout_s: float = GONE_TIMEOUT_S) -> list[Path]:
    """Remove the files of `maps` (`vllm_shm_maps` of an engine's processes) once every
    process that mapped them has ended, waiting at most `timeout_s` for that; none while one
    still runs (logged). Only the mappers are waited for: a helper the engine started that
    maps none (multiprocessing's resource tracker lives as long as this process) is not.
    The files removed."""
    deadline = time.monotonic() + timeout_s
    while (running := sorted(pid for pid in maps if _running(pid))) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    if running:
        log.warning("vLLM's processes %s still run %.0f s after the engine's shutdown: its "
                    "shared memory files are left in %s", running, timeout_s, SHM_DIR)
        return []
    removed = []
    for path in sorted(set().union(*maps.values())):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
            if path.name.startswith(TRACKED_PREFIX):
                _untrack(path)
    return removed


def _untrack(path: Path) -> None:
    """Tell this process's resource tracker that the `SharedMemory` file `path` is gone, so
    that it neither warns of it as leaked nor unlinks the name again at exit. Only to a
    tracker already running: the one the engine's processes inherited from this process
    (multiprocessing starts one for every spawned child); a fresh tracker, never told of the
    name, would print a KeyError's traceback at the unregister."""
    from multiprocessing import resource_tracker

    if getattr(resource_tracker._resource_tracker, "_fd", None) is not None:
        resource_tracker.unregister(f"/{path.name}", "shared_memory")


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie maps nothing: ended)."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
