"""The chunk-file tree of the disk and shared tiers, read without building a tier: where a
chunk's file is (`chunk_path`), what a tree holds (`scan_tree`), whether a chunk is stored
(`FileProbe`, the scheduler's probe) and the tree as `kvtier inspect` / `kvtier gc` see it
(`FileInventory`, namespace manifests included: tiers/manifest.py).

Layout: ROOT/<layout digest>/<k[0:2]>/<k[2:4]>/<key hex>.kvc (tiers/files/chunkfiles.py writes and
reads the files). Nothing below ROOT is trusted: every path is reached without following links
(`kvtier.tiers.files.filetree`), and only regular files of kvtier's names count.

Primitives: `ChunkFile`, `TreeScan`, `scan_tree`, `walk_chunks`, `FoundChunk`, `chunk_parts`,
`chunk_path`, `key_of`, `FileProbe`, `FileInventory`, `SUFFIX`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.tier import Removal, StoredChunk
from kvtier.tiers.files.filetree import TEMP_STALE_S, lstat_file, unlink_file, walk
from kvtier.tiers.files.fsops import NO_OPS, FsOps
from kvtier.tiers.files.manifests import file_manifests, remove_file_manifest
from kvtier.tiers.files.quota import LEDGER_NAME, QuotaLedger
from kvtier.tiers.manifest import NamespaceManifest, is_layout_name

log = logging.getLogger(__name__)
SUFFIX = ".kvc"
GC_BATCH_FILES = 64  # files `FileInventory.remove` deletes per hold of the ledger's lock
CLOCK_FILE_PREFIX = ".kvtier-clock-"  # `FileInventory.now_s`'s file in the root, removed at once
CLOCK_FILE_STALE_S = 3600.0  # a clock file this old was left by a gc or inspect killed


class ChunkFilesLike(Protocol):
    """What `walk_chunks` reads of a `ChunkFiles` (chunkfiles.py imports this module)."""

    root: Path
    layout_digest: str
    writable: bool
    ops: FsOps


@dataclass(frozen=True, slots=True)
class ChunkFile:
    """A chunk file found by a scan."""

    key: ChunkKey
    path: Path
    size_bytes: int
    mtime: float
    layout_digest: str = ""

    def parts(self) -> tuple[str, ...]:
        """Its path below the root, component by component."""
        name = self.key.hex()
        return (self.layout_digest, name[:2], name[2:4], f"{name}{SUFFIX}")


@dataclass(slots=True)
class TreeScan:
    """What `scan_tree` found: chunk files, and kvtier temp files still being written."""

    chunks: list[ChunkFile] = field(default_factory=list)
    temp_bytes: int = 0  # size of kvtier temp files younger than TEMP_STALE_S
    temp_files: int = 0
    swept: int = 0  # stale kvtier temp files deleted by the scan
    # directories the scan could not open (EACCES: another user's), paths below the root:
    # what they hold is not in `chunks` nor `temp_bytes`
    unreadable: list[str] = field(default_factory=list)


def chunk_parts(layout_digest: str, key: ChunkKey) -> tuple[str, str, str, str]:
    """The chunk `key`'s path below the root, component by component (no I/O)."""
    name = key.hex()
    return (layout_digest, name[:2], name[2:4], f"{name}{SUFFIX}")


def chunk_path(root: Path, layout_digest: str, key: ChunkKey) -> Path:
    """Where the chunk `key` of a layout lives under `root` (no I/O)."""
    return Path(root).joinpath(*chunk_parts(layout_digest, key))


def scan_tree(root: Path, layout_digests: Sequence[str] | None = None,
              sweep: bool = True, ops: FsOps = NO_OPS, now_s: float | None = None) -> TreeScan:
    """Every chunk file of `layout_digests` (default: every layout) below `root`, found
    without following links (`filetree.walk`); with `sweep`, deletes kvtier's own temp files
    older than TEMP_STALE_S on the way (a writer that died), and nothing else. `now_s`: now
    by the clock of the files' mtimes (`ChunkFiles.fs_now`; default this node's).

    Files whose names are not keys are skipped; a chunk's content is verified when read;
    directories this process may not open are skipped and listed (`TreeScan.unreadable`).
    Raises OSError when `root` cannot be listed.
    """
    found = TreeScan()
    stale_before = (time.time() if now_s is None else now_s) - TEMP_STALE_S
    for entry in walk(Path(root), layout_digests, ops, found.unreadable):
        if entry.temp:
            if sweep and entry.mtime < stale_before:
                try:
                    if unlink_file(Path(root), entry.parts(), ops) is not None:
                        found.swept += 1
                        continue
                except OSError:
                    pass  # read-only for us: it still counts as used
            found.temp_files += 1
            found.temp_bytes += entry.size_bytes
            continue
        key = key_of(entry.name)
        if key is not None:
            found.chunks.append(ChunkFile(key, Path(root).joinpath(*entry.parts()),
                                          entry.size_bytes, entry.mtime, entry.layout_digest))
    return found


@dataclass(frozen=True, slots=True)
class FoundChunk:
    """A chunk file of one layout found by `walk_chunks` (no path: millions are found)."""

    key: ChunkKey
    size_bytes: int
    mtime: float


def walk_chunks(files: ChunkFilesLike, owned: bool = False) -> Iterator[FoundChunk]:
    """The chunk files of one layout, one at a time, with no path object per file (the
    disk tier's start-up index of millions of files: `scan_tree` keeps a `Path` each).
    Sweeps stale temp files on the way when the tree is writable; counts into `files.ops`.

    `owned`: the caller holds the layout directory's owner lock (tiers/files/owner.py) and
    writes no chunk until this walk ends (the disk tier's start-up index): no writer of a
    chunk temp file is alive, so every one is swept, however young. A node restarted within
    TEMP_STALE_S of a crash (a supervisor's restart) kept the dead writes' temp files, never
    counted against the capacity, until a restart that came later than that; a crash loop
    left one a crash for weeks (a leak soak: one to three files per SIGKILL).
    """
    root, digest = Path(files.root), files.layout_digest
    stale_before = time.time() - TEMP_STALE_S
    for entry in walk(root, [digest], files.ops):
        if entry.temp:
            dead = entry.mtime < stale_before or (owned and entry.shard is not None)
            if files.writable and dead:
                with contextlib.suppress(OSError):
                    unlink_file(root, entry.parts(), files.ops)
            continue
        key = key_of(entry.name)
        if key is not None:
            yield FoundChunk(key, entry.size_bytes, entry.mtime)


def key_of(filename: str) -> ChunkKey | None:
    if not filename.endswith(SUFFIX) or len(filename) != 2 * KEY_BYTES + len(SUFFIX):
        return None
    try:
        return ChunkKey(bytes.fromhex(filename[: -len(SUFFIX)]))
    except ValueError:
        return None


def _used_since(root: Path, parts: Sequence[str], listed_mtime: float) -> bool:
    """Whether the file at `parts` is there with an mtime later than `listed_mtime` (a
    removal that kept it: not gone, used since). One lstat, only for a file not removed."""
    try:
        info = lstat_file(root, parts)
    except OSError:
        return False
    return info is not None and info.st_mtime > listed_mtime


class FileProbe:
    """Answers "is this chunk stored?" for a chunk-file directory, from any process, with
    no side effects (no mkdir, no scan): an lstat per path component and layout, never
    through a link, and only a regular file counts. With several layouts (the
    tensor-parallel ranks of one model) a chunk counts only when every rank's file exists."""

    def __init__(self, root: Path, layout_digests: list[str], blocking_ok: bool) -> None:
        self.root = Path(root)
        self.layout_digests = list(layout_digests)
        self.blocking_ok = blocking_ok  # cheap enough for a scheduler thread (local disk)

    def contains(self, key: ChunkKey) -> bool:
        try:
            return all(lstat_file(self.root, chunk_parts(d, key)) is not None
                       for d in self.layout_digests)
        except OSError:  # e.g. EACCES or a stale NFS handle: a miss, never an error
            return False

    def close(self) -> None:
        """Nothing to release: each lookup opens and closes what it uses."""


class FileInventory:
    """A disk or shared tier's directory as `kvtier.core.tier.Inventory`:
    ROOT/<digest>/<k0k1>/<k2k3>/<key hex>.kvc. Reads stat data only; changes nothing. Lists
    and removes only regular chunk files of kvtier's layout, reached without following a
    link: `kvtier gc --namespace` must never delete a file outside the tree through a
    symlinked directory (tests/faults/test_symlinks.py).

    With `ledger_mode` (a shared directory's), what `remove` deletes is taken off the
    directory's quota ledger, under its lock, GC_BATCH_FILES files per hold, as the writers'
    own evictions are: left there, the running writers' usage stayed what it was before gc
    until their next re-measure, and each put evicted real chunks from a directory gc had
    half emptied (tests/tools/test_gc_shared_quota.py). `remove_unused` keeps a file used
    since it was listed (tests/tools/test_gc_used_since_listed.py)."""

    def __init__(self, name: str, kind: str, root: Path, ledger_mode: int | None = None) -> None:
        """`ledger_mode`: the file mode of the directory's quota ledger (a shared tier's;
        None: it keeps none)."""
        self.name, self.kind, self.root = name, kind, Path(root)
        self.ledger_mode = ledger_mode

    def chunks(self) -> Iterator[StoredChunk]:
        for entry in walk(self.root):
            key = None if entry.temp else key_of(entry.name)
            if key is not None:  # temp files are not chunks
                yield StoredChunk(entry.layout_digest, key.hex(), entry.size_bytes, entry.mtime,
                                  (str(self.root.joinpath(*entry.parts())),))

    def now_s(self) -> float:
        """`StorageClock`: now by the clock that stamps the directory's mtimes (on NFS the
        server's), read off a file created in the root and removed at once (walks and
        inventories never list the root's files); this host's clock where none can be
        created (a read-only mount, a user who may only read: logged). Never raises."""
        name = f"{CLOCK_FILE_PREFIX}{uuid.uuid4().hex}.tmp"
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            return self._hosts_clock(exc)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
            try:
                now = os.fstat(fd).st_mtime
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=root_fd)
            _sweep_clock_files(root_fd, now)
            return now
        except OSError as exc:
            return self._hosts_clock(exc)
        finally:
            os.close(root_fd)

    def _hosts_clock(self, exc: OSError) -> float:
        log.warning("%s: the directory's clock cannot be read (%s); ages are taken by this "
                    "host's clock", self.root, exc)
        return time.time()

    def manifests(self) -> dict[str, NamespaceManifest | None]:
        """Each layout directory's manifest.json (`ManifestSource`, tiers/manifest.py)."""
        return file_manifests(self.root)

    def remove_manifest(self, namespace: str) -> bool:
        return remove_file_manifest(self.root, namespace)

    def remove(self, chunks: Sequence[StoredChunk]) -> int:
        return self._remove(chunks, keep_used=False).removed

    def remove_unused(self, chunks: Sequence[StoredChunk]) -> Removal:
        """`UnusedRemoval` (tools/admin/inventory.py): each file is deleted only if its mtime,
        which every hit touches (the shared tier's LRU order), is not later than the listing
        saw, checked by the unlink itself (`unlink_file`'s `not_after`, under the ledger's
        lock): a chunk an engine read after `kvtier gc` listed it stays, as a sampled victim
        read since it was sampled stays in the tier's own eviction. Raises OSError."""
        return self._remove(chunks, keep_used=True)

    def _remove(self, chunks: Sequence[StoredChunk], keep_used: bool) -> Removal:
        ledger = self._ledger()
        removed, kept = 0, []
        try:
            for i in range(0, len(chunks), GC_BATCH_FILES):
                done, used = self._remove_batch(chunks[i : i + GC_BATCH_FILES], ledger,
                                                keep_used)
                removed += done
                kept += used
        finally:
            if ledger is not None:
                ledger.close()
        return Removal(removed, tuple(kept))

    def _remove_batch(self, chunks: Sequence[StoredChunk], ledger: QuotaLedger | None,
                      keep_used: bool) -> tuple[int, list[StoredChunk]]:
        """Delete `chunks` (with `keep_used`, those unused since listed), taken off `ledger`
        (if any) under one hold of its lock; (deleted, kept as used)."""
        removed, kept = 0, []
        with ledger.locked() if ledger is not None else contextlib.nullcontext() as state:
            for chunk in chunks:
                key = key_of(f"{chunk.key_hex}{SUFFIX}")
                if key is None or key.hex() != chunk.key_hex \
                        or not is_layout_name(chunk.namespace):
                    continue  # not a name of kvtier's layout: never deleted
                parts = chunk_parts(chunk.namespace, key)
                freed = unlink_file(self.root, parts,
                                    not_after=chunk.last_used_s if keep_used else None)
                if freed is not None:
                    removed += 1
                    if state is not None:
                        state.used_bytes -= freed
                        state.chunks -= 1
                elif keep_used and _used_since(self.root, parts, chunk.last_used_s):
                    kept.append(chunk)
        return removed, kept

    def _ledger(self) -> QuotaLedger | None:
        """The directory's quota ledger, if it keeps one and one is there (gc creates none);
        None when it cannot be opened (logged: the writers' usage stays high until their next
        re-measure, as it did before gc kept it)."""
        if self.ledger_mode is None or not (self.root / LEDGER_NAME).is_file():
            return None
        try:
            return QuotaLedger(self.root, self.ledger_mode)
        except OSError as exc:
            log.warning("%s: cannot open the quota ledger (%s); what gc deletes is counted by "
                        "the writers' next re-measure", self.root, exc)
            return None

    def close(self) -> None:
        pass


def _sweep_clock_files(root_fd: int, now: float) -> None:
    """Remove the clock files of `FileInventory.now_s` calls killed between their create and
    unlink (a gc or inspect stopped there left one in the root for good), those older than
    `CLOCK_FILE_STALE_S` by the directory's clock `now` (a younger one may be another's, in
    flight)."""
    with contextlib.suppress(OSError), os.scandir(root_fd) as entries:
        for entry in entries:
            if not (entry.name.startswith(CLOCK_FILE_PREFIX) and entry.name.endswith(".tmp")):
                continue
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and \
                        now - entry.stat(follow_symlinks=False).st_mtime > CLOCK_FILE_STALE_S:
                    os.unlink(entry.name, dir_fd=root_fd)
