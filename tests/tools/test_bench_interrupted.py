"""Ctrl-C during a benchmark: one line and the shell's status for SIGINT (130), no
traceback, and the scratch files the run made removed (its `with` blocks ran). SIGTERM and
SIGHUP (a service manager, a closed terminal) end it the same way, with the shell's status
for them.

A real `kvtier bench storage` in a child process gets a real signal once its scratch
directory exists (it is then measuring); nothing is timed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tools.cli.main import EXIT_INTERRUPTED


def _signals_as_default() -> None:
    # A user's terminal: a shell's background job starts with SIGINT ignored, and a suite run
    # under nohup with SIGHUP ignored (which the command keeps ignored, as nohup means).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _measuring_bench_storage(tmp_path: Path) -> subprocess.Popen[str]:
    """A `kvtier bench storage` of disk and memory, once it measures (something inside its
    scratch directory: the directory's removal is registered)."""
    out = tmp_path / "storage.json"
    child = subprocess.Popen(
        [sys.executable, "-m", "kvtier.tools.cli.main", "bench", "storage", "--tier", "disk",
         "--tier", "memory", "--sizes", "2", "--trials", "1000", "--trial-bytes", "64MiB",
         "--dir", str(tmp_path), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_signals_as_default)
    deadline = time.monotonic() + 120
    try:
        while not list(tmp_path.glob(".kvtier-bench-*/*")):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "no scratch directory after 120 s"
            time.sleep(0.05)
    except BaseException:
        child.kill()
        child.communicate()
        raise
    return child


def test_ctrl_c_during_bench_storage_is_one_line_status_130_and_no_scratch_left(
        tmp_path: Path) -> None:
    child = _measuring_bench_storage(tmp_path)
    try:
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    # 130 from main; or, seen once in a loaded CI-like run, an end by SIGINT itself after
    # main had printed its line (the cause inside CPython not pinned down; its interpreter
    # ends so when it deems a KeyboardInterrupt unhandled): either way a shell reports 130.
    assert child.returncode in (EXIT_INTERRUPTED, -signal.SIGINT), stderr[-2000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "kvtier bench: interrupted"
    assert list(tmp_path.iterdir()) == []  # neither scratch nor a half-written JSON


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_during_bench_storage_leaves_no_scratch(
        tmp_path: Path, ending: signal.Signals) -> None:
    """Python's default for these signals ended the process where it stood: its scratch
    directory (.kvtier-bench-*, 64 MiB files) stayed."""
    child = _measuring_bench_storage(tmp_path)
    try:
        child.send_signal(ending)
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 128 + ending, stderr[-2000:]
    assert "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_a_signal_ignored_stays_ignored_and_the_callers_handlers_come_back() -> None:
    """`nohup kvtier bench ...` ignores SIGHUP: the command must not end on it; and a test
    that calls `main` in its own process keeps its handlers."""
    from kvtier.tools.cli.main import _signals_end_the_command

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    term = signal.getsignal(signal.SIGTERM)
    try:
        with _signals_end_the_command():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            with pytest.raises(SystemExit) as ended:
                signal.raise_signal(signal.SIGTERM)
            assert ended.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == term
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_second_ending_signal_does_not_cut_the_first_ones_clean_up_short(
        tmp_path: Path) -> None:
    """SIGTERM and SIGHUP at once (a service manager and a closed terminal, or a signal to
    the process group and one to the process): the second raised SystemExit again inside the
    `with` blocks the first was unwinding, and the scratch directory stayed."""
    child = _measuring_bench_storage(tmp_path)
    try:
        child.send_signal(signal.SIGTERM)
        child.send_signal(signal.SIGHUP)
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    # Python runs pending handlers lowest signal first: whichever it saw first ended it.
    assert child.returncode in (128 + signal.SIGTERM, 128 + signal.SIGHUP), stderr[-2000:]
    assert "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_an_ending_signal_inside_the_clean_up_is_ignored_until_the_command_has_ended(
        ) -> None:
    from kvtier.tools.cli.main import _signals_end_the_command

    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # not as under nohup
    cleaned_up = False
    try:
        with _signals_end_the_command():
            with pytest.raises(SystemExit) as ended:
                try:
                    signal.raise_signal(signal.SIGTERM)
                finally:
                    signal.raise_signal(signal.SIGHUP)  # must not raise inside the clean-up
                    cleaned_up = True
            assert ended.value.code == 128 + signal.SIGTERM
        assert cleaned_up
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # the caller's, back
    finally:
        signal.signal(signal.SIGHUP, hup)


def test_an_ending_signal_a_library_wrapped_still_ends_the_command_with_its_status(
        ) -> None:
    """SIGTERM while pydantic built a validator (a tier's module imported lazily as the
    bench reached it): pydantic's SchemaError wrapped the handler's SystemExit, and the
    command ended in a traceback (CI, 47th session). The fault: a library that wraps it."""
    import argparse

    from kvtier.tools.cli.main import _run_command

    def command(_args: argparse.Namespace) -> int:
        try:
            signal.raise_signal(signal.SIGTERM)
        except SystemExit as exc:
            raise RuntimeError("a library's own error") from exc
        return 0

    def failing(_args: argparse.Namespace) -> int:
        raise RuntimeError("no signal")

    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # not as under nohup
    term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as ended:
            _run_command(argparse.Namespace(func=command))
        assert ended.value.code == 128 + signal.SIGTERM
        with pytest.raises(RuntimeError, match="no signal"):  # without a signal: as it is
            _run_command(argparse.Namespace(func=failing))
    finally:
        signal.signal(signal.SIGHUP, hup)
        signal.signal(signal.SIGTERM, term)
