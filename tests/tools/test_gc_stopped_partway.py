"""`kvtier gc` stopped partway through a tier's deletions (an I/O error injected after the
first chunks went, as a refused command or a dropped connection stops a real one): it says
the tier stopped partway, reports what it had removed by then (counted by listing the tier
again), and exits 1. Before, the tier was reported "not readable", its removals left out of
the table and the JSON, as if nothing had been deleted. The same for a gc stopped among the
manifests of the namespaces it removes whole: those removed before it stopped are reported
removed (they were reported kept)."""

from __future__ import annotations

import errno
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from clikit import by_namespace, cli_json
from storekit import NEW, NEW_INFO, OLD, OLD_INFO, fill, held, tier_config, write_config
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


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_gc_stopped_among_the_manifests_reports_those_it_removed(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, tier_config(kind, tmp_path, request))
    fill(config, OLD, OLD_INFO, range(0, 3))
    fill(config, NEW, NEW_INFO, range(10, 12))
    first, second = sorted([OLD.digest(), NEW.digest()])  # the order gc removes them in
    remove_manifest = FileInventory.remove_manifest

    def failing(self: FileInventory, namespace: str) -> bool:
        if namespace == second:
            raise OSError(errno.EIO, "injected: the storage stopped answering")
        return remove_manifest(self, namespace)

    monkeypatch.setattr(FileInventory, "remove_manifest", failing)
    capsys.readouterr()
    assert main(["gc", "--config", str(config), "--model", "acme/tiny", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "injected" in next(iter(report["stopped"].values()))
    chunks = {OLD.digest(): 3, NEW.digest(): 2}  # every chunk went before the manifests
    assert {o["namespace"]: (o["removed_chunks"], o["removed_manifest"])
            for o in report["outcomes"]} == {first: (chunks[first], True),
                                             second: (chunks[second], False)}
    assert held(config, OLD, range(0, 3)) == [] and held(config, NEW, range(10, 12)) == []
    monkeypatch.undo()
    assert list(by_namespace(cli_json(capsys, "inspect", "--config", str(config)))) \
        == [second]  # its manifest only
