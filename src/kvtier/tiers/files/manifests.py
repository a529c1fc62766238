"""The namespace manifest of the directory tiers (disk, shared): ROOT/<digest>/manifest.json,
read, written atomically and removed without following a link below ROOT (tiers/manifest.py
says what a manifest is).

Primitives: `read_file_manifest`, `write_file_manifest`, `remove_file_manifest`,
`file_manifests`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import uuid
from dataclasses import replace
from pathlib import Path

from kvtier.tiers.files.filetree import NOT_OURS, open_dir
from kvtier.tiers.manifest import (
    FILE_NAME,
    MANIFEST_MAX_BYTES,
    NamespaceManifest,
    is_layout_name,
    parse_manifest,
)

log = logging.getLogger(__name__)
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def read_file_manifest(root: Path, namespace: str) -> NamespaceManifest | None:
    """The manifest of `namespace` under `root`; None when absent or not a valid one (a
    link, a FIFO or another non-regular file is not read). Raises nothing."""
    if not is_layout_name(namespace):
        return None
    try:
        dir_fd = open_dir(root, [namespace])
    except OSError:
        return None
    try:
        fd = os.open(FILE_NAME, os.O_RDONLY | os.O_NONBLOCK | _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MANIFEST_MAX_BYTES:
            return None
        data = os.read(fd, MANIFEST_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    found = parse_manifest(data, namespace)
    if found is None:
        log.warning("%s: not a valid kvtier manifest; its namespace shows as unknown",
                    Path(root) / namespace / FILE_NAME)
    return found


def write_file_manifest(root: Path, manifest: NamespaceManifest, file_mode: int) -> bool:
    """Write `manifest` to ROOT/<namespace>/manifest.json unless an equal one is there,
    atomically (a temp file renamed into place), never through a link. The layout directory
    must exist (the tier made it). Never raises: False (logged) when it could not be written.
    """
    current = read_file_manifest(root, manifest.namespace)
    if manifest.same_as(current):
        return True
    if current is not None:  # another engine's name for the model: keep the first time
        manifest = replace(manifest, created_s=current.created_s)
    temp = f".manifest-{uuid.uuid4().hex}.tmp"
    dir_fd = -1
    try:
        dir_fd = open_dir(root, [manifest.namespace])
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, file_mode,
                     dir_fd=dir_fd)
        try:
            os.fchmod(fd, file_mode)
            data = manifest.to_json()
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        finally:
            os.close(fd)
        os.replace(temp, FILE_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return True
    except OSError as exc:
        log.warning("%s: namespace manifest not written (%s); `kvtier inspect` shows its model "
                    "as unknown", Path(root) / manifest.namespace, exc)
        if dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
        return False
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)


def remove_file_manifest(root: Path, namespace: str) -> bool:
    """Delete ROOT/<namespace>/manifest.json (a regular file only, never through a link).
    True when one was removed.

    Raises:
        OSError: other than absent (EACCES, EROFS, ...).
    """
    if not is_layout_name(namespace):
        return False
    try:
        dir_fd = open_dir(root, [namespace])
    except OSError as exc:
        if exc.errno in NOT_OURS:
            return False
        raise
    try:
        if not stat.S_ISREG(os.stat(FILE_NAME, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        os.unlink(FILE_NAME, dir_fd=dir_fd)
        return True
    except OSError as exc:
        if exc.errno in NOT_OURS:
            return False
        raise
    finally:
        os.close(dir_fd)


def file_manifests(root: Path) -> dict[str, NamespaceManifest | None]:
    """namespace -> its manifest (None: present but not valid), for every layout directory
    under `root` that holds a manifest file.

    Raises:
        OSError: `root` cannot be listed (absent: {}).
    """
    try:
        names = [e.name for e in os.scandir(root)
                 if is_layout_name(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return {}
    found: dict[str, NamespaceManifest | None] = {}
    for name in sorted(names):
        try:
            present = stat.S_ISREG(os.stat(Path(root) / name / FILE_NAME,
                                           follow_symlinks=False).st_mode)
        except OSError:
            continue
        if present:
            found[name] = read_file_manifest(root, name)
    return found
