"""The tiered store, scenario by scenario, over example tiers (dicts of bytes): what a
lookup answers, where a read is served from and what it promotes, what a put writes now and
behind, what a full write-behind queue drops, and how failures are counted by reason.

Real tiers are not the point here (tests/tiers runs the contract suite over every tier); the
example tier is the double, and a subclass of it injects faults.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tierkit import key, tiny_layout

from kvtier.core.keys import ChunkKey
from kvtier.core.retention import DEFAULT_META, ChunkMeta
from kvtier.core.store import StoreEvent, StoreSettings, TieredStore
from kvtier.core.tier import CORRUPT, EventKind, Failure, TierResult
from kvtier.tiers import open_store
from kvtier.tiers.example import ExampleTier, ExampleTierConfig
from kvtier.tiers.files import chunkfiles
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()
CHUNK = LAYOUT.bytes_per_chunk


def payload(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * CHUNK)


def dict_tier(name: str, chunks: int = 8, **settings: object) -> ExampleTier:
    config = ExampleTierConfig(kind="example", name=name, capacity=chunks * CHUNK, **settings)
    return ExampleTier(config, LAYOUT)


class CorruptTier(ExampleTier):
    """Holds chunks, but every read of them fails verification (a damaged disk)."""

    def get_into(self, key: ChunkKey, out: memoryview,
                 meta: ChunkMeta = DEFAULT_META) -> TierResult:
        return CORRUPT if self.contains(key) else super().get_into(key, out, meta)


class StuckTier(ExampleTier):
    """Its puts wait until `release` is set: a slow lower tier that lets its queue fill."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = threading.Event()

    def put(self, key: ChunkKey, data: memoryview,
            meta: ChunkMeta = DEFAULT_META) -> TierResult:
        self.release.wait(10)
        return super().put(key, data, meta)


def three_tiers() -> tuple[ExampleTier, ExampleTier, ExampleTier]:
    return dict_tier("ram"), dict_tier("disk"), dict_tier("shared")


def test_lookup_is_the_longest_prefix_held_anywhere_and_names_the_fastest_holder() -> None:
    """Chunk 0 is in RAM and on disk, chunk 1 only in the shared directory, chunk 2 nowhere,
    chunk 3 in RAM: the prefix stops at the first gap (chunk 3 cannot be used without 2)."""
    ram, disk, shared = three_tiers()
    ram.put(key(0), payload(0))
    disk.put(key(0), payload(0))
    shared.put(key(1), payload(1))
    ram.put(key(3), payload(3))
    with TieredStore([ram, disk, shared]) as store:
        found = store.lookup([key(i) for i in range(4)])
        assert (found.num_chunks, found.tiers) == (2, ("ram", "shared"))
        assert store.contains(key(3)) and not store.contains(key(2))


def test_a_put_lands_in_the_top_tier_now_and_in_the_lower_tiers_behind() -> None:
    ram, disk, shared = three_tiers()
    with TieredStore([ram, disk, shared]) as store:
        assert store.put(key(1), payload(1)) is True
        assert ram.contains(key(1))  # synchronously
        assert store.flush(timeout_s=10)
        assert disk.contains(key(1)) and shared.contains(key(1))
        assert store.stats().queued_writes == 0


def test_a_read_from_a_lower_tier_is_promoted_to_every_tier_above_it() -> None:
    """Only the shared directory holds the chunk (another engine wrote it): the first read
    is served from there, and RAM and disk get a copy, so the next read is a RAM hit."""
    ram, disk, shared = three_tiers()
    shared.put(key(5), payload(5))
    with TieredStore([ram, disk, shared]) as store:
        out = memoryview(bytearray(CHUNK))
        assert store.get_into(key(5), out) == "shared" and out == payload(5)
        assert store.flush(timeout_s=10)
        assert ram.contains(key(5)) and disk.contains(key(5))
        assert store.get_into(key(5), out) == "ram"


def test_a_corrupt_copy_falls_through_to_the_next_tier_and_is_counted_by_reason() -> None:
    """The disk's copy fails verification: the read is served from the shared directory,
    and the store's stats say why the disk missed."""
    ram, shared = dict_tier("ram"), dict_tier("shared")
    disk = CorruptTier(ExampleTierConfig(kind="example", name="disk", capacity=8 * CHUNK),
                       LAYOUT)
    disk.put(key(2), payload(2))
    shared.put(key(2), payload(2))
    with TieredStore([ram, disk, shared]) as store:
        out = memoryview(bytearray(CHUNK))
        assert store.get_into(key(2), out) == "shared" and out == payload(2)
        assert store.stats().failures == {"disk": {"corrupt": 1}}


def test_a_miss_everywhere_returns_none() -> None:
    with TieredStore(list(three_tiers())) as store:
        assert store.get_into(key(9), memoryview(bytearray(CHUNK))) is None
        with store.borrow(key(9), memoryview(bytearray(CHUNK))) as view:
            assert view is None


def test_a_full_write_behind_queue_drops_the_write_and_counts_it_without_blocking() -> None:
    """The disk is stuck; its queue holds one write. The second and third puts still return
    at once (RAM has them), but their disk copies are dropped and counted."""
    ram = dict_tier("ram")
    disk = StuckTier(ExampleTierConfig(kind="example", name="disk", capacity=8 * CHUNK),
                     LAYOUT)
    store = TieredStore([ram, disk], StoreSettings(write_queue_depth=1))
    try:
        for i in range(3):
            assert store.put(key(i), payload(i))
        assert store.stats().queue_drops == {"disk": 2}
        disk.release.set()
        assert store.flush(timeout_s=10)
        assert disk.contains(key(0)) and not disk.contains(key(1))
    finally:
        disk.release.set()
        store.close()


def test_declined_and_full_writes_are_counted_per_reason() -> None:
    """A lower tier that admits a chunk only on its second offer declines the first put; a
    top tier with no room at all drops every write. Both show up by reason."""
    top = dict_tier("ram", chunks=0)
    picky = dict_tier("disk", admit_after=2)
    with TieredStore([top, picky]) as store:
        assert store.put(key(1), payload(1)) is False
        assert store.flush(timeout_s=10)
        assert store.stats().failures == {"ram": {"full": 1}, "disk": {"declined": 1}}
        assert [f.value for f in Failure] == [
            "missing", "corrupt", "io_error", "unavailable", "timeout", "full", "declined",
            "read_only", "raised", "codec", "auth", "no_key"]


def test_stores_and_evictions_come_back_as_typed_events() -> None:
    """A 2-chunk RAM tier takes three chunks: three stored events, then the oldest's
    eviction, in order; the queue is empty once taken."""
    ram = dict_tier("ram", chunks=2)
    with TieredStore([ram]) as store:
        for i in range(3):
            store.put(key(i), payload(i))
        events = store.take_events()
        assert events == [
            StoreEvent(EventKind.STORED, key(0), "ram"),
            StoreEvent(EventKind.STORED, key(1), "ram"),
            StoreEvent(EventKind.REMOVED, key(0), "ram"),
            StoreEvent(EventKind.STORED, key(2), "ram"),
        ]
        assert store.take_events() == []


def test_without_io_ram_tells_what_it_holds_and_only_a_lone_ram_what_is_gone() -> None:
    """`contains_without_io` (the worker asks it of each evicted chunk on the model runner's
    thread, issue 45): a chunk in RAM or on its way below is held; one RAM evicted is gone
    when RAM is the only tier, and unknown (None) when a lower tier may hold it."""
    with TieredStore([dict_tier("ram", chunks=1)]) as alone:
        alone.put(key(0), payload(0))
        alone.put(key(1), payload(1))  # evicts key 0
        assert [alone.contains_without_io(key(i)) for i in (0, 1)] == [False, True]
    lower = StuckTier(ExampleTierConfig(kind="example", name="disk", capacity=8 * CHUNK),
                      LAYOUT)
    with TieredStore([dict_tier("ram", chunks=1), lower]) as store:
        store.put(key(0), payload(0))
        store.put(key(1), payload(1))  # evicts key 0 from RAM; its write behind waits
        assert store.contains_without_io(key(0)) is True  # on its way below
        lower.release.set()
        assert store.flush(5.0)
        assert store.contains_without_io(key(0)) is None  # only the lower tier can tell
        assert store.contains(key(0))
        assert store.contains_without_io(key(9)) is None


def test_a_store_needs_tiers_with_distinct_names() -> None:
    with pytest.raises(ValueError, match="distinct"):
        TieredStore([dict_tier("ram"), dict_tier("ram")])
    with pytest.raises(ValueError):
        TieredStore([])


def test_open_store_builds_the_tiers_a_config_names(tmp_path: Path) -> None:
    """The config path: kinds are looked up in the registry, settings carried over."""
    config = StoreConfig.parse({
        "tiers": [{"kind": "example", "name": "hot", "capacity": 4 * CHUNK},
                  {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB",
                   "io_threads": 3}],
        "write_queue_depth": 5})
    with open_store(config, LAYOUT) as store:
        assert [t.name for t in store.tiers] == ["hot", "disk"]
        assert store.settings == StoreSettings(write_queue_depth=5, io_threads=16,
                                               write_threads={"hot": 1, "disk": 3})
        store.put(key(1), payload(1))
        assert store.flush(timeout_s=10)
        assert store.lookup([key(1)]).tiers == ("hot",)


@pytest.mark.parametrize("how", ["put", "put_from"])
def test_a_chunk_written_behind_reaches_the_disk_without_a_bounce(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's copy for the tiers below RAM is aligned for O_DIRECT: the disk tier writes
    it as it is, not through its staging buffer (one copy of the chunk fewer)."""
    aligned, seen = chunkfiles._aligned, []

    def watched(buffer: memoryview) -> bool:
        seen.append(aligned(buffer))
        return seen[-1]

    monkeypatch.setattr(chunkfiles, "_aligned", watched)
    config = StoreConfig.parse({"tiers": [
        {"kind": "memory", "capacity": 8 * CHUNK},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB"}]})
    with open_store(config, LAYOUT) as store:
        for i in range(4):
            if how == "put":
                store.put(key(i), payload(i))
            else:
                def fill(view: memoryview, i: int = i) -> None:
                    view[:] = payload(i)
                store.put_from(key(i), fill, memoryview(bytearray(CHUNK)))
        assert store.flush(timeout_s=10)
        assert seen and all(seen)
        assert store.tiers[0].delete(key(2))  # read back from the disk
        out = memoryview(bytearray(CHUNK))
        assert store.get_into(key(2), out) and out == payload(2)
