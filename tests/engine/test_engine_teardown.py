"""The engine harness's own clean-up (kvtier.testing.engines): where vLLM's shutdown of an
engine core slow to exit raises half-way (a child gone while it named them), the harness kills
the engine's processes left, and nothing else of the test's (its redis-server, say); the socket
files vLLM leaves go to a folder of the process's, removed at its exit; the shared memory files
its TP ranks leave in /dev/shm are removed once its processes are gone, and no other
process's; its rendezvous file in the temp dir goes with a temp dir of the engine's own. No
vLLM here: `sleep` processes stand for the engine's and the test's, a file for a socket, a
process mapping a file of /dev/shm for a TP rank, one making a file in its temp dir for an
engine's first worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

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


MAPS_ONE = """import mmap, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
region = mmap.mmap(fd, 4096)  # as vLLM's SHMManager maps its rank's file
print("mapped", flush=True)
sys.stdin.read()
"""


def _mapping(path: Path) -> subprocess.Popen[str]:
    """A stand-in for a TP rank: a process that creates and maps `path`, until killed."""
    process = subprocess.Popen([sys.executable, "-c", MAPS_ONE, str(path)], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == "mapped\n"
    return process


def test_an_engines_shared_memory_files_are_removed_once_its_processes_are_gone() -> None:
    """vLLM's TP ranks leave their /dev/shm/vllm_dist_* files (kvtier.testing.vllmshm): the
    files an engine's processes mapped are removed once those processes have ended (a zombie
    counts as ended), not while one runs, and another process's are kept."""
    from kvtier.testing.vllmshm import SHM_DIR, remove_when_gone, vllm_shm_maps

    tag = f"vllm_dist_kvtier-test-{os.getpid()}"
    ours, theirs = SHM_DIR / f"{tag}-cpushm_0", SHM_DIR / f"{tag}-other-cpushm_0"
    engine, other = _mapping(ours), _mapping(theirs)
    helper = subprocess.Popen(["sleep", "60"])  # the engine's, mapping none: not waited for
    try:
        maps = vllm_shm_maps([engine.pid, helper.pid])
        assert maps == {engine.pid: {ours}}
        assert remove_when_gone(maps, timeout_s=0.1) == []  # still runs
        assert ours.exists()
        engine.kill()  # not waited for: a zombie until reaped
        assert remove_when_gone(maps) == [ours]
        assert not ours.exists() and theirs.exists()
    finally:
        for process, path in ((engine, ours), (other, theirs), (helper, None)):
            process.kill()
            process.wait()
            if path is not None:
                path.unlink(missing_ok=True)


LEAKS_ONE = """import multiprocessing, sys, time
from multiprocessing import shared_memory
from kvtier.testing.vllmshm import remove_when_gone, vllm_shm_maps


def create(queue):
    memory = shared_memory.SharedMemory(create=True, size=4096)  # as vLLM's ShmRingBuffer
    queue.put(memory.name)
    time.sleep(600)


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")  # as vLLM starts its engine core
    queue = context.Queue()
    core = context.Process(target=create, args=(queue,))
    core.start()
    name = queue.get(timeout=60)
    maps = vllm_shm_maps([core.pid])
    core.kill()  # its object's __del__, which would unlink the file, never runs
    core.join()
    print(name, [path.name for path in remove_when_gone(maps)], flush=True)
"""


def test_an_engine_cores_queue_file_is_removed_and_untracked(tmp_path: Path) -> None:
    """vLLM's engine core creates its workers' RPC queue as a `SharedMemory` (/dev/shm/psm_*,
    160 MiB) that its exit never unlinks: the file stayed for the rest of the process, and at
    its exit the resource tracker the two share printed "There appear to be N leaked
    shared_memory objects" (`kvtier bench codecs --ttft`). The file is removed once the
    process that mapped it is gone, and the tracker told: nothing is left, nothing printed."""
    script = tmp_path / "leaks_one.py"
    script.write_text(LEAKS_ONE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert done.returncode == 0, done.stderr
    name, removed = done.stdout.split(maxsplit=1)
    assert name.startswith("psm_") and removed.strip() == repr([name])
    assert not Path("/dev/shm", name).exists()
    assert "leaked" not in done.stderr, done.stderr


RENDEZVOUS = """import os, sys, tempfile, time
path = os.path.join(tempfile.gettempdir(), "vllm_dist_" + sys.argv[1])
open(path, "w").close()  # as vLLM's first worker creates its FileStore's file
print(path, flush=True)
time.sleep(600)
"""


def _rendezvous(tag: str) -> tuple[subprocess.Popen[str], Path]:
    """A stand-in for an engine's process: it makes a rendezvous file in its temp dir, and
    lives until killed. The process and its file."""
    process = subprocess.Popen([sys.executable, "-c", RENDEZVOUS, tag], text=True,
                               stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, Path(process.stdout.readline().strip())


def test_an_engines_temp_files_go_with_it_and_no_other_process_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM leaves its rendezvous file, `<temp dir>/vllm_dist_<uuid>`, when the engine's
    processes are killed (kvtier.testing.vllmtmp): an engine's processes started with a temp
    dir of their own leave it there, removed with the folder; another process's file in the
    same temp dir, made meanwhile, is not touched; this process's temp dir is as it was."""
    from kvtier.testing.vllmtmp import own_temp_dir, temp_dir_named

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    started = []
    try:
        with own_temp_dir() as folder:
            with temp_dir_named(folder):
                assert tempfile.gettempdir() == str(folder)  # an engine built in this process
                started.append(_rendezvous("engine"))  # one it starts
            other = _rendezvous("another-engine")  # not started by the engine: the host's
            started.append(other)
            assert started[0][1].parent == folder and other[1].parent == temp
            started[0][0].kill()  # the engine's end: its file stays where it is
            started[0][0].wait()
        assert not folder.exists()
        assert list(temp.iterdir()) == [other[1]]
        assert tempfile.gettempdir() == str(temp) and os.environ["TMPDIR"] == str(temp)
    finally:
        for process, _ in started:
            process.kill()
            process.wait()
