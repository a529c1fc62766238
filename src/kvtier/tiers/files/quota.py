"""The quota ledger of a shared directory: how many bytes kvtier's files there may hold, agreed
between every process on every node that writes to it.

A per-process estimate, re-measured every scan, is not enough: 3 writers with a 4 MiB quota
reach 2.56x the quota at cold start and 1.17x in steady state, each writing against a usage
it measured before the others' writes (issue 12, item 5). The ledger is ROOT/.kvtier-quota,
little-endian int64 under an exclusive `flock` of that file:

    used_bytes      an upper bound of the bytes of kvtier's files (chunk and temp files)
    reserved_total  bytes ever reserved by writers (monotonic)
    completed_total bytes of writes ever ended (monotonic): renamed into place, or given
                    back (a failed write's, a duplicate's, a link probe's); what was reserved
                    and not ended is in flight (or a killed writer's)
    chunks          chunk files held, as counted by the writers (a gauge, not a bound)
    claimed_ns      unix time (ns) the last re-measure of the directory was claimed, by the
                    filesystem's clock (ChunkFiles.fs_now; one further ahead than
                    shared.FUTURE_CLAIM_S is taken as claimed now: a corrupt ledger must
                    not put off every re-measure)
    walk_ns         how long that walk took (0: unknown)
    repair          1: a writer found the usage over the quota with nothing left to evict,
                    and asks for a re-measure as soon as the interval allows

The first three are the ledger of builds before issue 28 (24 bytes); those builds read and
write only them and leave the rest alone, so old and new writers share one bound (older
builds add only renames to completed_total: their failed writes look in flight for ever, which
only loosens a re-measure's count back to theirs). A ledger of
24 bytes reads as "never re-measured" (claimed_ns 0).

The writers keep `used_bytes` an upper bound of the real usage at every moment:

- a writer reserves a chunk (`used += F`) and creates its temp file at full size (sparse, by
  ftruncate) under the lock, evicting first when the reservation would pass the quota;
- it renames the temp file into place under the lock, never over another writer's copy of
  the same chunk (two writers racing on one chunk: each asked whether it was held first,
  once): the second finds it placed and unlinks its own temp file, subtracting it
  (filetree.rename_new: where renames cannot refuse to replace, NFS, a hard link does).
  Where neither can (a filesystem without hard links) the rename replaces it and leaves
  `used` high by that copy until the next re-measure;
- every unlink by kvtier (eviction, delete, a corrupt file, a failed write's temp file) is
  done under the lock and subtracts the bytes it freed;
- `kvtier gc` unlinks under the lock too and subtracts (chunktree.FileInventory);
- deletions by others (an operator, an older kvtier gc, the stale-temp sweep) only make
  it high.

A re-measure corrects the drift without stopping the writers: read the two totals
(T0), scan the directory unlocked, then under the lock set `used = scanned + (reserved since
T0) + min(completed since T0, in flight at T0)`. Every file present then was seen by the scan
(it existed throughout), or was created (reserved) after T0, or was in flight at T0 and
renamed into place under the scan (a directory listing that spans a rename may show neither
name: at most what was in flight at T0, and no more than what ended since), so the sum is
still an upper bound. (Counting all that ended since T0 counted every write during the walk
twice more: a walk under busy writers evicted real chunks for them.) A walk that could not
open a directory (another user's: EACCES) did not see every file: its sum is then taken no
lower than the ledger's usage (the shared tier logs which directories).

A file created after T0 that the scan also saw counts twice (in `scanned` and in the bytes
reserved since T0), until the next re-measure. Bounded, and on the safe side:
- at most the bytes reserved during that walk (about half of them under steady writes: a
  file lands in a shard directory the walk has not read yet about as often as in one it has
  passed), the share of the cache rewritten while one walk ran;
- it never accumulates: each re-measure sets `used` afresh, with only its own walk's
  double count, and the writers' unlinks subtract only real files;
- it is too high, never too low: the usage stays an upper bound (the quota is never
  passed); the cost is that the directory evicts that many bytes early, holding up to
  that much less than its quota until the next re-measure repairs it
  (tests/tiers/test_shared_remeasure.py).
Not repaired within the walk, because a walk cannot tell a file created after T0 from one
that existed before and was read after T0: both have an mtime (and a ctime) after T0 (a hit
touches the mtime: the LRU order), and NFS has no birth time. Telling them apart would need
the writers to record what they create during a walk (a journal under the ledger's lock:
millions of entries in a long walk on a busy fleet), a listing of each shard under the
ledger's lock (the fleet's puts held for the whole walk, in slices), or a mark on touched
files that older kvtier builds and an operator's `touch` do not keep: a subtraction of a
file that was counted once makes the usage low, which breaks the bound, where the double
count only wastes room for a while.

The bound, for any number of writers on any number of nodes: the bytes of kvtier's chunk
and temp files in the directory never exceed the quota, provided (1) every writer is a
kvtier tier with this ledger, (2) `flock` is coherent between the nodes (any local
filesystem; NFSv4, CephFS; Lustre mounted with -o flock), and (3) nothing but kvtier adds
files to the tree. Where `flock` fails (ENOLCK) the ledger is used unlocked and the bound
no longer holds (logged once).

Each hold of the lock checks that the open file was not deleted (an fstat), and each
re-measure that it is the one at the ledger's path (`verify_path`: a stat more): a directory
emptied or made again under running engines, or a ledger deleted or moved, is opened again at
its path (a new ledger: the next put re-measures), so that no writer keeps the quota in a
file no one else sees. A forked child opens the ledger again
(flock locks an open file description, which a fork shares with the parent).

One walk at a time for the fleet: a re-measure is claimed in the ledger (`claimed_ns`, by
the shared tier) AND by an exclusive, non-blocking `flock` of ROOT/.kvtier-quota-walk held for
the whole walk (`try_walk` / `end_walk`). A ledger that is new or corrupt (not valid) has no
claim a writer can trust, nor one it can write (an invalid state is not written back): every
writer of every process asked for a walk at every put, and N engines starting on one NFS
directory each walked its millions of files, at once. The lock, not a time in the ledger, says
a walk is in flight: the others see it held and go on (hits served, puts dropped until the
walker's usage is in the ledger), and a walker that dies mid-walk holds it no longer (the
kernel drops a dead process's flock; an NFS server, that client's lock at its lease's end),
so the next put anywhere claims the walk again (tests/faults/test_one_walk_for_the_fleet.py).
Where the lock cannot be taken at all (ENOLCK, a walk-lock file this user cannot open) each
process walks on its own claims, as before (logged once).

Primitives: `QuotaLedger` (locked, verify_path, generation, try_walk, end_walk, close, path),
`LedgerState`, `LEDGER_NAME`, `WALK_LOCK_NAME`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
LEDGER_NAME = ".kvtier-quota"
WALK_LOCK_NAME = ".kvtier-quota-walk"  # flocked by the process that walks the directory
_FORMAT = struct.Struct("<qqqqqqq")
_OLD_BYTES = 24  # the first three fields: the ledger of builds before issue 28
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL})  # flock unsupported


@dataclass(slots=True)
class _OpenLedger:
    """The ledger's file as this process holds it: one fd and one thread lock per ledger
    file per process (flock is per open file on a local filesystem but a POSIX lock on NFS:
    per process, released by closing ANY fd of the file, so two tiers of one process must
    not each open the file)."""

    fd: int  # -1: closed (under `lock`), or to be opened again
    lock: threading.Lock
    users: int = 0
    generation: int = 0  # times the file was found gone and opened again
    pid: int = field(default_factory=os.getpid)  # the process that opened it
    walk_fd: int = -1  # ROOT/.kvtier-quota-walk, opened at the first claim of a walk
    walking: bool = False  # this process claimed the walk (under `walk_lock`)
    # guards walk_fd and walking; taken under `lock` (a claim is made holding the ledger)
    walk_lock: threading.Lock = field(default_factory=threading.Lock)


_OPEN: dict[str, _OpenLedger] = {}  # realpath of the root -> its ledger's file
_OPEN_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """After a fork, in the child: the parent's ledger files are not the child's. flock
    locks an open file description, which a fork shares: a child locking the parent's fd
    excluded nothing (tests/faults/test_quota_ledger_file.py). The child's ledgers open
    their files again when next locked; the locks may have been held by a parent's thread."""
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()
    for held in _OPEN.values():
        for fd in (held.fd, held.walk_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)  # the parent's flocks stay the parent's
        held.fd = held.walk_fd = -1
        held.walking = False
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@dataclass(slots=True)
class LedgerState:
    """The ledger's numbers while the lock is held; changes are written back on release."""

    used_bytes: int
    reserved_total: int
    completed_total: int
    valid: bool  # False: the file was new, short or garbage (used_bytes is unknown until a
    # re-measure sets it and marks the state valid; an invalid state is not written back)
    chunks: int = 0  # chunk files held (a gauge for stats; drifts, re-measured)
    claimed_ns: int = 0  # unix ns the last re-measure was claimed (0: never)
    walk_ns: int = 0  # how long the last re-measure's walk took
    repair: int = 0  # 1: a re-measure is asked for as soon as the interval allows

    def _fields(self) -> tuple[int, ...]:
        return (max(0, self.used_bytes), self.reserved_total, self.completed_total,
                max(0, self.chunks), self.claimed_ns, self.walk_ns, self.repair)


def _open_ledger(path: Path, file_mode: int) -> int:
    """The ledger's file, opened (created if absent).

    Raises:
        OSError: it cannot be; one that is not a regular file (a directory, a link, a FIFO
            someone left there: "Is a directory", "Illegal seek" later) names its path, what
            it is and that it must be removed.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, file_mode)
    except FileExistsError:
        pass
    else:
        os.fchmod(fd, file_mode)  # the umask must not narrow group_shared's 0660
        return fd
    try:
        info = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"not kvtier's quota ledger (a "
                          f"{stat.filemode(info.st_mode)} where a regular file belongs): "
                          "remove it, kvtier creates the ledger again", str(path))
        fd = os.open(path, flags | os.O_NONBLOCK)  # swapped for a FIFO meanwhile: no hang
    except FileNotFoundError:  # removed meanwhile
        return _open_ledger(path, file_mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not kvtier's quota ledger: remove it", str(path))
    return fd


class QuotaLedger:
    """ROOT/.kvtier-quota of one shared directory. Thread-safe and process-safe."""

    def __init__(self, root: Path, file_mode: int) -> None:
        """Raises:
            OSError: the ledger cannot be opened or created (a link at its path: ELOOP).
        """
        self.path = Path(root) / LEDGER_NAME
        self._key = os.path.realpath(root)
        self._file_mode = file_mode
        self._open = self._attach()
        self._lock_works = True
        self._walk_lock_works = True  # False: flock or the lock file unusable (try_walk)
        self._closed = False

    def _attach(self) -> _OpenLedger:
        """This process's open ledger file (opened if it has none), one more user of it."""
        with _OPEN_LOCK:
            if self._key not in _OPEN:
                _OPEN[self._key] = _OpenLedger(_open_ledger(self.path, self._file_mode),
                                               threading.Lock())
            held = _OPEN[self._key]
            held.users += 1
            return held

    def close(self) -> None:
        """Stop using the ledger (`locked` refuses from now on); its file is closed when the
        process's last user closes, once a `locked` block in flight has ended."""
        with _OPEN_LOCK:
            if self._closed:
                return
            self._closed = True
            if self._open.pid != os.getpid():  # a fork's child: the parent's, not its own
                return
            self._open.users -= 1
            if self._open.users == 0:
                del _OPEN[self._key]
                with self._open.lock, self._open.walk_lock:
                    for fd in (self._open.fd, self._open.walk_fd):
                        if fd >= 0:
                            os.close(fd)
                    self._open.fd = self._open.walk_fd = -1
                    self._open.walking = False

    @contextmanager
    def locked(self) -> Iterator[LedgerState]:
        """The ledger, exclusively: no other thread or process holds it meanwhile. What the
        block changes in the state is written back when it exits (also on an exception:
        the block's unlinks have happened).

        Raises:
            OSError: EBADF once closed (a closed ledger's fd number may name another file of
                the process by now: tests/faults/test_quota_ledger_file.py); the ledger's
                file cannot be read or written.
        """
        if self._open.pid != os.getpid() and not self._closed:  # a fork's child
            self._open = self._attach()
        with self._open.lock:
            if self._closed:
                raise OSError(errno.EBADF, "the quota ledger is closed", str(self.path))
            fd = self._locked_fd()
            try:
                raw = os.pread(fd, _FORMAT.size, 0)
                if len(raw) >= _OLD_BYTES:  # an old build's ledger: the rest is zero
                    raw = raw.ljust(_FORMAT.size, b"\0")
                values = _FORMAT.unpack(raw) if len(raw) == _FORMAT.size else (-1,) * 7
                valid = min(values) >= 0
                state = LedgerState(values[0], values[1], values[2], True, values[3],
                                    values[4], values[5], values[6]) if valid \
                    else LedgerState(0, 0, 0, False)
                before = state._fields()
                try:
                    yield state
                finally:
                    after = state._fields()
                    if state.valid and (after != before or not valid):
                        os.pwrite(fd, _FORMAT.pack(*after), 0)
            finally:
                self._flock(fd, fcntl.LOCK_UN)

    def try_walk(self) -> bool:
        """Claim the walk of the directory (a re-measure) for this process: True when no
        other process, nor another thread of this one, walks it now; this process then holds
        it until `end_walk` (or its death). Never blocks: a caller under the ledger's lock
        must not wait for a walk of millions of files. Any thread.

        True as well where the lock cannot be used (flock unsupported, a lock file this
        user may not open: logged once), as every claim was before it: an invalid ledger
        must never wait for a walk no one can claim.
        """
        if self._open.pid != os.getpid() and not self._closed:  # a fork's child
            self._open = self._attach()
        held = self._open
        with held.walk_lock:
            if held.walking or self._closed:
                return False
            if self._walk_lock_works:
                try:
                    self._flock_walk(held)
                except BlockingIOError:
                    return False  # another process walks
                except OSError as exc:
                    self._walk_unlocked(held, exc)
            held.walking = True
            return True

    def end_walk(self) -> None:
        """Release the walk `try_walk` claimed (nothing if this process holds none). Any
        thread: the claim is the process's, whichever thread walked."""
        held = self._open
        with held.walk_lock:
            if not held.walking:
                return
            held.walking = False
            if held.walk_fd >= 0:
                with contextlib.suppress(OSError):
                    fcntl.flock(held.walk_fd, fcntl.LOCK_UN)

    def _flock_walk(self, held: _OpenLedger) -> None:
        """Take the walk lock's flock, without waiting; its file opened first (again, if it
        was deleted: the directory emptied under the writers, who lock the new one).

        Raises:
            BlockingIOError: another process holds it.
            OSError: it cannot be opened or locked.
        """
        if held.walk_fd >= 0 and os.fstat(held.walk_fd).st_nlink == 0:
            os.close(held.walk_fd)
            held.walk_fd = -1
        if held.walk_fd < 0:
            held.walk_fd = _open_ledger(self.path.with_name(WALK_LOCK_NAME), self._file_mode)
        fcntl.flock(held.walk_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _walk_unlocked(self, held: _OpenLedger, exc: OSError) -> None:
        """The walk lock failed: this claim walks without it. Unusable here for good
        (unsupported, or not this user's to open): every later claim too, logged once; else
        (a directory gone or replaced) the next claim opens it again."""
        if held.walk_fd >= 0:
            os.close(held.walk_fd)
            held.walk_fd = -1
        if isinstance(exc, PermissionError) or exc.errno in _NO_FLOCK:
            self._walk_lock_works = False
            log.warning("%s: the walk lock %s cannot be used (%s); each writer walks the "
                        "directory on its own claims", self.path.parent, WALK_LOCK_NAME, exc)

    @property
    def generation(self) -> int:
        """How many times this process found the ledger's file gone and opened it again (a
        state read under another generation is another file's)."""
        return self._open.generation

    def verify_path(self) -> None:
        """Open the ledger again if the file at its path is not the one held: one renamed
        away, or deleted on this NFS client while open (renamed to .nfsXXXX: its link count
        is not 0), which `locked`'s fstat does not see. Two stats: for the start of a
        re-measure, not for every hold of the lock (on NFS each is a round trip).

        Raises:
            OSError: EBADF once closed; the ledger cannot be opened again.
        """
        if self._open.pid != os.getpid() and not self._closed:  # a fork's child
            self._open = self._attach()
        with self._open.lock:
            if self._closed:
                raise OSError(errno.EBADF, "the quota ledger is closed", str(self.path))
            if self._open.fd >= 0 and self._moved(self._open.fd):
                self._drop_fd()
            if self._open.fd < 0:
                self._open.fd = _open_ledger(self.path, self._file_mode)

    def _locked_fd(self) -> int:
        """The fd of the ledger's file, flocked. A file found deleted (its link count 0, or
        a stale NFS handle: the directory emptied or made again under running engines) is
        closed and the path opened again: a writer must not keep the quota in a file no one
        else sees (on NFS every put failed). A new ledger is not valid: the next put
        re-measures. One fstat, which a flock on NFS has just revalidated. Caller holds the
        thread lock.

        Raises:
            OSError: the ledger cannot be opened again (the directory is gone: ENOENT).
        """
        while True:
            if self._open.fd < 0:
                self._open.fd = _open_ledger(self.path, self._file_mode)
            fd = self._open.fd
            self._flock(fd, fcntl.LOCK_EX)
            if not self._gone(fd):
                return fd
            self._flock(fd, fcntl.LOCK_UN)
            self._drop_fd()

    def _drop_fd(self) -> None:
        """Close the ledger's file, found gone: the next hold opens the one at the path."""
        log.warning("%s was removed or replaced under this writer (the directory emptied or "
                    "made again?); opening the ledger at that path", self.path)
        os.close(self._open.fd)
        self._open.fd = -1
        self._open.generation += 1

    @staticmethod
    def _gone(fd: int) -> bool:
        """Whether the file of `fd` was deleted: one fstat."""
        try:
            return os.fstat(fd).st_nlink == 0
        except OSError as exc:
            if exc.errno == errno.ESTALE:  # NFS: deleted by another node
                return True
            raise

    def _moved(self, fd: int) -> bool:
        """Whether `fd` is not the file at the ledger's path (gone, or another): two stats."""
        try:
            held = os.fstat(fd)
            there = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.ESTALE:
                return True
            raise
        return (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino)

    def _flock(self, fd: int, operation: int) -> None:
        if not self._lock_works:
            return
        try:
            fcntl.flock(fd, operation)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            self._lock_works = False
            log.warning("%s: flock unsupported here (%s); the shared quota is kept without a "
                        "lock and can be overshot by concurrent writers", self.path, exc)
