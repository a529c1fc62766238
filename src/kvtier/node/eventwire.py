"""vLLM's KV-event wire format, without vLLM: what `kvtier node` publishes for routers.

The structs are those of `vllm/distributed/kv_events.py` (vLLM 0.32), field for field, with
the same msgspec options, so that their MessagePack is byte for byte vLLM's and any consumer
of vLLM's events (llm-d's KV-cache indexer, vLLM's own `msgspec.msgpack.Decoder(KVEventBatch)`)
reads the node's: a batch is an array `[ts, events, data_parallel_rank]`, each event a map
tagged with its class name (`"type": "BlockStored"`), fields at their default left out.
tests/node/test_node_events.py decodes what the node sends with vLLM's own decoder, and
compares these structs' encoding with vLLM's.

On ZMQ, a batch is one multipart message `[topic, seq, payload]`: `seq` an 8-byte big-endian
count from 0 per topic, as vLLM's `ZmqEventPublisher` sends (`frames`).

Primitives: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `KVEventBatch`, `frames`.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int  # vLLM's: kvtier's are the 16-byte chunk keys


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM; kvtier sends None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()


def frames(topic: bytes, seq: int, batch: KVEventBatch) -> tuple[bytes, bytes, bytes]:
    """The ZMQ multipart message of `batch`, number `seq` of `topic`."""
    return topic, seq.to_bytes(8, "big"), _encoder.encode(batch)
