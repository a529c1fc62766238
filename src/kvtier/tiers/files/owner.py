"""The owner of a disk tier's layout directory: one open disk tier at a time.

A disk tier keeps its directory's index in memory and enforces its capacity alone. Two tiers
on one directory (two engines on one host with the same model and disk path; vLLM's
data-parallel ranks, which share one config) each exceeded the capacity by the other's
files, evicted the other's chunks behind its index (failed loads, recomputed) and counted
wrong. So a disk tier holds an exclusive `flock` of ROOT/<layout digest>/.kvtier-owner for
its life: its `close` releases it, and the kernel does when the process ends, however it
ends (a crash never leaves the directory locked). The file holds the owner's pid, for the
message of a refused open only (a pid is never trusted to decide: the lock decides).

Two tiers of one process conflict as well: flock locks an open file description, and each
tier opens the file (but on NFS, whose flock is a per-process POSIX lock, only processes
are told apart). A filesystem without flock (ENOLCK, EOPNOTSUPP) is used unlocked, with one
warning.

The lock is on the owner file, not on the path: a layout directory removed under its owner
(an operator clearing the cache with `rm -rf`) took the lock with it, the tier's next put made
the directory again, and a second engine opened it unrefused. The owner takes the new
directory's lock at its next put (`keep`, within KEEP_CHECK_S), and one whose directory
another engine took first writes no more (tests/faults/test_disk_directory_removed.py).

The file's name is none of kvtier's chunk or temp names: walks, scans, inventories, `kvtier
gc` and the capacity never count or remove it (`filetree.walk`).

A vLLM engine opens its disk tier only once its model is loaded and its memory profiled
(the workers' register_kv_caches; the scheduler's side is built after that), so a second
server on the same directory learnt it was refused a whole start-up later. `refuse_owned`
tells the operator before vLLM is started (`kvtier serve`): the directories of a model's
namespaces (their manifests name the model) whose lock another process holds now.

Primitives: `DirectoryOwner` (keep, release), `refuse_owned`, `OWNER_NAME`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Collection
from pathlib import Path

from kvtier.errors import DirectoryInUse
from kvtier.tiers.files.filetree import open_dir
from kvtier.tiers.files.manifests import file_manifests

log = logging.getLogger(__name__)
OWNER_NAME = ".kvtier-owner"
# How long an open tries the lock again before it refuses: `refuse_owned` holds a shared lock
# for the microseconds between two calls; an owner holds the lock for its life.
PROBE_GRACE_S = 0.05
# How often `keep` looks at the owner file (an fstat): not at every put, which asks the
# filesystem for nothing else (tests/tiers/test_disk_put_syscalls.py); a second engine takes
# a whole start-up to open its tier, far longer.
KEEP_CHECK_S = 1.0
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL})


class DirectoryOwner:
    """This tier's ownership of ROOT/<layout digest>, held until `release`. Thread-safe."""

    def __init__(self, name: str, root: Path, layout_digest: str, file_mode: int,
                 dir_mode: int = 0o700) -> None:
        """Take ownership of the layout directory (which must exist) for the tier `name`;
        `dir_mode`: the mode it is made again with (`keep`).

        Raises:
            DirectoryInUse: another open disk tier owns it (in another process, or in this
                one: the message names the path, the owner's pid and the remedy).
            OSError: the owner file cannot be opened (a link or a directory at its path).
        """
        self.path = Path(root) / layout_digest / OWNER_NAME
        self._name, self._root, self._digest = name, Path(root), layout_digest
        self._modes = (dir_mode, file_mode)
        self._lost = False  # another tier took the directory, made again, first (`keep`)
        self._retake = False  # removed, and not made again and locked yet (`keep`)
        self._next_check = 0.0  # time.monotonic() of `keep`'s next look at the file
        self._guard = threading.Lock()
        # Whether the flock is held: False where the filesystem has none (used unlocked,
        # other writers possible), and once released.
        self.locked = False
        dir_fd = open_dir(Path(root), [layout_digest])
        try:
            self._fd = _open_owner_file(dir_fd, file_mode, self.path)
        finally:
            os.close(dir_fd)
        try:
            self._lock(name)
        except BaseException:
            self.release()
            raise

    def _lock(self, name: str) -> None:
        """flock the owner file and write this process's pid in it."""
        try:
            _lock_exclusive(self._fd)
        except BlockingIOError:
            raise DirectoryInUse(_in_use(name, self.path, _pid_in(self._fd))) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            log.warning("%s: flock unsupported here (%s); the disk tier %r does not keep "
                        "other engines out of its directory (each must have a path of its "
                        "own)", self.path, exc, name)
            return
        self.locked = True
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def keep(self) -> bool:
        """Whether this tier still owns its layout directory. One removed under it (its
        owner file gone with it) is taken again: made again if need be, its owner file
        created and locked, unless another tier holds that lock (False from then on, logged:
        the directory is that tier's). False, tried again at the next call, when it cannot
        be made again (the root gone). One fstat while the owner file is there, at most one
        each KEEP_CHECK_S; True where the filesystem has no flock, and once released. Any
        thread."""
        with self._guard:
            if self._lost:
                return False
            now = time.monotonic()
            if not self._retake and (now < self._next_check or not self.locked):
                return True
            self._next_check = now + KEEP_CHECK_S
            if not self._retake and os.fstat(self._fd).st_nlink > 0:
                return True
            self._close_fd()
            self._retake = True
            try:
                dir_fd = open_dir(self._root, [self._digest], self._modes[0])
                try:
                    self._fd = _open_owner_file(dir_fd, self._modes[1], self.path)
                finally:
                    os.close(dir_fd)
                self._lock(self._name)
            except (DirectoryInUse, OSError) as exc:
                self._close_fd()
                self._lost = isinstance(exc, DirectoryInUse)
                (log.error if self._lost else log.warning)(
                    "disk tier %r: %s was removed under it and is not its own again (%s)%s",
                    self._name, self.path.parent, exc,
                    "; it writes no more until it restarts" if self._lost else "")
                return False
            self._retake = False
            log.warning("disk tier %r: %s was removed under it; made again, and owned",
                        self._name, self.path.parent)
            return True

    def _close_fd(self) -> None:
        """Close the owner file (its lock with it), if open. Caller holds the guard."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.locked = False

    def release(self) -> None:
        """Give the directory up (closing the file drops the lock); a second call does
        nothing. Any thread."""
        with self._guard:
            self._close_fd()
            self._retake = False


def _lock_exclusive(fd: int) -> None:
    """flock `fd` exclusively, trying again for PROBE_GRACE_S while another holds it.

    Raises:
        BlockingIOError: another still holds it; OSError: flock failed.
    """
    deadline = time.monotonic() + PROBE_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(PROBE_GRACE_S / 10)


def refuse_owned(name: str, root: Path, models: Collection[str]) -> None:
    """Refuse, as an open would, where an open disk tier owns one of the layout directories
    under `root` whose manifest names one of `models` (a model's name as served: an engine
    of that model would open one of them). Nothing where none does, or none can be told
    (no manifest, no owner file, flock unsupported: the tier's own open decides).

    Each owner file is tried with a shared flock, without waiting, and let go at once: never
    kept, so it refuses no one (an open that meets it tries again: PROBE_GRACE_S). Call it
    before starting the engines it checks for, never beside them: their own lock would be
    taken for another's.

    Raises:
        DirectoryInUse: the message of a refused open (the directory, the owner's pid, the
            remedy), naming the tier `name`.
        OSError: `root` cannot be listed (absent: nothing is refused).
    """
    for namespace, manifest in file_manifests(root).items():
        if manifest is not None and manifest.model in models:
            _refuse_if_locked(name, Path(root), namespace)


def _refuse_if_locked(name: str, root: Path, namespace: str) -> None:
    """Raise DirectoryInUse where another open file holds ROOT/`namespace`'s owner lock."""
    path = root / namespace / OWNER_NAME
    try:
        dir_fd = open_dir(root, [namespace])
    except OSError:
        return  # gone meanwhile, or not a directory: no owner
    try:
        fd = os.open(OWNER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return  # never owned (or a link: the open says so)
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryInUse(_in_use(name, path, _pid_in(fd))) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
    finally:
        os.close(fd)  # the shared lock, if taken, with it


def _open_owner_file(dir_fd: int, file_mode: int, path: Path) -> int:
    """The owner file in the directory `dir_fd`, opened (created if absent), never through a
    link, never a FIFO's open that waits.

    Raises:
        OSError: it cannot be opened, or is not a regular file (its path: remove it).
    """
    fd = os.open(OWNER_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC, file_mode, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not kvtier's owner file: remove it", str(path))
    return fd


def _pid_in(fd: int) -> int | None:
    """The pid the owner wrote in its file; None when unreadable (not written yet)."""
    try:
        return int(os.pread(fd, 32, 0).decode())
    except (OSError, ValueError):
        return None


def _in_use(name: str, path: Path, pid: int | None) -> str:
    """The one-line message of a refused open: the path, its owner, the remedy."""
    if pid == os.getpid():
        owner = f"another disk tier of this process (pid {pid}), not closed"
    else:
        owner = f"another kvtier process (pid {pid if pid is not None else 'unknown'})"
    return (f"disk tier {name!r}: {path.parent} is owned by {owner} (it holds the lock "
            f"{path.name} there); a disk directory serves one engine at a time (that engine "
            "alone keeps its index and capacity): give each engine a disk path of its own, "
            "or use `kind: shared` for a directory several engines write (vLLM's "
            "data-parallel ranks share one config)")
