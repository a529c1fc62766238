"""Reports of serving benchmarks: a rich table, JSON, CSV and a PNG plot.

One report covers one or more runs of the same workload (one endpoint, or `--compare A B`,
or a demo's "without kvtier" / "with kvtier"); with two runs the table adds a B/A column.

Files written by `write_outputs(runs, out_dir)`, named after the workload:
  - `<workload>.json`: every run's settings, summary, per-turn TTFT, hit rates, counter
    deltas and per-request results, and the B/A ratios;
  - `<workload>.csv`: one row per request of every run;
  - `<workload>.png`: TTFT p50 per turn index, and TTFT of every request over time.

Primitives: `summary_table(runs)`, `run_dict(run)`, `write_outputs(runs, out_dir)`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from kvtier.tools.bench.serving import promdiff
from kvtier.tools.bench.serving.runner import BenchRun
from kvtier.tools.bench.serving.stats import Summary, by_turn, ratios, summarize

# What a turn index means in each workload (x axis of the plot).
_TURN_LABEL = {"multi-round": "turn", "long-doc": "question",
               "prefix-repetition": "use of the prefix"}
_COLORS = ("#888888", "#1f77b4", "#2ca02c", "#d62728")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


# (row label, how to format it from a run); latencies in ms.
_ROWS: tuple[tuple[str, Callable[[BenchRun], str]], ...] = (
    ("requests completed / sent", lambda r: f"{r.summary.completed} / {r.summary.requests}"),
    ("wall time (s)", lambda r: f"{r.summary.duration_s:.2f}"),
    ("request throughput (req/s)", lambda r: f"{r.summary.request_throughput_rps:.3f}"),
    ("output throughput (tok/s)", lambda r: f"{r.summary.output_throughput_tok_s:.1f}"),
    ("TTFT p50 / p90 / p99 (ms)", lambda r: " / ".join(
        _ms(v) for v in (r.summary.ttft.p50, r.summary.ttft.p90, r.summary.ttft.p99))),
    ("TTFT p50, returning turns (ms)", lambda r: _ms(_returning(r).ttft.p50)),
    ("ITL p50 / p90 / p99 (ms)", lambda r: " / ".join(
        _ms(v) for v in (r.summary.itl.p50, r.summary.itl.p90, r.summary.itl.p99))),
    ("latency p50 (ms)", lambda r: _ms(r.summary.latency.p50)),
    ("vLLM prefix cache hit rate", lambda r: _rate(r.hit_rates.get("prefix_cache"))),
    ("external (connector) hit rate", lambda r: _rate(r.hit_rates.get("external_prefix_cache"))),
)


def _returning(run: BenchRun) -> Summary:
    """Summary of the requests that are not their session's first (turn >= 1)."""
    return summarize([r for r in run.results if r.turn >= 1], run.summary.duration_s)


def summary_table(runs: Sequence[BenchRun]) -> Table:
    """A table with one column per run (and B/A ratios when there are exactly two)."""
    table = Table(title=f"kvtier bench {runs[0].workload}")
    table.add_column("")
    for run in runs:
        table.add_column(run.label, justify="right")
    two = len(runs) == 2
    if two:
        table.add_column(f"{runs[1].label} / {runs[0].label}", justify="right")
    ratio_of = _ratio_rows(runs) if two else {}
    for label, fmt in _ROWS:
        table.add_row(label, *(fmt(r) for r in runs), *([ratio_of.get(label, "")] if two else []))
    for key in sorted({k for r in runs for k in r.hit_rates if k.startswith("kvtier")}):
        label = ("kvtier lookup hit rate" if key == "kvtier_lookup"
                 else f"kvtier {key.split(':', 1)[1]} tier hit rate")
        table.add_row(label, *(_rate(r.hit_rates.get(key)) for r in runs), *([""] if two else []))
    for suffix, label in _KVTIER_TOTALS:
        values = [sum(promdiff.kvtier_counters(r.metrics or {}, suffix).values()) for r in runs]
        if any(values):
            table.add_row(label, *(f"{v:,.0f}" for v in values), *([""] if two else []))
    return table


# kvtier counters the table shows as totals over tiers (all of them are in the JSON).
_KVTIER_TOTALS = (("loaded_tokens_total", "kvtier tokens loaded"),
                  ("stored_tokens_total", "kvtier tokens stored"),
                  ("tier_evictions_total", "kvtier evictions"),
                  ("load_failures_total", "kvtier load failures"))


def _ratio_rows(runs: Sequence[BenchRun]) -> dict[str, str]:
    a, b = runs
    r = ratios(a.summary, b.summary)
    returning = ratios(_returning(a), _returning(b))

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    return {
        "request throughput (req/s)": fmt(r["request throughput"]),
        "output throughput (tok/s)": fmt(r["output tok/s"]),
        "TTFT p50 / p90 / p99 (ms)": " / ".join(fmt(r[k]) for k in ("TTFT p50", "TTFT p90",
                                                                     "TTFT p99")),
        "TTFT p50, returning turns (ms)": fmt(returning["TTFT p50"]),
        "ITL p50 / p90 / p99 (ms)": " / ".join(fmt(r[k]) for k in ("ITL p50", "ITL p90",
                                                                    "ITL p99")),
        "latency p50 (ms)": fmt(r["latency p50"]),
    }


def run_dict(run: BenchRun) -> dict[str, Any]:
    """Everything about one run, JSON-ready."""
    return {
        "label": run.label, "url": run.url, "model": run.model, "workload": run.workload,
        "params": run.params,
        "answers_from_server": run.run.answers_from_server,
        "summary": dataclasses.asdict(run.summary),
        "summary_returning_turns": dataclasses.asdict(_returning(run)),
        "ttft_by_turn": {str(k): dataclasses.asdict(v) for k, v in by_turn(run.results).items()},
        "hit_rates": run.hit_rates,
        "metrics_delta": run.metrics,
        "requests": [dataclasses.asdict(r) for r in run.results],
    }


def write_outputs(runs: Sequence[BenchRun], out_dir: str | Path) -> dict[str, Path]:
    """Write `<workload>.json`, `.csv` and `.png` for `runs` under `out_dir` (created).

    Returns {"json": path, "csv": path, "png": path}. Raises OSError when out_dir is not
    writable.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = runs[0].workload
    paths = {"json": out / f"{name}.json", "csv": out / f"{name}.csv", "png": out / f"{name}.png"}
    doc: dict[str, Any] = {"workload": name, "runs": [run_dict(r) for r in runs]}
    if len(runs) == 2:
        doc["ratios_b_over_a"] = ratios(runs[0].summary, runs[1].summary)
        doc["ratios_b_over_a_returning_turns"] = ratios(_returning(runs[0]), _returning(runs[1]))
    paths["json"].write_text(json.dumps(doc, indent=2))
    _write_csv(runs, paths["csv"])
    plot_ttft(runs, paths["png"])
    return paths


def _write_csv(runs: Sequence[BenchRun], path: Path) -> None:
    fields = ["label", "session", "turn", "prompt_tokens", "output_tokens", "start_s", "ttft_s",
              "latency_s", "itl_mean_s", "error"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for run in runs:
            for r in run.results:
                writer.writerow({
                    "label": run.label, "session": r.session, "turn": r.turn,
                    "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                    "start_s": f"{r.start_s:.6f}",
                    "ttft_s": "" if r.ttft_s is None else f"{r.ttft_s:.6f}",
                    "latency_s": f"{r.latency_s:.6f}",
                    "itl_mean_s": f"{sum(r.itl_s) / len(r.itl_s):.6f}" if r.itl_s else "",
                    "error": r.error or "",
                })


def plot_ttft(runs: Sequence[BenchRun], path: Path) -> Path:
    """Two panels: TTFT p50 (and p90 dashed) per turn index; TTFT of each request by send
    time. One color per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_turn, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, run in enumerate(runs):
        color = _COLORS[k % len(_COLORS)]
        turns = by_turn(run.results)
        xs = list(turns)
        ax_turn.plot(xs, [1000 * (p.p50 or 0) for p in turns.values()], "-o", color=color,
                     label=f"{run.label} p50")
        ax_turn.plot(xs, [1000 * (p.p90 or 0) for p in turns.values()], "--", color=color,
                     alpha=0.6, label=f"{run.label} p90")
        done = [r for r in run.results if r.ok and r.ttft_s is not None]
        ax_time.scatter([r.start_s for r in done], [1000 * (r.ttft_s or 0) for r in done], s=12,
                        color=color, label=run.label)
    from matplotlib.ticker import MaxNLocator

    ax_turn.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_turn.set_xlabel(_TURN_LABEL.get(runs[0].workload, "turn"))
    ax_turn.set_ylabel("TTFT (ms)")
    ax_turn.set_ylim(bottom=0)
    ax_time.set_xlabel("sent at (s since start)")
    ax_time.set_ylabel("TTFT (ms)")
    ax_time.set_ylim(bottom=0)
    for ax in (ax_turn, ax_time):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"kvtier bench {runs[0].workload}: time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
