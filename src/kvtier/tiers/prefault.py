"""Commit a RAM slab's pages in the background, so that stores never pay first-touch faults.

An anonymous mmap is committed lazily: the first write to each 4 KiB page faults and the
kernel zeroes it. On this project's VM a store into never-touched slab memory ran at
0.84 GB/s against 7.8 GB/s into a reused slot (9x; docs/performance.md), and a fresh
engine's RAM tier is untouched until its capacity has been stored once, which for a large
tier takes hours of traffic. (A page-locked slab, on CUDA, is committed by its allocation.)

So the memory tier asks the kernel to fault its slab in ahead of use, on a thread of
lowest priority (nice 19, so it yields to the engine's threads on a shared core), a few MiB
per call: `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) maps the pages writable without
changing a byte, so it is safe while slots are already being filled, and ctypes releases
the GIL for the call. On an older kernel the pages stay lazily committed (logged once).

Primitives: `prefault_in_background`, `available_bytes` (the host's, or its cgroup's:
`cgroup_headroom_bytes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
STEP_BYTES = 8 << 20  # one madvise call: ~8 ms at the VM's 1 GB/s, then check `stop`
# Where this process's memory cgroup is read (`cgroup_headroom_bytes`); a v1 limit at or
# above UNLIMITED_BYTES is none (v1 writes 2^63 rounded down to a page).
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
UNLIMITED_BYTES = 1 << 62


def _madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _populate(slab: np.ndarray, name: str, stop: threading.Event) -> None:
    madvise = _madvise()
    if madvise is None:
        return
    address, size = slab.ctypes.data, slab.nbytes  # `slab` keeps the mapping alive
    with contextlib.suppress(OSError):  # not permitted: still a background thread
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    start = time.perf_counter()
    done = 0
    while done < size and not stop.is_set():
        step = min(STEP_BYTES, size - done)
        if madvise(address + done, step, MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()
            if code == errno.EINVAL:  # a kernel before 5.14
                log.info("%s: pages are committed on first use (no MADV_POPULATE_WRITE)", name)
            else:
                log.warning("%s: committing its RAM stopped after %d MiB: %s", name,
                            done >> 20, os.strerror(code))
            return
        done += step
    log.debug("%s: %d MiB of RAM committed in %.2f s", name, done >> 20,
              time.perf_counter() - start)


def prefault_in_background(slab: np.ndarray, name: str,
                           stop: threading.Event) -> threading.Thread:
    """Start committing the pages of `slab` (anonymous, page-aligned memory) on a daemon
    thread; it ends when done, on an error (logged), or soon after `stop` is set."""
    thread = threading.Thread(target=_populate, args=(slab, name, stop),
                              name="kvtier-prefault", daemon=True)
    thread.start()
    return thread


def available_bytes() -> int | None:
    """What this process can still commit without swapping, reclaiming what is in use or
    meeting the OOM killer, in bytes: the host's MemAvailable, or less where its cgroup's
    memory limit leaves less (a container: a pod's limit, which /proc/meminfo does not show;
    a slab that fits the host but not the pod was committed whole, and the pod OOM-killed, at
    start-up). None where neither says."""
    limits = [b for b in (_mem_available(), cgroup_headroom_bytes()) if b is not None]
    return min(limits) if limits else None


def _mem_available() -> int | None:
    """The host's MemAvailable, in bytes; None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom_bytes(root: Path | None = None, self_cgroup: Path | None = None
                          ) -> int | None:
    """How far this process's memory cgroup (and those above it) is from its limit, in
    bytes: limit - (usage - inactive file pages, which the kernel reclaims first), the
    least of the limited ones; None where none is limited or none can be read. cgroup v2
    (`memory.max`, `memory.current`) or v1 (`memory.limit_in_bytes`,
    `memory.usage_in_bytes`); `root` and `self_cgroup` default to CGROUP_ROOT and
    SELF_CGROUP, read at the call. A path /proc/self/cgroup names that is not under `root` (a
    container sees its own cgroup as the root) is read at `root`."""
    root, self_cgroup = root or CGROUP_ROOT, self_cgroup or SELF_CGROUP
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            names = ("memory.max", "memory.current", "inactive_file")
            base = root
        elif "memory" in controllers.split(","):  # v1
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            base = root / "memory"
        else:
            continue
        folder = base / path.lstrip("/")
        if not folder.is_dir():
            folder = base
        while True:
            headroom = _headroom(folder, *names)
            if headroom is not None:
                headrooms.append(headroom)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(headrooms) if headrooms else None


def _headroom(folder: Path, limit_name: str, usage_name: str, inactive_name: str) -> int | None:
    """One cgroup's limit - its usage net of inactive file pages; None where unlimited or
    unreadable."""
    try:
        limit_text = (folder / limit_name).read_text().strip()
        if limit_text == "max" or int(limit_text) >= UNLIMITED_BYTES:
            return None
        usage = int((folder / usage_name).read_text())
        inactive = 0
        with contextlib.suppress(OSError):
            for line in (folder / "memory.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == inactive_name:
                    inactive = int(value)
        return max(0, int(limit_text) - max(0, usage - inactive))
    except (OSError, ValueError):
        return None
