"""Ctrl-C during a benchmark: one line and the shell's status for SIGINT (130), no
traceback, and the scratch files the run made removed (its `with` blocks ran).

A real `kvtier bench storage` in a child process gets a real SIGINT once its scratch
directory exists (it is then measuring); nothing is timed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier.tools.cli.main import EXIT_INTERRUPTED


def _sigint_as_default() -> None:
    # A shell's background job starts with SIGINT ignored; a user's Ctrl-C is not.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_bench_storage_is_one_line_status_130_and_no_scratch_left(
        tmp_path: Path) -> None:
    out = tmp_path / "storage.json"
    child = subprocess.Popen(
        [sys.executable, "-m", "kvtier.tools.cli.main", "bench", "storage", "--tier", "disk",
         "--tier", "memory", "--sizes", "2", "--trials", "1000", "--trial-bytes", "64MiB",
         "--dir", str(tmp_path), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_sigint_as_default)
    try:
        deadline = time.monotonic() + 120
        # Something inside its scratch directory: the directory's removal is registered, and
        # it is measuring.
        while not list(tmp_path.glob(".kvtier-bench-*/*")):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "no scratch directory after 120 s"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == EXIT_INTERRUPTED, stderr[-2000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "kvtier bench: interrupted"
    assert list(tmp_path.iterdir()) == []  # neither scratch nor a half-written JSON
