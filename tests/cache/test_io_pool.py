"""kvtier's thread pool (`IOPool`, kvtier/core/threads.py): a ThreadPoolExecutor's behaviour
on daemon threads that never hold the process's exit (a call stuck on a dead mount would hold
it for as long as the mount is dead: tests/faults/test_stalled_tier.py runs such an exit)."""

from __future__ import annotations

import gc
import threading

import pytest

from kvtier.core.threads import IOPool, start_threads


def named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_calls_return_their_results_and_raise_their_exceptions() -> None:
    pool = IOPool(2, "kvtier-t-results")
    try:
        assert pool.submit(pow, 2, 10).result(5) == 1024
        assert list(pool.map(abs, [-1, -2, -3])) == [1, 2, 3]
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(5)
    finally:
        pool.shutdown()


def test_no_more_than_max_threads_start() -> None:
    pool = IOPool(3, "kvtier-t-count")
    try:
        gate = threading.Event()
        running = [pool.submit(gate.wait, 10) for _ in range(6)]  # more than 3 at once
        threads = named("kvtier-t-count")
        assert len(threads) == 3 and all(t.daemon for t in threads)
        gate.set()
        assert all(f.result(10) for f in running)
    finally:
        pool.shutdown()


def test_start_threads_starts_them_all_at_once() -> None:
    pool = IOPool(4, "kvtier-t-start")
    try:
        start_threads(pool, 4)
        assert len(named("kvtier-t-start")) == 4
    finally:
        pool.shutdown()


def test_shutdown_cancels_queued_calls_on_request_and_ends_the_threads() -> None:
    pool = IOPool(1, "kvtier-t-shut")
    gate = threading.Event()
    running = pool.submit(gate.wait, 10)
    queued = [pool.submit(int) for _ in range(3)]
    threads = named("kvtier-t-shut")
    pool.shutdown(wait=False, cancel_futures=True)  # its one thread is busy: all still queued
    assert all(f.cancelled() for f in queued)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(int)
    gate.set()
    assert running.result(5) is True  # a running call runs to its end
    for thread in threads:
        thread.join(10)
    assert threads and not any(t.is_alive() for t in threads)


def test_a_pool_dropped_without_a_shutdown_ends_its_threads() -> None:
    pool = IOPool(2, "kvtier-t-dropped")
    start_threads(pool, 2)
    threads = named("kvtier-t-dropped")
    del pool
    gc.collect()
    for thread in threads:
        thread.join(10)
    assert threads and not any(t.is_alive() for t in threads)


def test_join_waits_for_the_threads_at_most_its_timeout() -> None:
    pool = IOPool(1, "kvtier-t-join")
    gate, started = threading.Event(), threading.Event()
    pool.submit(lambda: (started.set(), gate.wait(30)))
    assert started.wait(10)
    pool.shutdown(wait=False)
    assert pool.join(0.05) is False  # its one call is stuck
    gate.set()
    assert pool.join() is True
