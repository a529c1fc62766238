"""What, besides token ids, decides a chunk's KV: vLLM's per-block extra keys, as bytes.

Two requests with equal token ids can hold different KV: multimodal placeholder tokens stand
for different images (vLLM mixes each item's identifier and position into the block hash), and
prompt-embeds requests have all token ids 0 (vLLM mixes a hash of each block's embeddings). So
each chunk's key also covers the extra keys vLLM's own prefix cache uses for the chunk's blocks
(`generate_block_hash_extra_keys`, called here block by block, exactly as vLLM's block hasher
does): the two caches can never disagree about which prefixes are equal.

The extra keys are encoded with a canonical, type-tagged, length-prefixed byte encoding (never
Python's `hash()` or `repr()`), so every process and node computes the same bytes. A value the
encoding does not know (a future vLLM key of a new type) makes the request uncacheable: it is
neither looked up nor stored, rather than keyed on a guess.

LoRA and the cache salt are in the namespace (requeststate.py), so a text-only request, the
common case, skips the extraction entirely (`needs_chunk_extras`). A LoRA adapter is named there
by its content (`lora_identity`), not by the name and path vLLM's block hash uses: two adapters
served under one name never share KV, and one adapter at two paths (two nodes) does. Its content
is the one vLLM's workers loaded (`LoadedAdapters`), not what its files hold later.

Primitives: `UncacheableRequest`, `needs_chunk_extras`, `chunk_extras`, `span_extras`,
`encode_extra_keys`, `lora_identity`, `LoadedAdapters`.
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvtier.core.fingerprint import adapter_fingerprint
from kvtier.errors import UncacheableRequest

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# How many adapters keyed by name and path (`lora_identity`) are remembered as already logged:
# each is logged once while remembered, the least recently seen forgotten past this many (and
# logged again if it comes back), so a stream of distinct such adapters holds bounded memory.
MAX_WARNED_ADAPTERS = 1024
_warned_adapters: OrderedDict[tuple[str, str], None] = OrderedDict()  # (name, path), LRU order


def needs_chunk_extras(request: Request) -> bool:
    """Whether the request's chunks need extra key bytes (multimodal inputs or prompt
    embeddings); False for text-only requests, which then cost nothing more."""
    return bool(request.mm_features) or request.prompt_embeds is not None


def chunk_extras(request: Request, first_chunk: int, num_chunks: int, tokens_per_chunk: int,
                 block_size: int) -> list[bytes | None]:
    """Extra key bytes for chunks `first_chunk .. first_chunk + num_chunks - 1`, one entry
    per chunk: None where none of its blocks has extra keys.

    Raises:
        UncacheableRequest: an extra key holds a value of a type the encoding does not know,
            or a multimodal item has no identifier.
    """
    out: list[bytes | None] = []
    mm_index = 0  # carried from block to block, as vLLM's block hasher does
    for chunk in range(first_chunk, first_chunk + num_chunks):
        start = chunk * tokens_per_chunk
        extra, mm_index = _span_extras(request, start, start + tokens_per_chunk, block_size,
                                       mm_index)
        out.append(extra)
    return out


def span_extras(request: Request, start: int, end: int, block_size: int) -> bytes | None:
    """Extra key bytes of the blocks of tokens `start`..`end` (a chunk's tail: keys.tail_key),
    encoded as `chunk_extras` encodes a chunk's; None where none of them has extra keys.

    Raises:
        UncacheableRequest: as `chunk_extras`.
    """
    return _span_extras(request, start, end, block_size, 0)[0]


def _span_extras(request: Request, start: int, end: int, block_size: int,
                 mm_index: int) -> tuple[bytes | None, int]:
    parts: list[bytes] = []
    for block_start in range(start, end, block_size):
        block_end = block_start + block_size
        try:
            keys, mm_index = generate_block_hash_extra_keys(request, block_start, block_end,
                                                            mm_index)
        except AssertionError as e:  # an item without an identifier
            raise UncacheableRequest(f"vLLM extra keys: {e!r}") from e
        if request.prompt_is_token_ids is not None:
            # Mixed prompts: which positions are embeddings (token id 0 there).
            mask = bytes(request.prompt_is_token_ids[block_start:block_end])
            keys = (*(keys or ()), ("prompt_is_token_ids", mask))
        parts.append(encode_extra_keys(keys) if keys else b"")
    if any(parts):
        return b"".join(len(p).to_bytes(4, "little") + p for p in parts), mm_index
    return None, mm_index


def lora_identity(lora: LoRARequest) -> tuple[str, ...]:
    """The namespace entries that name a LoRA adapter: its content's fingerprint
    (`adapter_fingerprint` of its directory, read once per adapter version), or, where its path
    is not a local directory (or cannot be read), its name and path, as vLLM's block hash
    does (logged once per adapter while it is among the `MAX_WARNED_ADAPTERS` such adapters
    last seen: they share KV by name and path only). Scheduler
    thread (reads the adapter's files the first time it sees them)."""
    name, path = str(lora.lora_name), str(lora.lora_path)
    try:
        digest = adapter_fingerprint(path) if path else None
        why = "its path is not a local directory"
    except OSError as e:
        digest, why = None, f"its files could not be read ({e})"
    if digest is not None:
        return (f"lora-content={digest}",)
    if _first_warning(name, path):
        logger.warning("kvtier: LoRA adapter %r (path %r) is keyed by its name and path: %s",
                       name, path, why)
    return (f"lora={name}", f"lora-path={path}")


def _first_warning(name: str, path: str) -> bool:
    """Whether the adapter's fallback is not remembered as logged (then it is, as the most
    recently seen; the least recently seen forgotten past `MAX_WARNED_ADAPTERS`)."""
    adapter = (name, path)
    if adapter in _warned_adapters:
        _warned_adapters.move_to_end(adapter)
        return False
    _warned_adapters[adapter] = None
    if len(_warned_adapters) > MAX_WARNED_ADAPTERS:
        _warned_adapters.popitem(last=False)
    return True


class LoadedAdapters:
    """The LoRA adapters vLLM's workers hold, as the keys name them (scheduler thread).

    A worker reads an adapter's files when it first runs a request of its `lora_int_id`, and
    keeps those weights under the id, whatever the files hold later, until it evicts the
    adapter and reads it again (or a request reloads it, `load_inplace`). So an adapter is
    named by its content when kvtier first sees its id, and the id's requests are cached only
    while its files still hold that content: files that changed under an id leave unknown which
    weights a worker computes with (the loaded ones, or the new ones once read again), and a
    request that reloads its adapter in place changes them under the id at a step kvtier does
    not see. Such requests are neither looked up nor stored (UncacheableRequest), nor are the
    id's from then on (a new id is a new adapter); a request's stores check its adapter again
    (`identity` each step: its files stat'ed at most once a step per id). Not seen: an adapter
    loaded ahead of its first request (`LLM.llm_engine.add_lora`, a server's
    `/v1/load_lora_adapter`) and rewritten before that request.
    """

    def __init__(self, max_ids: int = 65_536) -> None:
        # By id: the identity its workers' weights have; None: unknown since its files changed.
        self._loaded: dict[int, tuple[str, ...] | None] = {}
        # Adapters (id, name, path) checked this step, and what they were found to be.
        self._this_step: dict[tuple[int, str, str], tuple[str, ...] | None] = {}
        self._max_ids = max_ids

    def new_step(self) -> None:
        """A scheduler step begins: each id's files are looked at again when next asked."""
        self._this_step.clear()

    def identity(self, lora: LoRARequest) -> tuple[str, ...]:
        """The namespace entries of the adapter vLLM's workers run `lora`'s requests with.

        Raises:
            UncacheableRequest: it is reloaded in place, or its files changed since its
                workers loaded it.
        """
        lora_id = lora.lora_int_id
        if lora.load_inplace:
            raise UncacheableRequest(f"LoRA adapter {lora.lora_name!r} (id {lora_id}) is "
                                     "reloaded in place: its weights change under its id")
        checked = (lora_id, str(lora.lora_name), str(lora.lora_path))
        if checked in self._this_step:
            known = self._this_step[checked]
            if known is None:
                raise UncacheableRequest(self._changed(lora))
            return known
        now = lora_identity(lora)
        loaded = self._loaded.setdefault(lora_id, now)
        if len(self._loaded) > self._max_ids:
            del self._loaded[next(iter(self._loaded))]
        if loaded == now:
            self._this_step[checked] = now
            return now
        self._this_step[checked] = None
        if loaded is not None:
            self._loaded[lora_id] = None
            logger.warning("kvtier: %s", self._changed(lora))
        raise UncacheableRequest(self._changed(lora))

    @staticmethod
    def _changed(lora: LoRARequest) -> str:
        return (f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}, path "
                f"{lora.lora_path!r}) changed since vLLM's workers loaded it; its requests are "
                "not cached (serve the new files under a new id)")


def encode_extra_keys(value: Any) -> bytes:
    """A canonical byte encoding of an extra-keys value: tuples/lists, str, bytes, int,
    bool, float and None, each type-tagged and length-prefixed.

    Raises:
        UncacheableRequest: for a value of any other type.
    """
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: Any, out: bytearray) -> None:
    # bool before int: bool is an int subclass.
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        raw = str(value).encode()
        out += b"i" + len(raw).to_bytes(4, "little") + raw
    elif isinstance(value, float):
        out += b"f" + struct.pack("<d", value)
    elif isinstance(value, str):
        raw = value.encode()
        out += b"s" + len(raw).to_bytes(4, "little") + raw
    elif isinstance(value, (bytes, bytearray)):
        out += b"b" + len(value).to_bytes(4, "little") + bytes(value)
    elif isinstance(value, (tuple, list)):
        out += b"t" + len(value).to_bytes(4, "little")
        for item in value:
            _encode(item, out)
    else:
        raise UncacheableRequest(f"an extra key of type {type(value).__name__}")
