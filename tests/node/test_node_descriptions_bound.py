"""`Descriptions` (node/descriptions.py): a chunk's description is kept while a tier holds it,
within the node's room, and otherwise among the recent ones only."""

from __future__ import annotations

from tierkit import key

from kvtier.node.descriptions import Descriptions
from kvtier.tiers.eventfacts import ChunkInfo


def info(i: int) -> ChunkInfo:
    return ChunkInfo(None, i.to_bytes(4, "little"), None, None)


def crowd(descriptions: Descriptions, n: int) -> None:
    """Describe `n` other chunks (never stored)."""
    for i in range(1000, 1000 + n):
        descriptions.remember(key(i), info(i))


def test_a_held_chunk_keeps_its_description_until_its_last_tier_lets_it_go() -> None:
    d = Descriptions(max_recent=4)
    d.add_room(8)
    d.remember(key(0), info(0))
    d.landed(key(0), "memory")
    d.landed(key(0), "disk")
    crowd(d, 10)
    assert d.get(key(0)) == info(0)
    assert not d.left(key(0), "memory")  # still on disk
    crowd(d, 10)
    assert d.get(key(0)) == info(0)
    assert d.left(key(0), "disk")  # in no tier now: kept for its removal's event
    assert d.get(key(0)) == info(0)
    d.release(key(0))
    assert d.get(key(0)) == info(0)  # among the recent ones
    crowd(d, 4)
    assert d.get(key(0)) is None


def test_a_chunk_that_lands_again_before_its_release_stays_held() -> None:
    d = Descriptions(max_recent=2)
    d.add_room(8)
    d.remember(key(0), info(0))
    d.landed(key(0), "memory")
    assert d.left(key(0), "memory")
    d.landed(key(0), "memory")  # back in RAM in the same batch
    d.release(key(0))
    crowd(d, 4)
    assert d.get(key(0)) == info(0)


def test_held_descriptions_are_bounded_by_the_nodes_room() -> None:
    """A tier whose removals the node never sees (a Redis expiring keys) cannot grow them past
    the node's capacity in chunks: the least recently stored go to the recent ones."""
    d = Descriptions(max_recent=1)
    d.add_room(3)
    for i in range(5):
        d.remember(key(i), info(i))
        d.landed(key(i), "redis")
    assert [d.get(key(i)) is not None for i in range(5)] == [False, True, True, True, True]
    crowd(d, 1)
    assert [d.get(key(i)) is not None for i in range(5)] == [False, False, True, True, True]


def test_a_chunk_never_described_keeps_nothing() -> None:
    d = Descriptions(max_recent=2)
    d.add_room(8)
    d.landed(key(0), "memory")
    assert d.get(key(0)) is None
    assert not d.left(key(0), "memory")


def test_copies_of_the_same_tokens_are_counted_per_tier() -> None:
    """Two keys of the same tokens (a reset engine's new epoch), after parents of the same
    tokens: while one is held in a tier, the other leaving it is no news to a router; in
    another tier, or once the other's description is pushed out of the held ones, it is."""
    d = Descriptions(max_recent=8)
    d.add_room(4)
    for k, parent in ((1, None), (2, 1), (11, None), (12, 11)):  # 11, 12: 1, 2 again
        d.remember(key(k), ChunkInfo(None if parent is None else key(parent),
                                     (k % 10).to_bytes(4, "little"), None, None))
        d.landed(key(k), "memory")
    d.landed(key(2), "disk")
    assert not d.left(key(2), "disk") and not d.copy_held(key(2), "disk")
    assert d.left(key(2), "memory") and d.copy_held(key(2), "memory")  # 12 has its tokens
    d.release(key(2))
    assert d.left(key(12), "memory") and not d.copy_held(key(12), "memory")  # the last one
    for k in (3, 4):  # past the room of 4: 1's description goes to the recent ones
        d.remember(key(k), info(k))
        d.landed(key(k), "memory")
    assert d.get(key(1)) == ChunkInfo(None, (1).to_bytes(4, "little"), None, None)
    assert d.left(key(11), "memory") and not d.copy_held(key(11), "memory")
