"""A node recovers only a slab file its own user made. /dev/shm is writable by every user of
the host (mode 1777), and a slab's name is predictable (kvtier-<node name>-<layout digest>,
listed there by any `ls`): a user outside the node's group planted a file at the name of a
predecessor's slab (`<name>.old`, or `<name>`, which a node running as root renamed aside),
with valid records of chunks of their choosing, and the node recovered them: its engines were
lent that user's bytes as the KV of the keys they named. Files of another user are now left
unread (counted as no chunk recovered); the tier starts and serves its own chunks.
The planted file is made by a real slab and handed to another user (root only: chown).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from tierkit import key, tiny_layout

from kvtier.tiers.memory import MemoryTier, MemoryTierConfig
from kvtier.tiers.shmslab import SHM_DIR

LAYOUT = tiny_layout()
STRANGER = 65534  # nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another user "
                                                          "takes root")


@pytest.fixture
def name() -> Iterator[str]:
    name = f"kvtier-test-foreign-{os.getpid()}"
    yield name
    for path in SHM_DIR.glob(f"{name}*"):
        path.unlink(missing_ok=True)


def tier(name: str) -> MemoryTier:
    return MemoryTier(MemoryTierConfig(kind="memory", capacity=8 * 4096 * 2,
                                       shared_memory=name), LAYOUT)


def plant(name: str, at: str) -> None:
    """A slab holding a forged chunk for key(7), left at `name` + `at`, another user's."""
    forger = tier(name)
    assert forger.put(key(7), memoryview(b"\x66" * LAYOUT.bytes_per_chunk)).ok
    forger.keep_shared_memory = True
    forger.close()
    planted = SHM_DIR / f"{name}{at}"
    if at:
        os.rename(SHM_DIR / name, planted)
    os.chown(planted, STRANGER, STRANGER)
    os.chmod(planted, 0o644)


@pytest.mark.parametrize("at", [".old", ""])
def test_a_slab_another_user_planted_is_not_recovered(name: str, at: str) -> None:
    plant(name, at)
    node = tier(name)
    assert node.recover() == (0, 0)
    assert not node.contains(key(7)), "another user's bytes served as a chunk"
    assert node.put(key(1), memoryview(b"\x01" * LAYOUT.bytes_per_chunk)).ok
    assert node.contains(key(1))
    node.close()
