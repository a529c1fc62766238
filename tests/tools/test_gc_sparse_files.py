"""`kvtier gc --quota` over a shared directory where a huge sparse file kvtier did not write
sits at a chunk's path (`truncate -s 100G`): counted at its size (st_size) the directory
was 10^6 times over any quota, and gc deleted every real chunk older than it. It counts what
it allocates (`filetree.counted_bytes`), as `du` does."""

from __future__ import annotations

from pathlib import Path

import pytest
from clikit import by_namespace, cli_json
from storekit import write_config
from tierkit import key, tiny_layout

from kvtier.tiers import build_tier
from kvtier.tiers.files.chunktree import chunk_path
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()


def test_gc_to_a_quota_keeps_real_chunks_beside_a_sparse_foreign_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "shared"
    config = write_config(tmp_path, {"kind": "shared", "path": str(root), "capacity": "1MiB"})
    tier = build_tier(StoreConfig.load(config).tiers[1], LAYOUT)
    for i in range(6):
        assert tier.put(key(i), memoryview(bytes(LAYOUT.bytes_per_chunk)))
    tier.close()
    foreign = chunk_path(root, LAYOUT.digest(), key(99))
    foreign.parent.mkdir(parents=True, exist_ok=True)
    with open(foreign, "wb") as f:
        f.truncate(100 << 30)  # the newest file: gc keeps the newest
    report = by_namespace(cli_json(capsys, "inspect", "--config", str(config)))
    assert report[LAYOUT.digest()]["size_bytes"] < 1 << 20
    out = cli_json(capsys, "gc", "--config", str(config), "--quota", "1MiB")
    assert [o["removed_chunks"] for o in out["outcomes"]] == [0]
    assert len(list(root.rglob("*.kvc"))) == 7
