"""Chunk files in a directory: where a chunk goes on disk, and how it is written and read.

Layout: ROOT/<layout digest>/<k[0:2]>/<k[2:4]>/<key hex>.kvc, one file per chunk, holding the
header of `kvtier.core.chunkformat` and the payload padded to 4 KiB. Writes are atomic: an
O_EXCL temp file in the same directory, a short-write check, then `os.replace`, so a reader
(in this or another process, on this or another node) sees a whole file or none. Two writers
of the same chunk both write whole files; the last rename wins and both are identical.
Reads and writes use O_DIRECT when the filesystem supports it (no page-cache copy) and fall
back to buffered I/O otherwise. Shared by the disk and shared-directory tiers.

Primitives: `ChunkFiles` (path_of, write, read_into, touch, remove, scan), `chunk_path`,
`scan_tree`, `FileProbe` (the disk and shared tiers' probe), `FileInventory` (their
`kvtier inspect` / `kvtier gc` view).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.core.chunkformat import (
    ALIGN_BYTES, HEADER_BYTES, encode_header, stored_size, verify_header, verify_payload,
)
from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.tier import StoredChunk
from kvtier.errors import CorruptBlock

log = logging.getLogger(__name__)
SUFFIX = ".kvc"
TEMP_SUFFIX = ".tmp"
STALE_TEMP_S = 600.0  # temp files older than this are leftovers of a crashed writer


@dataclass(frozen=True, slots=True)
class ChunkFile:
    """A chunk file found by `scan`."""

    key: ChunkKey
    path: Path
    size_bytes: int
    mtime: float


def chunk_path(root: Path, layout_digest: str, key: ChunkKey) -> Path:
    """Where the chunk `key` of a layout lives under `root` (no I/O)."""
    name = key.hex()
    return root / layout_digest / name[:2] / name[2:4] / f"{name}{SUFFIX}"


def _aligned(buffer: memoryview) -> bool:
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data if len(buffer) else 0
    return address % ALIGN_BYTES == 0 and len(buffer) % ALIGN_BYTES == 0


class ChunkFiles:
    """Reads and writes the chunk files of one layout under `root`. Thread-safe."""

    def __init__(
        self, root: Path, layout_digest: str, chunk_bytes: int, o_direct: str = "auto",
        dir_mode: int = 0o700, file_mode: int = 0o600,
    ) -> None:
        self.root = Path(root)
        self.layout_digest = layout_digest
        self.chunk_bytes = chunk_bytes
        self.file_bytes = stored_size(chunk_bytes)
        self.dir_mode, self.file_mode = dir_mode, file_mode
        self.directory = self.root / layout_digest
        make_dirs(self.directory, dir_mode)
        self._local = threading.local()
        self.o_direct = o_direct != "off" and self._probe_o_direct(o_direct == "on")

    def _probe_o_direct(self, required: bool) -> bool:
        probe = self.directory / f".probe-{uuid.uuid4().hex}{TEMP_SUFFIX}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, self.file_mode)
            try:
                os.write(fd, self._buffers()[0])
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            if required:
                raise
            log.info("%s: O_DIRECT not supported (%s); using buffered I/O", self.directory, exc)
            return False
        finally:
            probe.unlink(missing_ok=True)

    def _buffers(self) -> tuple[mmap.mmap, mmap.mmap]:
        """This thread's page-aligned (header, whole-file staging) buffers."""
        if not hasattr(self._local, "header"):
            self._local.header = mmap.mmap(-1, HEADER_BYTES)
            self._local.staging = mmap.mmap(-1, self.file_bytes)
        return self._local.header, self._local.staging

    def path_of(self, key: ChunkKey) -> Path:
        return chunk_path(self.root, self.layout_digest, key)

    def _flags(self, flags: int) -> int:
        return flags | os.O_DIRECT if self.o_direct else flags

    def write(self, key: ChunkKey, data: memoryview) -> None:
        """Store `data` as the chunk `key`, atomically.

        Raises:
            OSError: the write failed (ENOSPC, EACCES, EIO, ...); nothing is left behind.
        """
        path = self.path_of(key)
        make_dirs(path.parent, self.dir_mode)
        temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
        header, staging = self._buffers()
        header[:] = encode_header(key, self.layout_digest, data)
        if _aligned(data):
            parts: list[memoryview | mmap.mmap] = [header, data]
        else:  # bounce through an aligned buffer, zero-padded to the file size
            staging[HEADER_BYTES : HEADER_BYTES + len(data)] = data
            staging[HEADER_BYTES + len(data) :] = bytes(self.file_bytes - HEADER_BYTES - len(data))
            staging[:HEADER_BYTES] = header
            parts = [staging]
        fd = os.open(temp, self._flags(os.O_WRONLY | os.O_CREAT | os.O_EXCL), self.file_mode)
        try:
            os.fchmod(fd, self.file_mode)  # the umask must not narrow group_shared's 0660
            written = os.pwritev(fd, parts, 0)
            if written != self.file_bytes:
                # A short write to a regular file means the filesystem (or a quota) filled up
                # mid-file. Reported as EIO, the tiers never evicted on a full filesystem and
                # dropped every later put (tests/faults/test_write_failures.py, real tmpfs).
                raise OSError(errno.ENOSPC, f"short write: {written} of {self.file_bytes} "
                              "bytes (filesystem full)")
            os.close(fd)
            fd = -1
            os.replace(temp, path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            temp.unlink(missing_ok=True)
            raise

    def read_into(self, key: ChunkKey, out: memoryview) -> None:
        """Read and verify the chunk `key` into `out` (chunk_bytes long).

        `out` holds undefined bytes when this raises.

        Raises:
            FileNotFoundError: the chunk is not stored.
            CorruptBlock: the file is short, long, or fails header or checksum verification.
            OSError: any other read failure.
        """
        header, staging = self._buffers()
        fd = os.open(self.path_of(key), self._flags(os.O_RDONLY))
        try:
            size = os.fstat(fd).st_size
            if size != self.file_bytes:
                raise CorruptBlock(f"file is {size} bytes, expected {self.file_bytes}")
            if _aligned(out) and len(out) == self.file_bytes - HEADER_BYTES:
                got = os.preadv(fd, [header, out], 0)
                payload = out
            else:
                got = os.preadv(fd, [staging], 0)
                header[:] = staging[:HEADER_BYTES]
                payload = memoryview(staging)[HEADER_BYTES : HEADER_BYTES + len(out)]
        finally:
            os.close(fd)
        if got != self.file_bytes:
            raise CorruptBlock(f"short read: {got} of {self.file_bytes} bytes")
        payload_bytes, payload_sum = verify_header(memoryview(header), key, self.layout_digest)
        if payload_bytes != len(out):
            raise CorruptBlock(f"payload is {payload_bytes} bytes, expected {len(out)}")
        verify_payload(payload, payload_sum)
        if payload is not out:
            out[:] = payload

    def touch(self, key: ChunkKey) -> None:
        """Record an access in the file's mtime: the LRU order that survives restarts and
        that every process sharing the directory sees."""
        try:
            os.utime(self.path_of(key))
        except OSError:
            pass  # evicted meanwhile, or a read-only directory: the order is only advisory

    def remove(self, key: ChunkKey) -> bool:
        """Delete the chunk's file; True if it existed."""
        try:
            self.path_of(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def scan(self) -> Iterator[ChunkFile]:
        """Every chunk file of this layout (see `scan_tree`)."""
        return scan_tree(self.directory)


def make_dirs(directory: Path, mode: int) -> None:
    """Create `directory` and its missing parents with exactly `mode`, whatever the umask;
    directories that exist are left alone. `mkdir(parents=True)` used to create the tier's
    own root 0755 under umask 022 (key names listable by all users), and umask 022 narrowed
    group_shared's 0770 to 0750 (tests/tiers/test_permissions.py)."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=mode)
        except FileExistsError:  # another process made it: its mode is its creator's
            continue
        os.chmod(path, mode)


def scan_tree(directory: Path) -> Iterator[ChunkFile]:
    """Every chunk file below `directory`; deletes stale temp files on the way.

    Files whose names are not keys are skipped; a chunk's content is verified when read.
    """
    now = time.time()
    for dirpath, _dirnames, filenames in os.walk(directory):
        for filename in filenames:
            path = Path(dirpath) / filename
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            if filename.endswith(TEMP_SUFFIX):
                if now - info.st_mtime > STALE_TEMP_S:
                    path.unlink(missing_ok=True)
                continue
            key = _key_of(filename)
            if key is not None:
                yield ChunkFile(key, path, info.st_size, info.st_mtime)


def _key_of(filename: str) -> ChunkKey | None:
    if not filename.endswith(SUFFIX) or len(filename) != 2 * KEY_BYTES + len(SUFFIX):
        return None
    try:
        return ChunkKey(bytes.fromhex(filename[: -len(SUFFIX)]))
    except ValueError:
        return None


class FileProbe:
    """Answers "is this chunk stored?" for a chunk-file directory, from any process, with
    no side effects (no mkdir, no scan): one stat per layout. With several layouts (the
    tensor-parallel ranks of one model) a chunk counts only when every rank's file exists."""

    def __init__(self, root: Path, layout_digests: list[str], blocking_ok: bool) -> None:
        self.root = Path(root)
        self.layout_digests = list(layout_digests)
        self.blocking_ok = blocking_ok  # cheap enough for a scheduler thread (local disk)

    def contains(self, key: ChunkKey) -> bool:
        try:
            return all(chunk_path(self.root, d, key).exists() for d in self.layout_digests)
        except OSError:  # e.g. EACCES or a stale NFS handle: a miss, never an error
            return False


class FileInventory:
    """A disk or shared tier's directory as `kvtier.core.tier.Inventory`:
    ROOT/<digest>/<k0k1>/<k2k3>/<key hex>.kvc. Reads stat data only; changes nothing."""

    def __init__(self, name: str, kind: str, root: Path) -> None:
        self.name, self.kind, self.root = name, kind, Path(root)

    def chunks(self) -> Iterator[StoredChunk]:
        if not self.root.is_dir():
            return
        for namespace in sorted(p.name for p in self.root.iterdir() if p.is_dir()):
            for dirpath, _dirs, filenames in os.walk(self.root / namespace):
                for filename in filenames:
                    key = _key_of(filename)
                    if key is None:
                        continue  # temp files and strangers: not chunks
                    path = os.path.join(dirpath, filename)
                    try:
                        info = os.stat(path)
                    except FileNotFoundError:  # evicted by a running tier meanwhile
                        continue
                    yield StoredChunk(namespace, key.hex(), info.st_size, info.st_mtime, (path,))

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        removed = 0
        for chunk in chunks:
            try:
                os.unlink(chunk.locations[0])
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def close(self) -> None:
        pass
