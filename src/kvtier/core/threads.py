"""Where kvtier's I/O threads run: the cores of their pools (`StoreConfig.io_cores`).

A thread starts with the CPU mask of the thread that starts it. vLLM's CPU backend binds a
worker's model runner (its OpenMP threads, the main thread among them) to cores of its own
(`VLLM_CPU_OMP_THREADS_BIND`, and "auto" keeps the last core of each node for the engine's
other processes), and kvtier's pools start their threads from the model runner's thread: left
alone, every read, write-behind and load thread waits for the runner's core(s), which a
forward pass, and vLLM's busy-polling between steps, keep busy. An asynchronous load then
waits behind the very steps it was meant to stay out of (a 4k-token prefix from redis:
0.5-1.9 s on the runner's core, 0.15-0.2 s on the engine's in most runs: docs/performance.md,
"I/O threads' cores").

The settings:
  - "auto" (default): in a vLLM worker, the cores the engine was started on (the parent
    process's mask: the process that started this one, before vLLM bound anything), kept to
    the NUMA nodes of the cores this thread runs on, so that a rank's I/O stays beside its
    memory. Where the thread is not bound narrower than its parent (GPU workers), and
    outside an engine (the kvtier CLI, whose mask is the operator's `taskset`): inherit.
  - "inherit": the starting thread's mask, as Python does.
  - a list such as "2,3" or "6-7,14-15": those cores.

Primitives: `parse_io_cores`, `resolve_io_cores`, `io_pool`, `start_threads`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)
NODES = Path("/sys/devices/system/node")
START_WAIT_S = 10.0  # `start_threads`: how long a started thread waits for the others, at most


def parse_cpu_list(text: str) -> frozenset[int]:
    """Cores of a list such as "0,2-3" (the kernel's cpulist format).

    Raises:
        ValueError: not such a list, or an empty one.
    """
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a list of cores like '2,3' or '6-7,14-15'")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"{text!r} names no core")
    return frozenset(cores)


def parse_io_cores(text: str) -> str:
    """Validate an `io_cores` setting ("auto", "inherit" or a list of cores); the setting.

    Raises:
        ValueError: anything else (the message says what is allowed).
    """
    if text in ("auto", "inherit"):
        return text
    try:
        parse_cpu_list(text)
    except ValueError as exc:
        raise ValueError(f"'auto', 'inherit' or a list of cores: {exc}") from None
    return text


def resolve_io_cores(setting: str, engine_bound: bool = False) -> frozenset[int] | None:
    """The cores an `io_cores` setting means in this thread, now; None: inherit.
    `engine_bound`: this thread's mask is the engine's choice (a vLLM worker's model runner),
    which "auto" may widen; otherwise it is the operator's, and "auto" inherits it."""
    if setting == "inherit" or (setting == "auto" and not engine_bound):
        return None
    if not hasattr(os, "sched_setaffinity"):  # macOS: threads cannot be placed
        log.warning("kvtier: io_cores %r ignored: this OS places no threads", setting)
        return None
    if setting != "auto":
        return parse_cpu_list(setting)
    try:
        engine = frozenset(os.sched_getaffinity(os.getppid()))
        runner = frozenset(os.sched_getaffinity(0))
    except OSError:  # no parent to ask (it exited)
        return None
    return auto_cores(runner, engine, numa_nodes())


def auto_cores(runner: frozenset[int], engine: frozenset[int],
               nodes: Iterable[frozenset[int]]) -> frozenset[int] | None:
    """"auto": the engine's cores on the runner's NUMA nodes, when the runner is bound to
    fewer of them than that; None (inherit) otherwise."""
    near = frozenset().union(*(node for node in nodes if node & runner)) or engine
    cores = engine & near
    return cores if cores > runner else None


def numa_nodes() -> list[frozenset[int]]:
    """The cores of each NUMA node (none listed where sysfs does not say)."""
    nodes = []
    for cpulist in sorted(NODES.glob("node[0-9]*/cpulist")):
        try:
            nodes.append(parse_cpu_list(cpulist.read_text().strip()))
        except (OSError, ValueError):  # a node without cores has an empty list
            continue
    return nodes


def io_pool(threads: int, name: str, cores: frozenset[int] | None) -> ThreadPoolExecutor:
    """A pool of `threads` threads named `name`_N, each placed on `cores` as it starts
    (None: where the thread that starts it runs)."""
    if cores is None:
        return ThreadPoolExecutor(threads, thread_name_prefix=name)
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=_place,
                              initargs=(cores,))


def start_threads(pool: ThreadPoolExecutor, threads: int) -> None:
    """Start `threads` of `pool`'s threads now, where ThreadPoolExecutor starts one per call
    as calls come, each start waiting for its thread to run (0.3 s on a busy machine: inside
    a first load's time, docs/performance.md "A node's first load"). Blocks until they run;
    each holds its thread until all are started, so that none is reused in their place."""
    started = threading.Event()
    for _ in range(threads):
        pool.submit(started.wait, START_WAIT_S)
    started.set()


def _place(cores: frozenset[int]) -> None:
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:  # cores outside this container's cpuset: stay where started
        _cannot_place(cores, str(exc), frozenset(os.sched_getaffinity(0)))


_said_lock = threading.Lock()
_said: set[tuple[frozenset[int], str]] = set()


def _cannot_place(cores: frozenset[int], error: str, kept: frozenset[int]) -> None:
    """Say once (not once per thread: a pool's threads start at once) that `cores` could
    not be used."""
    with _said_lock:
        if (cores, error) in _said:
            return
        _said.add((cores, error))
    log.warning("kvtier: cannot run I/O threads on cores %s (%s); they stay on %s",
                sorted(cores), error, sorted(kept))
