"""The engine harness's own clean-up (kvtier.testing.engines): where vLLM's shutdown of an
engine core slow to exit raises half-way (a child gone while it named them), the harness kills
the engine's processes left, and nothing else of the test's (its redis-server, say); the socket
files vLLM leaves go to a folder of the process's, removed at its exit. No vLLM here: `sleep`
processes stand for the engine's and the test's, a file for a socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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


def test_a_process_without_a_socket_folder_gets_one_removed_at_its_exit(tmp_path: Path) -> None:
    """vLLM leaves socket files where VLLM_RPC_BASE_PATH says at every shutdown (/tmp by
    default): the first engine of a process names a folder of the process's, removed when it
    exits; a folder its environment names already is kept as it is."""
    script = ("import os; from kvtier.testing.engines import own_rpc_folder; "
              "folder = own_rpc_folder(); assert os.environ['VLLM_RPC_BASE_PATH'] == folder; "
              "assert own_rpc_folder() == folder; "
              "open(os.path.join(folder, 'engine-core'), 'w').close(); print(folder)")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    folder = Path(run.stdout.strip())
    assert folder.name.startswith("kvtier-rpc-") and not folder.exists()
    named = tmp_path / "rpc"
    named.mkdir()
    run = subprocess.run([sys.executable, "-c", script], env={**env, "VLLM_RPC_BASE_PATH":
                                                              str(named)},
                         capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == str(named) and (named / "engine-core").exists()
