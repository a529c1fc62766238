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

A pool's threads never hold the process's exit (`IOPool`): a ThreadPoolExecutor's threads
are not daemons, and CPython joins them at exit, waiting for the call each one runs. A `stat`
or a `write` on a dead hard-mounted NFS server stays in the kernel for ever, and so would a
script's exit after its `LLM(...)` had shut down and given up those writes. kvtier needs no
such wait: a close flushes what it can within its deadline, and a write cut short lands
nothing (a temp file renamed into place, a Redis SET, an S3 PUT): a later miss.

Primitives: `parse_io_cores`, `resolve_io_cores`, `IOPool`, `start_threads`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger(__name__)
NODES = Path("/sys/devices/system/node")
MAX_CORE = 8191  # the highest core number a Linux kernel counts (NR_CPUS at most 8192)
START_WAIT_S = 10.0  # `start_threads`: how long a started thread waits for the others, at most
P = ParamSpec("P")
R = TypeVar("R")
_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


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
        low, high = int(first), int(last or first)
        if high > MAX_CORE:  # a typo's range would be built here, core by core
            raise ValueError(f"{text!r} names core {high}, past the {MAX_CORE} Linux allows")
        cores.update(range(low, high + 1))
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


class IOPool(Executor):
    """ThreadPoolExecutor's behaviour (a thread started per call while none is idle, up to
    `threads`; `shutdown(wait, cancel_futures)`; its threads end when it is shut down or
    collected) on daemon threads that the process's exit does not wait for; `join` waits
    for them with a timeout. Thread-safe."""

    def __init__(self, threads: int, name: str, cores: frozenset[int] | None = None) -> None:
        """Args:
            threads: at most this many threads, named `name`_N.
            cores: where each thread runs, placed as it starts (None: where its starter runs).
        """
        self._max = threads
        self.name = name
        self._cores = cores
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._idle = _Idle()
        self._threads: list[threading.Thread] = []
        self._shut = False
        weakref.finalize(self, self._calls.put, None)  # its threads hold no reference to it

    def submit(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        future: Future[R] = Future()
        with self._idle.lock:
            if self._shut:
                raise RuntimeError(f"{self.name}: cannot schedule new calls after shutdown")
            self._calls.put((future, fn, args, kwargs))
            if self._idle.count:
                self._idle.count -= 1
            elif len(self._threads) < self._max:
                thread = threading.Thread(target=_serve, daemon=True,
                                          args=(self._calls, self._idle, self._cores),
                                          name=f"{self.name}_{len(self._threads)}")
                thread.start()
                self._threads.append(thread)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._idle.lock:
            self._shut = True
        if cancel_futures:
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    call[0].cancel()
        self._calls.put(None)  # each thread passes it on as it ends
        if wait:
            self.join()

    def join(self, timeout_s: float | None = None) -> bool:
        """After `shutdown`: wait at most `timeout_s` (None: for ever) for the threads to
        end; whether they all have (a call stuck in a dead tier may never return)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle.lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)


class _Idle:
    """A pool's threads waiting for a call that no submitted call has claimed yet."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0


def _serve(calls: queue.SimpleQueue[_Call | None], idle: _Idle,
           cores: frozenset[int] | None) -> None:
    """An `IOPool` thread: runs calls until it meets the end (None), which it passes on."""
    if cores is not None:
        _place(cores)
    while (call := calls.get()) is not None:
        future, fn, args, kwargs = call
        del call
        result: Any = None
        error: BaseException | None = None
        if running := future.set_running_or_notify_cancel():
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller, as a pool's are
                error = exc
        if running:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        del future, fn, args, kwargs, result, error  # nothing of a call outlives it here
        with idle.lock:
            idle.count += 1
    calls.put(None)


def start_threads(pool: Executor, threads: int) -> None:
    """Start `threads` of `pool`'s threads now, where a pool starts one per call
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
