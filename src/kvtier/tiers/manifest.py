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
    directory (a kvtier temp name: counted and swept like a chunk's, tiers/files/filetree.py)
    and renamed into place, no link followed below ROOT; never a chunk name (`<32 hex>.kvc` in
    a shard directory): tiers/files/manifests.py;
  - redis: <prefix><digest>:manifest, outside any chunk's `{<key hex>}` hash tag, so the
    inventory never takes it for a chunk's value: tiers/redis/manifest.py;
  - s3: <key prefix><digest>/manifest.json, read by tiers/s3/inventory.py.

Read back, a manifest is untrusted input: at most MANIFEST_MAX_BYTES, JSON, every field
checked, and its namespace must be the one it was read for; anything else is None ("unknown"
in `kvtier inspect`), never an error.

Primitives: `NamespaceInfo`, `NamespaceManifest` (kvtier.core.tier's), `new_manifest`,
`parse_manifest`, `is_layout_name`, `FILE_NAME`, `MANIFEST_MAX_BYTES`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass

from kvtier import __version__
from kvtier.core.layout import KVLayout
from kvtier.core.tier import MANIFEST_FORMAT
from kvtier.core.tier import NamespaceManifest as NamespaceManifest  # re-exported

FILE_NAME = "manifest.json"
MANIFEST_MAX_BYTES = 64 << 10  # a larger value is not a manifest of kvtier's
_HEX = re.compile(r"(?:[0-9a-f]{32})?")  # a fingerprint (ModelFingerprint.digest) or none
LAYOUT_NAME = re.compile(r"[0-9a-f]{32}")  # a namespace: a layout digest


def is_layout_name(name: str) -> bool:
    """Whether `name` can be a namespace of kvtier's (a layout digest)."""
    return bool(LAYOUT_NAME.fullmatch(name))


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
    # A time that is a time (NaN or 1e300 were taken, and copied into the manifest a tier
    # wrote next: "created_s": NaN is not JSON); a fingerprint of hex digits or none.
    if not 0 <= doc["created_s"] < 1e11 or not _HEX.fullmatch(doc["fingerprint"]):
        return None
    return NamespaceManifest(doc["namespace"], doc["model"], doc["fingerprint"],
                             doc["weight_files"], doc["layout"], doc["kvtier_version"],
                             float(doc["created_s"]))
