"""The namespace manifest: which model a storage namespace's chunks are the KV of.

A storage namespace is a layout digest (`KVLayout.digest()`): the directory ROOT/<digest>/ of
the disk and shared tiers, the values <prefix><digest>:... of the redis tier. The connector
puts the model's fingerprint in the layout, so every checkpoint has namespaces of its own;
chunk keys are hashes, so what a namespace holds is only recoverable from its manifest, a
small JSON document each persistent tier writes for the namespace it opens:

    {"kvtier_manifest": 1, "namespace": DIGEST, "model": NAME AS SERVED,
     "fingerprint": 32 HEX ("" none), "weight_files": N (0: weights not fingerprinted),
     "layout": {the KVLayout's fields}, "kvtier_version": "0.1.0", "created_s": UNIX TIME}

The connector's workers pass a `NamespaceInfo` to `open_store` (tiers know no vLLM); each tier
that offers `ManifestKeeper` (kvtier.core.tier) writes it (disk and shared: when opened;
redis: after its first stored chunk, so a server that is down costs no start-up time). It is
rewritten only when missing or different in more than `created_s`; a manifest that cannot be
written is logged, never fatal. Where it lives:
  - disk, shared: ROOT/<digest>/manifest.json, written to `.manifest-<32 hex>.tmp` in the same
    directory (a kvtier temp name: counted and swept like a chunk's, tiers/filetree.py) and
    renamed into place, no link followed below ROOT; never a chunk name (`<32 hex>.kvc` in a
    shard directory);
  - redis: <prefix><digest>:manifest, outside any chunk's `{<key hex>}` hash tag, so the
    inventory never takes it for a chunk's value.

Read back, a manifest is untrusted input: at most MANIFEST_MAX_BYTES, JSON, every field
checked, and its namespace must be the one it was read for; anything else is None ("unknown"
in `kvtier inspect`), never an error.

Primitives: `NamespaceInfo`, `NamespaceManifest` (kvtier.core.tier's), `new_manifest`,
`parse_manifest`, `FILE_NAME`, `read_file_manifest`, `write_file_manifest`,
`remove_file_manifest`, `file_manifests`, `redis_manifest_name`, `write_redis_manifest`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.core.layout import KVLayout
from kvtier.core.tier import MANIFEST_FORMAT
from kvtier.core.tier import NamespaceManifest as NamespaceManifest  # re-exported
from kvtier.tiers.filetree import NOT_OURS, is_layout_name, open_dir

log = logging.getLogger(__name__)
FILE_NAME = "manifest.json"
MANIFEST_MAX_BYTES = 64 << 10  # a larger value is not a manifest of kvtier's
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """What the engine knows about the model behind a namespace (the connector fills it)."""

    model: str  # the model's name as served (vLLM's served_model_name, else its model)
    fingerprint: str  # ModelFingerprint.digest (32 hex), "" when none was computed
    weight_files: int  # checkpoint files sampled into it; 0: weights not fingerprinted


def new_manifest(layout: KVLayout, info: NamespaceInfo) -> NamespaceManifest:
    """The manifest of `layout`'s namespace, created now."""
    return NamespaceManifest(layout.digest(), info.model, info.fingerprint, info.weight_files,
                             asdict(layout), __version__, round(time.time(), 3))


def parse_manifest(data: bytes | None, namespace: str) -> NamespaceManifest | None:
    """The manifest in `data` when it is a well-formed one of `namespace`; None otherwise
    (absent, too large, not JSON, a field missing or of the wrong type, another namespace's)."""
    if data is None or len(data) > MANIFEST_MAX_BYTES:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("kvtier_manifest") != MANIFEST_FORMAT:
        return None
    kinds: dict[str, type | tuple[type, ...]] = {
        "namespace": str, "model": str, "fingerprint": str, "weight_files": int, "layout": dict,
        "kvtier_version": str, "created_s": (int, float)}
    if any(not isinstance(doc.get(k), t) or isinstance(doc.get(k), bool)
           for k, t in kinds.items()):
        return None
    if doc["namespace"] != namespace or doc["weight_files"] < 0:
        return None
    return NamespaceManifest(doc["namespace"], doc["model"], doc["fingerprint"],
                             doc["weight_files"], doc["layout"], doc["kvtier_version"],
                             float(doc["created_s"]))


# -- directory tiers: ROOT/<digest>/manifest.json ----------------------------------------------
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


# -- redis: <prefix><digest>:manifest ----------------------------------------------------------
def redis_manifest_name(prefix: str, namespace: str) -> str:
    """The redis value holding `namespace`'s manifest (no hash tag: not a chunk's value)."""
    return f"{prefix}{namespace}:manifest"


def write_redis_manifest(client: Any, prefix: str, manifest: NamespaceManifest) -> bool:
    """Set `manifest`'s value unless an equal one is there (keeping the first `created_s`).
    True when it was written.

    Raises:
        redis.RedisError: the server failed the call (the caller logs it).
    """
    name = redis_manifest_name(prefix, manifest.namespace)
    current = parse_manifest(client.get(name), manifest.namespace)
    if manifest.same_as(current):
        return False
    if current is not None:
        manifest = replace(manifest, created_s=current.created_s)
    client.set(name, manifest.to_json())
    return True

