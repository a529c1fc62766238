"""The emulated network filesystem of `kvtier bench fleet --emulate-latency`: an LD_PRELOAD
shim that makes every metadata call on one directory wait, as a round trip to an NFS server
would, and leaves every other path alone. Checked in a child process with the shim loaded:
each call waits at least the latency (a sleep's lower bound, not a timing of the machine)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier.errors import ShimUnavailable
from kvtier.tools.bench.emulators.fslatency import build_shim, shim_env

CHILD = r"""
import json, os, sys, time
inside, outside = sys.argv[1], sys.argv[2]
fd = os.open(inside, os.O_RDONLY)
calls = {
    "stat": lambda: os.stat(os.path.join(inside, "f")),
    "stat_dir_fd": lambda: os.stat("f", dir_fd=fd),
    "openat": lambda: os.close(os.open("f", os.O_RDONLY, dir_fd=fd)),
    "scandir": lambda: list(os.scandir(fd)),
    "utime_fd": lambda: (lambda f: (os.utime(f), os.close(f)))(
        os.open(os.path.join(inside, "f"), os.O_RDONLY)),
    "outside": lambda: os.stat(outside),
    "sibling": lambda: os.stat(inside + "-sibling"),
}
out = {}
for name, call in calls.items():
    began = time.perf_counter()
    for _ in range(20):
        call()
    out[name] = (time.perf_counter() - began) / 20
print(json.dumps(out))
"""


@pytest.mark.timing
def test_metadata_calls_under_the_directory_wait_and_others_do_not(tmp_path: Path) -> None:
    try:
        build_shim(tmp_path / "cache")
    except ShimUnavailable as exc:
        pytest.skip(str(exc))
    inside = tmp_path / "nfs"
    inside.mkdir()
    (inside / "f").write_bytes(b"x")
    (tmp_path / "nfs-sibling").mkdir()  # a path that starts like it, outside it
    env = shim_env(inside, latency_ms=5.0, cache=tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", CHILD, str(inside), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=120, check=True)
    per_call = json.loads(result.stdout)
    for name in ("stat", "stat_dir_fd", "openat", "scandir"):
        assert per_call[name] >= 0.005, (name, per_call)
    assert per_call["utime_fd"] >= 0.010, per_call  # the open, then the touch through it
    assert per_call["outside"] < 0.005 and per_call["sibling"] < 0.005, per_call


def test_the_shim_is_kept_in_the_users_cache_not_the_temp_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built into the temp dir, a kvtier-fslatency/ stayed there after every run (this
    module's tests and `kvtier bench fleet --emulate-latency`), a folder of no process's."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        shim = build_shim()
    except ShimUnavailable as exc:
        pytest.skip(str(exc))
    assert shim.parent == tmp_path / "cache" / "kvtier" / "fslatency"
    assert shim_env(tmp_path, 1.0)["LD_PRELOAD"].split()[0] == str(shim)
    assert list(temp.iterdir()) == []
