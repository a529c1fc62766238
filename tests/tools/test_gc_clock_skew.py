"""`kvtier gc --max-age` and `kvtier inspect`'s ages on a host whose clock is not the shared
directory's.

A chunk file's mtime (its last use: every hit touches it) is stamped by the filesystem's
clock (on NFS the server's); gc measured its age against the clock of the host it ran on (a
cron job on any node, an operator's laptop). Run from a host 10 minutes ahead, `--max-age 15m`
deleted every chunk idle for more than 5 minutes, chunks the fleet was reading included; from
a host behind, it kept idle ones. gc now reads the filesystem's clock off a file it creates
in the tier's root and removes at once (`FileInventory.now_s`). `kvtier inspect` showed each
namespace's least and most recently used as "N ago" by the host's clock as well: it now takes
them by the same clock.

The gc host's clock is skewed by replacing `time` in gc's module (the fault injected); the
directory, its chunks and their mtimes are real.
"""

from __future__ import annotations

import json
import os
import re
import time
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from tierkit import key, tiny_layout

from kvtier.tiers import build_tier
from kvtier.tiers.files.chunktree import FileInventory
from kvtier.tiers.files.shared import SharedTierConfig
from kvtier.tools.admin import gc as gc_module
from kvtier.tools.admin.gc import GcRequest, run_gc
from kvtier.tools.cli import inspect as inspect_module
from kvtier.tools.cli.main import main

LAYOUT = tiny_layout()
AHEAD_S = 600.0
MAX_AGE_S = 900.0
IDLE_S = (300.0, 600.0, 1200.0, 1800.0)  # how long each chunk has been idle


def skewed_time(ahead_s: float) -> types.SimpleNamespace:
    """The `time` module as a host `ahead_s` ahead of the filesystem sees it."""
    return types.SimpleNamespace(time=lambda: time.time() + ahead_s,
                                 monotonic=time.monotonic, perf_counter=time.perf_counter)


def engine_with_idle_chunks(root: Path) -> Any:
    """A running shared tier holding one chunk per IDLE_S, each last used that long ago by
    the filesystem's clock (this host's, for a local directory)."""
    engine: Any = build_tier(SharedTierConfig(kind="shared", path=root, capacity=64 * 8192),
                             LAYOUT)
    data = memoryview(bytes(LAYOUT.bytes_per_chunk))
    now = time.time()
    for i, idle_s in enumerate(IDLE_S):
        assert engine.put(key(i), data)
        os.utime(engine.files.path_of(key(i)), (now - idle_s, now - idle_s))
    return engine


@pytest.mark.parametrize("ahead_s", [AHEAD_S, -AHEAD_S], ids=["ahead", "behind"])
def test_max_age_is_measured_by_the_filesystems_clock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead_s: float) -> None:
    engine = engine_with_idle_chunks(tmp_path / "shared")
    monkeypatch.setattr(gc_module, "time", skewed_time(ahead_s))
    inventory = FileInventory("shared", "shared", tmp_path / "shared", 0o600)
    [outcome] = run_gc([inventory], GcRequest(max_age_s=MAX_AGE_S))
    held = [engine.contains(key(i)) for i in range(len(IDLE_S))]
    assert held == [idle_s <= MAX_AGE_S for idle_s in IDLE_S], \
        f"a gc host {ahead_s:+.0f} s off the filesystem's clock took ages by its own"
    assert outcome.removed_chunks == 2
    assert not [p for p in (tmp_path / "shared").iterdir() if p.is_file()
                and not p.name.startswith(".kvtier-quota")], "gc left its clock file"
    engine.close()


def test_a_read_only_root_falls_back_to_the_hosts_clock(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where gc cannot create a file in the root (a dry run by a user who may only read),
    ages are taken by this host's clock, as before, and nothing fails."""
    engine = engine_with_idle_chunks(tmp_path / "shared")
    inventory = FileInventory("shared", "shared", tmp_path / "shared", 0o600)
    real_open = os.open

    def refused(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT and ".kvtier-clock-" in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    assert abs(inventory.now_s() - time.time()) < 60
    [outcome] = run_gc([inventory], GcRequest(max_age_s=MAX_AGE_S, dry_run=True))
    assert outcome.removed_chunks == 2 and outcome.dry_run
    monkeypatch.undo()
    assert all(engine.contains(key(i)) for i in range(len(IDLE_S)))
    engine.close()


@pytest.mark.parametrize("ahead_s", [AHEAD_S, -AHEAD_S], ids=["ahead", "behind"])
def test_inspect_shows_ages_by_the_filesystems_clock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        ahead_s: float) -> None:
    engine = engine_with_idle_chunks(tmp_path / "shared")
    engine.close()
    config = tmp_path / "store.yaml"
    config.write_text(yaml.safe_dump({"tiers": [
        {"kind": "shared", "path": str(tmp_path / "shared"), "capacity": 64 * 8192}]}))
    monkeypatch.setattr(inspect_module, "time", skewed_time(ahead_s))
    capsys.readouterr()
    assert main(["inspect", "--config", str(config)]) == 0
    shown = [float(m) for m in re.findall(r"(\d+\.\d)m ago", capsys.readouterr().out)]
    expected = [max(IDLE_S) / 60, min(IDLE_S) / 60]  # oldest, newest
    assert len(shown) == 2 and all(abs(s - e) < 0.5 for s, e in zip(shown, expected)), \
        f"inspect showed {shown} minutes ago, not {expected}: a host {ahead_s:+.0f} s off " \
        "the filesystem's clock"


@pytest.mark.parametrize("ahead_s", [AHEAD_S, -AHEAD_S], ids=["ahead", "behind"])
def test_inspect_json_gives_the_ages_by_the_filesystems_clock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        ahead_s: float) -> None:
    """`--json` gave the times of use as Unix times only: a script had to take its own host's
    clock for "how long ago", the skew the table no longer has. It gives each namespace's ages
    too (`oldest_age_s`, `newest_age_s`), in seconds by the directory's clock."""
    engine = engine_with_idle_chunks(tmp_path / "shared")
    engine.close()
    config = tmp_path / "store.yaml"
    config.write_text(yaml.safe_dump({"tiers": [
        {"kind": "shared", "path": str(tmp_path / "shared"), "capacity": 64 * 8192}]}))
    monkeypatch.setattr(inspect_module, "time", skewed_time(ahead_s))
    capsys.readouterr()
    assert main(["inspect", "--config", str(config), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["namespaces"]
    assert row["oldest_s"] <= row["newest_s"]  # the Unix times, as before
    ages = (row["oldest_age_s"], row["newest_age_s"])
    assert abs(ages[0] - max(IDLE_S)) < 30 and abs(ages[1] - min(IDLE_S)) < 30, \
        f"inspect --json gave ages {ages}, not {(max(IDLE_S), min(IDLE_S))}: a host " \
        f"{ahead_s:+.0f} s off the filesystem's clock"
    assert not [p for p in (tmp_path / "shared").iterdir()
                if p.name.startswith(".kvtier-clock-")], "inspect left its clock file"


def test_a_clock_file_a_killed_gc_left_is_swept_by_the_next(tmp_path: Path) -> None:
    """A gc or inspect killed between the clock file's create and its unlink left it in the
    root for good (nothing else lists the root's files): the next reading of the clock removes
    those older than an hour by the directory's clock, and leaves a younger one (another
    reader's, in flight)."""
    root = tmp_path / "shared"
    root.mkdir()
    left = root / ".kvtier-clock-0123456789abcdef.tmp"
    in_flight = root / ".kvtier-clock-fedcba9876543210.tmp"
    other = root / ".kvtier-quota"  # not a clock file: never touched
    for path in (left, in_flight, other):
        path.write_bytes(b"")
    hours_ago = time.time() - 2 * 3600
    os.utime(left, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))
    FileInventory("shared", "shared", root, 0o600).now_s()
    assert not left.exists()
    assert in_flight.exists() and other.exists()
    assert sorted(p.name for p in root.iterdir()) == sorted([in_flight.name, other.name])
