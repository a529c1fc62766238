"""A file tier's `path` is checked when the config is validated (issue 12, item 10): a path
that is a file, lies under /proc or /sys, or cannot be written is a ConfigError naming the
field, the value and the fix, at once, instead of a NotADirectoryError or PermissionError from
a vLLM worker 45 s into start-up. A `shared` tier may be a read-only directory (it serves hits).
A directory that does not answer (a dead mount) is accepted unchecked after a deadline.

The unwritable directory is real: a read-only tmpfs when the tests run as root (root writes
through any mode bits), a 0555 directory otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.files.disk import DiskTierConfig
from kvtier.tiers.files.shared import SharedTierConfig
from kvtier.tiers.storeconfig import StoreConfig

FIX = "writable by this user, or that can be created under a writable parent"


def _tier(kind: str, path: Path | str, **fields: Any) -> dict[str, Any]:
    return {"tiers": [{"kind": kind, "path": str(path), "capacity": "1GiB"} | fields]}


def _path(config: StoreConfig) -> Path:
    tier = config.tiers[0]
    assert isinstance(tier, (DiskTierConfig, SharedTierConfig))
    return tier.path


def _refused(kind: str, path: Path | str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse(_tier(kind, path), where="kvtier.yaml")
    error = caught.value
    assert error.field == f"kvtier.yaml.tiers.0.{kind}.path"
    assert error.value == str(path) and str(path) in str(error)
    return error


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_path_that_is_a_file_names_the_field_and_the_fix(tmp_path: Path, kind: str) -> None:
    blocker = tmp_path / "kv.img"
    blocker.write_bytes(b"not a directory")
    error = _refused(kind, blocker)
    assert "it is a file" in error.allowed and FIX in error.allowed
    error = _refused(kind, blocker / "kvtier")  # a file where a parent directory should be
    assert f"{blocker}, a parent of it, is a file" in error.allowed


@pytest.mark.parametrize("kind", ["disk", "shared"])
@pytest.mark.parametrize("path", ["", "   "])
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(
        kind: str, path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pathlib reads "" as ".": a Helm value or variable that came out empty made the tier
    write its chunks into whatever directory the vLLM worker started in."""
    monkeypatch.chdir(tmp_path)  # a writable working directory: the old code accepted it
    error = _refused(kind, path)
    assert "not an empty path" in error.allowed and FIX in error.allowed


@pytest.mark.parametrize("kind", ["disk", "shared"])
@pytest.mark.parametrize("path", ["/proc/kvtier", "/sys/kernel/kvtier", "/proc"])
def test_kernel_filesystems_are_refused(kind: str, path: str) -> None:
    """As root, /proc and /sys look writable to access(2); the tier would fail (or poke a
    kernel knob) only when it writes."""
    error = _refused(kind, path)
    assert "kernel filesystem, not storage" in error.allowed and FIX in error.allowed


def test_a_symlink_into_proc_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "kv"
    link.symlink_to("/proc/self")
    assert "/proc is a kernel filesystem" in _refused("disk", link).allowed


def test_an_unwritable_disk_directory_is_refused_a_read_only_shared_one_is_served(
        read_only_dir: Path) -> None:
    """A disk tier must write; a shared tier on a read-only export can still serve the hits
    other nodes wrote, so it is accepted. Neither can create a directory inside it."""
    error = _refused("disk", read_only_dir)
    assert "not writable" in error.allowed and FIX in error.allowed
    if os.getuid() == 0:
        assert "read-only filesystem" in error.allowed
    assert _path(StoreConfig.parse(_tier("shared", read_only_dir))) == read_only_dir
    # A command that only reads the tiers (kvtier inspect, as a monitoring user or on a
    # read-only mount) is given the disk tier's directory.
    assert _path(StoreConfig.parse(_tier("disk", read_only_dir), reading_only=True)) \
        == read_only_dir
    for kind in ("disk", "shared"):
        error = _refused(kind, read_only_dir / "kvtier")
        assert "does not exist and cannot be created" in error.allowed


def test_a_missing_directory_under_a_writable_parent_is_accepted_and_not_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation has no side effect: the tier creates its directory when it is built."""
    for kind in ("disk", "shared"):
        path = tmp_path / kind / "deep" / "kv"
        assert _path(StoreConfig.parse(_tier(kind, path))) == path
    assert list(tmp_path.iterdir()) == []
    monkeypatch.chdir(tmp_path)  # a relative path is taken from the working directory
    assert _path(StoreConfig.parse(_tier("disk", "kv"))) == Path("kv")


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_leading_tilde_is_the_users_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           kind: str) -> None:
    """No shell expands `~` inside a JSON or YAML config: "~/kv" made a folder named "~"
    in the engine's working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert _path(StoreConfig.parse(_tier(kind, "~/kv"))) == tmp_path / "kv"


def test_two_file_tiers_on_one_directory_are_refused(tmp_path: Path) -> None:
    """Each would count the other's chunks as its own and evict them to its own capacity."""
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({"tiers": [
            {"kind": "memory", "capacity": "1GiB"},
            {"kind": "disk", "path": str(tmp_path / "kv"), "capacity": "1GiB"},
            {"kind": "shared", "path": str(tmp_path / "x" / ".." / "kv"), "capacity": "1GiB"}]})
    assert caught.value.field == "config.tiers"
    assert "'disk' and 'shared' share the directory" in caught.value.allowed


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_file_tier_of_capacity_zero_is_refused(tmp_path: Path, kind: str) -> None:
    """It would store nothing, every write refused as full, and say nothing of it."""
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse(_tier(kind, tmp_path / "kv", capacity=0))
    assert caught.value.field == f"config.tiers.0.{kind}.capacity"
    assert "greater than 0" in caught.value.allowed


@pytest.mark.parametrize("text", ["-5GiB", " -1", "-0.5 MiB"])
def test_a_negative_size_says_so(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": text}]})
    assert caught.value.field == "config.tiers.0.memory.capacity"
    assert "must not be negative" in caught.value.allowed


@pytest.mark.timing
def test_a_directory_that_does_not_answer_is_accepted_unchecked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A dead hard-mounted NFS server blocks a `stat` for ever: reading the config (an
    engine's start) must not wait for it. The path is accepted unchecked after the check's
    deadline, said so; the store leaves the tier out if it still does not answer
    (tests/faults/test_stalled_tier.py)."""
    from kvtier.tiers.files import directories

    dead = tmp_path / "nfs" / "kvtier"
    answer = threading.Event()
    real_stat, real_lstat = os.stat, os.lstat

    def hung(real: Any) -> Any:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).startswith(str(tmp_path / "nfs")):
                answer.wait(30)
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(directories, "CHECK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(os, "stat", hung(real_stat))
    monkeypatch.setattr(os, "lstat", hung(real_lstat))
    try:
        start = time.monotonic()
        config = StoreConfig.parse(_tier("shared", dead))
        assert time.monotonic() - start < 5.0  # 30 s before: the hung stat's
    finally:
        answer.set()
    assert _path(config) == dead
    assert f"directory {dead} did not answer within 0.3 s" in caplog.text
