"""`kvtier bench clients`: the field's own benchmark clients vs vLLM without and with kvtier.

vLLM's multi-turn benchmark and LMCache's long_doc_qa run against the embedded model served
without and with kvtier; their figures side by side, and kvtier's gain.

A thin command over `kvtier.tools.bench.clients`."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from rich.table import Table

from kvtier.tools.bench.clients import (
    PLANS,
    SETUPS,
    ClientsConfig,
    ClientsResult,
    run_clients_bench,
)
from kvtier.tools.bench.clients_results import CLIENTS, METRICS, ClientFigures
from kvtier.tools.cli.argtypes import output_dir, output_file, positive_int, work_dir
from kvtier.tools.cli.bench import run_and_report, run_summary

_TITLES = {"multi-turn": "vLLM benchmarks/multi_turn/benchmark_serving_multi_turn.py",
           "long-doc-qa": "LMCache benchmarks/long_doc_qa/long_doc_qa.py (query round)"}


def register(workloads: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = workloads.add_parser(
        "clients", help="the field's benchmark clients (vLLM multi-turn, LMCache "
                        "long_doc_qa), unmodified, against vLLM with and without kvtier",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: 6 conversations, 3 documents (default: 24 "
                             "conversations of 4-6 turns, 8 at a time; 8 documents of ~2k "
                             "tokens)")
    parser.add_argument("--client", action="append", choices=CLIENTS,
                        help="clients to run (repeatable; default both)")
    parser.add_argument("--dir", type=work_dir, default=Path("."),
                        help="a scratch directory (logs, the clients' files, kvtier's disk "
                             "tier) goes here")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch directory (the clients' own outputs and logs)")
    parser.add_argument("--model-root", type=output_dir, default=Path(".kvtier-models"),
                        help="where the generated bench model is cached")
    parser.add_argument("--json", type=output_file, default=Path("results/bench-clients.json"))
    parser.add_argument("--tokens-per-chunk", type=positive_int,
                        help="kvtier's tokens_per_chunk (default: the demo's, 256)")
    parser.add_argument("--serial", action="store_true",
                        help="one request at a time (1 multi-turn client, 1 long_doc_qa "
                             "request in flight): where kvtier's greedy answers must equal "
                             "vLLM's")
    parser.add_argument("--no-tail-chunks", action="store_true",
                        help="kvtier's tail_chunks off: hits end at chunk boundaries")
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace, scratch: Path) -> ClientsConfig:
    plan = PLANS["quick" if args.quick else "full"]
    if args.serial:
        plan = replace(plan, name=f"{plan.name}-serial", clients=1, inflight=1)
    plan.validate()
    chosen = tuple(c for c in CLIENTS if c in args.client) if args.client else CLIENTS
    connector: list[tuple[str, object]] = []
    if args.tokens_per_chunk:
        connector.append(("tokens_per_chunk", args.tokens_per_chunk))
    if args.no_tail_chunks:
        connector.append(("tail_chunks", False))
    return ClientsConfig(plan=plan, work_dir=scratch, model_root=args.model_root,
                         clients=chosen, connector=tuple(connector))


def run(args: argparse.Namespace) -> int:
    scratch = tempfile.mkdtemp(prefix="kvtier-clients-", dir=args.dir) if args.keep else None
    with contextlib.nullcontext(scratch) if scratch else \
            tempfile.TemporaryDirectory(prefix="kvtier-clients-", dir=args.dir) as temp:
        config = config_from(args, Path(temp))
        command = shlex.join(["kvtier", *sys.argv[1:]])
        run_and_report("clients", lambda progress: run_clients_bench(config, progress),
                       lambda r: (*(client_table(r, c) for c in r.config.clients),
                                  run_summary(r.wall_s, r.machine, (), notes(r, scratch))),
                       lambda r: r.write_json(args.json, command), args.json)
    return 0


def client_table(result: ClientsResult, client: str) -> Table:
    """One client's figures: plain vLLM, vLLM + kvtier, and kvtier's gain (> 1: better)."""
    table = Table(title=_TITLES[client])
    for name in ("", *SETUPS, "kvtier gain"):
        table.add_column(name, justify="right" if name else "left")
    plain, kv = (result.run(client, s) for s in SETUPS)
    ratios = result.ratios(client)
    for key, metric in METRICS.items():
        values = [None if r is None else r.figures.get(key) for r in (plain, kv)]
        if all(v is None for v in values):
            continue
        label = f"{metric.label} ({metric.unit})" if metric.unit else metric.label
        gain = ratios.get(key)
        table.add_row(label, *(_fmt(v) for v in values),
                      "" if gain is None else f"{gain:.2f}x")
    tokens = [_tokens(r) for r in (plain, kv)]
    table.add_row("prompt tokens: kvtier / vLLM cache hits", *tokens, "")
    if kv is not None and kv.kvtier:
        table.add_row("kvtier: chunk reads / MiB read / chunks stored", "", _io(
            kv, dict(result.config.connector).get("tokens_per_chunk")), "")
    equal = result.answers_equal(client)
    if equal is not None:
        table.add_row("answers equal to vLLM's", "", f"{equal[0]} / {equal[1]}", "")
    return table


def notes(result: ClientsResult, kept: str | None) -> list[str]:
    lines = ["TTFT as each client measures it; gain: plain / kvtier for times, kvtier / plain "
             "for rates"]
    if kept:
        lines.append(f"the clients' outputs and the servers' logs are in {kept}")
    return lines


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def _io(run: ClientFigures, tokens_per_chunk: object) -> str:
    """kvtier's chunk reads, MiB read from its tiers, and chunks stored (tails count as
    chunks: a tail is stored in a chunk's bytes) over a run."""
    c = run.kvtier
    per_token = c["loaded_bytes"] / c["loaded_tokens"] if c.get("loaded_tokens") else None
    chunk = per_token * int(tokens_per_chunk) if per_token and isinstance(
        tokens_per_chunk, int) else None
    stored = f"{c.get('stored_bytes', 0) / chunk:,.0f}" if chunk else "-"
    return f"{c.get('tier_hits', 0):,.0f} / {c.get('tier_bytes_read', 0) / 2**20:,.1f} / {stored}"


def _tokens(run: ClientFigures | None) -> str:
    """Prompt tokens kvtier served / vLLM's own cache served, of those the run sent."""
    if run is None or run.prompt_tokens is None:
        return "-"
    kv, engine = run.kvtier_hit_tokens or 0.0, run.engine_hit_tokens or 0.0
    return f"{kv:,.0f} / {engine:,.0f} of {run.prompt_tokens:,.0f}"
