"""Fault injection for end-to-end tests: file access under a tier's directory made slow, or
hung, inside vLLM's own (spawned) processes, or in this one.

A `sitecustomize` on their PYTHONPATH wraps `os.open` / `os.stat` / `os.lstat`: while a flag
file `<root>/SLOW` exists, every call on a path under `root` sleeps the number of seconds the
flag holds first (a dead hard-mounted NFS server, or a disk gone slow). `reads_only` limits
it to opens for reading chunk files, so the scheduler's lookups (stats) and the write-behind
(opens for writing) run at full speed and only loads are slow. Without an `inject_dir` the
same code wraps them in this process, for the block: an engine started in it
(vllm_harness.start_engine's default) runs the injection in its scheduler, its worker and
kvtier's threads, and starts in seconds rather than ~50 s; vLLM's own processes are kept for
tests that need their engine core to step on its own (a request added, then aborted).

Primitives: `slow_files(root, inject_dir, reads_only)` (context manager, set up before the
engine starts), `SlowFlag` (its `on(seconds)` / `off()`), `injected` (any sitecustomize, with
its environment: tests/engine/slow_stores.py uses it too), `injecting()` (whether a block of
`injected` is open: vllm_harness.start_engine then starts vLLM's own processes, the only ones
that run the injection).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SITECUSTOMIZE = '''
"""Test fault injection (tests/engine/slow_files.py)."""
import io
import os
import time

_ROOT = os.environ.get("KVTIER_TEST_SLOW_ROOT")
if _ROOT:
    _open, _stat, _lstat = os.open, os.stat, os.lstat
    _flag = os.path.join(_ROOT, "SLOW")
    _reads_only = os.environ.get("KVTIER_TEST_SLOW_READS_ONLY") == "1"

    def _gate(path, dir_fd=None):
        p = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
        if dir_fd is not None and not os.path.isabs(p):  # relative to an open directory
            try:
                p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
            except OSError:
                return
        if (p + os.sep).startswith(_ROOT + os.sep) and p != _flag:
            try:
                with io.open(_flag) as f:  # not `open`: this module's os.open below
                    seconds = float(f.read() or 0)
            except (OSError, ValueError):
                return
            time.sleep(seconds)

    def open(path, *args, **kwargs):
        flags = args[0] if args else kwargs.get("flags", 0)
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if not (_reads_only and (writing or not os.fsdecode(path).endswith(".kvc"))):
            _gate(path, kwargs.get("dir_fd"))
        return _open(path, *args, **kwargs)

    def stat(path, *args, **kwargs):
        if not _reads_only:
            _gate(path, kwargs.get("dir_fd"))
        return _stat(path, *args, **kwargs)

    def lstat(path, *args, **kwargs):
        if not _reads_only:
            _gate(path, kwargs.get("dir_fd"))
        return _lstat(path, *args, **kwargs)

    os.open, os.stat, os.lstat = open, stat, lstat
'''


@dataclass(frozen=True)
class SlowFlag:
    """Switches the injected delay of one root on and off."""

    root: Path

    def on(self, seconds: float) -> None:
        (self.root / "SLOW").write_text(str(seconds))

    def off(self) -> None:
        (self.root / "SLOW").unlink(missing_ok=True)


@contextlib.contextmanager
def slow_files(root: Path, inject_dir: Path | None = None, *,
               reads_only: bool = False) -> Iterator[SlowFlag]:
    """Make processes started inside the block (vLLM's) honour `root/SLOW`, or this one when
    `inject_dir` is None; the flag starts off. `inject_dir` is an empty directory for the
    sitecustomize module."""
    flag = SlowFlag(root)
    env = {"KVTIER_TEST_SLOW_ROOT": str(root),
           "KVTIER_TEST_SLOW_READS_ONLY": "1" if reads_only else "0"}
    injection = injected(inject_dir, SITECUSTOMIZE, env) if inject_dir is not None \
        else _here(env)
    with injection:
        try:
            yield flag
        finally:
            flag.off()


@contextlib.contextmanager
def _here(env: dict[str, str]) -> Iterator[None]:
    """SITECUSTOMIZE run in this process with `env`; what it wrapped is restored on exit."""
    saved = os.open, os.stat, os.lstat
    with _environment(env):
        exec(SITECUSTOMIZE, {"__name__": "kvtier_test_slow_files"})
    try:
        yield
    finally:
        os.open, os.stat, os.lstat = saved


@contextlib.contextmanager
def injected(inject_dir: Path, sitecustomize: str, env: dict[str, str]) -> Iterator[None]:
    """Processes started inside the block run `sitecustomize` first (on their PYTHONPATH,
    from `inject_dir`) with `env` set; this process's environment is restored on exit."""
    (inject_dir / "sitecustomize.py").write_text(sitecustomize)
    path = os.pathsep.join(filter(None, [str(inject_dir), os.environ.get("PYTHONPATH")]))
    with _environment({**env, "PYTHONPATH": path, INJECTING: "1"}):
        yield


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with `env` set, restored on exit."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


INJECTING = "KVTIER_TEST_INJECTING"


def injecting() -> bool:
    """Whether processes started now run an injected sitecustomize (a block of `injected`)."""
    return os.environ.get(INJECTING) == "1"
