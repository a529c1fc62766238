"""Prefix-aware eviction: a chunk of KV is worth something only while its whole prefix is held.

A page cache evicts pages; a KV cache evicts prefixes. Chunk i of a prompt is a hit only if
chunks 0..i-1 are held too, so evicting a parent before its children wastes the children,
and LRU does exactly that: a lookup reads a prompt's chunks first to last, leaving the first
chunk of every cached prompt the least recently used. And on chat traffic most chunks are
never read again (three in four on Mooncake's conversation trace: one-shot prompts, and the
last turn of every conversation), while a chunk read once is read again far more often
(42% after two uses, 58% after four, on the same trace). The rule:

1. **Leaves only.** Only a chunk no held chunk extends (a leaf of the tree of held prefixes)
   can be evicted: a conversation is cut back from its end, never from its start.
2. **Among leaves, recency plus a bonus per doubling of uses**: a leaf's rank is the policy
   operation of its last use plus `bonus_ops x log2(uses)`; the lowest rank leaves first,
   the deeper chunk on a tie. A chunk evicted and offered again keeps its use count (a
   bounded memory of the evicted, `remembered` keys), so a conversation's second turn gets
   the bonus its first one could not earn. `bonus_ops` is the reuse horizon not already
   covered by the tier's own turnover: `max(0, horizon - capacity)`: a small tier needs it
   to keep returning conversations through bursts of one-shot prompts; a tier as large as
   the horizon keeps them by recency alone, and the rule falls back to LRU over leaves.
   The horizon is learned from the traffic: `HORIZON_GAPS` x the median gap, in operations,
   between a chunk's last use and its next (a hit, or an evicted chunk stored again), over
   the last ~65,000 such reuses (`ReuseGaps`); recency alone until 256 were seen. A
   fixed bonus learned on one workload is wrong on another: a chat service's conversations
   come back after tens of thousands of operations, an agent's turns after hundreds, and a
   grace that outlives its traffic fills a small tier with finished sessions (a fixed
   30,000-operation horizon hit 40.7% of the tokens LRU hit 81.3% of on `kvtier simulate`'s
   agent workload at 300k tokens; docs/performance.md).
3. **A new chunk's bonus falls with its place in the run of new chunks** it ends: a chunk
   used once, the n-th in a row of such chunks under its nearest chunk used more than once
   (or a first chunk), ranks `FIRST_RUN_SHARE x bonus_ops / n` above the insertion of its
   run's head, not its own: a run stored over time (a request decoding) is as old as its
   start, as LRU would rank its head. Ranked by its newest chunk instead, a request preempted
   while decoding (frozen since) lost its chain to requests that had finished after it, whose
   chains nobody reads again (`kvtier.tools.sim.batch`'s preemption batch at 3-4 GB:
   33,893 / 34,749 tokens recomputed against LRU's 5,077 / 4,584; now 3,305 / 1,980). A
   prompt's first new chunks are read again more often than its tail (on the same trace 37%
   of the first new chunk after a shared first chunk against 24% past the 20th; after a
   conversation's held prefix 44% against 7-17% from the third on), and they are what a
   returning prompt hits first; so a small tier keeps the heads of new prompts and trims
   their tails. A chunk whose parent is named but not held (evicted, pinned, in another
   tier) heads no run: it ranks by its last use alone.

All three need the chunk's parent: `insert(key, parent)` (a tier passes `ChunkMeta.parent`).
A chunk whose parent is unknown or not in this policy is ranked as a root: its prefix may
be held by another tier (the lookup walks a prefix across tiers) or pinned here (a pinned
chunk is out of the policy). When that parent enters (promoted, stored again, its pin
ended), the chunks held that extend it are its children again, whichever entered first: a
parent is never a leaf beside its child. Under rule 3 a chunk inserted with no parent heads
a run as a first chunk does (the protocol does not tell them apart: so do chunks a disk
tier finds at start-up, and chunks of a tier that passes no parents at all), one whose
named parent is not here heads none. Deeper chunks cost more to recompute, but a deep
chunk is only worth that while every chunk above it is held: the leaf rule is what keeps
that value, and the depth breaks ties in favour of the parent.

Cost: per put or hit O(log n) (a heap with stale entries skipped, rebuilt when mostly stale)
and a histogram count, plus every 256 reuses a read of that histogram's 192 buckets;
memory per held chunk: its parent, rank, uses, depth, run, last use, run start and child
count, plus the heap entry, and at most `remembered` counts and last uses of evicted chunks
(`max(65536, 4 x capacity)`); per chunk not held that held chunks extend, a count of them
(`_Absent`, dropped with the last: never more than the chunks held), so that it takes them
back in O(1) when it enters.
A pinned or deleted parent (`remove`) leaves its children in place; they leave in their own
rank order (the tier's lookup cannot reach them meanwhile), or extend it again when it comes
back. (Keys chain their prefix, so a parent named is never a chunk's descendant; a chunk
naming itself is taken for a root.)

Primitives: `PrefixPolicy`, `HORIZON_GAPS`, `FIRST_RUN_SHARE`.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.core.policies.reusegaps import ReuseGaps

K = TypeVar("K", bound=Hashable)

# The reuse horizon in median reuse gaps (rule 2). On Mooncake's conversation trace
# (`kvtier simulate --trace`, docs/performance.md) the median gap is ~10,000 operations and a
# fixed horizon of 25,000-35,000 ranked best: 2.6 gaps learns 25,000 there, and stays within
# a point of LRU (or far above it) on agent, RAG and drifting loads where 30,000 did not.
HORIZON_GAPS = 2.6
# A new chunk's bonus at the head of a run, in bonus_ops (rule 3): on the same trace 1.25
# keeps the most tokens over 0.5M-3M (1.0 and 1.5 within 0.15 points), never fewer than rule
# 2 alone from 0.3M to 50M.
FIRST_RUN_SHARE = 1.25
MIN_REMEMBERED = 1 << 16  # counts of evicted chunks kept at least (AdmissionFilter's default)


@dataclass(slots=True)
class _Chunk(Generic[K]):
    parent: K | None  # the chunk it extends, held or not (None: a root, or unknown)
    depth: int  # chunks above it when inserted (its parent held then)
    run: int  # its place in the run of chunks used once it ends (rule 3); 0: heads none
    uses: int  # inserts and hits, remembered across evictions
    last_op: int  # the policy operation of its last use
    run_op: int  # the policy operation its run's head was inserted at (rule 3)
    children: int = 0  # held chunks that extend it: it is a leaf at 0
    rank: float = 0.0  # its rank in the heap while a leaf


@dataclass(slots=True)
class _Absent:
    """A chunk not held here that held chunks extend: it takes them back when it comes."""

    children: int = 0  # held chunks that extend it (it is forgotten at 0)


class PrefixPolicy(Generic[K]):
    """Evicts the leaf of lowest rank (module docstring). Not thread-safe: the tier locks."""

    def __init__(self, capacity: int, horizon_ops: int | None = None,
                 gaps: ReuseGaps | None = None) -> None:
        """`capacity`: chunks the tier holds; `horizon_ops`: a fixed reuse horizon, in
        operations (None: learned from the reuse gaps, module docstring); `gaps`: the reuse
        gaps to learn it from, shared with a policy before this one (the tier's generation
        before a reset: the traffic is the same), None: new ones."""
        self._capacity = capacity
        self._gaps: ReuseGaps | None = None
        if horizon_ops is None:
            self._gaps = gaps if gaps is not None else ReuseGaps()
        self.horizon_ops = float(horizon_ops or 0)
        self.bonus_ops = float(max(0, self.horizon_ops - capacity))
        self._learn()
        self._remembered = max(MIN_REMEMBERED, 4 * capacity)
        self._chunks: dict[K, _Chunk[K]] = {}
        # Chunks not held that held chunks extend (each dropped with its last such child)
        self._absent: dict[K, _Absent] = {}
        self._leaves: list[tuple[float, int, int, K]] = []  # (rank, -depth, tiebreak, key)
        # evicted chunks: (uses, last use), oldest eviction first
        self._evicted_uses: OrderedDict[K, tuple[int, int]] = OrderedDict()
        self._op = 0  # policy operations (inserts and hits): the clock of `last_op`
        self._pushes = 0  # heap pushes: orders equal ranks and depths

    def insert(self, key: K, parent: K | None = None) -> None:
        """`key` became resident, extending `parent` (None: a root, or unknown). Held
        chunks that extend `key` and entered before it (while it was pinned, deleted or in
        another tier) extend it again: it is no leaf while they are held."""
        chunk = self._chunks.get(key)
        if chunk is not None:
            self.touch(key)
            return
        self._op += 1
        uses, last_op = self._evicted_uses.pop(key, (0, 0))
        if uses:
            self._reused(self._op - last_op)  # an evicted chunk came back
        if parent == key:
            parent = None  # extending itself, it would never be a leaf: never evicted
        above = self._chunks.get(parent) if parent is not None else None
        if above is None:
            run = 1 if parent is None else 0  # a first chunk heads a run; an orphan none
        else:
            run = 1 if above.uses > 1 else above.run + 1 if above.run else 0
        run_op = above.run_op if above is not None and run > 1 else self._op
        waiting = self._absent.pop(key, None)  # its children held already
        chunk = _Chunk(parent, 0 if above is None else above.depth + 1, run, uses + 1,
                       self._op, run_op, 0 if waiting is None else waiting.children)
        self._extend(parent, above)
        self._chunks[key] = chunk
        if chunk.children == 0:
            self._push(key, chunk)

    def touch(self, key: K) -> None:
        """A resident key was read: one more use, now."""
        chunk = self._chunks.get(key)
        if chunk is None:
            return
        self._op += 1
        self._reused(self._op - chunk.last_op)
        chunk.uses += 1
        chunk.last_op = self._op
        if chunk.children == 0:
            self._push(key, chunk)

    def remove(self, key: K) -> None:
        """`key` left for another reason than eviction (deleted, pinned, corrupt); the
        chunks that extend it stay, to extend it again if it comes back."""
        chunk = self._chunks.pop(key, None)
        if chunk is not None:
            self._forget(key, chunk)
            if chunk.children:
                self._absent[key] = _Absent(chunk.children)

    def evict(self, keep: Callable[[K], bool] | None = None) -> K | None:
        """The leaf of lowest rank not kept, forgotten as resident; None when no such leaf.
        Kept leaves stay leaves: their parents are not candidates meanwhile."""
        kept: list[tuple[float, int, int, K]] = []
        try:
            while self._leaves:
                entry = heapq.heappop(self._leaves)
                rank, _, _, key = entry
                chunk = self._chunks.get(key)
                if chunk is None or chunk.children or chunk.rank != rank:
                    continue  # stale: evicted, extended or used since it was pushed
                if keep is not None and keep(key):
                    kept.append(entry)
                    continue
                del self._chunks[key]
                self._forget(key, chunk)
                return key
            return None
        finally:
            for entry in kept:
                heapq.heappush(self._leaves, entry)

    def _extend(self, parent: K | None, above: _Chunk[K] | None) -> None:
        """Count one more child of `parent` (`above` where it is held, else absent)."""
        if parent is None:
            return
        record = above if above is not None else self._absent.setdefault(parent, _Absent())
        record.children += 1  # a leaf no more: a held parent's heap entry goes stale

    def _forget(self, key: K, chunk: _Chunk[K]) -> None:
        """Remember its uses (bounded) and count it off its parent: a held parent it was the
        last child of is a leaf again, an absent one is forgotten."""
        self._evicted_uses[key] = (chunk.uses, chunk.last_op)
        while len(self._evicted_uses) > self._remembered:
            self._evicted_uses.popitem(last=False)
        parent = chunk.parent
        if parent is None:
            return
        # Its parent counts it, held or absent: a chunk with children is never evicted,
        # takes them along when removed (`remove`) and back when inserted again (`insert`).
        above = self._chunks.get(parent)
        if above is not None:
            above.children -= 1
            if above.children == 0:
                self._push(parent, above)
        else:
            absent = self._absent[parent]
            absent.children -= 1
            if absent.children == 0:
                del self._absent[parent]

    def _reused(self, gap: int) -> None:
        """A chunk was used again `gap` operations after its last use: learn the horizon
        (rule 2), unless it is fixed."""
        if self._gaps is not None and self._gaps.add(gap):
            self._learn()

    def _learn(self) -> None:
        """The horizon from the reuse gaps seen so far (none: as it was)."""
        median = None if self._gaps is None else self._gaps.quantile(0.5)
        if median is not None:
            self.horizon_ops = HORIZON_GAPS * median
            self.bonus_ops = max(0.0, self.horizon_ops - self._capacity)

    def _push(self, key: K, chunk: _Chunk[K]) -> None:
        """(Re)rank a leaf; entries it had in the heap go stale."""
        if chunk.uses > 1:
            chunk.rank = chunk.last_op + self.bonus_ops * math.log2(chunk.uses)
        elif chunk.run:
            chunk.rank = chunk.run_op + self.bonus_ops * FIRST_RUN_SHARE / chunk.run
        else:
            chunk.rank = chunk.last_op
        self._pushes += 1
        heapq.heappush(self._leaves, (chunk.rank, -chunk.depth, self._pushes, key))
        if len(self._leaves) > 2 * len(self._chunks) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop the stale entries: the heap stays within twice the residents."""
        self._leaves = []
        for key, chunk in self._chunks.items():
            if chunk.children == 0:
                self._pushes += 1
                self._leaves.append((chunk.rank, -chunk.depth, self._pushes, key))
        heapq.heapify(self._leaves)

    def __len__(self) -> int:
        return len(self._chunks)
