"""Tenants, pins and expiry in the disk tier, and the journal that keeps them over a restart.

Real disk tiers on `tmp_path`, built as a store builds them (with the test's clock where it
moves time: no sleeps); a restart is a new tier on the same directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, tier_settings, tiny_layout, write_in_flight

from kvtier.core.retention import DEFAULT_META, ChunkMeta, tenant_label
from kvtier.core.store import TieredStore
from kvtier.core.tier import MetaKeeper
from kvtier.tiers.files.disk import DiskTier
from kvtier.tiers.files.retention_journal import COMPACT_SLACK_LINES, JOURNAL_NAME
from kvtier.tiers.storeconfig import StoreConfig

LAYOUT = tiny_layout()
CHUNK = bytes(range(256)) * (LAYOUT.bytes_per_chunk // 256)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def disk(tmp_path: Path, chunks: int, clock: Clock | None = None, **options: Any) -> DiskTier:
    if clock is None:
        tier = make_tier("disk", tmp_path, LAYOUT, chunks, **options)
    else:  # the tier's wall clock is the test's, its start-up index's too
        config = StoreConfig.parse(
            {"tiers": [tier_settings("disk", tmp_path, LAYOUT, chunks, **options)]})
        tier = DiskTier(config.tiers[0], LAYOUT, clock=clock)  # type: ignore[arg-type]
    assert isinstance(tier, DiskTier) and isinstance(tier, MetaKeeper)
    return tier


def put(tier: DiskTier, i: int, meta: ChunkMeta = DEFAULT_META) -> bool:
    return bool(tier.put(key(i), memoryview(CHUNK), meta))


def held(tier: DiskTier, ids: range | list[int]) -> list[int]:
    return [i for i in ids if tier.contains(key(i))]


def test_a_pin_survives_a_flood_and_a_restart(tmp_path: Path) -> None:
    import time

    now = time.time()
    tier = disk(tmp_path, 8)
    assert put(tier, 0, ChunkMeta(tenant="t", retain_until=now + 3600))
    for i in range(100, 140):
        put(tier, i)
    assert held(tier, [0]) == [0]
    # A restart: the index is rebuilt from the files, the pin from the journal.
    tier.close()
    again = disk(tmp_path, 8)
    assert again.meta_of(key(0)) == ChunkMeta("t", now + 3600, None)
    for i in range(200, 240):
        put(again, i)
    assert held(again, [0]) == [0]
    assert again.retention_stats().pinned_chunks == 1
    # The journal (rewritten at the restart) is the tier's alone, like its chunk files.
    assert (again.files.directory / JOURNAL_NAME).stat().st_mode & 0o077 == 0


def test_an_expiry_survives_a_restart_and_removes_the_chunk(tmp_path: Path) -> None:
    import time

    clock = Clock(time.time() - 1000)  # stored "1000 s ago", expiring 60 s after that
    tier = disk(tmp_path, 8, clock)
    put(tier, 0, ChunkMeta(expires_at=clock.now + 60))
    put(tier, 1)
    put(tier, 2, ChunkMeta(expires_at=clock.now + 7200))
    assert held(tier, [0, 1, 2]) == [0, 1, 2]
    path = tier.files.path_of(key(0))
    assert path.exists()
    # Restarted (real clock) after chunk 0's expiry: removed at start-up, file and all.
    tier.close()
    again = disk(tmp_path, 8)
    assert held(again, [0, 1, 2]) == [1, 2]
    assert not path.exists()
    assert again.retention_stats().expired == 1
    # Chunk 2 still expires on time after the restart.
    again._book.clock = Clock(clock.now + 7201)
    assert held(again, [0, 1, 2]) == [1]


def test_a_tenant_at_its_quota_evicts_its_own_chunks_on_disk(tmp_path: Path) -> None:
    tier = disk(tmp_path, 8, tenant_quota={"share": 0.5})
    for i in range(4):
        put(tier, i, ChunkMeta(tenant="B"))
    for i in range(100, 140):
        put(tier, i, ChunkMeta(tenant="A"))
    assert held(tier, range(4)) == [0, 1, 2, 3]
    usage = {u.tenant: u for u in tier.retention_stats().tenants}
    assert usage[tenant_label("A")].evictions == 36
    assert usage[tenant_label("B")].chunks == 4


def test_a_damaged_journal_costs_its_bad_lines_only(tmp_path: Path) -> None:
    import time

    now = time.time()
    tier = disk(tmp_path, 8)
    put(tier, 0, ChunkMeta(retain_until=now + 600))
    put(tier, 1, ChunkMeta(retain_until=now + 600))
    journal = tier.files.directory / JOURNAL_NAME
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join([lines[0], "{not json", '{"key": "zz"}', "[1, 2]",
                                  '{"key": "' + "00" * 16 + '", "retain_until": "soon"}',
                                  lines[1][: len(lines[1]) // 2]]) + "\n")
    tier.close()
    again = disk(tmp_path, 8)
    assert again.meta_of(key(0)) is not None and again.meta_of(key(0)).retain_until  # type: ignore[union-attr]
    assert again.meta_of(key(1)) is None  # its line was cut: stored, unpinned
    assert again._journal.skipped_lines == 5
    assert held(again, [0, 1]) == [0, 1]


def test_a_short_append_costs_its_own_line_only(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A full filesystem cut an append short (write(2) took part of the line): the next
    line was appended to the torn one, and that chunk lost its pin at the restart too. A
    short append is now taken back (the file cut to where the line began)."""
    import time

    from kvtier.tiers.files import retention_journal

    now = time.time()
    tier = disk(tmp_path, 8)
    assert put(tier, 0, ChunkMeta(retain_until=now + 600))
    real_write = os.write

    def short_write(fd: int, data: bytes) -> int:  # ENOSPC after part of the line
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(retention_journal.os, "write", short_write)
    assert put(tier, 1, ChunkMeta(retain_until=now + 600))
    monkeypatch.undo()
    assert put(tier, 2, ChunkMeta(retain_until=now + 600))
    tier.close()
    again = disk(tmp_path, 8)
    assert again.meta_of(key(0)) == ChunkMeta(None, now + 600, None)
    assert again.meta_of(key(1)) is None  # its line was not written: stored, unpinned
    assert again.meta_of(key(2)) == ChunkMeta(None, now + 600, None), \
        "the line appended after a short one was lost with it"
    assert again._journal.skipped_lines == 0
    again.close()


def test_the_store_writes_pins_behind_to_disk(tmp_path: Path) -> None:
    import time

    now = time.time()
    top = make_tier("memory", tmp_path, LAYOUT, 2)
    lower = disk(tmp_path, 16)
    meta = ChunkMeta(tenant="t", retain_until=now + 100, expires_at=now + 200)
    with TieredStore([top, lower]) as store:
        store.put(key(0), memoryview(CHUNK), meta=meta)
        store.flush()
        assert lower.meta_of(key(0)) == meta
        assert set(store.stats().retention) == {"memory", "disk"}


def test_a_chunk_stored_again_without_metadata_gets_none_back_at_a_restart(
        tmp_path: Path) -> None:
    """The journal's lines of a chunk evicted or deleted since are void once its key is
    stored again without a pin or expiry: a restart neither removes the new chunk for the
    old one's expiry nor pins it with the old one's pin."""
    import time

    clock = Clock(time.time() - 1000)  # stored "1000 s ago"
    tier = disk(tmp_path, 8, clock)
    assert put(tier, 0, ChunkMeta(expires_at=clock.now + 60))  # a request's ttl_s
    assert put(tier, 1, ChunkMeta(retain_until=clock.now + 7200))  # pinned for 2 h
    assert put(tier, 2, ChunkMeta(expires_at=clock.now + 60))  # kept as it is
    assert tier.delete(key(0)) and tier.delete(key(1))
    assert put(tier, 0) and put(tier, 1)  # stored again, by requests asking nothing
    assert tier.meta_of(key(0)) is None and tier.meta_of(key(1)) is None
    tier.close()
    again = disk(tmp_path, 8)  # restarted now: chunk 2's expiry has passed
    assert held(again, [0, 1, 2]) == [0, 1]
    assert again.meta_of(key(0)) is None and again.meta_of(key(1)) is None
    assert again.retention_stats().expired == 1
    assert again.check() == []
    # A pin asked again is journaled again, and kept over the next restart.
    until = time.time() + 3600
    assert put(again, 1, ChunkMeta(retain_until=until))
    again.close()
    assert disk(tmp_path, 8).meta_of(key(1)) == ChunkMeta(None, until, None)


def test_a_tenants_writes_in_flight_at_once_count_against_its_quota(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write-behind puts several chunks at once (`io_threads`): a tenant's write in
    flight counts against its quota, or each concurrent put passed the check with the others
    uncounted and the tenant ended over its quota."""
    tier = disk(tmp_path, 8, tenant_quota={"share": 0.25})  # 2 chunks a tenant
    assert put(tier, 0, ChunkMeta(tenant="A"))
    with write_in_flight(tier, monkeypatch, lambda: put(tier, 1, ChunkMeta(tenant="A"))):
        assert put(tier, 2, ChunkMeta(tenant="A"))  # A at its quota: evicts its own chunk 0
        assert put(tier, 3, ChunkMeta(tenant="B"))  # another tenant: not held back
    assert held(tier, range(4)) == [1, 2, 3]
    usage = {u.tenant: u.chunks for u in tier.retention_stats().tenants}
    assert usage == {tenant_label("A"): 2, tenant_label("B"): 1}
    assert tier.check() == []


def test_a_restart_brings_a_tenant_over_its_quota_down_to_it(tmp_path: Path) -> None:
    """A tenant holding more than its quota at a restart (the quota was lowered) evicts its
    own least recently used unpinned chunks down to it then, as its next put would have, in
    its files' order (a hit touches its file); its pinned chunks stay, another tenant's too."""
    clock = Clock(1_800_000_000.0)
    tier = disk(tmp_path, 8, clock, tenant_quota={"share": 0.5})  # 4 chunks a tenant
    assert put(tier, 0, ChunkMeta(tenant="A", retain_until=clock.now + 3600))
    for i in (1, 2, 3):
        assert put(tier, i, ChunkMeta(tenant="A"))
    assert put(tier, 9, ChunkMeta(tenant="B"))
    tier.close()
    # The files' ages: 1 is A's least recently used unpinned chunk, then 3; 2 was read last.
    for i, age_s in ((0, 50), (1, 40), (3, 30), (2, 10), (9, 45)):
        then = clock.now - age_s
        os.utime(tier.files.path_of(key(i)), (then, then))
    again = disk(tmp_path, 8, clock, tenant_quota={"share": 0.25})  # 2 chunks a tenant
    assert held(again, [0, 1, 2, 3, 9]) == [0, 2, 9]
    a, b = tenant_label("A"), tenant_label("B")
    usage = {u.tenant: u for u in again.retention_stats().tenants}
    assert (usage[a].chunks, usage[a].evictions, usage[b].chunks) == (2, 2, 1)
    assert again.retention_stats().quota_evictions == 2
    assert again.check() == []


def test_a_restart_dates_the_tiers_ttl_anew_even_after_a_compaction(tmp_path: Path) -> None:
    """docs/retention.md: a chunk's own expiry (its request's `ttl_s`) survives a restart,
    the tier's `ttl_s` starts anew, by the tier's `ttl_s` then. The journal keeps only the
    former: neither a tenant's line nor a compaction mid-run (which writes every chunk the
    book holds) may record the tier's expiry as the chunk's own."""
    t0 = 1_800_000_000.0
    clock = Clock(t0)
    tier = disk(tmp_path, 8, clock, ttl_s=100)
    assert put(tier, 0, ChunkMeta(tenant="A"))  # a line: its tenant
    assert put(tier, 1)  # no line
    assert put(tier, 2, ChunkMeta(expires_at=t0 + 500))  # its own expiry
    journal = tier.files.directory / JOURNAL_NAME
    for n in range(COMPACT_SLACK_LINES + 8):  # lines enough for a compaction
        assert tier.retain(key(2), ChunkMeta(retain_until=t0 + 1 + n))
    assert len(journal.read_text().splitlines()) < 10, "compacted"
    tier.close()

    clock.now = t0 + 50
    again = disk(tmp_path, 8, clock, ttl_s=1000)
    assert [again._book.expires_at(key(i)) for i in range(3)] == [
        t0 + 1050, t0 + 1050, t0 + 500]
    # What a promotion carries (`meta_of`) is the chunk's own expiry alone.
    assert [again.meta_of(key(i)).expires_at for i in range(3)] == [  # type: ignore[union-attr]
        None, None, t0 + 500]
    again.close()
    again = disk(tmp_path, 8, clock)  # no ttl_s now: only the request's expiry is left
    assert [again.meta_of(key(i)) for i in range(3)] == [
        ChunkMeta("A"), None, ChunkMeta(None, t0 + 8 + COMPACT_SLACK_LINES, t0 + 500)]


def test_a_shorter_request_expiry_leaves_a_chunk_without_its_own_one_unexpiring(
        tmp_path: Path) -> None:
    """docs/retention.md: a retain never shortens a chunk's life, and the tier's `ttl_s` is
    the tier's. A chunk stored without an expiry of its own keeps none when a later request
    asks an earlier expiry than the tier's `ttl_s` gave it: it expires at the tier's date,
    and after a restart without `ttl_s` not at all, as in a tier that never had one."""
    t0 = 1_800_000_000.0
    clock = Clock(t0)
    tier = disk(tmp_path, 8, clock, ttl_s=100)
    assert put(tier, 0)  # no expiry of its own: the tier's, t0 + 100
    assert put(tier, 1)
    assert tier.retain(key(0), ChunkMeta(expires_at=t0 + 50))  # earlier: no effect
    assert tier.retain(key(1), ChunkMeta(expires_at=t0 + 150))  # later: its own now
    assert [tier.meta_of(key(i)).expires_at for i in range(2)] == [  # type: ignore[union-attr]
        None, t0 + 150]
    clock.now = t0 + 60
    assert tier.contains(key(0)) and tier.contains(key(1))
    tier.close()
    again = disk(tmp_path, 8, clock)  # no ttl_s now
    clock.now = t0 + 1000
    assert again.contains(key(0)) and not again.contains(key(1))
    again.close()
