"""Where kvtier's I/O threads run (`io_cores`, kvtier/core/threads.py).

vLLM's CPU backend binds the model runner's thread to its own core(s); kvtier's pools start
their threads from that thread, so without placement every read and load waited for the core
the forward keeps busy (docs/performance.md, "I/O threads' cores"). These tests bind a thread
the same way (`os.sched_setaffinity`) and look at where the real pools' threads run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from tierkit import key, tiny_layout

from kvtier.core.threads import (
    IOPool,
    auto_cores,
    parse_cpu_list,
    resolve_io_cores,
    start_threads,
)
from kvtier.errors import ConfigError
from kvtier.tiers import open_store
from kvtier.tiers.storeconfig import StoreConfig

T = TypeVar("T")
CORES = frozenset(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 or more usable cores")


def bound_to(cores: frozenset[int], fn: Callable[[], T]) -> T:
    """fn's result, called on a new thread bound to `cores` (as vLLM binds the runner)."""
    box: list[T] = []

    def run() -> None:
        os.sched_setaffinity(0, cores)
        box.append(fn())
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return box[0]


def test_the_setting_is_auto_inherit_or_a_list_of_cores_and_anything_else_is_refused() -> None:
    tiers = [{"kind": "memory", "capacity": "1MiB"}]
    assert StoreConfig.parse({"tiers": tiers}).io_cores == "auto"
    for good in ("inherit", "0", "0,2-3", "6-7,14-15"):
        assert StoreConfig.parse({"tiers": tiers, "io_cores": good}).io_cores == good
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    for bad in ("all", "", "1-", "-1", "a,b", "2;3", "0-3000000", "8192"):
        with pytest.raises(ConfigError) as err:
            StoreConfig.parse({"tiers": tiers, "io_cores": bad})
        assert err.value.field == "config.io_cores" and "inherit" in err.value.allowed


def test_auto_widens_a_bound_runner_to_the_engine_cores_of_its_numa_nodes() -> None:
    node0, node1 = frozenset(range(4)), frozenset(range(4, 8))
    engine = node0 | node1
    # This machine's case: the runner on core 0 of 2, one node: both cores.
    assert auto_cores(frozenset({0}), frozenset({0, 1}), [frozenset({0, 1})]) == {0, 1}
    # A rank bound to 3 cores of node 0 (the 4th kept for the engine): node 0, not node 1.
    assert auto_cores(frozenset({0, 1, 2}), engine, [node0, node1]) == node0
    # No NUMA information: every engine core.
    assert auto_cores(frozenset({5}), engine, []) == engine
    # Not bound narrower than the engine (a GPU worker, the CLI): inherit.
    assert auto_cores(engine, engine, [node0, node1]) is None
    assert resolve_io_cores("inherit") is None
    assert resolve_io_cores("0") == {0}
    # Outside an engine a narrow mask is the operator's (taskset): "auto" keeps it.
    assert resolve_io_cores("auto") is None


@needs_two
def test_a_pool_started_from_a_bound_thread_runs_on_the_cores_it_is_given() -> None:
    one = frozenset({min(CORES)})

    def placed(cores: frozenset[int] | None) -> frozenset[int]:
        with IOPool(1, "kvtier-test", cores) as pool:
            return frozenset(pool.submit(os.sched_getaffinity, 0).result())
    assert bound_to(one, lambda: placed(None)) == one  # Python's way: the starter's core
    assert bound_to(one, lambda: placed(CORES)) == CORES
    # "auto" from a thread the engine bound narrower than its process's parent: wider.
    auto = bound_to(one, lambda: resolve_io_cores("auto", engine_bound=True))
    assert auto is not None and auto > one
    assert bound_to(one, lambda: resolve_io_cores("auto")) is None


@needs_two
def test_a_store_opened_on_a_bound_thread_reads_and_writes_behind_on_its_io_cores(
        tmp_path: Path) -> None:
    layout = tiny_layout(4)
    config = StoreConfig.parse({"io_cores": ",".join(map(str, sorted(CORES))), "tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB"}]})
    data = memoryview(bytes(range(256)) * (layout.bytes_per_chunk // 256))

    def use_store() -> dict[str, frozenset[int]]:
        with open_store(config, layout) as store:
            store.put(key(1), data)
            assert store.flush(10)
            store.tiers[0].delete(key(1))  # only on disk now: a read thread reads it
            spares = [memoryview(bytearray(layout.bytes_per_chunk))]
            with store.lend_as_landed([key(1)], spares) as lending:
                assert [(loan.view.tier, bytes(loan.view.data)) for loan in lending] == [
                    ("disk", bytes(data))]
            # Its readers and writers (the memory tier's prefault thread, started on the
            # bound thread, may still be running: it is neither; CI run, 24th session).
            return {t.name: frozenset(os.sched_getaffinity(t.native_id or 0))
                    for t in threading.enumerate()
                    if t.name.startswith(("kvtier-read", "kvtier-write"))}
    placed = bound_to(frozenset({min(CORES)}), use_store)
    assert any(name.startswith("kvtier-read") for name in placed)
    assert any(name.startswith("kvtier-write-disk") for name in placed)
    assert set(placed.values()) == {CORES}


def test_cores_outside_the_allowed_set_are_refused_once_and_the_threads_stay(
        caplog: pytest.LogCaptureFixture) -> None:
    outside = frozenset({max(CORES) + 4096})  # no such core here
    with caplog.at_level("WARNING", logger="kvtier.core.threads"), \
            IOPool(3, "kvtier-test", outside) as pool:
        placed = [pool.submit(os.sched_getaffinity, 0) for _ in range(9)]
        assert {frozenset(f.result()) for f in placed} == {CORES}
    assert len([r for r in caplog.records if "cannot run I/O threads" in r.message]) == 1


def test_where_the_os_places_no_threads_a_setting_is_ignored_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delattr(os, "sched_setaffinity")  # as on macOS, where vLLM's CPU backend runs
    with caplog.at_level("WARNING", logger="kvtier.core.threads"):
        assert resolve_io_cores("0,1") is None
        assert resolve_io_cores("auto", engine_bound=True) is None
    assert "ignored" in caplog.text


def test_a_pools_threads_are_started_at_once_when_asked() -> None:
    """`start_threads` (a node's read pool: its first load does not start them one a read);
    a pool otherwise starts a thread per call as calls come."""
    pool = IOPool(4, "kvtier-start-test", None)
    try:
        assert not [t for t in threading.enumerate() if t.name.startswith("kvtier-start-test")]
        start_threads(pool, 4)
        names = {t.name for t in threading.enumerate()}
        assert {f"kvtier-start-test_{i}" for i in range(4)} <= names
        assert pool.submit(lambda: 7).result(timeout=10) == 7  # the threads serve calls
    finally:
        pool.shutdown(wait=True)
