"""A file tier's directory tree, walked without ever following a link below its root.

The disk and shared tiers keep ROOT/<layout digest>/<k0k1>/<k2k3>/<key hex>.kvc. Other users
and processes can change that tree (a shared directory, a group-writable cache), so nothing
below ROOT is trusted: a directory replaced by a symlink must not make kvtier write into or
delete from the link's target, and a FIFO at a chunk path must not hang the reader (issue 12,
items 1 and 2; tests/faults/test_symlinks.py, test_fifo_and_devices.py). Every path below ROOT is
therefore reached one component at a time from a directory fd, each opened with
O_NOFOLLOW | O_DIRECTORY: a symlink anywhere on the way is an error (ELOOP/ENOTDIR), never a
detour. ROOT itself is the operator's configured path and may be a link.

Only kvtier's own names are walked or removed: layout directories (32 hex digits), shard
directories (2 hex digits), chunk files (32 hex digits + ".kvc") and kvtier's temp files
(`.<key hex>.kvc.<12 hex>.tmp` next to a chunk, `.probe-<32 hex>.tmp` and
`.manifest-<32 hex>.tmp` in a layout directory; the manifest itself, `manifest.json`, is read
by tiers/manifest.py, never walked as a chunk).
Anything else found in the tree, and anything that is not what its name says (a symlink, a
FIFO, a device, a directory named like a file), is skipped and left alone.

Directories kvtier creates get the tier's mode with the setgid bit kept: under a setgid root
(the administrator's way to keep a group cache in one group) the kernel sets S_ISGID on each
new directory, and an explicit chmod to 0770 would clear it, so later files would fall into
the writer's primary group (issue 12, item 4; tests/faults/test_group_sharing.py).

A file is counted at the bytes `counted_bytes` gives it, wherever it is met (a walk, a sample,
an unlink), so that the shared tier's ledger subtracts for an unlink what a re-measure added.

Primitives: `open_dir`, `make_root`, `lstat_file`, `unlink_file`, `file_id`, `FileId`,
`rename_new`, `walk`, `Entry`,
`sample_shards` (the shared tier's sampled eviction), `sweep_layout_temps`, `counted_bytes`,
`TEMP_STALE_S`, `is_temp_name`, `DIR_FLAGS`, `NOT_OURS`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import re
import stat
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.chunkformat import MAGIC
from kvtier.tiers.files.fsops import NO_OPS, FsOps
from kvtier.tiers.manifest import LAYOUT_NAME, is_layout_name

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A kvtier temp file older than this belongs to a writer that died: it is deleted by the next
# scan (the shared tier's quota scan, every scan_interval_s; the disk tier's start-up scan,
# which sweeps every chunk temp file, however young, where it holds the owner lock).
# A chunk write takes well under a second; a live writer whose temp file is swept anyway (a
# write stalled this long) only loses that one write (its rename fails: a dropped write).
# Ages are taken by the clock that stamps the mtimes (the shared tier's `ChunkFiles.fs_now`:
# on NFS the server's), not by a node's own, which may run minutes ahead.
TEMP_STALE_S = 120.0
_SHARD = re.compile(r"[0-9a-f]{2}")
_CHUNK = re.compile(r"[0-9a-f]{32}\.kvc")
_CHUNK_TEMP = re.compile(r"\.[0-9a-f]{32}\.kvc\.[0-9a-f]{12}\.tmp")
# an O_DIRECT probe, or a namespace manifest being written (tiers/manifest.py)
_PROBE_TEMP = re.compile(r"\.(?:probe|manifest)-[0-9a-f]{32}\.tmp")
# errnos of a path that is not (or no longer) what kvtier's layout says it is
NOT_OURS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})


def is_temp_name(name: str) -> bool:
    """Whether `name` is one of kvtier's temp files (a chunk write, or an O_DIRECT probe)."""
    return bool(_CHUNK_TEMP.fullmatch(name) or _PROBE_TEMP.fullmatch(name))


def counted_bytes(dir_fd: int, name: str, info: os.stat_result, ops: FsOps = NO_OPS) -> int:
    """The bytes the regular file `name` in the directory `dir_fd` (its lstat: `info`) counts
    for in a quota: its size, as kvtier reserves it. But a chunk file that allocates less than
    half of its size and does not begin with a chunk header's magic is a sparse file kvtier
    did not write (kvtier writes every byte of a chunk; `truncate -s 100G` at a chunk's path
    evicted every real chunk of a shared directory for it, tests/faults/
    test_sparse_foreign_files.py): it counts what it allocates, as `du` does. A temp file
    counts its size (kvtier reserves it full-size, sparse, and fills it later).

    Costs an open and an 8-byte read only for a chunk file that looks sparse: none where
    files are allocated as written; one per file where the filesystem compresses, or reports
    blocks late (ZFS, until its transaction group commits) or never (some FUSE mounts: 0).
    A file that cannot be read counts its size (an upper bound). Never raises.
    """
    allocated = info.st_blocks * 512
    if 2 * allocated >= info.st_size or is_temp_name(name):
        return info.st_size
    ops.add(opens=1)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
        try:
            head = os.pread(fd, len(MAGIC), 0)
        finally:
            os.close(fd)
    except OSError:
        return info.st_size
    return info.st_size if head == MAGIC else allocated


def open_dir(root: Path, parts: Sequence[str], create_mode: int | None = None,
             ops: FsOps = NO_OPS) -> int:
    """An fd of root/parts[0]/.../parts[-1], no link followed below `root`.

    Args:
        create_mode: create missing directories with this mode (setgid kept, see module
            docstring); None: a missing directory raises FileNotFoundError.
        ops: where the opens and mkdirs are counted (`kvtier.tiers.files.fsops`).
    Returns:
        A directory fd (O_CLOEXEC), the caller's to close.
    Raises:
        OSError: ELOOP/ENOTDIR when a component is a link or not a directory, ENOENT when
            missing (and not created), EACCES, EROFS, ...
    """
    ops.add(opens=1)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            child = _open_child(fd, part, create_mode, ops)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_child(parent_fd: int, name: str, create_mode: int | None, ops: FsOps) -> int:
    ops.add(opens=1)
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if create_mode is None:
            raise
    ops.add(other=1, opens=1)
    try:
        os.mkdir(name, create_mode, dir_fd=parent_fd)
    except FileExistsError:  # another process made it: its mode is its creator's
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    _set_mode(fd, create_mode)
    return fd


def _set_mode(fd: int, mode: int) -> None:
    """`mode` whatever the umask, keeping the S_ISGID the kernel inherited from the parent."""
    os.fchmod(fd, mode | (os.fstat(fd).st_mode & stat.S_ISGID))


def make_root(directory: Path, mode: int) -> None:
    """Create `directory` (the tier's root) and its missing parents with exactly `mode`
    (setgid kept), whatever the umask; existing directories are left alone.
    `mkdir(parents=True)` would create the root 0755 under umask 022 (key names listable
    by all users; tests/tiers/test_permissions.py)."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=mode)
        except FileExistsError:
            continue
        fd = os.open(path, DIR_FLAGS)
        try:
            _set_mode(fd, mode)
        finally:
            os.close(fd)


def lstat_file(root: Path, parts: Sequence[str],
               ops: FsOps = NO_OPS) -> os.stat_result | None:
    """The lstat of root/parts... when it is a regular file reached without a link; None
    when it is absent, not a regular file, or behind a link. Raises other OSErrors
    (EACCES, ESTALE, ...)."""
    try:
        fd = open_dir(root, parts[:-1], ops=ops)
    except OSError as exc:
        if exc.errno in NOT_OURS:
            return None
        raise
    ops.add(stats=1)
    try:
        info = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in NOT_OURS:
            return None
        raise
    finally:
        os.close(fd)
    return info if stat.S_ISREG(info.st_mode) else None


# A file's identity (`file_id`): st_dev, st_ino, st_ctime_ns.
FileId = tuple[int, int, int]


def file_id(info: os.stat_result) -> FileId:
    """The identity of the file `info` is a stat of: its device and inode, and its change
    time, since ext4 gives a freed inode number to the next file at once (a copy of a chunk
    placed since its last file was removed has a later change time, but within the clock's
    tick; the same inode is then taken for the same file, as before)."""
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


def unlink_file(root: Path, parts: Sequence[str], ops: FsOps = NO_OPS,
                not_after: float | None = None, same_file: FileId | None = None) -> int | None:
    """Delete the regular file root/parts... (never through a link, never anything but a
    regular file, or a symlink/FIFO/device sitting at a chunk path of kvtier's layout);
    with `not_after`, only if its mtime is not later (an eviction's victim read since it
    was chosen is kept); with `same_file`, only if it is that file (`file_id`: a corrupt
    one read, not a copy placed since).

    Returns:
        None when nothing was removed (absent, a directory, or behind a link); else the
        bytes freed: the file's `counted_bytes`, 0 for a link or special file, or for a
        regular file with other hard links (which frees nothing).
    Raises:
        OSError: other than absent/not-ours (EACCES, EROFS, ...).
    """
    try:
        fd = open_dir(root, parts[:-1], ops=ops)
    except OSError as exc:
        if exc.errno in NOT_OURS:
            return None
        raise
    try:
        ops.add(stats=1)
        info = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode) or (not_after is not None and info.st_mtime > not_after) \
                or (same_file is not None and file_id(info) != same_file):
            return None
        freed = counted_bytes(fd, parts[-1], info, ops) \
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 else 0
        ops.add(unlinks=1)
        os.unlink(parts[-1], dir_fd=fd)  # unlink never follows a link: it removes the link
    except OSError as exc:
        if exc.errno in NOT_OURS:
            return None
        raise
    finally:
        os.close(fd)
    return freed


@dataclass(frozen=True, slots=True)
class Entry:
    """A regular file of kvtier's layout found by `walk`."""

    layout_digest: str
    shard: tuple[str, str] | None  # (k0k1, k2k3); None for a file in the layout directory
    name: str
    size_bytes: int  # what it counts for in a quota (`counted_bytes`); a sample's: st_size
    mtime: float
    temp: bool  # one of kvtier's temp files (not a chunk)

    def parts(self) -> tuple[str, ...]:
        """Its path below the root, component by component."""
        return (self.layout_digest, *(self.shard or ()), self.name)


_RENAME_NOREPLACE = 1  # renameat2(2): fail with EEXIST rather than replace the target
_LIBC = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_LIBC, "renameat2", None)  # glibc >= 2.28
_renames_new = [_renameat2 is not None]  # False once a filesystem refused the flag
_links_new = [True]  # False once a filesystem refused hard links
# errnos of a filesystem that makes no hard links (FUSE mounts, some object-store gateways)
_NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS})


def rename_new(dir_fd: int, source: str, target: str) -> bool:
    """Rename `source` to `target` in the directory `dir_fd` unless `target` exists: True
    when renamed, False when `target` was there (`source` is left as it was). One syscall,
    atomic (renameat2 RENAME_NOREPLACE). Where the filesystem or libc has no such flag (NFS,
    CephFS, some FUSE mounts: EINVAL, ENOSYS) a hard link to `target`, which refuses to
    replace too (EEXIST), then an unlink of `source`: a replacing rename let the second of
    two writers of one chunk replace the first, counted twice in the shared quota until a
    re-measure (tests/tiers/test_same_chunk_race.py). Where there are no hard links either,
    a replacing rename, and True.

    Raises:
        OSError: the rename failed otherwise (ENOENT: `source` is gone).
    """
    if _renames_new[0]:
        assert _renameat2 is not None
        if _renameat2(dir_fd, source.encode(), dir_fd, target.encode(),
                      _RENAME_NOREPLACE) == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            return False
        if code not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), source)
        _renames_new[0] = False
    if _links_new[0]:
        placed = _link_new(dir_fd, source, target)
        if placed is not None:
            return placed
    os.replace(source, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return True


def _link_new(dir_fd: int, source: str, target: str) -> bool | None:
    """`rename_new` by a hard link and an unlink; None when the filesystem makes no links."""
    try:
        os.link(source, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        # NFS over a lossy link: a retransmitted LINK may answer EEXIST for the link that
        # was made; then `source` has two names.
        if os.stat(source, dir_fd=dir_fd, follow_symlinks=False).st_nlink < 2:
            return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        _links_new[0] = False
        return None
    with contextlib.suppress(FileNotFoundError):  # swept as stale meanwhile
        os.unlink(source, dir_fd=dir_fd)
    return True


def walk(root: Path, layout_digests: Sequence[str] | None = None,
         ops: FsOps = NO_OPS, unreadable: list[str] | None = None) -> Iterator[Entry]:
    """Every regular chunk and kvtier temp file below `root` (of `layout_digests`, or of
    every layout), found with directory fds and lstat only: links, special files, foreign
    names and directories kvtier does not make are neither entered nor reported. A
    directory this process may not open (EACCES: another user's) is skipped, its path
    below `root` added to `unreadable` when given: what it holds was not seen.

    Raises:
        OSError: `root` itself cannot be opened (absent: nothing is yielded).
    """
    try:
        ops.add(opens=1)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        names = layout_digests if layout_digests is not None else [
            n for n, _ in _children(root_fd, True, ops) if is_layout_name(n)]
        for digest in names:
            yield from _walk_layout(root_fd, digest, ops, unreadable)
    finally:
        os.close(root_fd)


def _walk_layout(root_fd: int, digest: str, ops: FsOps,
                 unreadable: list[str] | None) -> Iterator[Entry]:
    for layout_fd in _subdir(root_fd, digest, ops, unreadable, digest):
        for name, info in _children(layout_fd, False, ops):
            if _PROBE_TEMP.fullmatch(name):  # a temp file: counted at its size
                yield Entry(digest, None, name, info.st_size, info.st_mtime, True)
        for first, _ in _children(layout_fd, True, ops):
            if not _SHARD.fullmatch(first):
                continue
            for first_fd in _subdir(layout_fd, first, ops, unreadable, f"{digest}/{first}"):
                for second, _ in _children(first_fd, True, ops):
                    if _SHARD.fullmatch(second):
                        yield from _shard_files(first_fd, digest, (first, second), ops,
                                                unreadable)


def _shard_files(parent_fd: int, digest: str, shard: tuple[str, str], ops: FsOps,
                 unreadable: list[str] | None = None) -> Iterator[Entry]:
    """The chunk and temp files of the shard directory `shard[1]` under `parent_fd`."""
    for shard_fd in _subdir(parent_fd, shard[1], ops, unreadable, "/".join((digest, *shard))):
        for name, info in _children(shard_fd, False, ops):
            temp = bool(_CHUNK_TEMP.fullmatch(name))
            if temp or _CHUNK.fullmatch(name):
                yield Entry(digest, shard, name, counted_bytes(shard_fd, name, info, ops),
                            info.st_mtime, temp)


def sample_shards(root: Path, rng: random.Random, ops: FsOps = NO_OPS,
                  per_directory: int = 64, prune: bool = False,
                  ) -> Generator[list[Entry], None, None]:
    """The files of the shard directories ROOT/<layout>/<s1>/<s2>, one directory at a time,
    in a random order without repeats: first one random <s2> of each (layout, <s1>) in a
    random order, then a second of each, and so on, until every one was visited (or the
    caller stops). What the shared tier's eviction samples (an approximate LRU, as Redis
    samples its keyspace): a caller that stops after a few directories reads a few dozen
    files, whatever the tree holds; one that needs more of a small tree gets all of it.

    Costs per directory visited: an open and a read of it, an lstat per file, at most
    `per_directory` files (a random subset of a fuller one: at 10^8 chunks a shard
    directory holds ~1,500); per <s1> visited, an open and a read. Names are typed from
    the directory entries (no stat); links, foreign names and special files are skipped as
    by `walk`. With `prune`, an empty <s2> found is removed (eviction leaves them behind,
    and a sample that reads empty directories pays for nothing; the caller holds the lock
    under which every kvtier writer creates files).

    Raises:
        OSError: `root` cannot be read (absent: nothing is yielded).
    """
    try:
        ops.add(opens=1)
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    layout_fds: dict[str, int] = {}
    try:
        firsts: list[tuple[str, str]] = []  # (layout, s1)
        for digest in _typed_dirs(root_fd, LAYOUT_NAME, ops):
            for layout_fd in _subdir(root_fd, digest, ops):
                layout_fds[digest] = os.dup(layout_fd)
                firsts += [(digest, first) for first in _typed_dirs(layout_fd, _SHARD, ops)]
        rng.shuffle(firsts)
        pending: list[list[str] | None] = [None] * len(firsts)  # each s1's unvisited s2s
        while firsts:
            left = []
            for i, (digest, first) in enumerate(firsts):
                for first_fd in _subdir(layout_fds[digest], first, ops):
                    names = pending[i]
                    if names is None:
                        names = pending[i] = _typed_dirs(first_fd, _SHARD, ops)
                        rng.shuffle(names)
                        if prune and not names:  # an <s1> left empty by evictions
                            _remove_if_empty(layout_fds[digest], first, first_fd, ops)
                    if names:
                        yield _sampled_files(first_fd, digest, (first, names.pop()), rng,
                                             per_directory, ops, prune)
                    if names:
                        left.append(i)
            firsts, pending = [firsts[i] for i in left], [pending[i] for i in left]
    finally:
        os.close(root_fd)
        for fd in layout_fds.values():
            os.close(fd)


def sweep_layout_temps(root: Path, digest: str, ops: FsOps = NO_OPS,
                       now_s: float | None = None) -> int:
    """Delete kvtier's stale temp files (older than TEMP_STALE_S) in the layout directory
    ROOT/digest itself (an O_DIRECT probe's or a manifest's, of a writer killed meanwhile):
    one directory read, an lstat per temp file. `now_s`: now by the clock of the files'
    mtimes (default this node's). The number deleted; never raises."""
    stale_before = (time.time() if now_s is None else now_s) - TEMP_STALE_S
    try:
        fd = open_dir(root, [digest], ops=ops)
    except OSError:
        return 0
    swept = 0
    try:
        ops.add(dir_reads=1)
        with os.scandir(fd) as entries:
            names = [e.name for e in entries if _PROBE_TEMP.fullmatch(e.name)]
        for name in names:
            ops.add(stats=1)
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_mtime < stale_before:
                ops.add(unlinks=1)
                os.unlink(name, dir_fd=fd)
                swept += 1
    except OSError:
        pass  # read-only, or removed meanwhile: the next start-up tries again
    finally:
        os.close(fd)
    return swept


def _sampled_files(parent_fd: int, digest: str, shard: tuple[str, str], rng: random.Random,
                   limit: int, ops: FsOps, prune: bool) -> list[Entry]:
    """Up to `limit` chunk and temp files, chosen at random, of the shard directory
    `shard[1]` under `parent_fd`: names typed from the directory entries, an lstat each.
    With `prune`, the directory is removed when it holds nothing at all."""
    found = []
    for fd in _subdir(parent_fd, shard[1], ops):
        ops.add(dir_reads=1)
        with os.scandir(fd) as entries:
            listed = list(entries)
        names = [e.name for e in listed if (_CHUNK.fullmatch(e.name)
                 or _CHUNK_TEMP.fullmatch(e.name)) and e.is_file(follow_symlinks=False)]
        if prune and not listed:
            _remove_if_empty(parent_fd, shard[1], fd, ops)
        for name in rng.sample(names, min(limit, len(names))):
            ops.add(stats=1)
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            if stat.S_ISREG(info.st_mode):
                temp = not name.endswith(".kvc")  # (its size as is: no read under the lock)
                found.append(Entry(digest, shard, name, info.st_size, info.st_mtime, temp))
    return found


def _remove_if_empty(parent_fd: int, name: str, fd: int, ops: FsOps) -> None:
    """Remove the directory `name` (open as `fd`) when it holds nothing at all."""
    with os.scandir(fd) as entries:
        if next(entries, None) is not None:
            return
    ops.add(other=1)
    with contextlib.suppress(OSError):  # not empty any more, or not ours to remove
        os.rmdir(name, dir_fd=parent_fd)


def _typed_dirs(fd: int, pattern: re.Pattern[str], ops: FsOps) -> list[str]:
    """Names matching `pattern` of the directories in the directory `fd`, typed from the
    directory entries (a filesystem that does not type them costs an lstat each)."""
    ops.add(dir_reads=1)
    with os.scandir(fd) as entries:
        return [e.name for e in entries
                if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def _subdir(parent_fd: int, name: str, ops: FsOps, unreadable: list[str] | None = None,
            path: str = "") -> Iterator[int]:
    """Zero or one fd of the real directory `name` (closed after use); one this process may
    not open (EACCES) adds `path` (its path below the root) to `unreadable`, when given."""
    ops.add(opens=1)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno == errno.EACCES and unreadable is not None:
            unreadable.append(path or name)
        if exc.errno in NOT_OURS or exc.errno == errno.EACCES:
            return
        raise
    try:
        yield fd
    finally:
        os.close(fd)


def _children(fd: int, directories: bool, ops: FsOps) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of the directories, or of the regular files, in the directory `fd`."""
    found = []
    ops.add(dir_reads=1)
    with os.scandir(fd) as entries:
        for entry in entries:
            ops.add(stats=1)
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            wanted = stat.S_ISDIR if directories else stat.S_ISREG
            if wanted(info.st_mode):
                found.append((entry.name, info))
    return found
