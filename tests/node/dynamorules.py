"""NVIDIA Dynamo's KV router, its rules for vLLM's KV events ported to Python for the tests:
what its indexer makes of kvtier's events, decoded from the raw msgpack payload.
(Not named conftest.py: imported by name, as eventsub.py.)

Read in ai-dynamo/dynamo `lib/kv-router/src/zmq_wire/` at 4fb5a208fe6ecd1a8752e933f1e9eabd0931f223
(`deserialize.rs`, `convert.rs`) and `extra_keys.rs` at 035d7262edb1b407b2c9de5116b47321b08c751a
(the cache salt, dynamo#11571's follow-up):

  - a worker's events arrive on its own subscription (the topic names nothing); an event is a
    tagged map or array (`deserialize.rs`);
  - a stored event's blocks are published only if its `block_size` is the router's
    `kv_block_size`; the first block of another size ends the event (`convert.rs`
    `create_stored_blocks`: "Block not published. Block size must be ...");
  - the event's cache namespace is the first `dynamo-cache-salt:`-tagged string of its FIRST
    block's `extra_keys` (Dynamo's vLLM handler tags the request's salt so before vLLM sees it;
    `extra_keys.rs` `extra_keys_to_cache_namespace`); it and the LoRA name seed the hash of
    every block of the event (`protocols.rs` `block_hash_seed`); a block's local hash is XXH3
    of its tokens' little-endian bytes with that seed (`compute_salt_hash` is approximated
    here by XXH3 of namespace and LoRA: the tests rely only on the seed depending on them);
  - the radix tree places a stored event under its parent's block (by the worker's external
    hash); an event whose parent the worker never stored is dropped; a removal drops the
    worker's blocks by external hash;
  - a query hashes the prompt's full blocks with its own namespace and walks the tree from the
    root: a worker scores the number of consecutive blocks it holds.

Primitives: `DynamoIndexer` (`receive` a worker's payload, `score` a prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash

XXH3_SEED = 1337
SALT_TAG = "dynamo-cache-salt:"
_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
           "lora_name", "extra_keys")


class DynamoIndexer:
    """Dynamo's radix tree of one router, for workers of `kv_block_size`-token blocks."""

    def __init__(self, kv_block_size: int) -> None:
        self.kv_block_size = kv_block_size
        self.children: dict[tuple[int, int], int] = {}  # (node, local hash) -> node
        self.holders: dict[int, set[str]] = {}  # node -> workers holding it
        self.lookup: dict[tuple[str, bytes], int] = {}  # (worker, external hash) -> node
        self.wrong_size = 0  # blocks not published: another block size
        self.orphans = 0  # events dropped: parent unknown

    @staticmethod
    def _seed(namespace: str | None, lora: str | None) -> int:
        if not namespace and not lora:
            return XXH3_SEED
        return xxhash.xxh3_64_intdigest(f"{namespace or ''}\0{lora or ''}".encode())

    def local_hashes(self, tokens: Sequence[int], namespace: str | None = None,
                     lora: str | None = None) -> list[int]:
        bs, seed = self.kv_block_size, self._seed(namespace, lora)
        return [xxhash.xxh3_64_intdigest(np.asarray(tokens[i:i + bs], dtype="<u4").tobytes(),
                                         seed=seed)
                for i in range(0, len(tokens) - bs + 1, bs)]

    def receive(self, worker: str, payload: bytes) -> None:
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        for raw in events:
            if isinstance(raw, dict):
                raw = [raw["type"], *(raw.get(f) for f in _FIELDS)]
            if raw[0] == "BlockStored":
                self._stored(worker, raw)
            elif raw[0] == "BlockRemoved":
                for block in raw[1]:
                    node = self.lookup.pop((worker, bytes(block)), None)
                    if node is not None:
                        self.holders[node].discard(worker)

    def _stored(self, worker: str, fields: list[Any]) -> None:
        hashes, parent, tokens, size = fields[1], fields[2], fields[3], fields[4]
        lora = fields[7] if len(fields) > 7 else None
        extra = fields[8] if len(fields) > 8 else None
        node = 0  # the root
        if parent is not None:
            found = self.lookup.get((worker, bytes(parent)))
            if found is None:
                self.orphans += 1
                return
            node = found
        namespace = self._namespace(extra, lora)
        for j, block in enumerate(hashes):
            if size != self.kv_block_size:
                self.wrong_size += len(hashes) - j
                return
            local = self.local_hashes(tokens[j * size:(j + 1) * size], namespace, lora)[0]
            node = self.children.setdefault((node, local), len(self.children) + 1)
            self.holders.setdefault(node, set()).add(worker)
            self.lookup[(worker, bytes(block))] = node

    @staticmethod
    def _namespace(extra: list[Any] | None, lora: str | None) -> str | None:
        if not extra or not extra[0]:
            return None
        unmatched = lora or None
        for value in extra[0]:
            if not isinstance(value, str):
                continue
            if unmatched is not None and value == unmatched:
                unmatched = None
                continue
            if value.startswith(SALT_TAG) and len(value) > len(SALT_TAG):
                return value[len(SALT_TAG):]
        return None

    def score(self, tokens: Sequence[int], namespace: str | None = None,
              lora: str | None = None) -> dict[str, int]:
        """Each worker's consecutive matched blocks from the prompt's start."""
        scores: dict[str, int] = {}
        alive: set[str] | None = None
        node = 0
        for local in self.local_hashes(tokens, namespace, lora):
            node = self.children.get((node, local), -1)
            held = self.holders.get(node, set())
            alive = set(held) if alive is None else alive & held
            if not alive:
                break
            for worker in alive:
                scores[worker] = scores.get(worker, 0) + 1
        return scores
