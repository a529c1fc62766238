"""PNG plots of a sweep (matplotlib, Agg backend: no display needed).

Primitives:
    plot_sweep(result, path, title) -- TTFT, throughput and hit rates against the parameter
    plot_trace(sweep, path)         -- a trace's token hit ratio against capacity, per policy
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tools.sim.sweep import SweepResult
from kvtier.tools.sim.tracesweep import TraceSweep

_LABELS = {
    "cpu_gb": "CPU tier capacity (GB)",
    "hbm_util": "gpu_memory_utilization",
    "rate": "arrival rate (requests/s)",
}
_SHADE = {"pays": "#d8f0d8", "only costs": "#f6d5d5"}


def plot_sweep(result: SweepResult, path: str | Path, title: str = "") -> Path:
    """Write a three-panel PNG of `result` to `path` and return the path.

    Panels: TTFT p50/p99 with and without offload; output throughput; prefix hit rate on
    the GPU and per tier. Backgrounds: green where offload pays, red where it only costs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.value for p in result.points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax_ttft, ax_thr, ax_hit = axes
    for ax in axes:
        _shade(ax, result)
        ax.set_xlabel(_LABELS[result.param])
        ax.grid(True, alpha=0.3)
    for attr, style, label in (("ttft_p50_s", "-", "p50"), ("ttft_p99_s", "--", "p99")):
        ax_ttft.plot(xs, [getattr(p.baseline, attr) for p in result.points], style,
                     color="#888888", marker="o", label=f"no offload {label}")
        ax_ttft.plot(xs, [getattr(p.offload, attr) for p in result.points], style,
                     color="#1f77b4", marker="o", label=f"offload {label}")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (s)")
    ax_ttft.legend(fontsize=8)
    ax_thr.plot(xs, [p.baseline.throughput_tok_s for p in result.points], color="#888888",
                marker="o", label="no offload")
    ax_thr.plot(xs, [p.offload.throughput_tok_s for p in result.points], color="#1f77b4",
                marker="o", label="offload")
    ax_thr.set_ylabel("output tokens/s")
    top = max(max(p.baseline.throughput_tok_s, p.offload.throughput_tok_s)
              for p in result.points)
    ax_thr.set_ylim(0, top * 1.2 or 1.0)
    ax_thr.legend(fontsize=8)
    _hit_panel(ax_hit, result)
    fig.suptitle((title or f"kvtier simulate: sweep of {result.param}")
                 + "\n(green: offload pays; red: offload only costs)", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    if not out.parent.is_dir():  # no parent directories are created (issue 14)
        plt.close(fig)
        raise ConfigError("plot", str(out), "a path in an existing directory")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _hit_panel(ax: Any, result: SweepResult) -> None:
    xs = [p.value for p in result.points]
    ax.plot(xs, [p.offload.gpu_hit_rate for p in result.points], marker="o",
            color="#2ca02c", label="GPU prefix cache")
    names = list(dict.fromkeys(t.name for p in result.points for t in p.offload.tiers))
    for name in names:
        rates = [sum(t.hit_rate for t in p.offload.tiers if t.name == name)
                 for p in result.points]
        ax.plot(xs, rates, marker="o", label=f"{name} tier")
    ax.set_ylabel("share of prompt blocks")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)


def _shade(ax: object, result: SweepResult) -> None:
    xs = [p.value for p in result.points]
    for i, p in enumerate(result.points):
        color = _SHADE.get(p.verdict)
        if color is None:
            continue
        left = xs[i] - xs[i - 1] if i else (xs[1] - xs[0] if len(xs) > 1 else 1.0)
        right = xs[i + 1] - xs[i] if i + 1 < len(xs) else left
        ax.axvspan(xs[i] - left / 2, xs[i] + right / 2,  # type: ignore[attr-defined]
                   color=color, zorder=0)


def plot_trace(sweep: TraceSweep, path: str | Path) -> Path:
    """Write a PNG of the token hit ratio against capacity: a line per policy, the optimum
    (dashed) and unbounded (dotted); return the path.

    Raises:
        ConfigError: `path` is not in an existing directory.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    if not out.parent.is_dir():  # no parent directories are created (issue 14)
        raise ConfigError("plot", str(out), "a path in an existing directory")
    xs = [p.capacity_tokens for p in sweep.points]
    fig, ax = plt.subplots(figsize=(8, 5))
    names = [r.policy for r in sweep.points[0].policies] if sweep.points else []
    for index, name in enumerate(names):
        ax.plot(xs, [p.policies[index].hit_ratio for p in sweep.points], marker="o", label=name)
    ax.plot(xs, [p.optimum.hit_ratio for p in sweep.points], "k--", marker="x",
            label="optimum (Belady, prefix-closed)")
    ax.axhline(sweep.unbounded.hit_ratio, color="#888888", linestyle=":", label="unbounded")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (tokens)")
    ax.set_ylabel("token hit ratio")
    ax.set_ylim(0, max(0.05, sweep.unbounded.hit_ratio * 1.15))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{Path(sweep.trace).name}: {sweep.requests:,} requests, "
                 f"blocks of {sweep.block_tokens} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
