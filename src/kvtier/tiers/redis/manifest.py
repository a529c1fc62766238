"""The namespace manifest of the redis tier: <prefix><digest>:manifest, outside any chunk's
`{<key hex>}` hash tag (tiers/manifest.py says what a manifest is).

Primitives: `redis_manifest_name`, `write_redis_manifest`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import redis

from kvtier.tiers.manifest import NamespaceManifest, parse_manifest
from kvtier.tiers.redis.client import wrong_type


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
    try:
        current = parse_manifest(client.get(name), manifest.namespace)
    except redis.ResponseError as exc:  # a value of another type: no manifest, replaced
        if not wrong_type(exc):  # (as a string that is not one is), not failed on each put
            raise
        current = None
    if manifest.same_as(current):
        return False
    if current is not None:
        manifest = replace(manifest, created_s=current.created_s)
    client.set(name, manifest.to_json())
    return True
