"""What this engine's steps cost, learned from their own timings: the median step, and what
recomputing (prefilling) a span of a prompt costs.

A step's time is the time from its plan to the next plan (`build_connector_meta` runs once per
step), or to the end of the step that finished a request (`step_ended`: the engine may idle
after it, and an idle spell is not a step; nor is the time after a plan that ran nothing).
Of the steps that ran no inline load (a load stretches its step), the model is

    step_s = overhead + tokens * (a + b * position)

where `tokens` is the step's scheduled tokens and `position` their mean position in their
prompts (a token at position p attends p earlier ones: attention makes a token dearer the
later it comes). `overhead` is the median step that ran under MIN_PREFILL_TOKENS tokens (a
decode step); `a` and `b` are fitted by least squares, weighted by tokens, to the per-token
time `(step_s - overhead) / tokens` of the last PREFILL_WINDOW steps that ran at least
MIN_PREFILL_TOKENS, against their position (b >= 0 and a > 0; with every step at about the
same position, b = 0). Recomputing tokens s..e then costs
`(e - s) * (a + b * (s + e - 1) / 2)`; the overhead is paid by the step either way.
Until MIN_PREFILL_STEPS such steps are measured the cost is unknown (None).

Primitives: `EngineSteps`, `MIN_PREFILL_TOKENS`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

STEP_WINDOW = 64  # the median step is over this many recent steps
MIN_STEPS = 8  # steps measured before the median step is trusted
# A step with at least this many tokens is a prefill step: its time is mostly its tokens'.
MIN_PREFILL_TOKENS = 64
PREFILL_WINDOW = 32  # prefill steps the recompute cost is fitted to
MIN_PREFILL_STEPS = 3  # prefill steps measured before the recompute cost is trusted


@dataclass(frozen=True, slots=True)
class _Plan:
    """A planned step, timed when the next plan comes."""

    at_s: float
    tokens: int
    position: float  # the mean position of its tokens in their prompts
    inline_loads: bool


class EngineSteps:
    """Step times and the recompute cost they imply (scheduler thread)."""

    def __init__(self) -> None:
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._small_steps: deque[float] = deque(maxlen=STEP_WINDOW)
        # (tokens, mean position, seconds) of recent prefill steps
        self._prefills: deque[tuple[int, float, float]] = deque(maxlen=PREFILL_WINDOW)
        self._last: _Plan | None = None
        self._fit: tuple[float, float] | None = None  # (a, b); refitted when stale
        self._stale = True

    def observe_plan(self, now_s: float, tokens: int, position: float,
                     inline_loads: bool) -> None:
        """A step is planned at `now_s` (a monotonic clock): it runs `tokens` tokens at mean
        `position`, and loads inline or not. The previous plan's step took until now."""
        self.step_ended(now_s)
        self._last = _Plan(now_s, tokens, position, inline_loads)

    def step_ended(self, now_s: float) -> None:
        """The last planned step ended at `now_s` (a request it ran finished): time it now,
        before the engine perhaps idles; the next plan does not time it again."""
        last, self._last = self._last, None
        if last is None or not last.tokens:
            return
        seconds = now_s - last.at_s
        self._steps.append(seconds)
        if not last.inline_loads:
            if last.tokens < MIN_PREFILL_TOKENS:
                self._small_steps.append(seconds)
            else:
                self._prefills.append((last.tokens, last.position, seconds))
                self._stale = True

    @property
    def step_s(self) -> float | None:
        """The median of the recent steps' times; None until MIN_STEPS are measured. (A
        median: the steps that loaded inline, or came after an idle spell, do not move it.)"""
        if len(self._steps) < MIN_STEPS:
            return None
        return statistics.median(self._steps)

    def recompute_s(self, start: int, end: int) -> float | None:
        """Expected seconds to prefill a prompt's tokens `start`..`end`; None until measured."""
        fit = self._fitted()
        if fit is None or end <= start:
            return None if fit is None else 0.0
        a, b = fit
        return (end - start) * (a + b * (start + end - 1) / 2)

    def _fitted(self) -> tuple[float, float] | None:
        if self._stale:
            self._fit = self._fit_prefills()
            self._stale = False
        return self._fit

    def _fit_prefills(self) -> tuple[float, float] | None:
        if len(self._prefills) < MIN_PREFILL_STEPS:
            return None
        overhead = statistics.median(self._small_steps) if self._small_steps else 0.0
        data = np.array(self._prefills, dtype=np.float64)
        tokens, position, seconds = data[:, 0], data[:, 1], data[:, 2]
        per_token = np.maximum(seconds - overhead, 0.0) / tokens
        # Weighted by tokens: a big step says more about the per-token cost than a small one.
        weights = tokens / tokens.sum()
        mean_x = float(weights @ position)
        mean_y = float(weights @ per_token)
        spread = float(weights @ (position - mean_x) ** 2)
        b = float(weights @ ((position - mean_x) * (per_token - mean_y))) / spread \
            if spread > 1.0 else 0.0
        b = max(b, 0.0)
        a = mean_y - b * mean_x
        if a <= 0.0:  # a steep slope from noisy steps: keep the mean cost, flat
            a, b = mean_y, 0.0
        return (a, b) if a > 0.0 else None
