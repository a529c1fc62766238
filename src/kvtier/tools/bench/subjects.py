"""What `kvtier bench storage` times: the subjects, each a put-phase and a get-phase step.

Every subject of one chunk size moves the same chunks between the same page-aligned,
`mmap`-backed numpy buffers (`src` -> somewhere -> `dst`), as the vLLM connector will:

- `copy`: numpy copyto src -> dst, chunk by chunk (the in-memory ceiling; the same op in both
  phases);
- `direct`: O_DIRECT, one file per chunk in the tiers' directory tree: create + one pwrite
  + close, then open + one pread + close (the file tiers' ceiling: the same bytes in the
  same files and directories, so it includes the filesystem's cost of a file per chunk,
  which any such design pays, and leaves kvtier's own costs, header, checksum, temp file
  and rename, index, to the ratio);
- `direct_1file`: O_DIRECT into one file at offset i * size, always one thread (the
  device's sequential rate, for information);
- a tier (`memory`, `disk`, `shared`) built with `build_tier` and called directly;
- `lmcache`: LMCache's LocalDiskBackend in a subprocess of another interpreter.

With `threads` > 1, `direct`, the file tiers and LMCache move their chunks from that many
threads at once (LMCache: its own pools of that size); copy and memory stay on one thread.

Primitives: `Subject`, `SizeBench`, `LMCacheProcess`, `layout_for`, `aligned_buffer`,
`direct_read_s`, `direct_write_s`.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.core.chunkformat import stored_size
from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.tier import Medium
from kvtier.tiers import build_tier
from kvtier.tiers.registry import config_model, tier_class
from kvtier.tiers.storeconfig import TierSettings

LLAMA8B_TOKEN_BYTES = 2 * 32 * 8 * 128 * 2  # K+V, 32 layers, 8 KV heads, 128, bfloat16
LMCACHE_DRIVER = Path(__file__).with_name("lmcache_driver.py")
Step = Callable[[], float]  # runs once over every chunk; returns wall seconds


@dataclass(frozen=True, slots=True)
class Subject:
    """One thing measured at one chunk size."""

    name: str  # "copy", "direct", "direct_1file", a tier kind, or "lmcache"
    put: Step  # src -> the subject (for copy: src -> dst)
    get: Step  # the subject -> dst (only after put)
    clean: Callable[[], None]  # untimed: forget what put stored, ready for the next round


def layout_for(size_bytes: int) -> KVLayout:
    """A layout whose chunk is `size_bytes`: Llama-8B's KV (128 KiB a token) with as many
    tokens as fit when the size is a multiple of that, else one token of a single wide head."""
    if size_bytes % LLAMA8B_TOKEN_BYTES == 0:
        return KVLayout(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                        tokens_per_chunk=size_bytes // LLAMA8B_TOKEN_BYTES)
    return KVLayout(num_layers=1, num_kv_heads=1, head_size=size_bytes // 4, dtype="bfloat16",
                    tokens_per_chunk=1)


def aligned_buffer(size_bytes: int) -> np.ndarray:
    """A page-aligned, mmap-backed uint8 array, touched so page faults are not timed."""
    array = np.frombuffer(mmap.mmap(-1, size_bytes), dtype=np.uint8)
    array[:] = 0
    return array


def direct_read_s(paths: Sequence[Path], buffer: np.ndarray) -> float:
    """Seconds to read each file of `paths` into `buffer` (page-aligned, as long as a file)
    with O_DIRECT, one after the other, on one thread: the raw read a disk hit is held to."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, flags)
        try:
            os.preadv(fd, [buffer.data], 0)
        finally:
            os.close(fd)
    return time.perf_counter() - start


def direct_write_s(paths: Sequence[Path], buffer: np.ndarray) -> float:
    """Seconds to create each file of `paths` (absent) and write `buffer` (page-aligned) into
    it with O_DIRECT, one after the other, on one thread: the raw write a disk store is held
    to."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, flags, 0o600)
        try:
            _check(os.pwritev(fd, [buffer.data], 0), len(buffer))
        finally:
            os.close(fd)
    return time.perf_counter() - start


def _timed(body: Callable[[], None]) -> Step:
    def step() -> float:
        start = time.perf_counter()
        body()
        return time.perf_counter() - start
    return step


def _check(done: int, expected: int) -> None:
    if done != expected:
        raise OSError(f"short I/O: {done} of {expected} bytes")


class SizeBench:
    """The buffers, keys and directories of one chunk size; makes its subjects."""

    def __init__(self, work: Path, size_bytes: int, chunks: int, threads: int,
                 stack: ExitStack) -> None:
        """`threads` > 1: the file subjects (not copy, not memory) issue their chunks from
        that many threads at once, chunk i on thread i % threads."""
        self.work, self.size, self.chunks = work, size_bytes, chunks
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads) if threads > 1 else None
        if self._pool is not None:
            stack.callback(self._pool.shutdown)
        self.layout = layout_for(size_bytes)
        rng = np.random.default_rng(size_bytes)
        self.src = aligned_buffer(chunks * size_bytes)
        self.src[:] = rng.integers(0, 256, self.src.size, dtype=np.uint8)
        self.dst = aligned_buffer(chunks * size_bytes)
        self.keys = [ChunkKey(rng.bytes(16)) for _ in range(chunks)]
        self.raw_dir = work / f"raw-{size_bytes}"
        self.raw_dir.mkdir(parents=True, exist_ok=True)

    def each(self, body: Callable[[int], None], parallel: bool = True) -> None:
        """body(i) for every chunk i: on the pool when there is one and `parallel`."""
        if self._pool is None or not parallel:
            for i in range(self.chunks):
                body(i)
            return
        for future in [self._pool.submit(self._stride, body, first, self.threads)
                       for first in range(self.threads)]:
            future.result()  # re-raises the first failure

    def _stride(self, body: Callable[[int], None], first: int, stride: int) -> None:
        for i in range(first, self.chunks, stride):
            body(i)

    def view(self, array: np.ndarray, i: int) -> memoryview:
        return memoryview(array[i * self.size : (i + 1) * self.size])  # type: ignore[arg-type]

    def copy(self) -> Subject:
        def copy() -> None:
            for i in range(self.chunks):
                np.copyto(self.dst[i * self.size : (i + 1) * self.size],
                          self.src[i * self.size : (i + 1) * self.size])
        return Subject("copy", _timed(copy), _timed(copy), lambda: None)

    def direct(self) -> Subject:
        # The tiers' tree (<k[0:2]>/<k[2:4]>/<key>): a file per chunk in the same directories
        # as the tiers would use, made beforehand, so creates contend the same way. (All in
        # one directory, concurrent creates serialise on its lock: 0.3 GB/s at 0.5 MiB.)
        paths = [self.raw_dir / key.hex()[:2] / key.hex()[2:4] / key.hex() for key in self.keys]
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)

        def write(i: int) -> None:
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
            try:
                _check(os.pwrite(fd, self.view(self.src, i), 0), self.size)
            finally:
                os.close(fd)

        def read(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
            try:
                _check(os.preadv(fd, [self.view(self.dst, i)], 0), self.size)
            finally:
                os.close(fd)

        def clean() -> None:
            for path in paths:
                path.unlink(missing_ok=True)

        return Subject("direct", _timed(lambda: self.each(write)),
                       _timed(lambda: self.each(read)), clean)

    def direct_1file(self) -> Subject:
        path = self.raw_dir / "one.raw"

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
            try:
                for i in range(self.chunks):
                    _check(os.pwrite(fd, self.view(self.src, i), i * self.size), self.size)
            finally:
                os.close(fd)

        def read() -> None:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                for i in range(self.chunks):
                    _check(os.preadv(fd, [self.view(self.dst, i)], i * self.size), self.size)
            finally:
                os.close(fd)

        return Subject("direct_1file", _timed(write), _timed(read),
                       lambda: path.unlink(missing_ok=True))

    def tier(self, kind: str, stack: ExitStack) -> Subject:
        """A tier of `kind`, closed by `stack`. Raises RuntimeError if it drops or misses."""
        tier = build_tier(self._tier_config(kind), self.layout)
        stack.callback(tier.close)

        def put(i: int) -> None:
            if not tier.put(self.keys[i], self.view(self.src, i)):
                raise RuntimeError(f"{kind} tier dropped a put of {self.size} B")

        def get(i: int) -> None:
            if not tier.get_into(self.keys[i], self.view(self.dst, i)):
                raise RuntimeError(f"{kind} tier missed a chunk it holds ({self.size} B)")

        def clean() -> None:
            for key in self.keys:
                tier.delete(key)

        # A tier in RAM is timed like copy, its ceiling: one thread.
        parallel = tier_class(kind).medium is not Medium.CPU
        return Subject(kind, _timed(lambda: self.each(put, parallel)),
                       _timed(lambda: self.each(get, parallel)), clean)

    def _tier_config(self, kind: str) -> TierSettings:
        # Room for one round, so the timed path never evicts. For the file tiers the
        # capacity is a bound, not an allocation; the memory tier's slab is exactly a round.
        round_bytes = self.chunks * stored_size(self.size)
        settings: dict[str, Any] = {"kind": kind, "capacity": round_bytes}
        if tier_class(kind).has_path:
            settings.update(capacity=2 * round_bytes, path=self.work / kind)
        config = config_model(kind).model_validate(settings)
        assert isinstance(config, TierSettings)
        return config


class LMCacheProcess:
    """LMCache's LocalDiskBackend in a subprocess of another interpreter (see
    `lmcache_driver.py`), driven one JSON line at a time so its trials interleave."""

    def __init__(self, python: str, directory: Path) -> None:
        """Raises RuntimeError when the driver cannot start (lmcache missing, ...)."""
        directory.mkdir(parents=True, exist_ok=True)
        # LMCache logs a lot: to a file, as a full stderr pipe would block the driver.
        self._log = directory.parent / "lmcache-driver.log"
        with self._log.open("w") as log:
            self._process = subprocess.Popen(
                # -I: the script's folder (kvtier/tools/bench, with modules named like the
                # stdlib's, e.g. copy.py) must not shadow anything on the driver's path.
                [python, "-I", str(LMCACHE_DRIVER), "--dir", str(directory)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True,
            )
        self.info = {k: v for k, v in self._reply().items() if k != "ok"}

    def _reply(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            tail = self._log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"LMCache driver exited ({self._process.wait()}): {tail}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"LMCache driver: {reply.get('error')}")
        return reply

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._process.stdin.flush()
        return self._reply()

    def subject(self, size_bytes: int, chunks: int, threads: int) -> Subject | None:
        """LMCache at this size, or None when the size is not whole Llama-8B tokens."""
        if size_bytes % LLAMA8B_TOKEN_BYTES:
            return None
        self.call("setup", chunk_bytes=size_bytes, chunks=chunks, threads=threads)

        def clean() -> None:
            self.call("clear")

        return Subject("lmcache", lambda: float(self.call("put")["seconds"]),
                       lambda: float(self.call("get")["seconds"]), clean)

    def close(self) -> None:
        if self._process.poll() is not None:
            return
        assert self._process.stdin is not None
        try:
            self._process.stdin.write('{"op": "quit"}\n')
            self._process.stdin.close()
            self._process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
