"""Content-addressed chunk keys: a chained hash over token ids within a namespace.

The key of chunk i covers the namespace and ALL tokens of chunks 0..i, so equal keys mean
equal prefixes. A chunk may also carry extra bytes (what else its KV depends on: e.g. the
images behind multimodal placeholder tokens, see integrations/vllm/scheduler/request_keys.py);
a chunk without extras hashes exactly as it did before extras existed. Hashing is blake3 over a
canonical byte encoding (little-endian int64 token ids), so keys are identical across
processes, machines and restarts: nothing depends on Python's `hash()` or PYTHONHASHSEED (a
known cause of 0% hit rates with shared caches).

A *tail* of a chunk is its first m full vLLM blocks (0 < m < blocks a chunk), stored when a
request's computed tokens end inside the chunk, so that a hit may end at any block boundary
(`tail_key`): its key chains from the same parent as the full chunk's but starts with its own
tag and block count, so a tail's key never equals a full chunk's nor another length's tail.

Primitives: `ChunkKey`, `Namespace`, `chunk_keys`, `tail_key`, `tail_keys`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import blake3
import numpy as np

ChunkKey = NewType("ChunkKey", bytes)  # KEY_BYTES bytes
KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides token ids that decides whether two chunks hold the same KV."""

    model_id: str  # the served model's name or path
    layout_digest: str  # KVLayout.digest(): shape, dtype, TP rank and size, chunk size
    weights_fingerprint: str | None = None  # e.g. a checkpoint's revision or hash, if known
    cache_salt: str | None = None  # per-tenant salt: different salts never share chunks
    extra: tuple[str, ...] = ()  # anything else that changes the KV (e.g. LoRA adapter names)

    def digest(self) -> bytes:
        """The namespace's 16-byte seed for the key chain."""
        fields = (
            self.model_id, self.layout_digest, self.weights_fingerprint or "",
            self.cache_salt or "", *self.extra,
        )
        # Length-prefix each field so ("ab", "c") and ("a", "bc") differ.
        encoded = b"".join(len(f.encode()).to_bytes(4, "little") + f.encode() for f in fields)
        return blake3.blake3(b"kvtier-ns-v1" + encoded).digest(length=KEY_BYTES)


def chunk_keys(
    token_ids: Sequence[int] | np.ndarray, namespace: Namespace, tokens_per_chunk: int,
    parent: ChunkKey | None = None, extras: Sequence[bytes | None] | None = None,
) -> list[ChunkKey]:
    """Return one key per FULL chunk of `token_ids` (a trailing partial chunk gets none).

    Args:
        token_ids: the prompt (and generated) token ids, from the first token.
        namespace: the namespace the keys live in.
        tokens_per_chunk: chunk size in tokens.
        parent: key of the chunk before `token_ids[0]`, to extend a chain incrementally.
        extras: per full chunk, extra bytes its KV depends on, or None (as if absent).
    """
    tokens = np.asarray(token_ids, dtype="<i8")
    previous = parent if parent is not None else ChunkKey(namespace.digest())
    keys: list[ChunkKey] = []
    for i, start in enumerate(range(0, len(tokens) - tokens_per_chunk + 1, tokens_per_chunk)):
        hasher = blake3.blake3(previous)
        hasher.update(tokens[start : start + tokens_per_chunk].tobytes())
        extra = extras[i] if extras is not None else None
        if extra:
            # After a fixed-length token block, so a tag and a length keep it unambiguous.
            hasher.update(b"kvtier-extra-v1" + len(extra).to_bytes(8, "little") + extra)
        previous = ChunkKey(hasher.digest(length=KEY_BYTES))
        keys.append(previous)
    return keys


def tail_key(token_ids: Sequence[int] | np.ndarray, namespace: Namespace,
             num_blocks: int, parent: ChunkKey | None = None,
             extra: bytes | None = None) -> ChunkKey:
    """The key of a chunk's tail: its first `num_blocks` blocks, `token_ids` (those blocks'
    tokens), after the chunk `parent` (None: the first chunk of the chain).

    Args:
        token_ids: the tail's tokens (num_blocks * block_size of them).
        namespace: the namespace the key lives in (the block size is in it).
        num_blocks: blocks the tail holds, 1 .. blocks a chunk - 1.
        parent: key of the chunk before the tail's chunk.
        extra: extra bytes its KV depends on (request_keys.py), or None.
    """
    hasher = _tail_hasher(namespace, parent)
    hasher.update(np.asarray(token_ids, dtype="<i8").tobytes())
    if extra:
        hasher.update(b"kvtier-extra-v1" + len(extra).to_bytes(8, "little") + extra)
    return _tail_digest(hasher, num_blocks)


def tail_keys(token_ids: Sequence[int] | np.ndarray, namespace: Namespace, block_size: int,
              parent: ChunkKey | None = None) -> list[ChunkKey]:
    """`tail_key` of the first 1, 2, ... blocks of `token_ids` (one per full block), hashed in
    one pass over the tokens; for tails without extra bytes."""
    tokens = np.asarray(token_ids, dtype="<i8")
    hasher = _tail_hasher(namespace, parent)
    keys: list[ChunkKey] = []
    for m in range(1, len(tokens) // block_size + 1):
        hasher.update(tokens[(m - 1) * block_size:m * block_size].tobytes())
        keys.append(_tail_digest(hasher.copy(), m))
    return keys


def _tail_hasher(namespace: Namespace, parent: ChunkKey | None) -> blake3.blake3:
    # The tag first: a full chunk's hash starts with its parent key, a tail's never does.
    previous = parent if parent is not None else ChunkKey(namespace.digest())
    return blake3.blake3(b"kvtier-tail-v1" + previous)


def _tail_digest(hasher: blake3.blake3, num_blocks: int) -> ChunkKey:
    # The block count last (the tokens' length says it too; kept as a second guard), so
    # that a request's tails of 1, 2, ... blocks hash in one pass (`tail_keys`).
    hasher.update(b"kvtier-tail-blocks" + num_blocks.to_bytes(4, "little"))
    return ChunkKey(hasher.digest(length=KEY_BYTES))
