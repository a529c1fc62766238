"""A tier that stops answering (a dead hard-mounted NFS server, a server that accepts and never
replies) costs hits, never a hung caller (issue 12, item 6).

The store waits at most `read_timeout_s` for a read or a lookup of a tier below RAM: a read
not finished by then is a miss counted as `timeout`, the tier is skipped at once by every
later call, and used again as soon as it answers. The scheduler's locator waits at most
`timeout_s` for a slow tier's probe. A store's close does not wait for a write stuck in a
tier past its flush deadline, and a tier whose directory hangs when the store opens is left
out. Faults are injected with tier doubles whose calls block until released (the example
tier, tiers/example.py, with a gate), or `os.stat` blocked under one directory.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierkit import key, make_tier, tier_settings, tiny_layout

from kvtier.core.keys import ChunkKey
from kvtier.core.locator import ChunkLocator, LookupStatus
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import StoreSettings, TieredStore
from kvtier.core.tier import TierResult
from kvtier.tiers import build_probe, open_store
from kvtier.tiers.example import ExampleTier, ExampleTierConfig
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()
CHUNK = LAYOUT.bytes_per_chunk
TIMEOUT_S = 0.3


class HangingTier(ExampleTier):
    """Holds chunks like the example tier, but while `hang` is set its reads and lookups
    block until `release` is set (then answer normally). A stand-in for a tier on a network
    mount, whose reads are copies: not `InPlace` (an in-place tier's chunks are lent on the
    caller's thread, as RAM's are; the runtime protocol check takes None as absent)."""

    borrow = None
    reserve = None

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hang = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def _gate(self) -> None:
        self.calls += 1
        if self.hang.is_set():
            self.release.wait(30)

    def contains(self, key: ChunkKey) -> bool:
        self._gate()
        return super().contains(key)

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        self._gate()
        return super().get_into(key, out, meta)


def example(name: str, cls: type[ExampleTier] = ExampleTier) -> ExampleTier:
    return cls(ExampleTierConfig(kind="example", name=name, capacity=16 * CHUNK), LAYOUT)


@pytest.fixture
def hanging() -> Iterator[HangingTier]:
    tier = example("nfs", HangingTier)
    assert isinstance(tier, HangingTier)
    yield tier
    tier.release.set()  # let abandoned threads finish


def spares(n: int) -> list[memoryview]:
    return [memoryview(bytearray(CHUNK)) for _ in range(n)]


@pytest.mark.timing
def test_a_read_that_hangs_is_a_timely_miss_and_the_tier_is_then_skipped(
        hanging: HangingTier) -> None:
    store = TieredStore([example("ram"), hanging], StoreSettings(read_timeout_s=TIMEOUT_S))
    hanging.put(key(1), memoryview(b"\x01" * CHUNK))
    buffers = spares(1)
    given = buffers[0]
    hanging.hang.set()
    start = time.monotonic()
    with store.lend_as_landed([key(1)], buffers) as lending:
        assert list(lending) == [] and lending.failed_tier == "nfs"
    assert time.monotonic() - start < TIMEOUT_S + 0.2
    # The stuck read may still write into the spare it was given: the caller gets a new one.
    assert buffers[0] is not given and len(buffers[0]) == CHUNK
    assert store.stats().failures["nfs"]["timeout"] == 1
    # Skipped at once while stalled: reads, lookups and write-behind.
    calls = hanging.calls
    start = time.monotonic()
    with store.lend_as_landed([key(1)], buffers) as lending:
        assert list(lending) == []
    assert not store.contains(key(1))
    assert store.put(key(2), memoryview(b"\x02" * CHUNK))  # RAM stores it
    assert time.monotonic() - start < 0.1
    assert hanging.calls == calls


def test_a_stalled_tier_is_used_again_once_it_answers(hanging: HangingTier) -> None:
    store = TieredStore([example("ram"), hanging], StoreSettings(read_timeout_s=TIMEOUT_S))
    hanging.put(key(1), memoryview(b"\x01" * CHUNK))
    hanging.hang.set()
    with store.lend_as_landed([key(1)], spares(1)) as lending:
        assert list(lending) == []
    hanging.hang.clear()
    hanging.release.set()  # the stuck read returns: the tier answers again
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with store.lend_as_landed([key(1)], spares(1)) as lending:
            for loan in lending:
                assert bytes(loan.view.data) == b"\x01" * CHUNK
                return
        time.sleep(0.05)
    raise AssertionError("the tier was never used again")


def test_the_late_reads_of_one_stall_back_the_tier_off_once(
        hanging: HangingTier, caplog: pytest.LogCaptureFixture) -> None:
    """Four chunks of one load, each read a call of its own, all run late: one stall,
    warned once, backed off once (1 s). Each late read counted as a stall of its own doubled
    the backoff four times over (8 s) and skipped the tier long after it answered again."""
    store = TieredStore([example("ram"), hanging], StoreSettings(read_timeout_s=TIMEOUT_S))
    for i in range(4):
        hanging.put(key(i), memoryview(bytes([i]) * CHUNK))
    hanging.hang.set()
    with store.lend_as_landed([key(i) for i in range(4)], spares(4)) as lending:
        assert list(lending) == [] and lending.stopped_at == 0
    stalled_at = time.monotonic()
    assert store.stats().failures["nfs"]["timeout"] == 4
    assert sum("reads took over" in r.getMessage() for r in caplog.records) == 1
    hanging.hang.clear()
    hanging.release.set()
    while time.monotonic() - stalled_at < 2.0:  # the first backoff, 1 s, and some
        with store.lend_as_landed([key(1)], spares(1)) as lending:
            if list(lending):
                return
        time.sleep(0.05)
    raise AssertionError("the tier was still skipped 2 s after one stall")

def test_a_late_read_into_a_reserved_ram_slot_releases_it(tmp_path: object,
                                                           hanging: HangingTier) -> None:
    ram = make_tier("memory", tmp_path, LAYOUT, 2)  # type: ignore[arg-type]
    store = TieredStore([ram, hanging], StoreSettings(read_timeout_s=TIMEOUT_S))
    hanging.put(key(1), memoryview(b"\x07" * CHUNK))
    hanging.hang.set()
    with store.lend_as_landed([key(1)], spares(1)) as lending:
        assert list(lending) == []  # abandoned while reading into a reserved RAM slot
    hanging.release.set()
    # The late read fills its slot (the promotion) and releases it: RAM serves the chunk,
    # and both slots can still be filled (none is pinned for ever).
    deadline = time.monotonic() + 5
    while not ram.contains(key(1)) and time.monotonic() < deadline:
        time.sleep(0.02)
    with store.lend_as_landed([key(1)], spares(1)) as lending:
        assert [loan.view.tier for loan in lending] == [ram.name]
    assert store.put(key(2), memoryview(b"\x02" * CHUNK))
    assert store.put(key(3), memoryview(b"\x03" * CHUNK))


@pytest.mark.timing
def test_closing_with_a_write_that_hangs_returns_at_its_deadline(
        caplog: pytest.LogCaptureFixture) -> None:
    """A write-behind stuck in a tier that stopped answering (its `put` on a dead mount) is
    not waited for past the close's deadline: an engine or a node shutting down would hang
    for as long as the tier does. The write ends whenever the tier answers."""
    release = threading.Event()

    class HangingWrites(ExampleTier):
        def put(self, key: ChunkKey, data: memoryview,
                meta: ChunkMeta = DEFAULT_META) -> TierResult:
            release.wait(30)
            return super().put(key, data, meta)

    earlier = set(threading.enumerate())  # an earlier test's store's writers, left idle
    nfs = example("nfs", HangingWrites)
    store = TieredStore([example("ram"), nfs], StoreSettings(read_timeout_s=TIMEOUT_S))
    try:
        for i in range(3):
            assert store.put(key(i), memoryview(bytes([i]) * CHUNK))
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvtier.core.store"):
            store.close(flush_timeout_s=TIMEOUT_S)
        assert time.monotonic() - start < TIMEOUT_S + 3.0  # 30 s before: the hung put's
        assert "3 queued writes not finished" in caplog.text
    finally:
        release.set()
    writers = [t for t in threading.enumerate()
               if t.name.startswith("kvtier-write-nfs") and t not in earlier]
    for thread in writers:
        thread.join(5)
    assert writers and not any(t.is_alive() for t in writers)
    assert nfs.contains(key(0))  # the running write ended once the tier answered


def test_a_tier_whose_close_hangs_is_left_to_end_on_its_own(
        caplog: pytest.LogCaptureFixture) -> None:
    """Under a close's deadline, a lower tier's own close (a shared directory's waits for
    a measure of its link in flight, for a re-measure of its usage) that does not end is
    not waited for: the store's close returns while that tier's close is still blocked."""
    closing, release = threading.Event(), threading.Event()

    class HangingClose(ExampleTier):
        def close(self) -> None:
            closing.set()
            release.wait(60)

    store = TieredStore([example("ram"), example("nfs", HangingClose)],
                        StoreSettings(read_timeout_s=TIMEOUT_S))
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.core.store"):
            store.close(flush_timeout_s=TIMEOUT_S)
        assert closing.is_set() and not release.is_set()
        assert "'nfs': its close had not ended" in caplog.text
    finally:
        release.set()


# A process whose store gave up a write stuck in its tier for good (a `put` on a dead mount:
# here it waits on an event nobody sets), then ends: a script around `LLM(...)` after its
# shutdown, a node, a CLI.
EXIT_AFTER_A_HUNG_WRITE = """
import threading
from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.store import StoreSettings, TieredStore
from kvtier.tiers.example import ExampleTier, ExampleTierConfig

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                  tokens_per_chunk=16)

class DeadMount(ExampleTier):
    def put(self, key, data, meta=None):
        threading.Event().wait()

def example(name, cls=ExampleTier):
    return cls(ExampleTierConfig(kind="example", name=name,
                                 capacity=16 * LAYOUT.bytes_per_chunk), LAYOUT)

store = TieredStore([example("ram"), example("nfs", DeadMount)],
                    StoreSettings(read_timeout_s=0.3))
store.put(ChunkKey(b"k" * KEY_BYTES), memoryview(bytes(LAYOUT.bytes_per_chunk)))
store.close(flush_timeout_s=0.3)
print("closed", flush=True)
"""


def test_a_process_ends_after_its_store_gave_up_a_write_that_never_returns() -> None:
    """Python joins a ThreadPoolExecutor's threads at exit, waiting for the call each runs:
    the process above never ended (a script around an in-process engine with a dead shared
    mount, after its shutdown). kvtier's pools run daemon threads it does not wait for."""
    done = subprocess.run([sys.executable, "-c", EXIT_AFTER_A_HUNG_WRITE],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["closed"]
    assert "queued write" in done.stderr  # the close said what it gave up


def test_a_late_read_landing_after_the_close_is_stored_without_an_error(
        tmp_path: Path) -> None:
    """A read abandoned by a stalled tier lands whenever the tier answers, maybe after the
    store closed: its promotion into a RAM tier closed full reserved a slot by evicting a
    chunk the closed index no longer had (a KeyError, logged as a failed read)."""
    ram = make_tier("memory", tmp_path, LAYOUT, 2)  # type: ignore[arg-type]
    for i in range(2):
        assert ram.put(key(i), memoryview(bytes([i]) * CHUNK))
    ram.close()
    for i in range(2, 5):  # the late promotions: the third evicts
        assert ram.put(key(i), memoryview(bytes([i]) * CHUNK))
    assert ram.contains(key(4)) and not ram.contains(key(0))


@pytest.mark.timing
def test_a_lookup_that_hangs_leaves_the_rest_of_the_prefix_a_miss() -> None:
    gate = threading.Event()

    class HangingProbe:
        blocking_ok = False  # a network filesystem: asked off the scheduler's thread

        def contains(self, key: ChunkKey) -> bool:
            gate.wait(30)
            return True

        def close(self) -> None:
            return

    locator = ChunkLocator({"stalled": HangingProbe()}, max_keys=64, timeout_s=TIMEOUT_S)
    locator.record_stored([key(0)])
    keys = [key(0), key(1), key(2)]
    try:
        start = time.monotonic()
        while (found := locator.locate("r1", keys)).status is LookupStatus.RETRY:
            assert time.monotonic() - start < TIMEOUT_S + 0.5
            time.sleep(0.02)
        assert found.num_chunks == 1  # the index's key; the probe never answered
        assert locator.timeouts == 1
        # While it stays stuck, lookups answer at once from the index (no RETRY).
        assert locator.locate("r2", keys).num_chunks == 1
        gate.set()  # it answers: slow probes are asked again
        deadline = time.monotonic() + 5
        while locator.locate("r3", keys).status is not LookupStatus.RETRY:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        gate.set()
        locator.close()


@pytest.mark.timing
def test_a_tier_whose_directory_hangs_at_start_is_left_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A shared directory on a dead mount when the cache opens (an engine's start, a node's):
    its first `stat` would block for ever, and the engine would never start. The tier is left out
    after `read_timeout_s` (its scheduler's probe after `lookup_timeout_s`), logged, and the
    cache serves from the tiers that answer."""
    answer = threading.Event()
    real_stat = os.stat

    def hung_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(str(tmp_path / "shared")):
            answer.wait(30)  # a dead mount: answers when the server comes back
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    config = StoreConfig.parse({"read_timeout_s": TIMEOUT_S, "lookup_timeout_s": TIMEOUT_S,
                                "tiers": [tier_settings("memory", tmp_path, LAYOUT, 4),
                                          tier_settings("disk", tmp_path, LAYOUT, 4),
                                          tier_settings("shared", tmp_path, LAYOUT, 4)]})
    monkeypatch.setattr(os, "stat", hung_stat)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers"):
            store = open_store(config, LAYOUT)
            probe = build_probe(config.tiers[2], [LAYOUT], config.lookup_timeout_s)
        took_s = time.monotonic() - start
        assert [tier.name for tier in store.tiers] == ["memory", "disk"]
        assert probe is None
        assert took_s < 2 * TIMEOUT_S + 5.0, took_s  # 30 s before: the hung stat's
        assert caplog.text.count("tier 'shared': its directory") == 2
        assert str(tmp_path / "shared") in caplog.text
        assert store.put(key(1), memoryview(b"\x01" * CHUNK))  # served by the tiers that answer
        assert store.flush(5)
        assert store.tiers[1].contains(key(1))
        store.close()
    finally:
        answer.set()
    # Healthy again: the next opening has it.
    monkeypatch.setattr(os, "stat", real_stat)
    reopened = open_store(config, LAYOUT)
    assert [tier.name for tier in reopened.tiers] == ["memory", "disk", "shared"]
    reopened.close()


def test_the_deadlines_are_validated_settings() -> None:
    from kvtier.errors import ConfigError

    config = StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}],
                                "read_timeout_s": 0.5, "lookup_timeout_s": 1})
    assert (config.read_timeout_s, config.lookup_timeout_s) == (0.5, 1.0)
    with pytest.raises(ConfigError, match="read_timeout_s"):
        StoreConfig.parse({"tiers": [{"kind": "memory", "capacity": "1MiB"}],
                           "read_timeout_s": 0})
