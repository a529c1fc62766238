"""Per-request records of a serving benchmark and their statistics (pure functions).

Times are seconds. TTFT is from sending the request to the first generated token; ITL is the
gap between consecutive generated tokens (a stream chunk carrying n tokens counts as n gaps
of 1/n of its delay); latency is from sending to the last byte. Throughputs divide by the
wall time of the whole run, so they include idle gaps the workload itself causes.

Primitives: `RequestResult`, `Percentiles`, `Summary`, `percentile`, `percentiles`,
`summarize`, `by_turn`, `ratios`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request did."""

    session: int  # the workload session (prefix, user, document)
    turn: int  # index within the session
    prompt_tokens: int  # tokens sent
    output_tokens: int  # tokens received (the server's usage figure when it sends one)
    start_s: float  # when it was sent, seconds since the run started
    ttft_s: float | None  # time to the first token; None when none came
    latency_s: float  # time to the end of the response (or to the failure)
    itl_s: tuple[float, ...] = ()  # inter-token gaps
    error: str | None = None  # why it failed; None when it completed

    @property
    def ok(self) -> bool:
        """Completed with at least one token."""
        return self.error is None and self.ttft_s is not None


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Distribution of one latency, in seconds; all None when there were no samples."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    count: int


@dataclass(frozen=True, slots=True)
class Summary:
    """Aggregates of one run."""

    requests: int  # sent
    completed: int  # ok
    failed: int  # sent - completed
    duration_s: float  # wall time of the run
    request_throughput_rps: float  # completed requests per second
    output_throughput_tok_s: float  # generated tokens per second
    total_throughput_tok_s: float  # prompt + generated tokens of completed requests per second
    ttft: Percentiles
    itl: Percentiles
    latency: Percentiles


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default method).

    Returns None for no values. Raises ValueError when q is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentiles(values: Sequence[float]) -> Percentiles:
    """p50 / p90 / p99 / mean of `values`."""
    mean = sum(values) / len(values) if values else None
    return Percentiles(percentile(values, 50), percentile(values, 90), percentile(values, 99),
                       mean, len(values))


def summarize(results: Sequence[RequestResult], duration_s: float) -> Summary:
    """Aggregate `results` of a run that took `duration_s` of wall time.

    Raises ValueError when duration_s is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be positive")
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    total = output + sum(r.prompt_tokens for r in done)
    return Summary(
        requests=len(results), completed=len(done), failed=len(results) - len(done),
        duration_s=duration_s,
        request_throughput_rps=len(done) / duration_s,
        output_throughput_tok_s=output / duration_s,
        total_throughput_tok_s=total / duration_s,
        ttft=percentiles([r.ttft_s for r in done if r.ttft_s is not None]),
        itl=percentiles([gap for r in done for gap in r.itl_s]),
        latency=percentiles([r.latency_s for r in done]),
    )


def by_turn(results: Iterable[RequestResult]) -> dict[int, Percentiles]:
    """TTFT percentiles of completed requests per turn index (turn 0 = a session's first)."""
    ttfts: dict[int, list[float]] = {}
    for r in results:
        if r.ok and r.ttft_s is not None:
            ttfts.setdefault(r.turn, []).append(r.ttft_s)
    return {turn: percentiles(values) for turn, values in sorted(ttfts.items())}


# The figures `ratios` compares: (label, attribute path).
RATIO_FIELDS: tuple[tuple[str, str], ...] = (
    ("request throughput", "request_throughput_rps"),
    ("output tok/s", "output_throughput_tok_s"),
    ("TTFT p50", "ttft.p50"), ("TTFT p90", "ttft.p90"), ("TTFT p99", "ttft.p99"),
    ("ITL p50", "itl.p50"), ("ITL p90", "itl.p90"), ("ITL p99", "itl.p99"),
    ("latency p50", "latency.p50"),
)


def ratios(a: Summary, b: Summary) -> dict[str, float | None]:
    """B / A for every figure in RATIO_FIELDS; None where either is missing or A is 0.

    For throughputs a ratio > 1 means B is faster; for latencies a ratio < 1 means B is.
    """
    out: dict[str, float | None] = {}
    for label, path in RATIO_FIELDS:
        va, vb = _get(a, path), _get(b, path)
        out[label] = vb / va if va and vb is not None else None
    return out


def _get(obj: object, path: str) -> float | None:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]
