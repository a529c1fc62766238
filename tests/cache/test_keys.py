"""Chunk keys: a chained, namespaced content hash that every process computes the same way.

Each test is a short scenario: the same prompt in two processes, an edited prompt, two
tenants, two LoRA adapters... and what must (or must not) happen to the keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.core.keys import KEY_BYTES, Namespace, chunk_keys

NS = Namespace(model_id="meta-llama/Llama-3.1-8B", layout_digest="0" * 32)
PROMPT = list(range(1000, 1064))  # 64 tokens: 4 chunks of 16

_KEYS_IN_A_FRESH_PROCESS = """
import json, sys
from kvtier.core.keys import Namespace, chunk_keys
ns = Namespace(model_id="m", layout_digest="ab" * 16, weights_fingerprint="rev1",
               cache_salt="tenant-a", extra=("lora:x",))
keys = chunk_keys(list(range(100)), ns, 16)
# A set of strings iterates in PYTHONHASHSEED order: print it to prove the seeds differ.
print(json.dumps({"keys": [k.hex() for k in keys], "set_order": list({"a", "b", "c", "d"})}))
"""


def _keys_in_subprocess(hash_seed: str) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, "-c", _KEYS_IN_A_FRESH_PROCESS], env=env,
                          capture_output=True, text=True, check=True, timeout=60)
    return json.loads(done.stdout)


def test_two_fresh_processes_with_different_hash_seeds_compute_the_same_keys() -> None:
    """Two engine replicas start with different PYTHONHASHSEEDs (as Python does by default).
    If keys depended on hash(), they would never share a chunk: keys must be equal."""
    results = [_keys_in_subprocess(seed) for seed in ("1", "2", "3")]
    orders = {tuple(r["set_order"]) for r in results}
    assert len(orders) > 1, "the processes did not really run with different hash seeds"
    assert results[0]["keys"] == results[1]["keys"] == results[2]["keys"]
    assert len(results[0]["keys"]) == 6
    # And they equal what this process computes.
    ns = Namespace(model_id="m", layout_digest="ab" * 16, weights_fingerprint="rev1",
                   cache_salt="tenant-a", extra=("lora:x",))
    assert results[0]["keys"] == [k.hex() for k in chunk_keys(list(range(100)), ns, 16)]


def test_a_prompt_gives_one_key_per_full_chunk_and_none_for_the_partial_tail() -> None:
    """A 70-token prompt with 16-token chunks: 4 full chunks are keyed, the 6 tail tokens are
    not (their KV is incomplete, so it must never be stored under a key)."""
    keys = chunk_keys(list(range(70)), NS, 16)
    assert len(keys) == 4
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 4
    assert chunk_keys(list(range(15)), NS, 16) == []
    assert chunk_keys([], NS, 16) == []
    # The tail does not influence the full chunks' keys.
    assert chunk_keys(list(range(64)), NS, 16) == keys


def test_editing_one_token_changes_its_chunk_and_every_later_one_but_no_earlier_one() -> None:
    """A user edits token 40 (chunk 2 of 4). Chunks 0 and 1 are still the same prefix and
    keep their keys; chunk 2 and everything after it cover different text and must change."""
    original = chunk_keys(PROMPT, NS, 16)
    edited_prompt = list(PROMPT)
    edited_prompt[40] += 1
    edited = chunk_keys(edited_prompt, NS, 16)
    assert edited[:2] == original[:2]
    assert all(e != o for e, o in zip(edited[2:], original[2:]))


def test_a_chunk_key_covers_the_whole_prefix_not_only_its_own_tokens() -> None:
    """Two prompts whose second chunks are identical but whose first chunks differ hold
    different KV in that second chunk (attention saw different text): different keys."""
    tail = list(range(500, 516))
    first = chunk_keys(list(range(16)) + tail, NS, 16)
    second = chunk_keys(list(range(1, 17)) + tail, NS, 16)
    assert first[1] != second[1]


@pytest.mark.parametrize("change", [
    {"model_id": "meta-llama/Llama-3.1-70B"},
    {"layout_digest": "1" * 32},
    {"weights_fingerprint": "sha256:abc"},
    {"cache_salt": "tenant-b"},
    {"extra": ("lora:customer-42",)},
])
def test_every_namespace_field_changes_every_key(change: dict[str, object]) -> None:
    """The same tokens under another model, layout, checkpoint, tenant or LoRA adapter are
    different KV: not one key may be shared."""
    other = Namespace(**{**{f: getattr(NS, f) for f in NS.__slots__}, **change})
    assert not set(chunk_keys(PROMPT, NS, 16)) & set(chunk_keys(PROMPT, other, 16))


def test_tenants_with_different_salts_never_share_a_chunk_and_one_tenant_always_does() -> None:
    """Tenant isolation: each tenant's salt puts its chunks in a separate key space, while
    the same tenant sending the same prompt twice hits its own chunks."""
    alice = Namespace(model_id="m", layout_digest="0" * 32, cache_salt="alice")
    bob = Namespace(model_id="m", layout_digest="0" * 32, cache_salt="bob")
    assert not set(chunk_keys(PROMPT, alice, 16)) & set(chunk_keys(PROMPT, bob, 16))
    assert chunk_keys(PROMPT, alice, 16) == chunk_keys(list(PROMPT), alice, 16)


def test_field_boundaries_are_unambiguous() -> None:
    """Length-prefixed fields: moving a character from one field to the next is a
    different namespace ("ab"+"c" is not "a"+"bc")."""
    one = Namespace(model_id="ab", layout_digest="c")
    two = Namespace(model_id="a", layout_digest="bc")
    assert one.digest() != two.digest()
    assert (Namespace("m", "d", extra=("x", "y")).digest()
            != Namespace("m", "d", extra=("xy",)).digest())


def test_extending_a_chain_from_a_parent_equals_computing_it_in_one_shot() -> None:
    """A decode step appends tokens: keys computed incrementally from the last full chunk's
    key equal the keys of the whole sequence computed at once."""
    whole = chunk_keys(PROMPT, NS, 16)
    head = chunk_keys(PROMPT[:32], NS, 16)
    tail = chunk_keys(PROMPT[32:], NS, 16, parent=head[-1])
    assert head + tail == whole


def test_token_container_and_integer_width_do_not_matter() -> None:
    """The engine may hand tokens as a list, an int32 array or an int64 array: same keys."""
    expected = chunk_keys(PROMPT, NS, 16)
    assert chunk_keys(np.array(PROMPT, dtype=np.int32), NS, 16) == expected
    assert chunk_keys(np.array(PROMPT, dtype=np.int64), NS, 16) == expected
    assert chunk_keys(tuple(PROMPT), NS, 16) == expected


def test_extra_bytes_change_their_chunk_and_every_later_one_and_none_changes_nothing() -> None:
    plain = chunk_keys(PROMPT, NS, 16)
    assert chunk_keys(PROMPT, NS, 16, extras=[None, None, None, None]) == plain
    cat = chunk_keys(PROMPT, NS, 16, extras=[None, b"image:cat", None, None])
    dog = chunk_keys(PROMPT, NS, 16, extras=[None, b"image:dog", None, None])
    assert cat[0] == dog[0] == plain[0]  # before the image: shared
    assert all(c != d for c, d in zip(cat[1:], dog[1:]))
    assert all(c != p for c, p in zip(cat[1:], plain[1:]))


def test_a_tail_key_names_its_blocks_after_its_parent_and_never_a_chunk() -> None:
    from kvtier.core.keys import tail_key

    chunks = chunk_keys(PROMPT, NS, 16)  # blocks of 4 tokens: a tail holds 1-3 of them
    tails = [tail_key(PROMPT[16:16 + 4 * m], NS, m, parent=chunks[0]) for m in (1, 2, 3)]
    assert len(set(tails)) == 3 and not set(tails) & set(chunks)
    # Its own tokens and its parent both count; the same inputs give the same key.
    assert tails[1] == tail_key(np.array(PROMPT[16:24], dtype=np.int32), NS, 2, chunks[0])
    assert tails[1] != tail_key([*PROMPT[16:23], 7], NS, 2, chunks[0])
    assert tails[1] != tail_key(PROMPT[16:24], NS, 2, chunks[1])
    # A tail of the first chunk chains from the namespace, as the chunk does.
    assert tail_key(PROMPT[:8], NS, 2) != tail_key(PROMPT[:8], NS.__class__(
        model_id=NS.model_id, layout_digest=NS.layout_digest, cache_salt="other"), 2)
    assert tail_key(PROMPT[:8], NS, 2, extra=b"image:cat") != tail_key(PROMPT[:8], NS, 2)
    # A full chunk's tokens under a tail's tag are still no chunk key.
    assert tail_key(PROMPT[16:32], NS, 4, chunks[0]) != chunks[1]


def test_a_requests_tails_hashed_in_one_pass_equal_each_tail_hashed_alone() -> None:
    from kvtier.core.keys import tail_key, tail_keys

    parent = chunk_keys(PROMPT, NS, 16)[0]
    assert tail_keys(PROMPT[16:30], NS, 4, parent) == [
        tail_key(PROMPT[16:16 + 4 * m], NS, m, parent) for m in (1, 2, 3)]
