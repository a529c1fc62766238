"""The streams-and-arrivals workload that `kvtier bench interference` and `kvtier bench disagg`
share: K streams decode while M other requests arrive on a schedule, and the streams'
inter-token gaps are read inside the arrivals' window. Also how both start their servers: a
start that fails because another engine on the machine holds the memory is retried.

Primitives: `Arrival`, `arrival_schedule`, `token_times`, `gaps_in_window`, `arrival_window`,
`streams_itl_in_window`, `arrival_ttft`, `failures`, `prompt`, `streams_workload`, `send_after`,
`machine`, `retry_while_memory_short`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.errors import ConfigError, ServerError
from kvtier.tools.bench.prompts import bench_prompt
from kvtier.tools.bench.serving.client import ClientConfig, run_workload
from kvtier.tools.bench.serving.stats import Percentiles, RequestResult, percentiles
from kvtier.tools.bench.serving.workloads import Turn, Workload

T = TypeVar("T")

# A server that cannot start because another engine holds the memory is retried.
_MEMORY_SHORT = "less than desired"
_START_RETRIES = 3
_RETRY_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class Arrival:
    """One arriving request of the timed phase."""

    index: int  # its number; its prefix is the warm-up's prefix of the same number
    send_at_s: float  # when it is sent, seconds after the timed phase's streams
    prefix_tokens: int  # tokens of its warmed prefix


def arrival_schedule(count: int, gap_s: float, lead_s: float,
                     prefix_tokens: Sequence[int]) -> tuple[Arrival, ...]:
    """`count` arrivals `gap_s` apart, the first at `lead_s`; prefix lengths cycle through
    `prefix_tokens`.

    Raises:
        ConfigError: count < 0, a negative time, or no prefix length.
    """
    if count < 0 or gap_s < 0 or lead_s < 0:
        raise ConfigError("arrivals", (count, gap_s, lead_s), "count >= 0, times >= 0")
    if not prefix_tokens:
        raise ConfigError("prefix_tokens", "", "at least one length")
    return tuple(Arrival(i, lead_s + i * gap_s, prefix_tokens[i % len(prefix_tokens)])
                 for i in range(count))


def token_times(result: RequestResult) -> list[float]:
    """When each token of `result` arrived, seconds since its run began ([] without one)."""
    if result.ttft_s is None:
        return []
    times = [result.start_s + result.ttft_s]
    for gap in result.itl_s:
        times.append(times[-1] + gap)
    return times


def gaps_in_window(results: Sequence[RequestResult], start_s: float,
                   end_s: float) -> list[float]:
    """The inter-token gaps of `results` whose later token arrived in [start_s, end_s]."""
    gaps = []
    for r in results:
        times = token_times(r)
        gaps += [gap for gap, t in zip(r.itl_s, times[1:]) if start_s <= t <= end_s]
    return gaps


def arrival_window(arrivals: Sequence[RequestResult]) -> tuple[float, float]:
    """(first arrival sent, last arrival answered), seconds into the run; (0, 0) without."""
    if not arrivals:
        return (0.0, 0.0)
    return (min(r.start_s for r in arrivals), max(r.start_s + r.latency_s for r in arrivals))


def streams_itl_in_window(streams: Sequence[RequestResult],
               arrivals: Sequence[RequestResult]) -> Percentiles:
    """The answered streams' gaps while the arrivals came (see gaps_in_window)."""
    return percentiles(gaps_in_window([r for r in streams if r.ok], *arrival_window(arrivals)))


def arrival_ttft(arrivals: Sequence[RequestResult]) -> Percentiles:
    """The answered arrivals' time to first token."""
    return percentiles([r.ttft_s for r in arrivals if r.ok and r.ttft_s is not None])


def failures(results: Sequence[RequestResult]) -> list[str]:
    """Why each failed request of `results` failed."""
    return [r.error or "no token" for r in results if not r.ok]


def prompt(tokens: int, seed: int) -> tuple[int, ...]:
    """`tokens` prompt token ids, the same for the same seed."""
    return tuple(bench_prompt(tokens, seed)["prompt_token_ids"])


def streams_workload(count: int, prompt_tokens: int, max_tokens: int, seed: int) -> Workload:
    """`count` independent streams, stream i's prompt from seed `seed + i`."""
    turns = tuple(Turn(session=i, turn=0, max_tokens=max_tokens,
                       tokens=prompt(prompt_tokens, seed + i)) for i in range(count))
    return Workload("streams", turns, chained=False)


async def send_after(workload: Workload, cfg: ClientConfig, delay_s: float,
                     t0: float) -> list[RequestResult]:
    """Send `workload` after `delay_s`; start times shifted to seconds since `t0`."""
    await asyncio.sleep(delay_s)
    begun = time.perf_counter() - t0
    run = await run_workload(workload, cfg)
    return [dataclasses.replace(r, start_s=r.start_s + begun) for r in run.results]


def machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """The machine a run ran on: its CPUs and its load average before and now."""
    return {"cpus": os.cpu_count(), "loadavg_before": load_before,
            "loadavg_after": os.getloadavg()}


def retry_while_memory_short(attempt: Callable[[], T], progress: Callable[[str], None],
                             label: str = "") -> T:
    """`attempt()`, again after a minute (up to 3 times) while it raises a ServerError saying
    that another engine on the machine holds the memory; `label` prefixes the progress line.

    Raises:
        ServerError: any other, or the last attempt's.
    """
    for tried in range(_START_RETRIES + 1):
        try:
            return attempt()
        except ServerError as exc:
            if _MEMORY_SHORT not in str(exc) or tried == _START_RETRIES:
                raise
            progress(f"{label}not enough free memory (another engine?), retrying in "
                     f"{_RETRY_WAIT_S:g} s")
            time.sleep(_RETRY_WAIT_S)
    raise AssertionError("unreachable")
