"""Test helpers for store configs on disk, shared by tests/tools and tests/tiers: a memory
tier over one persistent tier of a kind (disk, shared, redis from the `redis_url` fixture, or
s3 from `s3_session`), and what that tier holds. The `kvtier inspect` / `kvtier gc` reports
over them: tests/tools/clikit.py. (Not named conftest.py: see tierkit.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tierkit import key

from kvtier.core.layout import KVLayout
from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig

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
