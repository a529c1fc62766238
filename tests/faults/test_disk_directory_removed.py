"""A disk tier's layout directory removed under the running engine (an operator clearing the
cache with `rm -rf`), and the directory's ownership (tiers/files/owner.py).

The owner's lock was on the removed owner file: the tier's next put made the directory
again, without an owner file, and a second engine on the same path opened it unrefused,
two tiers each keeping an index and a capacity of one directory (what the owner lock is
for). The owner now takes its lock again on the new directory at its next put, and a tier
whose directory another engine took meanwhile writes nothing into it.

The directory is removed for real; the second engine is a second tier (an open in this
process is refused as one in another process is: test_disk_owner.py). The owner looks at its
file once a second (`owner.KEEP_CHECK_S`): at every put here, where the second engine opens
within microseconds, not after a start-up.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from tierkit import key, make_tier, tiny_layout

from kvtier.core.tier import Failure
from kvtier.errors import DirectoryInUse
from kvtier.tiers.files import owner as owner_module

LAYOUT = tiny_layout()
DATA = memoryview(bytes(LAYOUT.bytes_per_chunk))


@pytest.fixture(autouse=True)
def owner_checked_at_every_put(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(owner_module, "KEEP_CHECK_S", 0.0, raising=False)


def test_the_owner_takes_its_directory_again_when_it_was_removed(tmp_path: Path) -> None:
    owner: Any = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert owner.put(key(1), DATA)
    shutil.rmtree(owner.files.directory)
    assert owner.put(key(2), DATA)  # the directory made again, by its owner
    with pytest.raises(DirectoryInUse):
        make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert not owner.contains(key(1)) and owner.contains(key(2))
    assert owner.check() == []
    owner.close()
    make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8).close()  # given up at close


def test_a_tier_whose_removed_directory_another_engine_took_writes_nothing_there(
        tmp_path: Path) -> None:
    first: Any = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)
    assert first.put(key(1), DATA)
    shutil.rmtree(first.files.directory)
    second: Any = make_tier("disk", tmp_path, LAYOUT, capacity_chunks=8)  # the new owner
    result = first.put(key(2), DATA)
    assert not result and result.failure is Failure.IO_ERROR
    assert not second.contains(key(2)) and not first.files.path_of(key(2)).exists()
    assert second.put(key(3), DATA) and second.check() == []
    first.close()
    second.close()
