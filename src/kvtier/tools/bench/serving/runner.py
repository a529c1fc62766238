"""One benchmark of one endpoint: scrape `/metrics`, send the workload, scrape again.

This is the piece `kvtier bench` and `kvtier demo` share. A demo comparing "without kvtier"
and "with kvtier" is two `bench_endpoint` calls on two servers (see
`kvtier.tools.ops.server`) and one
`report.write_outputs` over both runs.

Primitives: `BenchRun`, `bench_endpoint` (sync; runs its own event loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.tools.bench.serving import promdiff
from kvtier.tools.bench.serving.client import ClientConfig, WorkloadRun, run_workload, warm_up
from kvtier.tools.bench.serving.stats import RequestResult, Summary, summarize
from kvtier.tools.bench.serving.workloads import Workload


@dataclass(frozen=True, slots=True)
class BenchRun:
    """The results of one workload against one endpoint."""

    label: str  # what the report calls it ("A", "without kvtier", ...)
    url: str  # the endpoint
    model: str  # the model name sent
    workload: str  # workload name
    params: dict[str, Any]  # workload sizes and client settings
    run: WorkloadRun  # per-request results
    summary: Summary  # aggregates of `run`
    metrics: dict[str, float] | None  # counter deltas (promdiff.diff); None without /metrics
    hit_rates: dict[str, float | None]  # promdiff.hit_rates of `metrics`

    @property
    def results(self) -> tuple[RequestResult, ...]:
        return self.run.results


def bench_endpoint(workload: Workload, cfg: ClientConfig, label: str = "A",
                   on_done: Callable[[RequestResult], None] | None = None) -> BenchRun:
    """Run `workload` against `cfg.url` and return its results and counter deltas.

    Call from a thread with no running event loop. Request failures are in the results
    (`RequestResult.error`); nothing is raised for them.
    """
    return asyncio.run(_bench(workload, cfg, label, on_done))


async def _bench(workload: Workload, cfg: ClientConfig, label: str,
                 on_done: Callable[[RequestResult], None] | None) -> BenchRun:
    await warm_up(workload, cfg)
    before = await promdiff.scrape(cfg.url)
    run = await run_workload(workload, cfg, on_done)
    after = await promdiff.scrape(cfg.url)
    metrics = promdiff.diff(before, after) if before is not None and after is not None else None
    client = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("url", "model")}
    return BenchRun(
        label=label, url=cfg.url, model=cfg.model, workload=workload.name,
        params={**workload.params, **client}, run=run,
        summary=summarize(run.results, run.duration_s), metrics=metrics,
        hit_rates=promdiff.hit_rates(metrics or {}))
