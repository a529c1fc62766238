"""Fault injection for end-to-end tests: kvtier's store thread made slow inside vLLM's own
(spawned) processes.

A `sitecustomize` on their PYTHONPATH wraps `PagedKV.gather` when kvtier's paged module is
imported: while a flag file exists, a gather on the store thread ("kvtier-store") sleeps the
number of seconds the flag holds before it reads the blocks, as if the thread had lost its
core. Synchronous gathers (the model runner's) are not slowed.

Primitives: `slow_stores(flag_dir, inject_dir)` (context manager, set up before the engine
starts), `StoreFlag` (its `on(seconds)` / `off()`, and `wait_for_a_slow_gather()`: until a
gather slowed since `on` is in flight).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from slow_files import injected

SITECUSTOMIZE = '''
"""Test fault injection (tests/engine/slow_stores.py)."""
import os
import sys

_FLAG = os.environ.get("KVTIER_TEST_SLOW_STORES")
_MODULE = "kvtier.integrations.vllm.worker.paged"


def _patch(module):
    import threading
    import time

    gather = module.PagedKV.gather

    def slow_gather(self, *args, **kwargs):
        if threading.current_thread().name.startswith("kvtier-store"):
            try:
                with open(_FLAG) as f:
                    seconds = float(f.read() or 0)
                open(_FLAG + ".began", "a").close()  # a slow gather is in flight
                time.sleep(seconds)
            except (OSError, ValueError):
                pass
        return gather(self, *args, **kwargs)

    module.PagedKV.gather = slow_gather


class _Finder:
    """Patches the module right after it is first executed."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _FLAG:
    sys.meta_path.insert(0, _Finder())
'''


@dataclass(frozen=True)
class StoreFlag:
    """Switches the injected delay on and off."""

    path: Path

    def on(self, seconds: float) -> None:
        self._began.unlink(missing_ok=True)
        self.path.write_text(str(seconds))

    def off(self) -> None:
        self.path.unlink(missing_ok=True)

    def wait_for_a_slow_gather(self, timeout_s: float = 60.0) -> None:
        """Until a gather slowed since `on` has begun (the store thread is then in flight)."""
        deadline = time.monotonic() + timeout_s
        while not self._began.exists():
            assert time.monotonic() < deadline, f"no slow gather began in {timeout_s} s"
            time.sleep(0.02)

    @property
    def _began(self) -> Path:
        return self.path.with_name(self.path.name + ".began")


@contextlib.contextmanager
def slow_stores(flag_dir: Path, inject_dir: Path) -> Iterator[StoreFlag]:
    """Make processes started inside the block (vLLM's) honour the flag; it starts off.
    `inject_dir` is an empty directory for the sitecustomize module."""
    flag = StoreFlag(flag_dir / "SLOW_STORES")
    with injected(inject_dir, SITECUSTOMIZE, {"KVTIER_TEST_SLOW_STORES": str(flag.path)}):
        try:
            yield flag
        finally:
            flag.off()
