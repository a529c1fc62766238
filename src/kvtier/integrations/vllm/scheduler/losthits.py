"""Why tokens kvtier found were not loaded: the scheduler's share of `lost_hit_tokens`.

A lookup finds a hit: the tokens beyond vLLM's own cache that kvtier holds (counted in
`lookup_hit_tokens`). It offers vLLM a prefix of them, cut by the load-or-recompute rule
(offer.py), and vLLM may take fewer than offered. Both are known only once vLLM allocates the
request's blocks (`update_state_after_alloc`): a lookup may repeat while the request waits for
blocks, and only the last one counts. So a lookup leaves a `LookupHit` on its request, and the
allocation turns it into tokens lost by reason (metrics.LOST_HIT_REASONS):
  - recompute_faster: found, cut by the rule (a trial offers the whole hit: nothing lost);
  - vllm_declined: offered, not taken (vLLM keeps its own cache's partial block, replays a
    sliding window), or not offered to a request that skips prefix-cache reads (vLLM would
    take none of it: connector_scheduler.py).
What the workers fail to load of what vLLM took is theirs to count (load_failed, no_state:
worker/connector_worker.py).

Scheduler side, one thread. Primitives: `LookupHit`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookupHit:
    """One lookup's hit, in tokens beyond vLLM's own cache."""

    found_tokens: int  # held by kvtier (lookup_hit_tokens)
    offered_tokens: int  # of those, offered to vLLM (the rest the rule cut)

    def lost(self, allocated_tokens: int) -> dict[str, int]:
        """Tokens found and not taken, by reason, once vLLM allocated the request's blocks
        for `allocated_tokens` external tokens (its `num_external_tokens`); reasons with none
        left out."""
        lost = {"recompute_faster": self.found_tokens - self.offered_tokens,
                "vllm_declined": self.offered_tokens - allocated_tokens}
        return {reason: tokens for reason, tokens in lost.items() if tokens > 0}
