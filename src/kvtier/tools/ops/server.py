"""A vLLM OpenAI server as a subprocess that is always stopped, whole process group and all.

The server is started in its own session (process group), so stopping it also stops vLLM's
engine-core and worker processes, and nothing is left behind when the caller fails: not its
ZeroMQ socket files either (vLLM's `VLLM_RPC_BASE_PATH`, /tmp by default, where processes
stopped together left 2-3 a server: each server gets a folder of its own there, removed with
it), nor the files vLLM leaves in its temp dir (its rendezvous file at every stop,
kvtier.testing.vllmtmp): the same folder is its TMPDIR, unless the server must share the
host's (`own_temp_dir=False`: `kvtier serve` with vLLM's weight cache daemon, whose socket
vLLM finds only there). What vLLM keeps across runs is not in the temp dir (its compile
caches are under VLLM_CACHE_ROOT, ~/.cache/vllm); the lock vLLM takes around a model's
download there is then per server (the Hugging Face hub's own locks, in its cache, still
keep two servers' downloads of a file apart).
What to run comes from `kvtier.tools.ops.serving.build_command`:

    cmd = build_command(ServeConfig(model, kvtier=False, port=free_port(), vllm_args=(...)))
    with running_server(cmd, log_path=tmp / "vllm.log") as server:
        ...  # server.url answers /v1/completions and /metrics

Primitives: `VllmServer` (start / wait_ready / stop), `running_server(cmd, ...)`,
`free_port()` (kvtier.testing.ports: below the kernel's ephemeral ports, which vLLM's
own processes take as a server starts), `ServerError`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import psutil

from kvtier.errors import ServerError
from kvtier.testing.ports import free_port as free_port  # the tools pick their ports here
from kvtier.tools.ops.serving import ServeCommand

RPC_PATH = "VLLM_RPC_BASE_PATH"  # where vLLM's processes put their ZeroMQ socket files

# Servers not yet stopped, stopped at interpreter exit if their owner did not.
_LIVE: weakref.WeakSet[VllmServer] = weakref.WeakSet()


@dataclass(eq=False)
class VllmServer:
    """A vLLM server subprocess in its own process group. Start it with `start()` (or use
    `running_server`); `stop()` is idempotent and kills the whole group; `pause()` and
    `resume()` stop and continue it. Not thread-safe: one owner thread."""

    command: ServeCommand
    log_path: Path | None = None  # stdout+stderr go here; None: inherit the caller's
    # its temp dir (TMPDIR) is its own folder, removed at stop: False for a server that must
    # share the host's (vLLM finds its weight cache daemon's socket only there)
    own_temp_dir: bool = True
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False, repr=False)
    _rpc_dir: str | None = field(default=None, init=False, repr=False)  # its files' folder

    @property
    def url(self) -> str:
        return self.command.url

    def start(self) -> None:
        """Start the process (returns at once; see wait_ready)."""
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
        env = {**os.environ, **self.command.env}
        self._rpc_dir = tempfile.mkdtemp(prefix="kvtier-rpc-", dir=env.get(RPC_PATH))
        env[RPC_PATH] = self._rpc_dir
        if self.own_temp_dir:
            env["TMPDIR"] = self._rpc_dir
        self.proc = subprocess.Popen(
            self.command.argv, env=env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
            start_new_session=True)
        _LIVE.add(self)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until GET /health answers 200.

        Raises:
            ServerError: the process exited, or `timeout_s` passed (with the log's tail).
        """
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM exited with code {self.proc.returncode} before it "
                                  f"was ready{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    # Another server on the port answers too: this one then fails to bind it
                    # and exits, which the next poll reports with its log.
                    if resp.status == 200 and self._listens():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(f"vLLM was not healthy after {timeout_s:g} s{self._log_tail()}")

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `grace_s`; the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        _LIVE.discard(self)
        pgid = proc.pid  # a session leader's pgid is its pid
        _signal_group(pgid, signal.SIGCONT)  # a paused server takes its SIGTERM too
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            proc.wait()
        # Engine-core and worker processes may outlive the API server by a moment.
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None
        return proc.returncode

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP to its group) until `resume`: an idle
        vLLM is not idle (its worker busy-polls its queue for a second after each step), and
        servers measured in turn on a small machine would share its cores with the others'
        polls."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Let a `pause`d server run again (SIGCONT to its group)."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGCONT)

    def _listens(self) -> bool:
        """Whether the socket listening on the server's port is its own (its process's or a
        child's); True where the machine does not say (psutil.AccessDenied)."""
        assert self.proc is not None
        port = urlsplit(self.url).port
        try:
            root = psutil.Process(self.proc.pid)
            ours = {root.pid} | {child.pid for child in root.children(recursive=True)}
            return any(conn.pid in ours for conn in psutil.net_connections(kind="tcp")
                       if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port)
        except psutil.AccessDenied:
            return True
        except psutil.NoSuchProcess:
            return False

    def _log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"; last lines of {self.log_path}:\n" + "\n".join(tail)


@contextlib.contextmanager
def running_server(command: ServeCommand, *, log_path: Path | None = None,
                   startup_timeout_s: float = 600.0) -> Iterator[VllmServer]:
    """Start `command`, wait until healthy, yield the server; stop it on exit, always.

    Raises:
        ServerError: it did not become healthy.
    """
    server = VllmServer(command, log_path)
    try:
        server.start()
        server.wait_ready(startup_timeout_s)
        yield server
    finally:
        server.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is in group `pgid`. Zombies are skipped: an
    orphan waits for init to reap it, which can take seconds on some machines."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if fields[2] == str(pgid) and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False
