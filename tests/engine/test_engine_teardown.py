"""The engine harness's own clean-up (kvtier.testing.engines): where vLLM's shutdown of an
engine core slow to exit raises half-way (a child gone while it named them), the harness kills
the engine's processes left, and nothing else of the test's (its redis-server, say). No vLLM
here: `sleep` processes stand for the engine's and the test's."""

from __future__ import annotations

import signal
import subprocess

from kvtier.testing.engines import _descendants, _kill


def test_the_engines_processes_left_are_killed_and_nothing_else() -> None:
    engine = subprocess.Popen(["sleep", "60"])
    others = subprocess.Popen(["sleep", "60"])
    try:
        assert {engine.pid, others.pid} <= _descendants()
        gone = subprocess.Popen(["true"])
        gone.wait()
        _kill({engine.pid, gone.pid})  # one exited already: no error
        assert engine.wait(timeout=10) == -signal.SIGKILL
        assert others.poll() is None
    finally:
        for process in (engine, others):
            process.kill()
            process.wait()
