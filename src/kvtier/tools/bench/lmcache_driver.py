"""Drive LMCache 0.5.6's LocalDiskBackend for `kvtier bench storage --lmcache-python PATH`.

Runs under ANOTHER interpreter (a venv with lmcache and torch installed), as a script, so
kvtier never depends on LMCache: it imports only the standard library, torch and lmcache,
never kvtier. `kvtier.tools.bench.storage` starts it once and sends it one JSON command per line
on stdin, so LMCache's trials interleave with kvtier's in the same run; each reply is one
JSON line on stdout (LMCache's own logging goes to stderr).

Commands:
    {"op": "setup", "chunk_bytes": N, "chunks": K, "threads": T}
                     a backend with T disk I/O threads; K random source chunks of N bytes
    {"op": "put"}    store the K chunks; reply {"ok": true, "seconds": S} once all are on disk
    {"op": "get"}    read the K chunks back (T == 1: `get_blocking` for each chunk;
                     T > 1: `batched_get_blocking`, its concurrent read path); reply seconds
    {"op": "clear"}  remove the K chunks (untimed)
    {"op": "quit"}

The backend is configured as LMCache's disk offload usually is: local_cpu off, O_DIRECT on
(`extra_config.use_odirect`), LRU policy; `disk_io_threads` (LMCache's default: 4) is T, so
it runs with the same concurrency as kvtier's subjects in the same run. Puts are
asynchronous in LMCache (a thread pool writes), so a put trial ends when the completion
callback of the last chunk has run. A get is `get_blocking`, which allocates a buffer from
the CPU backend and reads the file into it; the buffer is released after the trial's clock
stops, as an engine would after copying it to the GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.pin_memory_allocator import PinMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

GIB = 1024**3
TOKEN_BYTES = 2 * 32 * 1024 * 2  # KV_2LTD, 32 layers, 1024 = 8 heads x 128, bfloat16


class Driver:
    """One LocalDiskBackend in `directory`, re-created at each `setup` (one chunk size)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.backend: LocalDiskBackend | None = None
        self.threads = 1
        self.keys: list[CacheEngineKey] = []
        self.sources: list[Any] = []

    def setup(self, chunk_bytes: int, chunks: int, threads: int) -> dict[str, Any]:
        self.close()
        if chunk_bytes % TOKEN_BYTES:
            return {"ok": False, "error": f"chunk_bytes must be a multiple of {TOKEN_BYTES}"}
        shape = torch.Size([2, 32, chunk_bytes // TOKEN_BYTES, 1024])
        # Room for the sources and for the gets' buffers, plus allocator slack.
        pool_bytes = (2 * chunks + 2) * chunk_bytes
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=chunk_bytes // TOKEN_BYTES, local_cpu=False,
            max_local_cpu_size=pool_bytes / GIB, local_disk=self.directory,
            # Only a bound in LMCache's accounting (nothing is preallocated), and a large
            # one on purpose: `remove()` does not give back `current_cache_size`, so after a
            # few put/clear rounds a tight bound would make every put "insufficient
            # evictable space", skipped silently, its completion callback never called.
            max_local_disk_size=1024.0,
            extra_config={"use_odirect": True, "disk_io_threads": threads},
        )
        # The allocator LocalCPUBackend builds by default; its buffer is page-aligned, which
        # O_DIRECT needs (a torch.empty pool is not, and LMCache then fails every write
        # with EINVAL inside its executor, where the error is lost).
        allocator = PinMemoryAllocator(pool_bytes)
        cpu = LocalCPUBackend(config, memory_allocator=allocator)
        backend = LocalDiskBackend(config, self.loop, cpu)
        self.sources = []
        for _ in range(chunks):
            obj = cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            if obj is None:
                return {"ok": False, "error": "LocalCPUBackend could not allocate a source"}
            obj.tensor.view(torch.uint8).view(-1).copy_(
                torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8))
            self.sources.append(obj)
        self.keys = [CacheEngineKey("kvtier-bench", 1, 0, i, torch.bfloat16)
                     for i in range(chunks)]
        self.backend, self.threads = backend, threads
        return {"ok": True}

    def put(self) -> dict[str, Any]:
        assert self.backend is not None, "setup first"
        done = threading.Semaphore(0)
        start = time.perf_counter()
        for key, obj in zip(self.keys, self.sources, strict=True):
            self.backend.submit_put_task(key, obj, on_complete_callback=lambda _k: done.release())
        for _ in self.keys:
            if not done.acquire(timeout=60):  # LMCache skips some puts without a word
                return {"ok": False, "error": "put did not complete in 60 s (skipped?)"}
        seconds = time.perf_counter() - start
        stored = sum(self.backend.contains(key) for key in self.keys)
        if stored != len(self.keys):
            return {"ok": False, "error": f"only {stored} of {len(self.keys)} chunks stored"}
        return {"ok": True, "seconds": seconds}

    def get(self) -> dict[str, Any]:
        assert self.backend is not None, "setup first"
        start = time.perf_counter()
        if self.threads > 1:
            objs = self.backend.batched_get_blocking(self.keys)
        else:
            objs = [self.backend.get_blocking(key) for key in self.keys]
        seconds = time.perf_counter() - start
        missing = sum(obj is None for obj in objs)
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()
        if missing:
            return {"ok": False, "error": f"{missing} of {len(objs)} chunks missing"}
        return {"ok": True, "seconds": seconds}

    def clear(self) -> dict[str, Any]:
        assert self.backend is not None, "setup first"
        for key in self.keys:
            self.backend.remove(key)
        return {"ok": True}

    def close(self) -> None:
        if self.backend is not None:
            self.clear()
            self.backend.close()
            self.backend = None
        for obj in self.sources:
            obj.ref_count_down()
        self.sources = []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="directory for LocalDiskBackend's files")
    args = parser.parse_args()
    driver = Driver(args.dir)
    print(json.dumps({"ok": True, "lmcache": _lmcache_version(), "torch": torch.__version__}),
          flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        try:
            reply = getattr(driver, op)(**command)
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    driver.close()
    return 0


def _lmcache_version() -> str:
    from importlib.metadata import version

    return version("lmcache")


if __name__ == "__main__":
    sys.exit(main())
