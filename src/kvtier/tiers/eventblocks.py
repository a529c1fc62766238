"""kvtier's tier events as a router's blocks, without vLLM: what both publishers send.

The connector's scheduler (`kvtier.integrations.vllm.scheduler.events`, vLLM's structs) and
`kvtier node` (`kvtier.node.events`, their copies in `eventwire.py`) turn the same store
events into the same blocks here, and differ only in the structs they fill:

  - **block size.** A router recomputes its own keys from each event's `token_ids`, but some
    check the event's `block_size` against theirs: NVIDIA Dynamo's KV router publishes no
    block of another size (`lib/kv-router/src/zmq_wire/convert.rs`, `create_stored_blocks`).
    A chunk of `tokens_per_chunk` tokens is announced as `tokens_per_chunk / block_size`
    blocks of `block_size` (default: the chunk, one block), as LMCache re-slices its chunks
    (LMCache PR #3938); a chunk's tail (keys.tail_key: m vLLM blocks) as its tokens /
    `block_size` blocks where that divides (events of vLLM's block size), else not at
    all. Their hashes chain: a chunk's last block is its key (so the next
    chunk's parent is that key, as with one block a chunk), the others are blake2b of the key
    and their index; a removal names every block of the chunk.
  - **extra_keys** in vLLM's format (vllm PR #33304, `generate_block_hash_extra_keys` and
    `to_event_extra_keys`): one entry per block, the LoRA name in every block of a LoRA
    request, the cache salt in the prompt's first block only (where the chunk has no parent),
    None for a block with neither. Routers read the salt there: Dynamo takes an event's cache
    namespace from its first block (`zmq_wire/extra_keys.rs`), llm-d folds it into block 0
    (`preciseprefixcache/blockkeys.go`), so salted chunks match salted queries.
  - **runs, parents first.** Consecutive store events of one tier whose chunks follow one
    another in a prompt (a chunk's parent the previous one's key, same LoRA and salt) are one
    `BlockStored`, as vLLM announces a prefill's blocks in one event; runs go out parents
    before children (llm-d skips a block whose parent it has not indexed, Dynamo's radix
    tree cannot place it); a removal ends a run, so that nothing is announced out of order
    with it.

Stores that complete out of order (a write-behind tier's writers race) would reach a router
child first, across batches, where llm-d skips the child for good: `ParentsFirst` holds a
stored chunk back until its parent has been announced in its tier, for at most `hold_s`.

Primitives: `RouterBlocks`, `router_blocks`, `block_hashes`, `ParentsFirst`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.core.keys import ChunkKey
from kvtier.core.store import StoreEvent
from kvtier.tiers.eventfacts import ChunkInfo

_PERSON = b"kvtier-evblock"  # blake2b's personalization: these hashes are no chunk keys


@dataclass(frozen=True, slots=True)
class RouterBlocks:
    """One event's blocks: a BlockStored's fields (`stored`) or a BlockRemoved's."""

    stored: bool
    tier: str  # the tier's name (its medium, locality and ownership: eventfacts.event_place)
    block_hashes: list[bytes]
    # BlockStored only (empty or None for a removal):
    parent: ChunkKey | None = None  # the last block of the chunk before the first
    token_ids: list[int] | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[str, ...] | None] | None = None


def block_hashes(key: ChunkKey, blocks: int) -> list[bytes]:
    """The event hashes of a chunk announced as `blocks` blocks: the last one is its key."""
    return [hashlib.blake2b(key + i.to_bytes(4, "big"), digest_size=16,
                            person=_PERSON).digest() for i in range(blocks - 1)] + [bytes(key)]


def router_blocks(events: Iterable[StoreEvent], info_of: Callable[[ChunkKey], ChunkInfo | None],
                  tokens_per_chunk: int, block_size: int) -> tuple[list[RouterBlocks], int]:
    """The events for routers of `events` (in their order, stores in runs), and the number of
    stored chunks left out because `info_of` knows no tokens for them (a router could not
    index them anyway).

    Raises:
        ValueError: `block_size` does not divide `tokens_per_chunk` (configs check it first).
    """
    if block_size < 1 or tokens_per_chunk % block_size:
        raise ValueError(f"event block size {block_size} does not divide {tokens_per_chunk}")
    blocks = tokens_per_chunk // block_size
    out: list[RouterBlocks] = []
    pending: list[tuple[str, ChunkKey, ChunkInfo]] = []
    unknown = 0
    for event in events:
        info = info_of(event.key)
        if event.kind == "removed":
            count = _blocks_of(info, block_size) if info is not None else blocks
            if count is None:
                continue  # a tail never announced (its tokens do not divide into blocks)
            out += _stored_runs(pending, block_size)
            pending = []
            out.append(RouterBlocks(False, event.tier, block_hashes(event.key, count)))
            continue
        if info is None or _blocks_of(info, block_size) is None:
            unknown += 1
        else:
            pending.append((event.tier, event.key, info))
    return out + _stored_runs(pending, block_size), unknown


def _blocks_of(info: ChunkInfo, block_size: int) -> int | None:
    """The event blocks a chunk is announced as: its tokens / `block_size` (a chunk's tail,
    keys.tail_key, holds fewer tokens than a chunk); None where they do not divide (a tail
    with events of one block a chunk: not announced)."""
    tokens = len(info.token_ids) // 4
    return tokens // block_size if tokens and tokens % block_size == 0 else None


def _stored_runs(stored: Sequence[tuple[str, ChunkKey, ChunkInfo]], block_size: int
                 ) -> list[RouterBlocks]:
    runs: list[list[tuple[str, ChunkKey, ChunkInfo]]] = []
    tails: dict[tuple[str, ChunkKey], int] = {}  # (tier, a run's last key) -> the run
    for chunk in stored:
        tier, key, info = chunk
        i = tails.pop((tier, info.parent), None) if info.parent is not None else None
        if i is None or not _follows(runs[i][-1], chunk):
            i = len(runs)
            runs.append([])
        runs[i].append(chunk)
        tails[(tier, key)] = i
    merged: list[list[tuple[str, ChunkKey, ChunkInfo]]] = []
    for run in (runs[i] for i in _parents_first(runs)):
        if merged and _follows(merged[-1][-1], run[0]):
            merged[-1] += run  # a run stored in reverse, now in order
        else:
            merged.append(run)
    return [_run_event(run, block_size) for run in merged]


def _follows(before: tuple[str, ChunkKey, ChunkInfo], after: tuple[str, ChunkKey, ChunkInfo]
             ) -> bool:
    """Whether chunk `after` continues `before`'s prompt in one event: the same tier, LoRA
    and salt, `before` its parent."""
    (tier, key, info), (next_tier, _, next_info) = before, after
    return (tier, key, info.lora_name, info.cache_salt) == (
        next_tier, next_info.parent, next_info.lora_name, next_info.cache_salt)


def _parents_first(runs: list[list[tuple[str, ChunkKey, ChunkInfo]]]) -> list[int]:
    """The runs' order: each after the run holding its first chunk's parent, if any."""
    holder = {(tier, key): i for i, run in enumerate(runs) for tier, key, _ in run}
    order: list[int] = []
    placed: set[int] = set()
    for start in range(len(runs)):
        chain = []
        i: int | None = start
        while i is not None and i not in placed and i not in chain:
            chain.append(i)
            tier, _, info = runs[i][0]
            i = holder.get((tier, info.parent)) if info.parent is not None else None
        for j in reversed(chain):
            placed.add(j)
            order.append(j)
    return order


def _run_event(run: list[tuple[str, ChunkKey, ChunkInfo]], block_size: int) -> RouterBlocks:
    tier, _, first = run[0]
    hashes = [h for _, key, info in run
              for h in block_hashes(key, _blocks_of(info, block_size) or 1)]
    tokens = np.frombuffer(b"".join(info.token_ids for _, _, info in run), dtype="<i4")
    lora = (first.lora_name,) if first.lora_name else ()
    extra: list[tuple[str, ...] | None] = [lora or None] * len(hashes)
    if first.parent is None and first.cache_salt:  # the prompt's first block
        extra[0] = (*lora, first.cache_salt)
    return RouterBlocks(True, tier, hashes, first.parent, tokens.tolist(), first.lora_name,
                        extra if any(extra) else None)


class ParentsFirst:
    """The store events a publisher may announce now, parents before children across its
    batches. Not thread-safe: its publisher's thread."""

    def __init__(self, hold_s: float = 2.0, max_keys: int = 65536) -> None:
        """`hold_s`: how long a chunk whose parent is not announced is held (then it goes
        out anyway: its parent may have been announced long ago, or by another engine);
        `max_keys`: announced chunks remembered."""
        self._hold_s = hold_s
        self._max_keys = max_keys
        self._announced: OrderedDict[tuple[str, ChunkKey], None] = OrderedDict()
        self._held: list[tuple[float, StoreEvent]] = []

    @property
    def holding(self) -> bool:
        """Whether some store is held back (a later `order` call may release it)."""
        return bool(self._held)

    def order(self, events: Iterable[StoreEvent],
              info_of: Callable[[ChunkKey], ChunkInfo | None], now_s: float) -> list[StoreEvent]:
        """`events` and those held before, in an order to announce them, less those still
        held; a removal goes out at once (and drops a held store of its chunk)."""
        queue = self._held + [(now_s, e) for e in events]
        out: list[StoreEvent] = []
        moved = True
        while moved:
            moved = False
            waiting: list[tuple[float, StoreEvent]] = []
            for since, event in queue:
                where = (event.tier, event.key)
                if event.kind == "removed":
                    self._announced.pop(where, None)
                    waiting = [(t, e) for t, e in waiting if (e.tier, e.key) != where]
                    out.append(event)
                    moved = True
                    continue
                info = info_of(event.key)
                if (info is None or info.parent is None or now_s - since >= self._hold_s
                        or (event.tier, info.parent) in self._announced):
                    out.append(event)
                    self._announced[where] = None
                    self._announced.move_to_end(where)
                    moved = True
                else:
                    waiting.append((since, event))
            queue = waiting
        while len(self._announced) > self._max_keys:
            self._announced.popitem(last=False)
        self._held = queue
        return out
