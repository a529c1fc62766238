"""Test helpers for store configs on disk, shared by tests/tools and tests/tiers: a memory
tier over one persistent tier of a kind (disk, shared, redis from the `redis_url` fixture, or
s3 from `s3_session`), and what that tier holds. The `kvtier inspect` / `kvtier gc` reports
over them: tests/tools/clikit.py. (Not named conftest.py: see tierkit.py.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from tierkit import key, tiny_layout

from kvtier.core.layout import KVLayout
from kvtier.tiers import build_tier, open_store
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.storeconfig import StoreConfig

# Two namespaces of one model (its weights before and after an update), and one stored by a
# kvtier before manifests: no fingerprint, no manifest.
OLD_FP, NEW_FP = "0123456789abcdef" * 2, "fedcba9876543210" * 2
OLD = dataclasses.replace(tiny_layout(16), model_fingerprint=OLD_FP)
NEW = dataclasses.replace(tiny_layout(16), model_fingerprint=NEW_FP)
LEGACY = tiny_layout(16)
OLD_INFO = NamespaceInfo(model="acme/tiny", fingerprint=OLD_FP, weight_files=2)
NEW_INFO = NamespaceInfo(model="acme/tiny", fingerprint=NEW_FP, weight_files=2)

KINDS = ["disk", "shared", pytest.param("redis", marks=pytest.mark.redis),
         pytest.param("s3", marks=pytest.mark.s3)]


def tier_config(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    """A persistent tier of `kind` (64 MiB of files, or an unbounded redis namespace)."""
    if kind == "redis":
        return {"kind": "redis", "url": request.getfixturevalue("redis_url"), "capacity": 0}
    if kind == "s3":  # a fresh prefix in the session's bucket (tests/s3_server.py)
        return {"kind": "s3", **request.getfixturevalue("s3_session").settings()}
    return {"kind": kind, "path": str(tmp_path / kind), "capacity": "64MiB"}


def write_config(tmp_path: Path, tier: dict[str, Any]) -> Path:
    """store.yaml: a small memory tier over `tier`."""
    path = tmp_path / "store.yaml"
    path.write_text(yaml.safe_dump({"tiers": [
        {"kind": "memory", "capacity": "1MiB", "pin": "off"}, tier]}))
    return path


def held(config_path: Path, layout: KVLayout, keys: range) -> list[int]:
    """The test keys (tierkit.key) of `keys` that the config's persistent tier holds."""
    tier = build_tier(StoreConfig.load(config_path).tiers[1], layout)
    try:
        return [i for i in keys if tier.contains(key(i))]
    finally:
        tier.close()


def fill(config_path: Path, layout: KVLayout, info: NamespaceInfo | None, keys: range) -> None:
    """Store chunks `keys` of `layout` through a real store opened as an engine's worker opens
    it (with `info`: the namespace's manifest), and let its write-behind finish."""
    with open_store(StoreConfig.load(config_path), layout, info) as store:
        for i in keys:
            store.put(key(i), memoryview(bytes([i % 256]) * layout.bytes_per_chunk))
        store.flush()
