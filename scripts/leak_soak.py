#!/usr/bin/env python3
"""A leak soak: a real vLLM engine (CPU backend, the generated "test" model, in this process)
with kvtier, driven through requests that reuse and evict, with faults injected on the way;
this process's file descriptors, threads, RSS and memory mappings sampled every 10% of them.

    python3 scripts/leak_soak.py MODE [REQUESTS] [--workdir DIR]

MODE: `none` (no connector: vLLM's own growth, the baseline), `memory` (1 MiB), `disk`
(1 MiB of RAM over 4 MiB of disk; the disk directory made read-only by a bind mount for the
middle third of the run: needs root), `redis` (1 MiB over 4 MiB of a redis-server on
127.0.0.1, killed and restarted twice) or `node` (a `kvtier node` of 2 MiB RAM over 4 MiB of
disk, killed with SIGKILL and restarted 4 times under the running engine: its fds, threads
and files are sampled too). Half the requests repeat one of 60 prompts, half are new.
Anything that grows per request or per fault, beyond the baseline's slope, is a leak
(docs/performance.md, "Leak soak", has the figures). Nothing is left running or in
/dev/shm at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for helpers in ("tests", "tests/engine", "tests/node"):  # the engine tests' harness
    sys.path.insert(0, str(ROOT / helpers))

BATCH = 10  # requests a generate call
POOL = 60  # prompts that recur


def sample(tag: str, done: int, work: Path, node: Any = None) -> dict[str, Any]:
    """This process's resources (and the node's, and the disk tiers' files), as one line."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    status = Path("/proc/self/status").read_text().splitlines()
    rss_kib = int(next(line for line in status if line.startswith("VmRSS")).split()[1])
    row: dict[str, Any] = {
        "tag": tag, "requests": done, "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")), "rss_mib": round(rss_kib / 1024, 1),
        "maps": len(maps), "kvtier_maps": sum("kvtier" in m for m in maps)}
    for name in ("disk", "nodedisk"):
        if (work / name).exists():
            row[f"{name}_chunk_files"] = sum(1 for _ in (work / name).rglob("*.kvc"))
            row[f"{name}_temp_files"] = sum(1 for _ in (work / name).rglob(".*.tmp"))
    if node is not None and node.process.poll() is None:
        pid = node.process.pid
        row["node_fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        row["node_threads"] = len(os.listdir(f"/proc/{pid}/task"))
    print(json.dumps(row), flush=True)
    return row


@contextlib.contextmanager
def kvtier_config(mode: str, work: Path) -> Iterator[tuple[dict[str, Any] | None, Any]]:
    """The connector's extra config for `mode`, and what the faults act on."""
    from redis_server import RedisServer

    from kvtier.integrations.vllm.config import kvtier_transfer_config

    extra: dict[str, Any] = {"tokens_per_chunk": 64, "load_when": "always",
                             "tail_chunks": False}
    ram = {"kind": "memory", "capacity": "1MiB"}
    if mode == "none":
        yield None, None
    elif mode == "memory":
        yield kvtier_transfer_config({**extra, "tiers": [ram]}), None
    elif mode == "disk":
        disk = {"kind": "disk", "path": str(work / "disk"), "capacity": "4MiB"}
        yield kvtier_transfer_config({**extra, "tiers": [ram, disk]}), work / "disk"
    elif mode == "redis":
        server = RedisServer(work / "redis").start()
        try:
            tier = {"kind": "redis", "url": server.url, "capacity": "4MiB"}
            yield kvtier_transfer_config({**extra, "tiers": [ram, tier]}), server
        finally:
            server.stop()
    elif mode == "node":
        from nodekit import NodeProcess, short_dir, unique_name, write_config

        config = write_config(work / "node.json", {"tiers": [
            {"kind": "memory", "capacity": "2MiB"},
            {"kind": "disk", "path": str(work / "nodedisk"), "capacity": "4MiB"}]})
        node = NodeProcess(config, short_dir(work) / "node.sock", unique_name(work),
                           work / "node.log").start()
        try:
            yield kvtier_transfer_config({**extra, "node": str(node.socket_path),
                                          "lookup_timeout_s": 1.0}), node
        finally:
            node.kill()  # and its slabs removed
    else:
        raise SystemExit(f"unknown mode {mode!r}: none, memory, disk, redis or node")


def at(fraction: float, total: int) -> int:
    """The request count, a whole number of batches, nearest below `fraction` of `total`."""
    return max(BATCH, int(total * fraction) // BATCH * BATCH)


def inject(mode: str, target: Any, done: int, total: int) -> None:
    """The faults of `mode` due after `done` requests."""
    if mode == "disk" and done in (at(1 / 3, total), at(2 / 3, total)):
        if os.geteuid() != 0:
            print("# no fault: a read-only bind mount needs root", flush=True)
            return
        command = ["mount", "--bind", "-o", "ro", str(target), str(target)] \
            if done == at(1 / 3, total) else ["umount", "-l", str(target)]
        subprocess.run(command, check=True)
        print(f"# fault: {' '.join(command[:-1])}", flush=True)
    elif mode == "redis" and done in (at(1 / 3, total), at(1 / 2, total)):
        target.proc.kill()
        target.proc.wait()
        target.start()
        print("# fault: redis-server killed and restarted", flush=True)
    elif mode == "node" and done % at(1 / 5, total) == 0 and done < total:
        target.process.kill()
        target.process.wait()
        target.start()
        print("# fault: node killed (SIGKILL) and restarted", flush=True)


def soak(mode: str, total: int, work: Path) -> None:
    from vllm_harness import random_prompts, start_engine, token_ids

    from kvtier.testing.tinymodel import make_preset_model

    model = make_preset_model("test", work / "models")
    rng = random.Random(1)
    pool = random_prompts([rng.randrange(200, 700) for _ in range(POOL)], seed=7)
    with kvtier_config(mode, work) as (config, target), start_engine(model, config) as llm:
        node = target if mode == "node" else None
        sample("start", 0, work, node)
        try:
            for done in range(BATCH, total + 1, BATCH):
                batch = [pool[rng.randrange(POOL)] for _ in range(BATCH // 2)]
                new = [rng.randrange(150, 500) for _ in range(BATCH - len(batch))]
                batch += random_prompts(new, seed=done)
                token_ids(llm, batch, max_tokens=4)
                inject(mode, target, done, total)
                if done % at(1 / 10, total) == 0:
                    sample("run", done, work, node)
        finally:
            if mode == "disk":
                subprocess.run(["umount", "-l", str(target)], capture_output=True)
        time.sleep(2)  # the write-behind's last writes
        sample("end", total, work, node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["none", "memory", "disk", "redis", "node"])
    parser.add_argument("requests", type=int, nargs="?", default=600)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the model, tiers and logs go (default: a temp dir)")
    args = parser.parse_args()
    if args.requests < 10 * BATCH:
        parser.error(f"at least {10 * BATCH} requests")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        soak(args.mode, args.requests, args.workdir)
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as work:
        soak(args.mode, args.requests, Path(work))


if __name__ == "__main__":
    main()
