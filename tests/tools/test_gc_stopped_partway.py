"""`kvtier gc` stopped partway through a tier's deletions (an I/O error injected after the
first chunks went, as a refused command or a dropped connection stops a real one): it says
the tier stopped partway, reports what it had removed by then (counted by listing the tier
again), and exits 1. Before, the tier was reported "not readable", its removals left out of
the table and the JSON, as if nothing had been deleted."""

from __future__ import annotations

import errno
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from storekit import fill, held, tier_config, write_config
from tierkit import tiny_layout

from kvtier.tiers.files.chunktree import FileInventory
from kvtier.tools.admin.inventory import StoredChunk
from kvtier.tools.cli.main import main

LAYOUT = tiny_layout(16)
GONE_BEFORE_THE_FAULT = 2


@pytest.fixture
def fault_after_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file tier's deletions fail (EIO) after the first two chunks went."""
    remove_batch = FileInventory._remove_batch

    def failing(self: FileInventory, chunks: Sequence[StoredChunk], *args: Any) -> Any:
        remove_batch(self, chunks[:GONE_BEFORE_THE_FAULT], *args)
        raise OSError(errno.EIO, "injected: the storage stopped answering")

    monkeypatch.setattr(FileInventory, "_remove_batch", failing)


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_gc_stopped_partway_reports_what_it_removed(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture[str], fault_after_two: None) -> None:
    config = write_config(tmp_path, tier_config(kind, tmp_path, request))
    fill(config, LAYOUT, None, range(6))
    capsys.readouterr()
    assert main(["gc", "--config", str(config), "--quota", "0", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == {}
    [stopped] = report["stopped"].values()
    assert "injected" in stopped
    [outcome] = report["outcomes"]
    assert outcome["removed_chunks"] == GONE_BEFORE_THE_FAULT
    assert outcome["kept_chunks"] == 6 - GONE_BEFORE_THE_FAULT
    assert len(held(config, LAYOUT, range(6))) == 6 - GONE_BEFORE_THE_FAULT

    assert main(["gc", "--config", str(config), "--quota", "0"]) == 1
    out = capsys.readouterr().out
    assert "stopped partway" in out and "not readable" not in out
