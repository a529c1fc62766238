"""The GPU's paged KV pool with a prefix cache over block hashes (vLLM's block manager, lean).

Blocks are counted, not stored. A block is either free, private to one request (not yet full,
so unhashed), referenced by hash (possibly by several requests sharing a prefix), or cached:
hashed, unreferenced, and evictable in LRU order. Allocation takes free blocks first and then
evicts cached ones, oldest first. Requests release their blocks in reverse order, so a prompt's
tail is evicted before its shared head (as vLLM's free queue does).

Primitives:
    GpuKVCache -- match / acquire / can_allocate / allocate / register / release
"""

from __future__ import annotations

from collections import OrderedDict


class GpuKVCache:
    """Block accounting of one engine's GPU KV pool. Single-threaded."""

    __slots__ = ("cached", "evictions", "private", "ref", "total")

    def __init__(self, total_blocks: int) -> None:
        self.total = total_blocks
        self.ref: dict[int, int] = {}  # hash -> requests referencing it
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, LRU first
        self.private = 0  # unhashed blocks in use
        self.evictions = 0  # cached blocks evicted to make room

    @property
    def free(self) -> int:
        """Blocks holding nothing."""
        return self.total - len(self.ref) - len(self.cached) - self.private

    def match(self, hashes: list[int], n: int) -> tuple[int, int]:
        """Return (leading blocks of hashes[:n] on the GPU, how many of those are cached)."""
        ref, cached = self.ref, self.cached
        hits = from_cache = 0
        for i in range(n):
            h = hashes[i]
            if h in ref:
                hits += 1
            elif h in cached:
                hits += 1
                from_cache += 1
            else:
                break
        return hits, from_cache

    def can_allocate(self, n: int, reclaiming: int = 0) -> bool:
        """Whether `n` blocks can be allocated after `reclaiming` cached blocks get acquired."""
        return self.free + len(self.cached) - reclaiming >= n

    def acquire(self, hashes: list[int], n: int, held: list[int]) -> None:
        """Reference hashes[:n] (all present) and append them to `held`."""
        ref, cached = self.ref, self.cached
        for i in range(n):
            h = hashes[i]
            if h in ref:
                ref[h] += 1
            else:
                del cached[h]
                ref[h] = 1
            held.append(h)

    def allocate(self, n: int) -> None:
        """Take `n` private blocks, evicting cached ones as needed (check can_allocate)."""
        short = n - self.free
        cached = self.cached
        for _ in range(short if short > 0 else 0):
            cached.popitem(last=False)
        if short > 0:
            self.evictions += short
        self.private += n
        assert self.free >= 0, "allocated past the pool"

    def register(self, h: int, held: list[int]) -> None:
        """A private block of the caller became full with hash `h`: share or keep it."""
        self.private -= 1
        ref = self.ref
        if h in ref:
            ref[h] += 1  # another request computed it first: drop our copy
        else:
            if h in self.cached:
                del self.cached[h]
            ref[h] = 1
        held.append(h)

    def release(self, held: list[int], n_private: int) -> None:
        """Drop a request's references (deepest block first) and its private blocks."""
        ref, cached = self.ref, self.cached
        for h in reversed(held):
            count = ref[h] - 1
            if count:
                ref[h] = count
            else:
                del ref[h]
                cached[h] = None
        held.clear()
        self.private -= n_private
        assert self.private >= 0, "released more private blocks than held"

    def drop_cached(self) -> None:
        """Forget every unreferenced cached block (validation: force a GPU miss)."""
        self.cached.clear()
