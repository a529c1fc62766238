"""`kvtier gc` beside running engines on a shared directory: what it deletes is taken off the
directory's quota ledger (ROOT/.kvtier-quota), under its lock, as an engine's own eviction is.

gc deleted chunk files and left the ledger as it was: the writers' usage stayed at what it had
been until the next re-measure (at fleet scale hours apart: REMEASURE_DUTY times a walk), so
after `gc --quota` halved a full directory every put still evicted as if it were full,
deleting real chunks from a half-empty directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from clikit import cli_json
from storekit import write_config
from tierkit import key, tiny_layout

from kvtier.tiers import build_tier
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()


def test_gc_takes_what_it_deletes_off_the_shared_ledger(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "shared"
    config = write_config(tmp_path, {"kind": "shared", "path": str(root),
                                     "capacity": 10 * 8192})  # 10 files of 8 KiB
    engine: Any = build_tier(StoreConfig.load(config).tiers[1], LAYOUT)  # running throughout
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    for i in range(10):
        assert engine.put(key(i), data)
    out = cli_json(capsys, "gc", "--config", str(config), "--quota", str(5 * 8192))
    assert [o["removed_chunks"] for o in out["outcomes"]] == [5]
    assert engine.stats().evictions == 0
    assert engine.put(key(10), data)  # room for it: nothing evicted
    assert engine.stats().evictions == 0
    assert sum(engine.contains(key(i)) for i in range(11)) == 6
    with engine.ledger.locked() as ledger:
        assert ledger.used_bytes == 6 * engine.file_bytes and ledger.chunks == 6
    engine.close()
