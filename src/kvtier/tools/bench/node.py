"""`kvtier bench node`: what a RAM hit and a store cost through `kvtier node` against the same
RAM tier in the engine's process, and a raw copy of the same bytes.

The same chunks (the engine's side of a load: each lent chunk copied out, as the scatter
would; of a store: each chunk copied in, as the gather would) go through three paths, each
timed over several trials (median):
  - raw: `numpy.copyto` of the bytes, chunk by chunk (the floor: the copy itself); a
    store's into a buffer a chunk, as into the tier's slots, a load's all into one buffer,
    as the loads' (a store's raw into one cache-warm buffer, as before, ran 2-2.5x faster
    than into a batch of buffers here: a floor no store into a slab could reach);
  - in-process: a `TieredStore` of one memory tier (the connector's default mode);
  - node: a `kvtier node serve` process (its own interpreter, as deployed) and `NodeStore`:
    one `Reserve` round trip per batch of stores; a load of the chunks the engine stored reads
    them in place under their slots' locks, no round trip ("load"), and the same load by an
    engine that knows no slot (another engine's, or one restarted) takes one `Borrow`
    ("load, borrowed"; in-process and raw: the same as "load"); chunks in its shared-memory
    slab.
Also timed: one control round trip (a one-key `Lookup`), the price of each call.

Before the timed trials, untimed warm-up trials store into every slot of both tiers once: a
store into a slot never written pays a page fault a page (the slab's first touch; through
the node, this process's first touch of the shared slab), 5-15x the copy. The tier's
background prefault (tiers/prefault.py), on a thread of lowest priority, had not reached
them on a loaded machine, and no prefault of the node's maps this process's pages: with one
warm-up trial, `--quick`'s first timed trial stored 8 of its 16 chunks into fresh slots
(through the node, 4,082 faults; 2.9x the next trial). Counted in the timed stores (this
thread's, all trials): minor page faults (`store_faults`; 0 is the steady state measured)
and involuntary context switches (`store_preempted`): on a loaded machine a batch's stores
outlast a time slice and wait for the CPU (one trial's in-process stores 1,012 us a chunk
of wall time, 275 us of CPU, once preempted), where the raw copy's short batch seldom does.

Primitives: `NodeBenchConfig`, `NodeBenchResult`, `run_node_bench`, `node_process`,
`restartable_node` (`BenchNode`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.retention import DEFAULT_META
from kvtier.errors import ConfigError, NodeUnavailable
from kvtier.integrations.vllm.worker.chunkstore import ChunkStore
from kvtier.node.client import NodeClient, node_status
from kvtier.node.nodestore import NodeStore
from kvtier.node.protocol import Found, Lookup
from kvtier.tiers import open_store
from kvtier.tiers.manifest import NamespaceInfo
from kvtier.tiers.storeconfig import StoreConfig
from kvtier.tools.bench.headroom import MemoryNeed, require_memory
from kvtier.units import format_size

PATHS = ("raw", "in-process", "node")
OPERATIONS = ("store", "load", "load, borrowed")


@dataclass(frozen=True, slots=True)
class NodeBenchConfig:
    chunks: int = 64  # chunks a batch (a step's stores, a request's hit)
    chunk_kib: int = 2048  # bytes of one chunk (a 256-token chunk of a ~1B model: ~2 MiB)
    trials: int = 5
    round_trips: int = 500  # Lookups timed for the round trip

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field; NotEnoughMemory where the run's
        buffers (`memory_need`) do not fit in the memory available."""
        for name in ("chunks", "chunk_kib", "trials", "round_trips"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "a positive integer")
        if self.chunk_kib % 4:
            raise ConfigError("chunk_kib", self.chunk_kib, "a multiple of 4 (KiB: a token of "
                              "one layer of the bench's layout)")
        require_memory(self.memory_need())

    def memory_need(self) -> MemoryNeed:
        """A batch four times over: the engine's chunks, the raw store's targets, the
        in-process memory tier and the node's (in shared memory, RAM too), each tier with its
        16 MiB of slack."""
        batch = self.chunks * self.layout().bytes_per_chunk
        return MemoryNeed("--chunks", self.chunks, 4 * batch + (32 << 20), 0,
                          f"{self.chunks} chunks of {format_size(self.chunk_kib << 10)} "
                          "(--chunk-kib), 4 copies")

    def layout(self) -> KVLayout:
        """A layout whose chunk is `chunk_kib` KiB (bfloat16, 2 x 8 heads of 128: 4 KiB a
        token and layer): 16 tokens of chunk_kib / 64 layers, else (a size that is no
        multiple of 64 KiB, which was rounded to one: `--chunk-kib 32` measured 64 KiB
        chunks) chunk_kib / 4 tokens of one layer."""
        per_layer = 2 * 8 * 128 * 2 * 16  # bytes of 16 tokens of one layer
        layers, tokens = divmod(self.chunk_kib * 1024, per_layer)
        if tokens:
            layers, tokens = 1, self.chunk_kib // 4
        else:
            tokens = 16
        return KVLayout(num_layers=layers, num_kv_heads=8, head_size=128, dtype="bfloat16",
                        tokens_per_chunk=tokens)


@dataclass(frozen=True, slots=True)
class NodeBenchResult:
    config: NodeBenchConfig
    chunk_bytes: int
    seconds_per_chunk: dict[str, dict[str, float]]  # operation -> path -> median
    round_trip_s: float  # median of one-key Lookups
    # path -> minor page faults of the bench's thread in the timed stores, all trials (0:
    # every slot written before; more: first touches timed, see the module docstring)
    store_faults: dict[str, int]
    # path -> the times the bench's thread was preempted in the timed stores: by the
    # machine's other work, and through the node by the node's thread each Commit wakes
    # (10-16 a trial of 16 chunks on 2 cores)
    store_preempted: dict[str, int]
    verified: bool  # every load gave back the bytes stored

    def ratio(self, operation: str, path: str, baseline: str) -> float:
        by = self.seconds_per_chunk[operation]
        return by[path] / by[baseline]

    def write_json(self, path: Path) -> None:
        data = asdict(self)
        data["ratios"] = {op: {"node/in-process": self.ratio(op, "node", "in-process"),
                               "node/raw": self.ratio(op, "node", "raw")} for op in OPERATIONS}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


def run_node_bench(config: NodeBenchConfig, progress: Callable[[str], None]) -> NodeBenchResult:
    """Measure the three paths (see the module docstring).

    Raises:
        ConfigError: a bad setting; ServerError-like RuntimeError: the node did not start.
    """
    config.validate()
    layout = config.layout()
    size = layout.bytes_per_chunk
    sources = [np.full(size, i % 251, dtype=np.uint8) for i in range(config.chunks)]
    out = np.empty(size, dtype=np.uint8)
    targets = [np.empty(size, dtype=np.uint8) for _ in range(config.chunks)]  # a raw store's
    spares = [memoryview(mmap.mmap(-1, size)) for _ in range(4)]
    times: dict[str, dict[str, list[float]]] = {op: {p: [] for p in PATHS} for op in OPERATIONS}
    verified = True
    faults, preempted = {"in-process": 0, "node": 0}, {"in-process": 0, "node": 0}
    # Room for one batch and a little; the warm-ups store into every slot (at most
    # capacity / chunk of them) once, so that the timed trials reuse slots (evicting the
    # last trial's chunks), as in steady state, never first-touch them.
    capacity_mib = config.chunks * size // (1 << 20) + 16
    warm_ups = -(-(capacity_mib << 20) // size // config.chunks)
    capacity = f"{capacity_mib}MiB"
    with tempfile.TemporaryDirectory(prefix="kvn-") as tmp, \
            node_process(Path(tmp), capacity) as socket_path:
        info = NamespaceInfo("bench-node", "", 0)
        client = NodeClient(socket_path, layout, info, timeout_s=30)
        stores: dict[str, ChunkStore] = {
            "in-process": open_store(StoreConfig.parse(
                {"tiers": [{"kind": "memory", "capacity": capacity, "pin": "off"}]}), layout),
            "node": NodeStore(client, size)}
        for round_ in range(warm_ups + config.trials):
            trial = round_ - warm_ups + 1  # <= 0: a warm-up, not counted
            progress(f"trial {trial} of {config.trials}" if trial > 0 else
                     f"warm-up {round_ + 1} of {warm_ups}")
            keys = [ChunkKey(os.urandom(16)) for _ in range(config.chunks)]
            raw_store, raw_load = _raw(sources, targets), _raw(sources, [out] * config.chunks)
            for path, store in stores.items():
                stored = _store(store, keys, sources)
                loaded, same = _load(store, keys, sources, out, spares)
                verified = verified and same
                if trial > 0:
                    faults[path] += stored.faults
                    preempted[path] += stored.preempted
                    times["store"][path].append(stored.seconds)
                    times["load"][path].append(loaded)
            borrowed, same = _load(NodeStore(client, size), keys, sources, out, spares)
            verified = verified and same
            if trial > 0:
                times["store"]["raw"].append(raw_store)
                times["load"]["raw"].append(raw_load)
                times["load, borrowed"]["raw"].append(raw_load)
                times["load, borrowed"]["in-process"].append(times["load"]["in-process"][-1])
                times["load, borrowed"]["node"].append(borrowed)
        progress("round trips")
        trips = []
        for _ in range(config.round_trips):
            start = time.perf_counter()
            client.call(Lookup([bytes(16)]), Found)
            trips.append(time.perf_counter() - start)
        for store in stores.values():
            store.close()
    return NodeBenchResult(
        config, size,
        {op: {p: statistics.median(v) for p, v in by.items()} for op, by in times.items()},
        statistics.median(trips), faults, preempted, verified)


def _raw(sources: list[np.ndarray], targets: list[np.ndarray]) -> float:
    """Seconds per chunk to copy each source into its target."""
    start = time.perf_counter()
    for source, target in zip(sources, targets):
        np.copyto(target, source)
    return (time.perf_counter() - start) / len(sources)


@dataclass(frozen=True, slots=True)
class _TimedStore:
    seconds: float  # a chunk
    faults: int  # minor page faults of this thread meanwhile
    preempted: int  # involuntary context switches of this thread meanwhile


def _store(store: ChunkStore, keys: list[ChunkKey], sources: list[np.ndarray]) -> _TimedStore:
    """Store `sources` under `keys` (a step's stores), timed."""
    spare = memoryview(bytearray(len(sources[0])))
    before = resource.getrusage(resource.RUSAGE_THREAD)
    start = time.perf_counter()
    store.plan_puts(keys, [DEFAULT_META] * len(keys))
    for key, source in zip(keys, sources):
        def fill(slot: memoryview, source: np.ndarray = source) -> None:
            np.copyto(np.frombuffer(slot, dtype=np.uint8), source)
        if not store.put_from(key, fill, spare):
            raise RuntimeError(f"a chunk was not stored ({type(store).__name__})")
    store.flush(30)
    seconds = (time.perf_counter() - start) / len(keys)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    return _TimedStore(seconds, after.ru_minflt - before.ru_minflt,
                       after.ru_nivcsw - before.ru_nivcsw)


def _load(store: ChunkStore, keys: list[ChunkKey], sources: list[np.ndarray], out: np.ndarray,
          spares: list[memoryview]) -> tuple[float, bool]:
    """Seconds per chunk to lend `keys` and copy each out (a request's hit), and whether every
    chunk came back as stored (checked after the timing)."""
    seen: list[int] = []
    start = time.perf_counter()
    with store.lend_as_landed(keys, spares) as lending:
        for loan in lending:
            with loan:
                np.copyto(out, np.frombuffer(loan.view.data, dtype=np.uint8))
                seen.append(int(out[0]))
    seconds = (time.perf_counter() - start) / len(keys)
    return seconds, seen == [int(s[0]) for s in sources]


@contextlib.contextmanager
def node_process(root: Path, capacity: str | int, below: Sequence[dict[str, Any]] = (),
                 settings: dict[str, Any] | None = None) -> Iterator[str]:
    """A `kvtier node serve` subprocess with a memory tier of `capacity` over the tiers
    `below` (their configs), and the store's other `settings` (e.g. write_queue_depth); its
    socket (also `kvtier bench ttft`'s kvtier-node engine). Its RAM slabs are removed when
    it stops (`--drop-ram`): a benchmark leaves nothing in /dev/shm."""
    with restartable_node(root, capacity, below, settings) as node:
        yield node.socket_path


class BenchNode:
    """`node_process`'s node, which a benchmark may restart (`restart`: its RAM empty, its
    tiers below RAM as they were)."""

    def __init__(self, root: Path, capacity: str | int, below: Sequence[dict[str, Any]],
                 settings: dict[str, Any] | None) -> None:
        self.root = root.absolute()  # engines take the socket's absolute path only
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = self.root / "node.yaml"
        self.config.write_text(yaml.safe_dump(
            {**(settings or {}), "tiers": [{"kind": "memory", "capacity": capacity}, *below]}))
        self.socket_path = str(self.root / "node.sock")
        self.name = f"bench-{os.getpid()}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Raises RuntimeError: the node did not answer within a minute.

        In a session of its own, as a node's service runs (a DaemonSet's pod, a systemd
        unit: a CPU group of its own). In the benchmark's session it shared one scheduling
        group (Linux's autogroup) with the bench's redis-server and proxy, and the vLLM
        server's group, spinning on both cores, took them for up to 1.75 s at a time
        (docs/performance.md, "The machine's stalls, explained")."""
        self._proc = proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.node", "serve", "--config", str(self.config),
             "--socket", self.socket_path, "--name", self.name, "--drop-ram"],
            stdout=subprocess.DEVNULL, stderr=(self.root / "node.log").open("ab"),
            start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                node_status(self.socket_path, timeout_s=1)
                return
            except NodeUnavailable:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the node did not start: "
                                       + (self.root / "node.log").read_text()[-2000:]) from None
                time.sleep(0.1)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    def restart(self) -> None:
        """Stop (the RAM slabs dropped) and start again: the engines reconnect by themselves."""
        self.stop()
        self.start()


@contextlib.contextmanager
def restartable_node(root: Path, capacity: str | int, below: Sequence[dict[str, Any]] = (),
                     settings: dict[str, Any] | None = None) -> Iterator[BenchNode]:
    """`node_process`, as a `BenchNode`; stopped on exit."""
    node = BenchNode(root, capacity, below, settings)
    try:
        node.start()
        yield node
    finally:
        node.stop()
