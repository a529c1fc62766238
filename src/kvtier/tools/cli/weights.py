"""The router-weights table of `kvtier plan` and `kvtier inspect --metrics`: each tier's
restore cost next to recompute's, the weight they imply, and the static guess it replaces
(kvtier.tools.ops.restorecost)."""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from rich.table import Table

from kvtier.tools.ops.restorecost import ROUTERS, WEIGHT_FORMULA, TierWeight

# The connector's reasons (integrations/vllm/scheduler/offer.py), in the column's order.
DECISION_REASONS = ("loaded", "trial", "recompute_faster")


def print_router_weights(console: Console, weights: tuple[TierWeight, ...],
                         decisions: Mapping[str, Mapping[str, float]] | None = None) -> None:
    """The weights next to llm-d's and Dynamo's static guesses (plan and inspect); with
    `decisions` (measured: tier -> reason -> chunks), what the engine did with each tier's
    hits so far: loaded / trial / recompute_faster."""
    table = Table(title=f"router weights ({WEIGHT_FORMULA}; per 1k tokens)")
    columns = ["tier", "source", "restore s", "recompute s", "weight",
               *(f"{r} static" for r in ROUTERS)]
    if decisions is not None:
        columns.append("hit chunks loaded/\ntrial/recomputed")
    for col in columns:
        table.add_column(col, justify="left" if col in ("tier", "source") else "right")
    for w in weights:
        cells = [w.tier, w.source, _seconds(w.restore_s_per_1k), _seconds(w.recompute_s_per_1k),
                 "not measured" if w.weight is None else f"{w.weight:.2f}",
                 *(f"{w.static[r]:.2f}" if r in w.static else "-" for r in ROUTERS)]
        if decisions is not None:
            made = decisions.get(w.tier, {})
            cells.append("/".join(f"{made.get(r, 0):.0f}" for r in DECISION_REASONS)
                         if w.source == "measured" else "-")
        table.add_row(*cells)
    console.print(table)
    console.print("llm-d: precise prefix-cache scorer, media gpu / cpu; Dynamo: KV router, "
                  "host / disk. The weight replaces the static guess on the same row.")
    if any(w.medium is None for w in weights):
        console.print("A measured tier's static guess needs its kind: pass the server's kvtier "
                      "config (inspect --config, plan --store-config).")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
