"""Helpers for the node's tests (tests/node): a real `kvtier node serve` process, clients of
it, chunks with recognisable bytes, and bounded waits. (Not named conftest.py: imported by
name; the fixtures built on it are in tests/node/conftest.py.)

Primitives:
  - `LAYOUT`, `OTHER_LAYOUT`, `INFO`: two KV layouts (4 KiB and 8 KiB chunks) and a model.
  - `node_tiers(tmp_path, ram_chunks, disk_chunks)`: a node's tiers (RAM of a few chunks).
  - `NodeProcess`: `kvtier node serve` as a subprocess (start, stop, kill, SIGSTOP/SIGCONT).
  - `connect(socket_path, ...)`: a `NodeClient` and its `NodeStore`.
  - `payload`, `put_chunks`, `lend`, `expected`: chunks stored and lent back, with their
    bytes; `memory_tier`: the node's RAM tier in its status.
  - `wait_for(predicate, timeout_s, what)`: poll with a deadline.
  - `Lines(stream)`: a child process's output, a line at a time, each within a deadline.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from tierkit import footprint_bytes, key, tiny_layout

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META
from kvtier.errors import NodeUnavailable
from kvtier.node.client import NodeClient, node_status
from kvtier.node.nodestore import NodeStore
from kvtier.node.protocol import Hello
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.shmslab import SHM_DIR

LAYOUT = tiny_layout()  # 4 KiB chunks: one 4 KiB RAM slot each
OTHER_LAYOUT = tiny_layout(tokens_per_chunk=32)  # another engine's layout (8 KiB chunks)
INFO = NamespaceInfo("node-test-model", "", 0)
SLOT_BYTES = footprint_bytes("memory", LAYOUT)
START_TIMEOUT_S = 30.0  # a node process answering its socket (a loaded 2-core machine)
T = TypeVar("T")

__all__ = ["INFO", "LAYOUT", "OTHER_LAYOUT", "SLOT_BYTES", "Borrowed", "Lines", "NodeProcess",
           "connect",
           "expected", "key", "lend", "memory_tier", "node_tiers", "payload", "put_chunks",
           "shm_files", "short_dir", "unique_name", "wait_for", "write_config"]


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    """`predicate()`'s first truthy value, polled until `timeout_s` passes.

    Raises:
        AssertionError: naming `what` and the last value, at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} (last: {value!r})")
        time.sleep(0.02)


class Lines:
    """A child process's text output read on a thread of its own, a line at a time: `next`
    waits at most its deadline. (select() on the pipe would not do: a line the file object
    has read ahead into its buffer, with the one before it, leaves the pipe empty.)"""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        with contextlib.suppress(ValueError, OSError):  # closed under it
            for line in stream:
                self._lines.put(line)
        self._lines.put("")  # the end

    def next(self, timeout_s: float, what: str = "the process") -> str:
        """The next line ("" once the stream ended).

        Raises:
            AssertionError: no line within `timeout_s`.
        """
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{what} said nothing within {timeout_s} s") from None
        if not line:
            self._lines.put(line)  # every later call sees the end too
        return line


def node_tiers(tmp_path: Path, ram_chunks: int, disk_chunks: int = 0,
               layout: KVLayout = LAYOUT) -> dict[str, Any]:
    """A node's store config: RAM of `ram_chunks` slots of `layout`, then (if any) a disk tier
    of `disk_chunks` chunks under `tmp_path`."""
    tiers: list[dict[str, Any]] = [
        {"kind": "memory", "capacity": ram_chunks * footprint_bytes("memory", layout)}]
    if disk_chunks:
        tiers.append({"kind": "disk", "path": str(tmp_path / "disk"),
                      "capacity": disk_chunks * footprint_bytes("disk", layout)})
    return {"tiers": tiers}


def shm_files(name: str) -> list[Path]:
    """The node's slabs in /dev/shm (one per layout) for a node named `name`."""
    return sorted(SHM_DIR.glob(f"kvtier-{name}-*"))


def left_in_shm(name: str) -> list[Path]:
    """What a node named `name` killed with SIGKILL leaves in /dev/shm: its slabs and its
    name's lock file."""
    return [*shm_files(name), *SHM_DIR.glob(f"kvtier-{name}.lock")]


@dataclass
class NodeProcess:
    """`python3 -m kvtier.node serve` on `socket_path`, named `name` (its
    slabs: /dev/shm/kvtier-<name>-*), logging to `log_path`; `args`: more of its flags."""

    config_path: Path
    socket_path: Path
    name: str
    log_path: Path
    umask: int = 0o022
    args: tuple[str, ...] = ()
    entry: tuple[str, ...] = ("-m", "kvtier.node")  # how python3 runs it: the module, or -c
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> NodeProcess:
        """Start it and wait until it answers `node status`.

        Raises:
            AssertionError: it exited or did not answer within START_TIMEOUT_S.
        """
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, *self.entry, "serve",
             "--config", str(self.config_path), "--socket", str(self.socket_path),
             "--name", self.name, *self.args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, umask=self.umask)
        log.close()
        wait_for(self._answers, START_TIMEOUT_S, f"node {self.name} answering")
        return self

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the node exited with {self.process.returncode}:\n"
                                 f"{self.log_path.read_text()}")
        try:
            node_status(str(self.socket_path), timeout_s=2)
        except NodeUnavailable:
            return False
        return True

    def status(self) -> dict[str, Any]:
        return node_status(str(self.socket_path))

    def pause(self) -> None:
        """SIGSTOP, and wait until the kernel has stopped it (the signal is asynchronous)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        wait_for(lambda: self._state() == "T", 10, f"node {self.name} stopped")

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        wait_for(lambda: self._state() != "T", 10, f"node {self.name} continued")

    def _state(self) -> str:
        """The process's state letter in /proc (R, S, T: stopped...)."""
        assert self.process is not None
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM, and its exit status (within `timeout_s`)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)  # a stopped node must see the SIGTERM
        self.process.terminate()
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL if still running (every fixture's teardown), and its slabs removed."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=20)
        for path in left_in_shm(self.name):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config))
    return path


def connect(socket_path: Path | str, layout: KVLayout = LAYOUT, *, timeout_s: float = 5.0,
            retry_s: float = 0.2, engine: str | None = None) -> tuple[NodeClient, NodeStore]:
    """A client of the node for `layout`'s chunks (an "engine": `engine` names it, default
    this process), and its store."""
    client = NodeClient(str(socket_path), layout, INFO, timeout_s=timeout_s, retry_s=retry_s,
                        engine=engine)
    return client, NodeStore(client, layout.bytes_per_chunk)


def borrower(client: NodeClient, layout: KVLayout = LAYOUT) -> NodeStore:
    """Another store on `client`'s connections that knows no slot: each of its loads borrows
    (a round trip and a lease), where the store that stored a chunk reads it in place."""
    return NodeStore(client, layout.bytes_per_chunk)


def payload(i: int, nbytes: int = LAYOUT.bytes_per_chunk) -> bytes:
    """Chunk i's bytes: distinct for every i and every 64-byte stretch of the chunk."""
    seed = hashlib.blake2b(i.to_bytes(8, "big")).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def put_chunks(store: NodeStore, ids: Sequence[int], nbytes: int = LAYOUT.bytes_per_chunk
               ) -> list[bool]:
    """Store chunks `ids` (key(i) holding payload(i)) as a mover does: one `plan_puts` for the
    step, then a `put_from` each; what each `put_from` returned."""
    keys = [key(i) for i in ids]
    store.plan_puts(keys, [DEFAULT_META] * len(keys))
    spare = memoryview(bytearray(nbytes))

    def filler(i: int) -> Callable[[memoryview], None]:
        def fill(slot: memoryview) -> None:
            slot[:] = payload(i, nbytes)
        return fill

    return [store.put_from(k, filler(i), spare) for i, k in zip(ids, keys)]


@dataclass(frozen=True)
class Borrowed:
    """What a `lend_as_landed` lent: each chunk's index and bytes, and where it stopped."""

    chunks: list[tuple[int, bytes]]
    stopped_at: int
    failed_tier: str | None


def lend(store: NodeStore, keys: Sequence[ChunkKey], nbytes: int = LAYOUT.bytes_per_chunk
         ) -> Borrowed:
    """Borrow `keys` in order (one round trip), copy each lent chunk, release them all."""
    chunks = []
    with store.lend_as_landed(list(keys), [memoryview(bytearray(nbytes))],
                              in_order=True) as lending:
        for loan in lending:
            with loan:
                chunks.append((loan.index, bytes(loan.view.data)))
        return Borrowed(chunks, lending.stopped_at, lending.failed_tier)


def expected(ids: Sequence[int], nbytes: int = LAYOUT.bytes_per_chunk) -> list[tuple[int, bytes]]:
    """What `lend` returns when chunks `ids` are all lent."""
    return [(n, payload(i, nbytes)) for n, i in enumerate(ids)]


def memory_tier(status: dict[str, Any], layout: KVLayout = LAYOUT) -> dict[str, Any]:
    """The node's RAM tier stats for `layout`, from its status document."""
    tier: dict[str, Any] = status["layouts"][layout.digest()]["tiers"][0]
    return tier


def short_dir(tmp_path: Path) -> Path:
    """`tmp_path`, or a shorter directory when a socket path in it would pass AF_UNIX's 108
    bytes (a long --basetemp), removed at this process's exit at the latest (the engine
    tests' module fixtures never removed theirs: a kvn-* stayed in /tmp)."""
    if len(str(tmp_path / "node.sock")) < 100:
        return tmp_path
    directory = tempfile.mkdtemp(prefix="kvn-", dir="/tmp")
    atexit.register(shutil.rmtree, directory, True)
    return Path(directory)


def unique_name(tmp_path: Path) -> str:
    """A node name no other test (or test run) uses: the slabs' names come from it."""
    return f"t{os.getpid()}-{tmp_path.name}"[:60]


def older_hello(*args: Any, **kwargs: Any) -> Hello:
    """The Hello of an engine of an older kvtier (it says nothing of stamps: it checks no lent
    slot's stamp, and may write a slot after closing its connection): patched over
    `kvtier.node.client.Hello`."""
    return Hello(*args, **{**kwargs, "stamps": False})
