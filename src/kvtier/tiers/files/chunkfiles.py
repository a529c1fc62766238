"""Chunk files in a directory: where a chunk goes on disk, and how it is written and read.

Layout: ROOT/<layout digest>/<k[0:2]>/<k[2:4]>/<key hex>.kvc, one file per chunk, holding the
header of `kvtier.core.chunkformat` and the body padded to 4 KiB: the payload itself, or its
codec's and seal's output (`ChunkEncoder`: a file is then as long as its body needs, so a
compressed chunk takes less disk). Writes are atomic: an
O_EXCL temp file in the same directory, a short-write check, then a rename that never
replaces (`filetree.rename_new`), so a reader (in this or another process, on this or another
node) sees a whole file or none. Of two writers of the same chunk the first rename places it
and the second finds it there and removes its own copy (identical bytes), so the shared
tier's quota ledger counts the chunk once. Anything else found at the chunk's path is not a
copy (the put answered OK and stored nothing, for ever): a link, a socket, a FIFO, a device
or an empty directory is removed and the rename tried again; a directory that holds
something is never deleted, and the write fails (a dropped write, its path in the warning;
tests/faults/test_foreign_entries_at_chunk_paths.py).
Reads and writes use O_DIRECT when the filesystem supports it (no page-cache copy) and fall
back to buffered I/O otherwise. Shared by the disk and shared-directory tiers.

Nothing below ROOT is trusted (other processes and users write there): every path is reached
without following links (`kvtier.tiers.files.filetree`), a chunk is read only from a regular file
opened O_NOFOLLOW | O_NONBLOCK (a FIFO must not hang the reader for ever), and every read is
bounded by the file size the format dictates. A directory that cannot be written (a read-only
mount) is served read-only: `writable` is False and writes fail with EROFS.

Primitives: `ChunkFiles` (path_of, write, read_into, exists, touch, remove, scan),
`PendingWrite`. Reading the tree without a tier (scans, probes, inventories):
tiers/files/chunktree.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from kvtier.core.chunkformat import (
    ALIGN_BYTES,
    HEADER_BYTES,
    ChunkEncoder,
    Encoded,
    read_header,
    stored_size,
)
from kvtier.core.keys import ChunkKey
from kvtier.core.throttled import ThrottledWarning
from kvtier.errors import CorruptChunk, UnreadableChunk
from kvtier.tiers.files.chunktree import TreeScan, chunk_parts, chunk_path, scan_tree
from kvtier.tiers.files.filetree import (
    FileId,
    file_id,
    lstat_file,
    make_root,
    open_dir,
    rename_new,
    unlink_file,
)
from kvtier.tiers.files.fsops import FsOps

log = logging.getLogger(__name__)
TEMP_SUFFIX = ".tmp"
READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def _aligned(buffer: memoryview) -> bool:
    address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data if len(buffer) else 0
    return address % ALIGN_BYTES == 0 and len(buffer) % ALIGN_BYTES == 0


class ChunkFiles:
    """Reads and writes the chunk files of one layout under `root`. Thread-safe."""

    def __init__(
        self, root: Path, layout_digest: str, chunk_bytes: int, o_direct: str = "auto",
        dir_mode: int = 0o700, file_mode: int = 0o600, encoder: ChunkEncoder | None = None,
        fs_clock: bool = False,
    ) -> None:
        """`encoder`: how chunks are stored (a codec, a seal); None: as is (version 1).
        `fs_clock`: read the filesystem's clock off the files it creates (`fs_now`; an fstat
        per write): for a directory other nodes write to (the shared tier), not a disk tier.

        Raises:
            OSError: the directory cannot be used at all (nor read), or `o_direct` is "on"
                and O_DIRECT writes fail.
        """
        self.root = Path(root)
        self.layout_digest = layout_digest
        self.chunk_bytes = chunk_bytes
        self.encoder = encoder or ChunkEncoder(layout_digest, "uint8", chunk_bytes)
        self.file_bytes = stored_size(chunk_bytes)  # a chunk stored as is
        # The largest file a chunk of this layout takes (a sealed chunk: its tag and
        # checksum more); any chunk file of another size is corrupt.
        self.max_file_bytes = max(self.file_bytes, stored_size(self.encoder.max_body_bytes))
        self.dir_mode, self.file_mode = dir_mode, file_mode
        self.directory = self.root / layout_digest
        self.ops = FsOps()  # the metadata operations asked of the filesystem (fsops.py)
        self._cannot_remove = ThrottledWarning(log)  # every chunk, on a read-only directory
        self._local = threading.local()
        self._clock_ahead_s = 0.0  # the filesystem's clock minus this node's (`fs_now`)
        self._fs_clock = fs_clock  # whether writes read it (`_saw_clock`)
        self.writable = self._prepare_directory()
        self.o_direct = o_direct != "off" and self.writable and self._probe_o_direct(
            o_direct == "on")

    def _prepare_directory(self) -> bool:
        """Create the layout directory; False when the root is read-only for this process
        (a read-only mount, or a directory others made without write permission for us).
        Not an error: the tier serves that root read-only, and probes no O_DIRECT."""
        try:
            make_root(self.root, self.dir_mode)
            os.close(open_dir(self.root, [self.layout_digest], self.dir_mode))
            if os.access(self.directory, os.W_OK):
                return True
            reason = "no write permission, or a read-only mount"
        except OSError as exc:
            if exc.errno not in READ_ONLY_ERRNOS or not os.access(self.root, os.R_OK | os.X_OK):
                raise
            reason = exc.strerror or str(exc)
        log.warning("%s is read-only for this process (%s): chunks are served from it, writes "
                    "are dropped", self.root, reason)
        return False

    def _probe_o_direct(self, required: bool) -> bool:
        name = f".probe-{uuid.uuid4().hex}{TEMP_SUFFIX}"
        dir_fd = open_dir(self.root, [self.layout_digest])
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | _FILE_FLAGS,
                         self.file_mode, dir_fd=dir_fd)
            try:
                os.write(fd, self._buffers()[0])
                self._saw_clock(fd)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            if required:
                raise
            log.info("%s: O_DIRECT not supported (%s); using buffered I/O", self.directory, exc)
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
            os.close(dir_fd)

    def fs_now(self) -> float:
        """Now by the clock that stamps the directory's mtimes (on NFS the server's), as the
        last file this process created there showed it against this node's clock. kvtier's
        temp files are stale by their mtimes (filetree.TEMP_STALE_S): a node whose clock ran
        minutes ahead of the server's swept every write in flight in the directory
        (tests/faults/test_clock_skew.py). This node's clock until a file was created, and
        always without `fs_clock`."""
        return time.time() + self._clock_ahead_s

    def _saw_clock(self, fd: int) -> None:
        """Read the filesystem's clock off the mtime of `fd`, a file this process just
        created or resized (`fs_now`); nothing unless `fs_clock`."""
        if not self._fs_clock:
            return
        self.ops.add(stats=1)
        self._clock_ahead_s = os.fstat(fd).st_mtime - time.time()

    def _buffers(self) -> tuple[mmap.mmap, mmap.mmap]:
        """This thread's page-aligned (header, whole-file staging) buffers."""
        if not hasattr(self._local, "header"):
            self._local.header = mmap.mmap(-1, HEADER_BYTES)
            self._local.staging = mmap.mmap(-1, self.max_file_bytes)
        return self._local.header, self._local.staging

    def path_of(self, key: ChunkKey) -> Path:
        return chunk_path(self.root, self.layout_digest, key)

    def _flags(self, flags: int) -> int:
        return flags | os.O_DIRECT if self.o_direct else flags

    def encode(self, key: ChunkKey, data: memoryview, tenant: str | None = None) -> Encoded:
        """The chunk (of `tenant`, `ChunkMeta.tenant`) as it will be stored (codec, seal):
        on the caller's (write) thread."""
        return self.encoder.encode(key, data, tenant)

    @staticmethod
    def size_of(encoded: Encoded) -> int:
        """The bytes the file of `encoded` takes."""
        return stored_size(len(encoded.body))

    def write(self, key: ChunkKey, data: memoryview | Encoded) -> None:
        """Store `data` (a payload of the default tenant, or `encode`'s output) as the chunk
        `key`, atomically: `prepare_write`, `fill`, `complete`.

        Raises:
            OSError: the write failed (ENOSPC, EACCES, EIO, EROFS, ELOOP for a link on the
                way, ...); nothing is left behind.
        """
        encoded = data if isinstance(data, Encoded) else self.encode(key, data)
        pending = self.prepare_write(key, self.size_of(encoded))
        try:
            pending.fill(encoded)
            if not pending.complete():  # another writer's identical copy is in place
                pending.abort()
        except BaseException:
            pending.abort()
            raise

    def prepare_write(self, key: ChunkKey, size_bytes: int | None = None) -> PendingWrite:
        """Create the chunk's temp file, already `size_bytes` long (default `file_bytes`;
        sparse): from now on a scan of the directory counts the bytes the write will take.
        Directories on the way are created, never followed if they are links.

        Raises:
            OSError: EROFS (read-only), EACCES, ELOOP/ENOTDIR (a link or a file where a
                directory belongs), ENOSPC, ...; nothing is left behind.
        """
        if not self.writable:
            raise OSError(errno.EROFS, f"{self.root} is read-only for this process")
        parts = chunk_parts(self.layout_digest, key)
        dir_fd = open_dir(self.root, parts[:-1], self.dir_mode, self.ops)
        temp = f".{parts[-1]}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}"
        self.ops.add(opens=1)
        try:
            fd = os.open(temp, self._flags(os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS),
                         self.file_mode, dir_fd=dir_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        pending = PendingWrite(self, key, dir_fd, fd, temp, parts[-1],
                               size_bytes or self.file_bytes)
        try:
            os.fchmod(fd, self.file_mode)  # the umask must not narrow group_shared's 0660
            self.ops.add(other=1)
            os.ftruncate(fd, pending.size_bytes)
            self._saw_clock(fd)
        except BaseException:
            pending.abort()
            raise
        return pending

    def read_into(self, key: ChunkKey, out: memoryview, tenant: str | None = None,
                  touch: bool = False) -> None:
        """Read, verify and decode the chunk `key` of `tenant` (`ChunkMeta.tenant`: a sealed
        chunk opens with its key only) into `out` (chunk_bytes long). Never blocks on
        anything but the medium: only a regular file of a chunk's size is read. With
        `touch`, a chunk read whole has the access recorded in the file's mtime as `touch`
        does, through the open file (no second walk of its path).

        `out` holds undefined bytes when this raises.

        Raises:
            FileNotFoundError: the chunk is not stored.
            CorruptChunk: the file is short, long, not a regular file (a FIFO, a device, a
                symlink, or a link on the way), or fails header or checksum verification;
                KeyNotHeld / AuthFailure / CodecFailure (CorruptChunks): it cannot be opened
                or decoded here (`kvtier.core.chunkformat.failure_of` tells which). Its
                `file_id` names the file read, for `remove`.
            UnreadableChunk: the file opened failed to read (an OSError; its `file_id` as
                above).
            OSError: any other failure (the file could not be opened).
        """
        parts = chunk_parts(self.layout_digest, key)
        try:
            dir_fd = open_dir(self.root, parts[:-1], ops=self.ops)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CorruptChunk(f"{self.path_of(key)}: a link or a file where kvtier's "
                                   "directory belongs; not followed") from exc
            raise
        try:
            fd = self._open_regular(dir_fd, parts[-1])
        finally:
            os.close(dir_fd)
        try:
            info = os.fstat(fd)
            try:
                self._read_open(key, fd, info.st_size, out, tenant, touch)
            except CorruptChunk as exc:  # this file: not what is at the path when removed
                exc.file_id = exc.file_id or file_id(info)
                raise
            except OSError as exc:
                raise UnreadableChunk(exc, file_id(info)) from exc
        finally:
            os.close(fd)

    def _read_open(self, key: ChunkKey, fd: int, size: int, out: memoryview,
                   tenant: str | None, touch: bool) -> None:
        """`read_into`'s read, verification and decoding of the open chunk file `fd` (of
        `size` bytes). Raises what `read_into` raises."""
        header, staging = self._buffers()
        if size % ALIGN_BYTES or not HEADER_BYTES < size <= self.max_file_bytes:
            raise CorruptChunk(f"file is {size} bytes, not a chunk file of this layout "
                               f"(at most {self.max_file_bytes})")
        # A chunk stored as is lands in `out` straight from the medium (O_DIRECT, no
        # bounce); an encoded one (smaller, or larger by a seal) in the staging buffer,
        # then is decoded into `out`.
        in_place = size == self.file_bytes and _aligned(out) \
            and len(out) == size - HEADER_BYTES
        if in_place:
            got = os.preadv(fd, [header, out], 0)
            body = out
        else:
            got = os.preadv(fd, [memoryview(staging)[:size]], 0)
            header[:] = staging[:HEADER_BYTES]
            body = memoryview(staging)[HEADER_BYTES:size]
        if got != size:
            raise CorruptChunk(f"short read: {got} of {size} bytes")
        chunk = read_header(memoryview(header), key, self.layout_digest)
        if stored_size(chunk.body_bytes) != size:
            raise CorruptChunk(f"file is {size} bytes, its header says {chunk.body_bytes}")
        if body is out and not chunk.plain:  # an encoded chunk of the plain size: rare
            staging[HEADER_BYTES:size] = out
            body = memoryview(staging)[HEADER_BYTES:size]
        self.encoder.decode(key, chunk, body[: chunk.body_bytes], out, tenant)
        if touch:  # only a chunk read whole: one sealed under a key not held here ages
            self._touch_open(fd)  # out (a rotated secret's chunks), as a corrupt one goes

    def _open_regular(self, dir_fd: int, name: str) -> int:
        """An fd of the regular file `name`, opened for reading without blocking on a FIFO
        or a device and without following a link."""
        flags = self._flags(os.O_RDONLY | os.O_NONBLOCK | _FILE_FLAGS)
        self.ops.add(opens=1)
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptChunk(f"{name}: a symlink at a chunk path; not followed") from exc
            if exc.errno == errno.EINVAL and self.o_direct:  # O_DIRECT refused (not a file)
                raise CorruptChunk(f"{name}: cannot be read as a chunk file ({exc})") from exc
            if exc.errno in (errno.ENXIO, errno.ENODEV):  # a socket, a device without driver
                raise CorruptChunk(f"{name}: not a regular file ({exc.strerror})") from exc
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise CorruptChunk(f"{name}: not a regular file (mode {stat.filemode(mode)})")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def exists(self, key: ChunkKey) -> bool:
        """Whether the chunk's file is a regular file reached without a link (one lstat per
        component). Never raises: EACCES or a stale NFS handle is a miss."""
        try:
            return lstat_file(self.root, chunk_parts(self.layout_digest, key),
                              self.ops) is not None
        except OSError:
            return False

    def replaced(self, key: ChunkKey, read: FileId) -> bool:
        """Whether a file other than `read` (a failed read's `file_id`) is at the
        chunk's path now: a copy placed since that file was read. One lstat per
        component; never raises (an error: False)."""
        try:
            info = lstat_file(self.root, chunk_parts(self.layout_digest, key), self.ops)
        except OSError:
            return False
        return info is not None and file_id(info) != read

    def _touch_open(self, fd: int) -> None:
        self.ops.add(other=1)
        # a read-only directory, or another user's file: the order is only advisory
        with contextlib.suppress(OSError):
            os.utime(fd)

    def touch(self, key: ChunkKey) -> None:
        """Record an access in the file's mtime: the LRU order that survives restarts and
        that every process sharing the directory sees."""
        parts = chunk_parts(self.layout_digest, key)
        try:
            dir_fd = open_dir(self.root, parts[:-1], ops=self.ops)
        except OSError:
            return  # evicted meanwhile, or not ours: the order is only advisory
        self.ops.add(other=1)
        try:
            os.utime(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            pass  # evicted meanwhile, or a read-only directory
        finally:
            os.close(dir_fd)

    def remove(self, key: ChunkKey, failed: dict[ChunkKey, None] | None = None,
               same_file: FileId | None = None) -> int | None:
        """Delete the chunk's file (or whatever non-directory sits at its path, never
        through a link); with `same_file` (a failed read's `file_id`), only if it is
        still that file.
        None when nothing was removed; else the bytes that freed (0 for a
        link or special file). Never raises: a read-only directory keeps its files (logged,
        and the key added last to `failed` when given: the disk tier removes them later)."""
        try:
            return unlink_file(self.root, chunk_parts(self.layout_digest, key), self.ops,
                               same_file=same_file)
        except OSError as exc:
            self._cannot_remove.warning("%s: cannot remove chunk %s (%s)", self.directory,
                                        key.hex(), exc)
            if failed is not None:
                failed[key] = None  # last of its keys (insertion order)
            return None

    def scan(self) -> TreeScan:
        """Every chunk file of this layout (see `scan_tree`)."""
        return scan_tree(self.root, [self.layout_digest], sweep=self.writable, ops=self.ops)


class PendingWrite:
    """One chunk write between `ChunkFiles.prepare_write` and `complete` (or `abort`):
    its temp file exists, full size. Used by one thread."""

    def __init__(self, files: ChunkFiles, key: ChunkKey, dir_fd: int, fd: int, temp: str,
                 name: str, size_bytes: int) -> None:
        self.files, self.key = files, key
        self.size_bytes = size_bytes  # the file's size once filled
        self._dir_fd, self._fd, self._temp, self._name = dir_fd, fd, temp, name

    def fill(self, data: memoryview | Encoded) -> None:
        """Write the header and body of `data` (a payload, or `ChunkFiles.encode`'s output
        for this key, `size_bytes` long once stored) into the temp file.

        Raises:
            OSError: ENOSPC for a short write (the filesystem filled up), EIO, ...
            ValueError: `data` does not make a file of `size_bytes` (the caller's bug).
        """
        files = self.files
        encoded = data if isinstance(data, Encoded) else files.encode(self.key, data)
        body = encoded.body
        if stored_size(len(body)) != self.size_bytes:
            raise ValueError(f"a chunk of {len(body)} bytes does not fill {self.size_bytes}")
        header, staging = files._buffers()
        header[:] = encoded.header
        if encoded.padded is not None and _aligned(encoded.padded) \
                and HEADER_BYTES + len(encoded.padded) == self.size_bytes:
            iov: list[memoryview | mmap.mmap] = [header, encoded.padded]
        elif _aligned(body):
            iov = [header, body]
        else:  # bounce through an aligned buffer, zero-padded to the file size
            staging[HEADER_BYTES : HEADER_BYTES + len(body)] = body
            staging[HEADER_BYTES + len(body) : self.size_bytes] = bytes(
                self.size_bytes - HEADER_BYTES - len(body))
            staging[:HEADER_BYTES] = header
            iov = [memoryview(staging)[: self.size_bytes]]
        written = os.pwritev(self._fd, iov, 0)
        if written != self.size_bytes:
            # A short write to a regular file means the filesystem (or a quota) filled up
            # mid-file. Reported as EIO, the tiers never evicted on a full filesystem and
            # dropped every later put (tests/faults/test_write_failures.py, real tmpfs).
            raise OSError(errno.ENOSPC, f"short write: {written} of {self.size_bytes} "
                          "bytes (filesystem full)")

    def complete(self) -> bool:
        """Rename the filled temp file into place: readers see the whole chunk from now on.
        False when another writer renamed its copy of the chunk into place meanwhile (the
        caller asked whether it was held before writing, once: `Tier.put`): this one is
        left as a temp file for `abort`. Where renames cannot refuse to replace (NFS) a hard
        link places it (`filetree.rename_new`); where neither can, the other copy is
        replaced, and a quota ledger that counted both stays high by one copy until the next
        re-measure (still an upper bound: kvtier.tiers.files.quota); two writers hammering
        24 keys under a 10-chunk quota had counted 10 chunks for 4 files, and dropped writes
        for a full quota.

        Raises:
            OSError: the rename failed (FileNotFoundError: the temp file was swept as stale
                by another process; IsADirectoryError: a directory that is not kvtier's is in
                the way, `_clear_foreign`); call `abort`.
        """
        os.close(self._fd)
        self._fd = -1
        self.files.ops.add(other=1)
        placed = rename_new(self._dir_fd, self._temp, self._name)
        if not placed and self._clear_foreign():
            self.files.ops.add(other=1)
            placed = rename_new(self._dir_fd, self._temp, self._name)
        if not placed:
            return False
        self._temp = ""
        os.close(self._dir_fd)
        self._dir_fd = -1
        return True

    def _clear_foreign(self) -> bool:
        """What the rename found at the chunk's path: another writer's chunk file (False:
        it stays, this copy is not needed), or an entry kvtier did not write there, which
        would otherwise turn every store of this key into a silent no-op. One that is
        kvtier's to clear is removed, never through a link, and True says the rename may be
        tried again: a link, a socket, a FIFO or a device (what `unlink_file` and the readers
        remove from kvtier's layout too), or an empty directory. One extra lstat, only when
        the chunk's path was taken.

        Raises:
            IsADirectoryError: a directory that holds something (or cannot be removed) is
                there: it is never deleted, and this chunk cannot be stored until someone
                removes it (the tiers count a dropped write, their warning names the path).
            OSError: the entry could not be removed (EACCES, EROFS, ...).
        """
        self.files.ops.add(stats=1)
        try:
            info = os.stat(self._name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True  # removed meanwhile: the rename may place this copy
        if stat.S_ISREG(info.st_mode):
            return False
        path = self.files.path_of(self.key)
        if stat.S_ISDIR(info.st_mode):
            try:
                self.files.ops.add(other=1)
                os.rmdir(self._name, dir_fd=self._dir_fd)  # an empty one only
            except OSError as exc:
                raise IsADirectoryError(
                    errno.EISDIR, "a directory kvtier did not make sits at this chunk's path "
                    "and is not removed: remove it, or the chunk is never stored",
                    str(path)) from exc
        else:
            self.files.ops.add(unlinks=1)
            os.unlink(self._name, dir_fd=self._dir_fd)  # the link itself, never its target
        log.info("%s: a %s that kvtier did not write sat at a chunk's path; removed",
                 path, stat.filemode(info.st_mode))
        return True

    def abort(self) -> int:
        """Give up: remove the temp file. The bytes that freed (0 when it had been swept).
        Never raises."""
        freed = 0
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._dir_fd >= 0:
            if self._temp:
                self.files.ops.add(stats=1, unlinks=1)
                try:
                    freed = os.stat(self._temp, dir_fd=self._dir_fd,
                                    follow_symlinks=False).st_size
                    os.unlink(self._temp, dir_fd=self._dir_fd)
                except OSError:
                    freed = 0  # swept as stale by another process (filetree.TEMP_STALE_S)
            os.close(self._dir_fd)
            self._dir_fd = -1
        return freed
