"""llm-d's precise prefix-cache scorer, its rules ported to Python for the tests: what a router
of llm-d makes of kvtier's KV events, decoded from the raw ZMQ frames as llm-d decodes them.
(Not named conftest.py: imported by name, as eventsub.py.)

Each rule cites the llm-d file it comes from, read at llm-d/llm-d-router
ebab687927f5331c1b39defcb579a07951bce56c (main, 2026-08-22) unless noted:

  - topics: the subscription filter `kv@` (`pkg/kvevents/pool.go` DefaultConfig) and
    `parseTopic`: exactly three `@`-separated parts give pod and model, anything else is a pod
    named after the whole topic with no model (`pkg/kvevents/engineadapter/common.go`);
  - events: a batch `[ts, events, dp_rank]`, each event a tagged array or (vllm#42892) a map
    under "type", normalized to positions (`engineadapter/vllm_adapter.go`); a hash is its
    last 8 bytes, big-endian (`getHashAsUint64`);
  - indexing (`pkg/kvevents/pool.go` processEventBatch): the lower-cased medium is the device
    tier ("gpu" without one); a stored event whose non-zero parent is no engine key the index
    knows is skipped; its request keys are recomputed from its token ids at the indexer's
    block size, chained from the parent's last request key (`GetRequestKey`) or from the
    model's seed; `extra_keys` strings taint a block as multimodal hashes
    (`pkg/kvcache/kvblock/extra_keys.go` ParseRawExtraKeys), realigned from engine blocks to
    canonical blocks (`realignExtraFeatures`); an engine key maps to its request keys
    (`in_memory.go` engineToRequestMapping: 1:1, many:1 or 1:many); a removal drops the pod's
    entry from each of the engine key's request keys;
  - keys (`pkg/kvcache/kvblock/token_processor.go`, the default "cbor-fnv"): FNV-64a of the
    canonical CBOR of `[parent, tokens, extra]`, full blocks only, the seed
    `hash(fnv64a(hashSeed), nil, model)`; the request side folds the cache salt into block 0
    (`preciseprefixcache/blockkeys.go` foldCacheSalt);
  - pseudo-pods (llm-d-router PR #2586, open: `pkg/kvcache/kvblock/pseudo_pod.go` at
    36da54d72db3fcd728d0a4b5c9a77a5bc7fc78ba): an entry of pod `node:<n>` stands for every
    endpoint on node n, `pool:<name>` for every endpoint (`ResolvePseudoPods`);
  - scoring (`pkg/kvcache/prefix_match.go` at ca49ef2798068bad6cc903addf8e9e7e938af117): the
    pods holding the first key are the candidates, each chain ends at the first key its pod
    does not hold, a block counts the highest weight among the pod's tiers for it, and a tier
    with no configured weight counts 1.0 (`defaultTierWeight`); the weights default to gpu 1.0,
    cpu 0.8 (`pkg/kvcache/backend.go`).

Primitives: `parse_topic`, `Indexer` (`receive` frames, `score` a prompt).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

TOPIC_FILTER = "kv@"
DEFAULT_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys")
REMOVED_FIELDS = ("block_hashes", "medium")
_MASK = (1 << 64) - 1


def parse_topic(topic: str) -> tuple[str, str]:
    """(pod, model) as llm-d reads them from a topic."""
    parts = topic.split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (topic, "")


def hash_as_uint64(raw: Any) -> int:
    """A block hash as llm-d keys it: an int as it is, bytes by their last 8 (big-endian)."""
    if isinstance(raw, int):
        return raw & _MASK
    data = bytes(raw)
    return int.from_bytes(data[-8:].rjust(8, b"\0"), "big")


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | code]) + struct.pack(fmt, n)
    raise ValueError(n)


def _cbor(value: Any) -> bytes:
    """Canonical CBOR of the values llm-d hashes (uint64, token lists, strings, MM hashes)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value)
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(value, dict):  # a Go struct: its fields by name, one here ("Hash")
        items = sorted(value.items(), key=lambda kv: (len(kv[0]), kv[0]))
        return _cbor_head(5, len(value)) + b"".join(_cbor(k) + _cbor(v) for k, v in items)
    return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)


def _fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & _MASK
    return h


class Indexer:
    """llm-d's KV-events pool, block index and longest-prefix scorer, in memory."""

    def __init__(self, block_size: int = 16, weights: Mapping[str, float] | None = None,
                 hash_seed: str = "") -> None:
        self.block_size = block_size
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self._init_hash = _fnv64a(hash_seed.encode())
        self.engine_to_request: dict[int, list[int]] = {}
        self.entries: dict[int, dict[tuple[str, str], None]] = {}  # request key -> (pod, tier)
        self.skipped_orphans = 0  # stored events whose parent was never indexed
        self.dropped_topics: list[str] = []  # messages the subscription filter kept out

    def _hash(self, parent: int, tokens: Sequence[int] | None, extra: Any) -> int:
        return _fnv64a(_cbor([parent, None if tokens is None else list(tokens), extra]))

    def request_keys(self, parent: int | None, tokens: Sequence[int], model: str,
                     extra: Sequence[list[str] | None] | None = None) -> list[int]:
        """`TokensToKVBlockKeys`: full blocks only, chained from `parent` or the model's seed."""
        bs = self.block_size
        chunks = [list(tokens[i:i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]
        prefix = self._hash(self._init_hash, None, model) if parent is None else parent
        keys = []
        for i, chunk in enumerate(chunks):
            mm = extra[i] if extra is not None else None
            prefix = self._hash(prefix, chunk, None if mm is None else [{"Hash": h} for h in mm])
            keys.append(prefix)
        return keys

    def receive(self, topic: str, payload: bytes) -> None:
        """A ZMQ message `[topic, seq, payload]` the router's socket received."""
        if not topic.startswith(TOPIC_FILTER):
            self.dropped_topics.append(topic)
            return
        pod, model = parse_topic(topic)
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        for raw in events:
            fields = self._positional(raw)
            if fields[0] == "BlockStored":
                self._stored(pod, model, fields)
            elif fields[0] == "BlockRemoved":
                self._removed(pod, fields)
            elif fields[0] == "AllBlocksCleared":
                for pods in self.entries.values():
                    for entry in [e for e in pods if e[0] == pod]:
                        del pods[entry]

    @staticmethod
    def _positional(raw: Any) -> list[Any]:
        if isinstance(raw, list):
            return raw
        order = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(raw["type"], ())
        return [raw["type"], *(raw.get(name) for name in order)]

    @staticmethod
    def _at(fields: list[Any], i: int) -> Any:
        return fields[i] if i < len(fields) else None

    def _stored(self, pod: str, model: str, fields: list[Any]) -> None:
        hashes = [hash_as_uint64(h) for h in fields[1]]
        parent_raw, tokens = fields[2], list(fields[3])
        tier = (self._at(fields, 6) or "GPU").lower()
        lora = self._at(fields, 7)
        model = lora or model
        parent_key: int | None = None
        if parent_raw is not None and hash_as_uint64(parent_raw) != 0:
            known = self.engine_to_request.get(hash_as_uint64(parent_raw))
            if not known:
                self.skipped_orphans += 1
                return
            parent_key = known[-1]
        extra = self._extra(self._at(fields, 8), len(tokens) // self.block_size)
        keys = self.request_keys(parent_key, tokens, model, extra)
        if not keys:
            return
        for engine, request in self._mapping(hashes, keys).items():
            self.engine_to_request[engine] = request
        for key in keys:
            self.entries.setdefault(key, {})[(pod, tier)] = None

    @staticmethod
    def _extra(raw: list[Any] | None, canonical: int) -> list[list[str] | None] | None:
        """ParseRawExtraKeys, then realignExtraFeatures to `canonical` blocks."""
        if raw is None or canonical == 0:
            return None
        parsed: list[list[str] | None] = []
        for block in raw:
            hashes = [] if block is None else [
                k if isinstance(k, str) else k[0] for k in block
                if isinstance(k, str) or (isinstance(k, list) and k and isinstance(k[0], str))]
            parsed.append(hashes or None)
        engine = len(parsed)
        if engine == canonical:
            return parsed
        if engine < canonical:
            return [parsed[i * engine // canonical] for i in range(canonical)]
        merged: list[list[str] | None] = [None] * canonical
        for i, block in enumerate(parsed):
            if block is not None:
                merged[i * canonical // engine] = (merged[i * canonical // engine] or []) + block
        return merged

    @staticmethod
    def _mapping(engine: list[int], request: list[int]) -> dict[int, list[int]]:
        if len(engine) == len(request):
            return {e: [r] for e, r in zip(engine, request)}
        if len(engine) > len(request):  # many:1
            return {e: [request[i * len(request) // len(engine)]] for i, e in enumerate(engine)}
        per = len(request) // len(engine)  # 1:many
        return {e: request[i * per:(i + 1) * per] for i, e in enumerate(engine)}

    def _removed(self, pod: str, fields: list[Any]) -> None:
        tier = (self._at(fields, 2) or "GPU").lower()
        for raw in fields[1]:
            for key in self.engine_to_request.get(hash_as_uint64(raw), []):
                self.entries.get(key, {}).pop((pod, tier), None)

    def score(self, tokens: Sequence[int], model: str, endpoints: Mapping[str, str],
              cache_salt: str | None = None) -> dict[str, float]:
        """Each endpoint's weighted longest-prefix score for a prompt (`endpoints`: address:port
        -> its Kubernetes node); an endpoint matching nothing is absent."""
        n = len(tokens) // self.block_size
        extra = None if not cache_salt or not n else [[cache_salt]] + [None] * (n - 1)
        keys = self.request_keys(None, tokens, model, extra)
        scores: dict[str, float] = {}
        alive: set[str] | None = None
        for key in keys:
            weights: dict[str, float] = {}
            for pod, tier in self.entries.get(key, {}):
                for endpoint in self._resolve(pod, endpoints):
                    w = self.weights.get(tier, 1.0)
                    weights[endpoint] = max(w, weights.get(endpoint, w))
            if alive is None:
                alive = set(weights)
            alive &= set(weights)
            if not alive:
                break
            for endpoint in alive:
                scores[endpoint] = scores.get(endpoint, 0.0) + weights[endpoint]
        return scores

    @staticmethod
    def _resolve(pod: str, endpoints: Mapping[str, str]) -> list[str]:
        if pod.startswith("pool:"):
            return list(endpoints)
        if pod.startswith("node:"):
            return [e for e, node in endpoints.items() if node == pod[len("node:"):]]
        return [pod] if pod in endpoints else []
