"""Hits at vLLM's block granularity (issue 44, item 6): the scheduler side of chunk tails.

A request stores its prompt's tail once its prompt is computed, and its sequence's tail when
it ends: the full blocks past its last full chunk, under a key of their own (keys.tail_key). A
lookup takes the full chunks held, then the longest tail of the next chunk held, so a hit
ends at a block boundary. Driven as vLLM's scheduler drives it (test_connector_scheduler's
Engine), with chunks of 128 tokens over vLLM blocks of 32 (tails of 1-3 blocks).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from test_connector_scheduler import Engine, request

from kvtier.core.keys import ChunkKey

CHUNK = 128  # 4 blocks of test_connector_scheduler.BLOCK (32)


def prefill(engine: Engine, rid: str, tokens: int, blocks: list[int],
            first: int = 1000) -> list[ChunkKey]:
    """A new request of `tokens` tokens, its prompt computed in one step; the keys of what
    the step stored (reported stored)."""
    req = request(rid, tokens, first=first)
    engine.admit(req, blocks)
    return engine.store_all(engine.step(new={rid: (blocks, 0, tokens)}))


def test_a_prompt_stores_its_tail_and_hits_it_again_up_to_its_last_full_block() -> None:
    engine = Engine(tokens_per_chunk=CHUNK)
    a = request("a", 360)
    engine.admit(a, list(range(12)))
    meta = engine.step(new={"a": (list(range(12)), 0, 360)})
    # Chunks 0 and 1, then its prompt's tail (planned as its prompt completes): the 3 full
    # blocks past them (tokens 256-352).
    assert [t.block_ids for t in meta.stores] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10)]
    tail = meta.stores[2]
    assert tail.parent == meta.stores[1].key  # after chunk 1
    engine.store_all(meta)
    engine.sched.request_finished(a)
    # The same prompt again: chunks 0-1 and the tail, 352 of its 359 loadable tokens.
    b = request("b", 360)
    blocks = list(range(20, 32))
    assert engine.admit(b, blocks) == 352
    meta = engine.step(new={"b": (blocks, 352, 8)})
    assert [(t.key, t.block_ids) for t in meta.loads["b"]][-1] == (tail.key, (28, 29, 30))
    assert len(meta.loads["b"]) == 3
    assert meta.stores == []  # it holds nothing new: no full chunk, its tail is held


def test_only_a_tail_of_the_same_blocks_hits_a_shorter_one_is_another_key() -> None:
    engine = Engine(tokens_per_chunk=CHUNK)
    prefill(engine, "a", 360, list(range(12)))  # tail of 3 blocks stored
    # Its first 300 tokens: chunks 0-1 hit, and no tail of 1 block is held (a tail covers
    # its exact blocks: a prefix of one is another key).
    assert engine.admit(request("b", 300), list(range(20, 30))) == 256


@pytest.mark.parametrize(("tokens", "tails"), [(352, [(8, 9, 10), (8, 9)]),
                                                 (256, [(4, 5, 6)])])
def test_a_prompt_that_ends_at_a_blocks_end_hits_as_far_again(
        tokens: int, tails: list[tuple[int, ...]]) -> None:
    """The same prompt again recomputes its last token, so a prompt of whole blocks hits a
    block short of its end: in a tail one block shorter than its own, or, at a chunk's end,
    in its last chunk's tail of all blocks but one, as vLLM's own prefix cache hits (found by
    trying: 128 and 256 tokens over chunks of 64 hit 64 and 192 tokens, vLLM's own 96 and
    224)."""
    engine = Engine(tokens_per_chunk=CHUNK)
    a = request("a", tokens)
    blocks = list(range(tokens // 32))
    engine.admit(a, blocks)
    meta = engine.step(new={"a": (blocks, 0, tokens)})
    assert [t.block_ids for t in meta.stores[tokens // CHUNK:]] == tails
    engine.store_all(meta)
    engine.sched.request_finished(a)
    vllms_own = (tokens - 1) // 32 * 32
    assert engine.admit(request("b", tokens), list(range(40, 40 + tokens // 32))) == vllms_own


def test_a_hit_loads_a_tail_after_vllms_own_blocks() -> None:
    engine = Engine(tokens_per_chunk=CHUNK)
    prefill(engine, "a", 360, list(range(12)))
    # vLLM holds 9 blocks itself (288 tokens): the tail loads its last 2 blocks only.
    b = request("b", 360)
    blocks = [0, 1, 2, 3, 4, 5, 6, 7, 8, 40, 41, 42]
    assert engine.admit(b, blocks, local_tokens=288) == 64
    meta = engine.step(new={"b": (blocks, 352, 8)})
    [tail] = meta.loads["b"]
    assert (tail.block_ids, tail.first_block) == ((8, 40, 41), 1)


def test_the_next_turn_hits_the_tail_its_previous_turn_stored_when_it_ended() -> None:
    engine = Engine(tokens_per_chunk=CHUNK)
    a = request("a", 200)
    engine.admit(a, list(range(8)))
    meta = engine.step(new={"a": (list(range(8)), 0, 200)})
    assert [t.block_ids for t in meta.stores] == [(0, 1, 2, 3), (4, 5)]  # chunk, prompt tail
    engine.store_all(meta)
    # It answers 50 tokens (ids 1200-1249 continue its prompt) and ends: 249 of its 250
    # tokens computed, its sequence's tail is the 3 full blocks past chunk 0 (to 224).
    for token in range(1200, 1250):
        a.append_output_token_ids(token)
    a.num_computed_tokens = 249
    assert engine.sched.request_finished(a) is True  # held for that last store
    meta = engine.step()
    [end_tail] = meta.stores
    assert end_tail.block_ids == (4, 5, 6)
    engine.store_all(meta)
    # The next turn: the whole conversation and more. It hits chunk 0 and that tail.
    b = request("b", 300)
    assert engine.admit(b, list(range(20, 30))) == 224


def test_tail_chunks_off_stores_and_hits_full_chunks_only() -> None:
    engine = Engine(tokens_per_chunk=CHUNK, tail_chunks=False)
    stored = prefill(engine, "a", 360, list(range(12)))
    assert len(stored) == 2
    assert engine.admit(request("b", 360), list(range(20, 32))) == 256
