"""A memory tier's slab in named shared memory (`MemoryTierConfig.shared_memory`: kvtier node
puts its RAM tier there, and its engines map it), with a record per slot from which a node
restarted on the same name recovers the chunks it held.

The file /dev/shm/<name> (mode 0660: the node's group) is laid out as
    [slots: num_slots x slot_bytes][records: num_slots x 96 B][stamps: num_slots x 8 B]
    [footer: 64 B]
so that a slot's offset in the file is its offset in the slab (what engines are told). A
record is (key, xxh3-64 of the chunk's bytes, chunk bytes, valid) and the chunk's `ChunkMeta`
as the tier keeps it (tenant, pin, expiry, parent: a pinned system prompt stays pinned across
a restart, a tenant's chunks count against its quota, the prefix policy keeps its tree); it is
made valid when a chunk is committed to its slot and invalid before the slot is written again
or its chunk leaves, so a valid record always describes bytes that were whole at their commit.
A pin or expiry extended later is written into the record (`record_meta`). Not kept: the
engine that stored a chunk through a node (`engine_quota`): a recovered chunk counts against
no engine's quota.

A node that starts finds the file its predecessor left (a crash, a restart) and renames it
aside (`<name>.old`, still mapped by engines of the old node: their late writes land there,
never in the new slab); `recoverable` then yields each chunk of a valid record whose bytes
still hash to its checksum (a torn or scribbled slot is dropped, counted), with its meta, to
be put into the new slab (one whose expiry has passed is not), and the old file is removed.
Only a file of the node's own user is recovered: /dev/shm is writable by every user, and a
slab's name is listed there, so another user could plant one of forged chunks at it. Anything
else at the slab's name (another user's file, a directory, a link) is left alone and the slab
created at a fresh one (`<name>.<random>`, removed at `close`); a predecessor's file goes to a
fresh aside name where `<name>.old` is taken.
**Stamps.** A slot's stamp (a 64-bit count) is bumped before the slot is written again
(`clear`): a node lends a chunk with its slot's stamp, and the engine reads the stamp again
once its copy out of the slot is done (`SlotStamps`). The same stamp: the slot was not
written since the lending, so what the engine copied is the chunk. Another: the node took the
lending back (`NodeConfig.lease_timeout_s`, an engine frozen past it) and gave the slot to
another chunk meanwhile: the copy is the wrong KV, and the load a failed one. The order: the
node writes the stamp before the slot's new bytes, and the engine reads the stamp after its
copy's reads (x86-64 keeps both orders; a device's copy is done when its event is).

The file's pages are allocated when it is created (posix_fallocate): charged to the node,
never to the engine that first writes a slot.

**Reads in place without the node.** An engine that knows which slot holds a chunk (it stored
it there, or was lent it before) reads it with no round trip to the node: it takes a shared
lock on the slot's record byte (`SlabReader.lock`: an open file description lock, F_OFD_SETLK,
a syscall, never waiting) and checks that the record is valid and names the chunk. The node
clears a record only under an exclusive lock of the same byte (`SharedSlab.claim`), taken
without waiting: where an engine holds the slot, the claim fails and the node leaves the slot
(its bytes and record untouched) until a later claim succeeds; a chunk leaving the tier gives
its slot up only once claimed. So while an engine's lock is held, the slot's bytes are the
record's chunk, whole. The kernel drops an engine's locks when it dies (no slot leaks), and a
lock is one syscall on the engine's own thread: no wait for the node's thread to be scheduled.

Primitives: `SharedSlab`, `SlabReader`, `SlotStamps`, `SHM_DIR`, `slab_file_bytes`,
`shm_size_bytes`, `is_own_file`, `holder_of`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import xxhash

from kvtier.core.keys import ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")  # where named shared memory lives on Linux
_RECORD = np.dtype([("key", "V16"), ("checksum", "<u8"), ("nbytes", "<u4"), ("valid", "u1"),
                    ("known", "u1"), ("pad", "V2"), ("parent", "V16"), ("tenant", "V32"),
                    ("retain_until", "<f8"), ("expires_at", "<f8")])
# Which of a record's meta fields are set (its "known" bits).
_PARENT, _TENANT, _RETAIN, _EXPIRES = 1, 2, 4, 8
_LEAVING = 2  # "valid": the chunk left while engines read it in place (not to be read again)
_FOOTER = struct.Struct("<8sQQQ32x")  # magic, slot_bytes, num_slots, chunk_bytes
_FLOCK = struct.Struct("@hhqqi4x")  # Linux's struct flock: type, whence, start, len, pid
_STAMP = np.dtype("<u8")  # a slot's stamp: bumped before the slot is written again
# Records with meta and a stamp a slot (KVTSLAB1's and KVTSLAB2's are not recovered: a node
# upgraded to stamps starts with a cold RAM once).
_MAGIC = b"KVTSLAB3"


def slab_file_bytes(slot_bytes: int, num_slots: int) -> int:
    """The size of a slab's file: its slots, a record per slot and the footer (what it
    takes in /dev/shm; `kvtier plan --node-engines` sizes a node's /dev/shm with it)."""
    return num_slots * (slot_bytes + _RECORD.itemsize + _STAMP.itemsize) + _FOOTER.size


def is_own_file(path: Path) -> bool:
    """Whether `path` is a regular file (not a link) of this process's user."""
    try:
        found = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(found.st_mode) and found.st_uid == os.geteuid()


def holder_of(path: Path) -> str:
    """What holds `path`, for a log: its kind and owner."""
    try:
        found = path.lstat()
    except OSError as exc:
        return f"something unreadable ({exc})"
    kind = "a directory" if stat.S_ISDIR(found.st_mode) else "a link" \
        if stat.S_ISLNK(found.st_mode) else "a file"
    return f"{kind} of uid {found.st_uid} (this node is uid {os.geteuid()})"


def shm_size_bytes() -> int | None:
    """The size of SHM_DIR's file system (a tmpfs: half the RAM by default), used or not;
    None where there is no SHM_DIR."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


class SharedSlab:
    """The slab and its records in /dev/shm/`name`; see the module docstring. Not
    thread-safe: the memory tier calls it under its lock (`record` hashes outside it)."""

    def __init__(self, name: str, slot_bytes: int, num_slots: int, chunk_bytes: int) -> None:
        """Create the file (a predecessor's renamed aside first, for `recoverable`).

        Raises:
            OSError: no /dev/shm, or no room for it (ENOSPC).
        """
        self.path = SHM_DIR / name
        self._name = name
        # Whether `path` is the name a successor recovers from (kept at `close(keep=True)`);
        # not once a fresh name was taken (`_create`).
        self._recoverable_name = True
        # A predecessor's file, until recovered: just moved aside, or moved by an earlier
        # try that found no room for the new one.
        self.old = self._move_aside(name)
        self.slot_bytes, self.num_slots, self.chunk_bytes = slot_bytes, num_slots, chunk_bytes
        size = slab_file_bytes(slot_bytes, num_slots)
        try:
            self._fd, self._mmap = self._create(size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or self.old is None:
                raise
            # A warm restart needs room for both files; without it, a cold RAM tier beats
            # none: the predecessor's chunks are dropped, not recovered.
            log.warning("%s: no room in %s for a new slab beside the last node's (%s); its "
                        "chunks are dropped, not recovered", name, SHM_DIR, exc)
            self.old.unlink(missing_ok=True)
            self.old = None
            self._fd, self._mmap = self._create(size)
        slab_bytes = num_slots * slot_bytes
        self._records_at = slab_bytes  # the records' offset in the file (the lock bytes')
        self.slots = np.frombuffer(self._mmap, dtype=np.uint8, count=slab_bytes)
        self._records = np.frombuffer(self._mmap, dtype=_RECORD, count=num_slots,
                                      offset=slab_bytes)
        self._stamps = np.frombuffer(self._mmap, dtype=_STAMP, count=num_slots,
                                     offset=slab_bytes + num_slots * _RECORD.itemsize)
        self._mmap[size - _FOOTER.size:] = _FOOTER.pack(_MAGIC, slot_bytes, num_slots,
                                                        chunk_bytes)

    def _move_aside(self, name: str) -> Path | None:
        """Move a predecessor's file (a regular file of this user at `path`) aside for
        `recoverable`, to `<name>.old`, or to a fresh name where another user's file, or a
        directory, holds that one; the file aside (this user's), or None. Anything else at
        `path` (another user's file, a directory, a link) is left where it is, unread
        (`_create` then takes a fresh name)."""
        old = SHM_DIR / f"{name}.old"
        if is_own_file(self.path):
            try:
                os.replace(self.path, old)
            except OSError:  # EPERM (another's, sticky /dev/shm), EISDIR: a fresh name
                old = SHM_DIR / f"{name}.old-{secrets.token_hex(8)}"
                try:
                    os.replace(self.path, old)
                except OSError as exc:
                    log.warning("%s: the last node's slab cannot be moved aside (%s); not "
                                "recovered", self.path, exc)
                    with contextlib.suppress(OSError):
                        self.path.unlink()
        return old if is_own_file(old) else None

    def _create(self, size: int) -> tuple[int, mmap.mmap]:
        """The new file (kept open: the node's claims lock its bytes), its pages allocated,
        mapped; at a fresh name (`<name>.<random>`, logged) where something not this node's
        holds its own: /dev/shm is every user's, and a slab's name is predictable, so any user
        of the host could take it first. A directory there (moved aside by a node running as
        root) refused the layout at every later start; another user's file, at the start of
        a node not running as root (it may not move it). A slab at a fresh name is removed
        at `close`: no successor looks for it (tests/node/test_node_slab_squatted.py).

        Raises:
            OSError: ENOSPC, no room.
        """
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            try:
                fd = os.open(self.path, flags, 0o660)
                break
            except FileExistsError:
                log.warning("%s is held by %s: this slab is created at a fresh name (its "
                            "chunks are not recovered by the next node while it stays: "
                            "remove it)", self.path, holder_of(self.path))
                self.path = SHM_DIR / f"{self._name}.{secrets.token_hex(8)}"
                self._recoverable_name = False
        try:
            os.fchmod(fd, 0o660)  # the umask must not narrow what the node's group may map
            os.posix_fallocate(fd, 0, size)
            return fd, mmap.mmap(fd, size, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            self.path.unlink()
            raise

    @staticmethod
    def checksum(data: memoryview) -> int:
        return xxhash.xxh3_64_intdigest(data)

    def record(self, index: int, key: ChunkKey, checksum: int,
               meta: ChunkMeta = DEFAULT_META) -> None:
        """Slot `index` holds `key`'s chunk, whose bytes hash to `checksum`, kept with `meta`
        (its engine aside)."""
        parent = meta.parent
        self._records[index] = (key, checksum, self.chunk_bytes, 0,
                                0 if parent is None else _PARENT, b"\0" * 2, parent or b"",
                                b"", 0.0, 0.0)
        self.record_meta(index, meta)
        self._records["valid"][index] = 1

    def record_meta(self, index: int, meta: ChunkMeta) -> None:
        """The chunk in slot `index` is kept with `meta`'s tenant, pin and expiry now (a pin or
        expiry extended); its parent stays as recorded."""
        record = self._records[index : index + 1]
        known = int(record["known"][0]) & _PARENT
        tenant = _tenant_bytes(meta.tenant)
        if tenant is not None:
            known |= _TENANT
            record["tenant"] = tenant
        if meta.retain_until is not None:
            known |= _RETAIN
            record["retain_until"] = meta.retain_until
        if meta.expires_at is not None:
            known |= _EXPIRES
            record["expires_at"] = meta.expires_at
        record["known"] = known

    def clear(self, index: int) -> None:
        """Slot `index` is about to be written (a free slot: no engine reads it in place):
        its record made invalid and its stamp bumped, both before the new bytes (an engine
        that still copies a lending of it, taken back, sees the stamp changed)."""
        self._records["valid"][index] = 0
        self._stamps[index] += 1

    def stamp(self, index: int) -> int:
        """Slot `index`'s stamp now (what a lending of its chunk carries)."""
        return int(self._stamps[index])

    def claim(self, index: int) -> bool:
        """Clear slot `index`'s record (its chunk left) unless an engine reads the slot in
        place (`SlabReader.lock`): then nothing changes, and False: the slot is not to be
        written until a later claim succeeds."""
        at = self._records_at + index * _RECORD.itemsize
        if not _lock(self._fd, fcntl.F_WRLCK, at):
            # No new read starts (nor a recovery): the chunk left. The reads under way
            # checked the record already; the bytes stay until a claim succeeds.
            self._records["valid"][index] = _LEAVING
            return False
        try:
            self._records["valid"][index] = 0
        finally:
            _lock(self._fd, fcntl.F_UNLCK, at)
        return True

    def clear_all(self) -> None:
        self._records["valid"][:] = 0

    def recoverable(self, now_s: float) -> Iterator[tuple[ChunkKey, memoryview, ChunkMeta]]:
        """Each chunk a predecessor's file holds whole (its record valid, its bytes hashing
        to its checksum) and not expired at `now_s` (wall clock), read-only, valid until the
        next one is asked for, with its meta; `dropped` counts the slots whose bytes did not
        hash to their checksum. The file is removed at the end."""
        self.dropped = 0
        if self.old is None:
            return
        try:
            yield from self._recover(self.old, now_s)
        finally:
            with contextlib.suppress(FileNotFoundError, PermissionError):  # another user's
                self.old.unlink()
            self.old = None

    def _recover(self, path: Path, now_s: float
                 ) -> Iterator[tuple[ChunkKey, memoryview, ChunkMeta]]:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            found = os.fstat(fd)
            if found.st_uid != os.geteuid() or not stat.S_ISREG(found.st_mode):
                # Any user may write /dev/shm and read a slab's name off it: a file another
                # user planted there would have had its forged chunks lent to the engines
                # (tests/cache/test_slab_foreign_files.py).
                log.warning("%s: not a slab of this node's user (uid %d, not %d); not "
                            "recovered", path, found.st_uid, os.geteuid())
                return
            size = found.st_size
            if size < _FOOTER.size:
                return
            old = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            yield from self._valid_chunks(path, old, size, now_s)
        finally:
            with contextlib.suppress(BufferError):  # a view still held: left to the GC
                old.close()

    def _valid_chunks(self, path: Path, old: mmap.mmap, size: int, now_s: float
                      ) -> Iterator[tuple[ChunkKey, memoryview, ChunkMeta]]:
        magic, slot_bytes, num_slots, chunk_bytes = _FOOTER.unpack(old[size - _FOOTER.size:])
        if magic != _MAGIC and magic.startswith(_MAGIC[:-1]):  # an upgrade: said as one
            log.warning("%s: a slab of an older kvtier's format (%s; this one writes %s, with a "
                        "stamp a slot); not recovered: this layout starts with an empty RAM, "
                        "once", path, magic.decode("ascii", "replace"), _MAGIC.decode())
            return
        if magic != _MAGIC or (slot_bytes, chunk_bytes) != (self.slot_bytes, self.chunk_bytes) \
                or slab_file_bytes(slot_bytes, num_slots) != size:
            log.warning("%s: not a slab of this layout (%r, %d B slots); not recovered",
                        path, magic, slot_bytes)
            return
        records = np.frombuffer(old, dtype=_RECORD, count=num_slots,
                                offset=num_slots * slot_bytes).copy()
        for index in np.flatnonzero(records["valid"] == 1):
            record = records[index]
            meta = _meta(record)
            if meta.expires_at is not None and meta.expires_at <= now_s:
                continue  # a miss by now anyway
            start = int(index) * slot_bytes
            with memoryview(old)[start:start + chunk_bytes] as data:
                if record["nbytes"] != chunk_bytes \
                        or self.checksum(data) != int(record["checksum"]):
                    self.dropped += 1
                    continue
                with data.toreadonly() as chunk:
                    yield ChunkKey(bytes(record["key"])), chunk, meta

    def close(self, keep: bool) -> None:
        """Stop recording; the file is removed unless `keep` (for the next node to recover).
        Mappings of it stay valid until unmapped."""
        if not keep or not self._recoverable_name:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SlabReader:
    """An engine's thread reading a node's slab in place, without asking the node (see the
    module docstring): `lock` a slot whose record names the chunk, read it, `unlock`. One per
    thread and mapping: an OFD lock belongs to its open file, so two threads sharing one
    would release each other's."""

    def __init__(self, fd: int, mapping: mmap.mmap | np.ndarray) -> None:
        """`mapping`: the whole slab file, mapped by the engine (or its bytes, as an array);
        `fd`: that same file opened by this thread (an open file description of its own,
        closed by `close`; a file opened again by its name might be a restarted node's).
        Once closed, it neither holds the file nor keeps the mapping.

        Raises:
            ValueError: it is not a slab of this format (no records to trust).
        """
        size = len(mapping)
        magic, slot_bytes, num_slots, _ = _FOOTER.unpack(np.frombuffer(
            mapping, dtype=np.uint8, offset=size - _FOOTER.size).tobytes()) \
            if size >= _FOOTER.size else (b"", 0, 0, 0)
        if magic != _MAGIC or slab_file_bytes(slot_bytes, num_slots) != size:
            os.close(fd)
            raise ValueError(f"not a kvtier slab with records ({magic!r})")
        self.slot_bytes, self._records_at = slot_bytes, num_slots * slot_bytes
        self._records = np.frombuffer(mapping, dtype=_RECORD, count=num_slots,
                                      offset=self._records_at)
        self._fd = fd
        # Slots held now, by how many loans (`lock` minus `unlock`): an OFD lock does not
        # count, so one slot lent twice (two requests of a step sharing a prefix) is unlocked
        # at its last loan's `unlock`, not its first; and whether `close` waits for them:
        # loans still out keep their locks, and their `unlock` must not meet a closed fd.
        self._held: dict[int, int] = {}
        self._closing = False
        self._held_lock = threading.Lock()

    def lock(self, index: int, key: ChunkKey) -> bool:
        """Hold slot `index` if its record names `key`, valid and unexpired: until
        `unlock`, its bytes are that chunk's, whole. False (nothing held): another chunk's,
        being written, gone, expired, or being claimed by the node this very moment."""
        at = self._records_at + index * _RECORD.itemsize
        with self._held_lock:
            if self._closing or not 0 <= index < len(self._records) \
                    or not _lock(self._fd, fcntl.F_RDLCK, at):
                return False
            record = self._records[index]
            if record["valid"] == 1 and bytes(record["key"]) == key and not (
                    int(record["known"]) & _EXPIRES and record["expires_at"] <= time.time()):
                self._held[index] = self._held.get(index, 0) + 1
                return True
            if index not in self._held:  # held already by another loan: stays locked
                _lock(self._fd, fcntl.F_UNLCK, at)
            return False

    def unlock(self, index: int) -> None:
        """Let slot `index` go (a closed reader's last one closes its file)."""
        with self._held_lock:
            loans = self._held.pop(index, 0) - 1
            if self._fd < 0 or loans < 0:
                return
            if loans:
                self._held[index] = loans
                return
            _lock(self._fd, fcntl.F_UNLCK, self._records_at + index * _RECORD.itemsize)
            if self._closing and not self._held:
                self._close_now()

    def close(self) -> None:
        """Lock nothing more; its file is closed (every lock dropped) once the slots held
        now are unlocked: a loan still out (a load's copies not done yet) keeps its slot's
        lock, so that the node leaves it alone until then."""
        with self._held_lock:
            self._closing = True
            if not self._held:
                self._close_now()

    def _close_now(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        # Its records' view no more: the engine unmaps a slab it let go (a dead node's) once
        # nothing views it, so that its pages are freed for the restarted node's slab.
        self._records = np.empty(0, dtype=_RECORD)


class SlotStamps:
    """An engine's view of a slab's stamps (see the module docstring): whether a slot is still
    as it was lent, read after the copy out of it is done."""

    def __init__(self, mapping: mmap.mmap | np.ndarray) -> None:
        """`mapping`: the whole slab file, as the engine maps it.

        Raises:
            ValueError: it is not a slab of this format (no stamps to read).
        """
        size = len(mapping)
        magic, slot_bytes, num_slots, _ = _FOOTER.unpack(np.frombuffer(
            mapping, dtype=np.uint8, offset=size - _FOOTER.size).tobytes()) \
            if size >= _FOOTER.size else (b"", 0, 0, 0)
        if magic != _MAGIC or slab_file_bytes(slot_bytes, num_slots) != size:
            raise ValueError(f"not a kvtier slab with stamps ({magic!r})")
        self.slot_bytes = slot_bytes
        self._stamps = np.frombuffer(mapping, dtype=_STAMP, count=num_slots,
                                     offset=num_slots * (slot_bytes + _RECORD.itemsize))

    def unchanged(self, offset: int, stamp: int) -> bool:
        """Whether the slot at `offset` (of the slab) still has `stamp`: not written again
        since a lending of it carried that stamp. Read after the copy out of it is done."""
        index = offset // self.slot_bytes
        return 0 <= index < len(self._stamps) and int(self._stamps[index]) == stamp


def _lock(fd: int, kind: int, at: int) -> bool:
    """Lock (F_RDLCK shared, F_WRLCK exclusive) or unlock (F_UNLCK) the byte at `at` of
    `fd`'s file, for its open file description, never waiting: False when another description
    holds a lock that conflicts."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, at, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _meta(record: np.void) -> ChunkMeta:
    """The meta a record keeps (its engine is not kept)."""
    known = int(record["known"])
    return ChunkMeta(
        tenant=bytes(record["tenant"]).hex() if known & _TENANT else None,
        retain_until=float(record["retain_until"]) if known & _RETAIN else None,
        expires_at=float(record["expires_at"]) if known & _EXPIRES else None,
        parent=ChunkKey(bytes(record["parent"])) if known & _PARENT else None)


def _tenant_bytes(tenant: str | None) -> bytes | None:
    """A tenant id's 32 bytes (`retention.tenant_id`: 64 hex digits); None for the default
    tenant or anything else (not kept)."""
    if tenant is None or len(tenant) != 64:
        return None
    try:
        return bytes.fromhex(tenant)
    except ValueError:
        return None
