"""The median reuse gap the prefix policy learns its horizon from (kvtier.core.policies.
reusegaps): read to a quarter of an octave, following a workload that changes."""

from __future__ import annotations

import random

from kvtier.core.policies.reusegaps import REFRESH, ReuseGaps


def test_nothing_is_read_before_enough_gaps() -> None:
    gaps = ReuseGaps()
    for _ in range(REFRESH - 1):
        gaps.add(100)
    assert gaps.quantile(0.5) is None
    gaps.add(100)
    assert gaps.quantile(0.5) is not None and len(gaps) == REFRESH


def test_quantiles_of_a_known_distribution_within_a_quarter_octave() -> None:
    """Log-normal gaps of median 5,000: the median read within a factor 1.19, the 90th
    percentile (e^(1.2816 sigma) x the median) too."""
    rng = random.Random(45)
    gaps = ReuseGaps()
    for _ in range(20_000):
        gaps.add(max(1, round(rng.lognormvariate(8.517, 1.0))))  # e^8.517 = 5,000
    median, p90 = gaps.quantile(0.5), gaps.quantile(0.9)
    assert median is not None and p90 is not None
    assert 5_000 / 1.19 <= median <= 5_000 * 1.19
    assert 5_000 * 3.602 / 1.19 <= p90 <= 5_000 * 3.602 * 1.19


def test_it_follows_a_workload_that_changes() -> None:
    """Long gaps (a chat service's conversations), then short ones (an agent fleet's turns):
    after a few half-lives the median is the new traffic's."""
    gaps = ReuseGaps(half_life=4_096)
    for _ in range(20_000):
        gaps.add(20_000)
    assert _near(gaps.quantile(0.5), 20_000)
    for _ in range(4 * 4_096):
        gaps.add(300)
    assert _near(gaps.quantile(0.5), 300)


def test_gaps_of_zero_one_and_beyond_the_top_bucket_are_counted() -> None:
    gaps = ReuseGaps()
    for gap in (0, 1, 2**60) * REFRESH:
        gaps.add(gap)
    low, high = gaps.quantile(0.1), gaps.quantile(1.0)
    assert low is not None and low < 2 and high is not None and high >= 2**47


def _near(read: float | None, gap: int) -> bool:
    """`read` is `gap` read back from its bucket: within a quarter octave."""
    return read is not None and gap / 1.19 <= read <= gap * 1.19
