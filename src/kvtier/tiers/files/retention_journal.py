"""The retention journal of a persistent tier: each chunk's tenant id, pin and expiry, so that
a restart keeps them (`kvtier.core.retention`). Only a request's expiry: one the tier's own
`ttl_s` gave starts anew at a restart (`RetentionBook.meta_of`, docs/retention.md).

One JSON object a line in `<layout directory>/retention.jsonl` (a name the chunk scan skips):
`{"key": HEX, "tenant": ID|null, "retain_until": S|null, "expires_at": S|null}`, appended
(O_APPEND; a line is far below PIPE_BUF; one cut short by a full filesystem is cut off again,
so that the next line does not join it) whenever a chunk is stored or retained with metadata;
the last line of a key wins. A chunk stored again without metadata (evicted or deleted since
its lines were written) gets a line of nulls (`forget`): it has none now, and its old pin or
expiry must not come back at a restart. At start-up the tier reads it, applies the lines of
chunks it still holds, and rewrites it compacted (a temp file renamed into place); it is
compacted again once it holds many more lines than chunks with metadata. Tenants are
`tenant_id`s (hashes), never salts. The file is untrusted input: a line that does not parse
or has the wrong types is skipped (and counted); nothing is unpickled. Nor is a link followed
(O_NOFOLLOW), and the temp file is a new one (O_EXCL): whoever could write in the directory
(one another user made before the tier did) and planted `retention.jsonl` or the temp's name as
a symlink to the tier's user's files had the tier append JSON lines to, or truncate and
overwrite, its target (tests/faults/test_journal_symlinks.py).

Durability: a rewrite's temp file is fsync'd before it is renamed over the journal, else a
power loss soon after could leave the renamed journal empty (the data not yet written back,
XFS and others: every pin and expiry lost). The directory is not fsync'd after the rename,
as for chunk files, which the tier never fsyncs (a cache: a chunk lost to a power loss is a
miss): the rename lost leaves the journal of before, whole, and loses only the lines appended
since, as appends are never fsync'd either. A rewrite killed before its rename leaves
`.retention.jsonl.<pid>.tmp`: the tier's start-up sweeps it (`sweep_temps`) by the rule of
its chunk temp files (every one where it holds the owner lock: no other process rewrites the
journal; else those older than `filetree.TEMP_STALE_S`).

Primitives: `RetentionJournal`, `is_journal_temp`.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.tiers.files.filetree import TEMP_STALE_S

log = logging.getLogger(__name__)
JOURNAL_NAME = "retention.jsonl"
# Opened without following a link at the name (a link there: ELOOP, an error not a write).
_NO_LINKS = os.O_NOFOLLOW | os.O_CLOEXEC
COMPACT_SLACK_LINES = 4096  # appended lines beyond the live entries before a compaction
_TEMP = re.compile(r"\.retention\.jsonl\.\d+\.tmp")  # a rewrite's temp file (its pid)


def is_journal_temp(name: str) -> bool:
    """Whether `name` is a journal rewrite's temp file, `.retention.jsonl.<pid>.tmp`."""
    return bool(_TEMP.fullmatch(name))


class RetentionJournal:
    """Append-only metadata of one tier's chunks, compacted at start-up. Thread-safe."""

    def __init__(self, directory: Path, writable: bool = True) -> None:
        self.path = Path(directory) / JOURNAL_NAME
        self.writable = writable
        self.skipped_lines = 0  # lines that did not parse (untrusted input)
        self._lines = 0
        self._lock = threading.Lock()
        # Keys whose last line in the file carries metadata (`forget` nulls it).
        self._keys: set[ChunkKey] = set()

    def load(self) -> dict[ChunkKey, ChunkMeta]:
        """Every key's last metadata (an absent or unreadable journal: none)."""
        entries: dict[ChunkKey, ChunkMeta] = {}
        try:
            with os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | _NO_LINKS), "rb"
                           ) as file:
                text = file.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return entries
        except OSError as exc:
            log.warning("retention journal %s unreadable (%s): pins and expiries are lost",
                        self.path, exc)
            return entries
        for line in text.splitlines():
            parsed = _parse(line)
            if parsed is None:
                self.skipped_lines += bool(line.strip())
                continue
            if parsed[1].is_default:  # no metadata (`forget`): its earlier lines are void
                entries.pop(parsed[0], None)
            else:
                entries[parsed[0]] = parsed[1]
        with self._lock:
            self._keys = set(entries)
        return entries

    def rewrite(self, entries: Iterable[tuple[ChunkKey, ChunkMeta]]) -> None:
        """Replace the journal by `entries` (atomically: a temp file, fsync'd, renamed into
        place); an entry without metadata (`is_default`) takes no line."""
        if not self.writable:
            return
        entries = [(key, meta) for key, meta in entries if not meta.is_default]
        lines = [_line(key, meta) for key, meta in entries]
        temp = self.path.with_name(f".{JOURNAL_NAME}.{os.getpid()}.tmp")
        with self._lock:
            if not lines and not self.path.exists():
                return  # nothing to keep: no file
            try:
                temp.unlink(missing_ok=True)  # a dead process's of this pid (a link: itself)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_LINKS, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    out.writelines(lines)
                    out.flush()
                    os.fsync(out.fileno())  # else a power loss may leave the renamed one empty
                os.replace(temp, self.path)
                self._lines = len(lines)
                self._keys = {key for key, _meta in entries}
            except OSError as exc:
                log.warning("retention journal %s not rewritten (%s)", self.path, exc)

    def sweep_temps(self, owned: bool) -> int:
        """Delete the temp files of rewrites killed before their rename (regular files
        only; nothing else is touched): every one when `owned` (the caller holds the
        directory's owner lock, and only its owner rewrites the journal: their writers are
        dead), else those older than TEMP_STALE_S. Start-up only. The number deleted; never
        raises (a read-only directory: none)."""
        if not self.writable:
            return 0
        stale_before = time.time() - TEMP_STALE_S
        swept = 0
        with self._lock:  # not this process's own rewrite in flight
            try:
                with os.scandir(self.path.parent) as entries:
                    names = [e.name for e in entries if is_journal_temp(e.name)]
            except OSError:
                return 0  # no directory yet: nothing to sweep
            for name in names:
                try:
                    info = os.lstat(self.path.parent / name)
                    if stat.S_ISREG(info.st_mode) and (owned or info.st_mtime < stale_before):
                        os.unlink(self.path.parent / name)
                        swept += 1
                except OSError as exc:  # removed meanwhile, or not ours to remove
                    log.warning("retention journal %s: %s not swept (%s)", self.path, name, exc)
        if swept:
            log.info("retention journal %s: %d temp file(s) of a rewrite killed before its "
                     "rename swept", self.path, swept)
        return swept

    def append(self, key: ChunkKey, meta: ChunkMeta, live_entries: int) -> bool:
        """Record a chunk's metadata; True when the journal now wants a compaction (more
        than `live_entries` + COMPACT_SLACK_LINES lines)."""
        if not self.writable:
            return False
        data = _line(key, meta).encode()
        with self._lock:
            return self._append_locked(key, meta, data, live_entries)

    def forget(self, key: ChunkKey, live_entries: int) -> bool:
        """A chunk was stored anew without metadata: void what the journal has of it (a pin
        or expiry of the chunk stored before under its key, evicted or deleted since), so that
        a restart does not give it back. Appends a line only for a key the journal has
        metadata of. True when the journal now wants a compaction, as `append`."""
        if not self.writable or key not in self._keys:
            return False
        data = _line(key, DEFAULT_META).encode()
        with self._lock:
            if key not in self._keys:
                return False
            return self._append_locked(key, DEFAULT_META, data, live_entries)

    def _append_locked(self, key: ChunkKey, meta: ChunkMeta, data: bytes,
                       live_entries: int) -> bool:
        """`data` (`key`'s line of `meta`) appended to the file; lock held."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NO_LINKS, 0o600)
            try:
                _append_whole(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("retention journal %s: append failed (%s); a restart loses this "
                        "chunk's pin/expiry", self.path, exc)
            return False
        self._lines += 1
        if meta.is_default:
            self._keys.discard(key)
        else:
            self._keys.add(key)
        return self._lines > live_entries + COMPACT_SLACK_LINES


def _append_whole(fd: int, data: bytes) -> None:
    """Append `data` (one line) to the file `fd` (O_APPEND; its one writer holds the lock),
    or nothing: a write cut short (a full filesystem) is cut off the file again, else the
    next line was appended to the torn one and lost with it at a restart
    (tests/tiers/test_disk_retention.py).

    Raises:
        OSError: the write failed (ENOSPC for a short one).
    """
    size_before = os.fstat(fd).st_size
    written = os.write(fd, data)
    if written != len(data):
        os.ftruncate(fd, size_before)
        raise OSError(errno.ENOSPC, f"short write: {written} of {len(data)} bytes")


def _line(key: ChunkKey, meta: ChunkMeta) -> str:
    return json.dumps({"key": key.hex(), "tenant": meta.tenant,
                       "retain_until": meta.retain_until, "expires_at": meta.expires_at},
                      separators=(",", ":")) + "\n"


def _parse(line: str) -> tuple[ChunkKey, ChunkMeta] | None:
    try:
        item = json.loads(line)
        key = ChunkKey(bytes.fromhex(item["key"]))
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(item, dict) or len(key) != KEY_BYTES:
        return None
    tenant = item.get("tenant")
    times = [item.get("retain_until"), item.get("expires_at")]
    if tenant is not None and not isinstance(tenant, str):
        return None
    if not all(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool)
                             and math.isfinite(t)) for t in times):
        return None
    retain_until, expires_at = (None if t is None else float(t) for t in times)
    return key, ChunkMeta(tenant, retain_until, expires_at)
