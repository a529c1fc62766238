"""What load_mode "auto" decides from: the measured cost of a load and of an engine step.

A hit loaded inline stretches the step that needs it, and so one inter-token gap of every
request in the batch, by the load's time. Loaded asynchronously, it costs the batch nothing
and its own request one more step or so (vLLM learns of a finished load at a step's end and
schedules the request in the next one). The rule (`LoadCosts.inline`):
  - no other request runs: inline (there is no batch to protect);
  - else inline when the load's expected time is at most INLINE_STEP_SHARE of the engine's
    median step, so that the batch feels one gap of at most 1.2x (issue 13's ITL target);
  - else asynchronous.
The expected time: the hit's chunks held in RAM times the measured seconds per RAM chunk,
plus its chunks below RAM times the measured seconds per such chunk (moving averages of the
workers' complete loads, `LoadSample`, reported with each step). Until a step time and the
costs the hit needs have been measured: a hit held in RAM inline, one below RAM asynchronous
(the measured defaults: a RAM hit adds 0.3-8.3 ms at 1k-16k tokens, a disk hit 6-91 ms,
docs/performance.md).

Primitives: `LoadSample`, `LoadCosts`, `INLINE_STEP_SHARE`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

# An inline load may stretch one step by this share of the median step: 1.2x at most.
INLINE_STEP_SHARE = 0.2
# Weight of a new load in the per-chunk moving averages: about the last five loads count.
LOAD_WEIGHT = 0.2
STEP_WINDOW = 64  # the step time is the median of this many recent steps
MIN_STEPS = 8  # steps measured before the step time is trusted


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One request's complete load, as a worker timed it."""

    ram_chunks: int  # chunks the RAM tier (the top tier) lent
    lower_chunks: int  # chunks read from a tier below it
    seconds: float  # from the first read to the last scatter


class LoadCosts:
    """Moving measures of what loads and steps cost (scheduler thread)."""

    def __init__(self) -> None:
        self._ram_chunk_s: float | None = None
        self._lower_chunk_s: float | None = None
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._last_plan_s: float | None = None  # when the last step was planned, if it ran any

    def observe_load(self, sample: LoadSample) -> None:
        """Take a worker's timing of a complete load in."""
        if sample.lower_chunks:
            ram_part_s = (self._ram_chunk_s or 0.0) * sample.ram_chunks
            per_chunk = max(0.0, sample.seconds - ram_part_s) / sample.lower_chunks
            self._lower_chunk_s = _average(self._lower_chunk_s, per_chunk)
        elif sample.ram_chunks:
            self._ram_chunk_s = _average(self._ram_chunk_s, sample.seconds / sample.ram_chunks)

    def observe_plan(self, now_s: float, runs_tokens: bool) -> None:
        """A step is planned at `now_s` (a monotonic clock); `runs_tokens`: it schedules any.
        The time since the last plan that ran tokens is that step's time."""
        if self._last_plan_s is not None:
            self._steps.append(now_s - self._last_plan_s)
        self._last_plan_s = now_s if runs_tokens else None

    @property
    def step_s(self) -> float | None:
        """The median of the recent steps' times; None until MIN_STEPS are measured. (A
        median: the steps that loaded inline, or came after an idle spell, do not move it.)"""
        if len(self._steps) < MIN_STEPS:
            return None
        return statistics.median(self._steps)

    def expected_s(self, ram_chunks: int, lower_chunks: int) -> float | None:
        """The expected time of a load of that many chunks; None until measured."""
        ram_s = self._ram_chunk_s if ram_chunks else 0.0
        lower_s = self._lower_chunk_s if lower_chunks else 0.0
        if ram_s is None or lower_s is None:
            return None
        return ram_chunks * ram_s + lower_chunks * lower_s

    def inline(self, ram_chunks: int, lower_chunks: int) -> bool:
        """Whether a hit of that many chunks, while other requests run, loads inline."""
        step_s, expected_s = self.step_s, self.expected_s(ram_chunks, lower_chunks)
        if step_s is None or expected_s is None:
            return lower_chunks == 0
        return expected_s <= INLINE_STEP_SHARE * step_s


def _average(current: float | None, new: float) -> float:
    return new if current is None else current + LOAD_WEIGHT * (new - current)
