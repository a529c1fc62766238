"""The median gap between a chunk's uses, learned from the traffic in constant memory.

A histogram of log2 gaps, a quarter of an octave a bucket, whose counts halve every
`half_life` gaps added: it follows a workload that changes (an agent fleet's turns come back
in hundreds of operations, a chat service's conversations in tens of thousands) without
keeping any gap. Its quantiles are read to a quarter of an octave (a factor of 1.19).

Primitives: `ReuseGaps`.
"""

from __future__ import annotations

import math

PER_OCTAVE = 4  # buckets per doubling of the gap
OCTAVES = 48  # gaps up to 2^48 operations
REFRESH = 256  # gaps added between two decays (and quantile reads by the policy)


class ReuseGaps:
    """Gaps (in any clock's units) added one at a time; `quantile` of the recent ones."""

    def __init__(self, half_life: int = 1 << 16) -> None:
        """`half_life`: gaps added after which an earlier one counts half."""
        self._counts = [0.0] * (PER_OCTAVE * OCTAVES)
        self._total = 0.0
        self._added = 0
        self._decay = 0.5 ** (REFRESH / half_life)

    def add(self, gap: int) -> bool:
        """Count one gap; True every REFRESH gaps (the counts just decayed: a caller reading
        a quantile then reads it at that pace)."""
        bucket = int(math.log2(gap) * PER_OCTAVE) if gap > 1 else 0
        self._counts[min(bucket, len(self._counts) - 1)] += 1.0
        self._total += 1.0
        self._added += 1
        if self._added % REFRESH:
            return False
        self._counts = [count * self._decay for count in self._counts]
        self._total *= self._decay
        return True

    def quantile(self, q: float) -> float | None:
        """The gap below which a share `q` of the recent gaps fall (its bucket's geometric
        middle); None before REFRESH gaps were added."""
        if self._added < REFRESH:
            return None
        target = q * self._total
        seen = 0.0
        for bucket, count in enumerate(self._counts):
            seen += count
            if seen >= target:
                return float(2 ** ((bucket + 0.5) / PER_OCTAVE))
        return float(2 ** OCTAVES)

    def __len__(self) -> int:
        return self._added
