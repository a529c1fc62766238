"""A directory's link measured with a probe file: the `kvtier.core.tier.LinkProbe` of the
file tiers (issue 45: a network filesystem, or a disk that is really a network block device,
can be slower than a recompute, and the load-or-recompute rule needs to know before the
first load is timed).

The probe file is kvtier's own temp name in the layout directory (`.probe-<32 hex>.tmp`,
`filetree.is_temp_name`): a process killed mid-measure leaves one that the quota counts and a
re-measure or a restart sweeps (filetree.TEMP_STALE_S). It is written once, random bytes (a
compressing filesystem must not read zeros back at memory speed), O_DIRECT where the tier's
chunk files are (`ChunkFiles.o_direct`), else buffered then fsync'd; then read as a load reads
a chunk (open without following a link, fstat, one read, close), each read from the medium:
O_DIRECT, or the file's cached pages dropped first (posix_fadvise DONTNEED):
  - the round trip: the best of ROUND_TRIPS reads of its first 4 KiB;
  - the bandwidth: the best of BANDWIDTH_ROUNDS rounds of STREAMS whole-file reads at once
    (a load reads several chunks at once: one stream of a network filesystem or an NVMe
    drive at queue depth 1 falls well short of what they carry), less the round trip.
A load writes nothing, so the write is not timed. Each timing checks the deadline first
(`links.best_of`). Its cost: one 2 MiB write and 8 reads of 2 MiB, 8 MiB of buffers.

The tier reserves the probe file's bytes in its capacity while it exists, as a write's, never
evicting for it (`probe_bytes`: the room left, if less than PROBE_BYTES).

Primitives: `measure_directory`, `probe_bytes`, `PROBE_BYTES`, `MIN_PROBE_BYTES`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import time
import uuid
from pathlib import Path

from kvtier.core.chunkformat import ALIGN_BYTES
from kvtier.core.tier import LinkSpeed
from kvtier.tiers.files.chunkfiles import TEMP_SUFFIX
from kvtier.tiers.files.filetree import open_dir
from kvtier.tiers.links import best_of, check_deadline, in_parallel

PROBE_BYTES = 2 << 20  # the probe file: 2 MiB cross a 1 Gbit/s link in 17 ms
MIN_PROBE_BYTES = 256 << 10  # a tier with less room left in its capacity measures nothing
ROUND_TRIPS = 3
BANDWIDTH_ROUNDS = 2
STREAMS = 4  # reads at once in a bandwidth round
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def probe_bytes(room_bytes: int) -> int:
    """The probe file's size for a tier with `room_bytes` left in its capacity: PROBE_BYTES,
    or the room if less (whole 4 KiB blocks).

    Raises:
        OSError: ENOSPC, the room is under MIN_PROBE_BYTES.
    """
    size = min(PROBE_BYTES, room_bytes // ALIGN_BYTES * ALIGN_BYTES)
    if size < MIN_PROBE_BYTES:
        raise OSError(errno.ENOSPC, f"{max(0, room_bytes)} bytes of room in the capacity, "
                      f"{MIN_PROBE_BYTES} needed for a probe file")
    return size


def measure_directory(root: Path, layout_digest: str, o_direct: bool, file_mode: int,
                      deadline: float, size_bytes: int = PROBE_BYTES) -> LinkSpeed:
    """The link to ROOT/`layout_digest` (see the module docstring), with a probe file of
    `size_bytes` (a multiple of 4 KiB), removed before this returns. Blocking: the caller
    bounds it (`kvtier.tiers.links.BoundedMeasure`).

    Raises:
        OSError: the directory cannot be written or read (ENOSPC, EACCES, EIO, ...).
        LinkTimeout: `deadline` (monotonic) passed between two steps.
    """
    if size_bytes <= 0 or size_bytes % ALIGN_BYTES:
        raise ValueError(f"a probe file of {size_bytes} bytes: a positive multiple of "
                         f"{ALIGN_BYTES}")
    name = f".probe-{uuid.uuid4().hex}{TEMP_SUFFIX}"
    buffers = [mmap.mmap(-1, size_bytes) for _ in range(STREAMS)]  # page-aligned (O_DIRECT)
    buffers[0][:] = os.urandom(size_bytes)
    dir_fd = open_dir(root, [layout_digest])
    try:
        _write(dir_fd, name, buffers[0], o_direct, file_mode)
        round_trip_s = best_of(ROUND_TRIPS, lambda: _timed_reads(
            dir_fd, name, buffers[:1], ALIGN_BYTES, o_direct, deadline), deadline)
        round_s = best_of(BANDWIDTH_ROUNDS, lambda: _timed_reads(
            dir_fd, name, buffers, size_bytes, o_direct, deadline), deadline)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        os.close(dir_fd)
    return LinkSpeed(round_trip_s, STREAMS * size_bytes / max(round_s - round_trip_s, 1e-6))


def _write(dir_fd: int, name: str, buffer: mmap.mmap, o_direct: bool, file_mode: int) -> None:
    """Create `name` (O_EXCL, no link followed) holding `buffer`, on the medium when this
    returns (fsync). Raises OSError (a short write is EIO)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS
    fd = os.open(name, flags | os.O_DIRECT if o_direct else flags, file_mode, dir_fd=dir_fd)
    try:
        written = os.write(fd, buffer)
        if written != len(buffer):
            raise OSError(errno.EIO, f"short write of a probe file: {written} of {len(buffer)}")
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed_reads(dir_fd: int, name: str, buffers: list[mmap.mmap], nbytes: int,
                 o_direct: bool, deadline: float) -> float:
    """Seconds for len(`buffers`) reads at once of `name`'s first `nbytes` from the medium,
    each as a chunk is read (tiers/files/chunkfiles.py: open, fstat, read, close).
    Raises OSError, LinkTimeout."""
    check_deadline(deadline)
    flags = os.O_RDONLY | _FILE_FLAGS
    if o_direct:
        flags |= os.O_DIRECT
    else:  # a buffered read would be served from the pages the write or a read left
        fd = os.open(name, flags, dir_fd=dir_fd)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(buffer: mmap.mmap) -> None:
        with memoryview(buffer) as whole, whole[:nbytes] as view:
            fd = os.open(name, flags, dir_fd=dir_fd)
            try:
                os.fstat(fd)
                got = os.preadv(fd, [view], 0)
            finally:
                os.close(fd)
        if got != nbytes:
            raise OSError(errno.EIO, f"short read of a probe file: {got} of {nbytes}")

    start = time.perf_counter()
    if len(buffers) == 1:
        read(buffers[0])
    else:
        in_parallel([functools.partial(read, buffer) for buffer in buffers])
    return time.perf_counter() - start
