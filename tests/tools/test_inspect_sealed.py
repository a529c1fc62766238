"""`kvtier inspect` over a tier that encrypts at rest (disk and shared directories on
tmp_path, with an operator secret from an environment variable) shows no key material: not
the secret, not a tenant's salt. The sealed tiers themselves: tests/tiers/test_sealed_tiers.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tierkit import key, make_tier

from kvtier.core.layout import KVLayout
from kvtier.core.retention import ChunkMeta, tenant_id
from kvtier.core.tier import OK, Tier
from kvtier.tools.cli.main import main

SECRET = "operator-secret-for-the-sealed-tier-tests-0123456789"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16",
                  tokens_per_chunk=16)


def payload(i: int) -> bytes:
    return bytes((i * 13 + j * 7) % 251 for j in range(LAYOUT.bytes_per_chunk))


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVTIER_SEAL_SECRET", SECRET)
    yield


def sealed_tier(kind: str, tmp_path: Path, **options: object) -> Tier:
    return make_tier(kind, tmp_path, LAYOUT, 8, encryption_secret_env="KVTIER_SEAL_SECRET",
                     **options)


@pytest.mark.parametrize("kind_", ["disk", "shared"])
def test_inspect_of_an_encrypting_tier_shows_no_key_material(
        kind_: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = sealed_tier(kind_, tmp_path, codec="zstd")
    assert tier.put(key(7), memoryview(payload(7)),
                    ChunkMeta(tenant=tenant_id("salt-of-a-tenant"))) == OK
    tier.close()
    config = tmp_path / "store.yaml"
    config.write_text(yaml.safe_dump({"tiers": [
        {"kind": "memory", "capacity": "1MiB", "pin": "off"},
        {"kind": kind_, "path": str(tmp_path / kind_), "capacity": "1MiB", "codec": "zstd",
         "encryption_secret_env": "KVTIER_SEAL_SECRET"}]}))
    assert main(["inspect", "--config", str(config), "--json"]) == 0
    listed = capsys.readouterr()
    assert [n["chunks"] for n in json.loads(listed.out)["namespaces"]] == [1]
    assert main(["inspect", "--config", str(config)]) == 0
    table = capsys.readouterr()
    for text in (listed.out, listed.err, table.out, table.err):
        assert SECRET not in text and "salt-of-a-tenant" not in text
