"""`kvtier demo`: serve a generated model without and with kvtier, and compare
(kvtier.tools.bench.demo).

    kvtier demo                   # ~3-4 min on a 2-core CPU: 8 users x 4 turns
    kvtier demo --quick           # ~1-2 min: 4 users x 3 turns (CI)
    kvtier demo --out /tmp/demo   # where the table's JSON, CSV and PNG go
    kvtier demo --node            # ~3-4 min: two engines on one kvtier node, one restarted

Nothing is downloaded: the model has random weights and is generated on first use. The two
servers run one after the other on 127.0.0.1 and are stopped on every way out (Ctrl-C,
SIGTERM, an error).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.status import Status
from rich.table import Table

from kvtier.errors import ServerError
from kvtier.testing.tinymodel import default_model_root
from kvtier.tools.bench.demo import PLANS, DemoEvents, DemoPlan, headline_lines, run_demo
from kvtier.tools.bench.demo_node import NodeDemoResult, NodePhase, run_node_demo
from kvtier.tools.bench.serving.report import summary_table
from kvtier.tools.bench.serving.runner import BenchRun
from kvtier.tools.bench.serving.stats import RequestResult
from kvtier.tools.cli.argtypes import output_dir
from kvtier.tools.ops.serving import ServeCommand


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo", help="see kvtier make returning conversations fast (vLLM, no downloads)",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a smaller workload (about half the time; for CI)")
    p.add_argument("--out", type=output_dir, default=Path("results/demo"),
                   help="directory for JSON, CSV and PNG (default results/demo)")
    p.add_argument("--model-dir", type=output_dir, default=None,
                   help="where the generated model is cached (default ~/.cache/kvtier/models)")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the servers' logs (in the output directory's logs/)")
    p.add_argument("--node", action="store_true",
                   help="the node scene: two engines sharing one `kvtier node`'s RAM, and an "
                        "engine restarted mid-conversation (demo-node.json, .png)")
    p.set_defaults(func=run)


class ConsoleEvents(DemoEvents):
    """Progress on a rich console: a line per phase, a spinner while a server starts, a
    progress bar per run."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.t0 = time.perf_counter()
        self._status: Status | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def _line(self, text: str) -> None:
        self.console.print(f"[dim]{time.perf_counter() - self.t0:5.0f}s[/dim]  {text}")

    def step(self, text: str) -> None:
        self._line(text)

    def server_starting(self, label: str, command: ServeCommand, log_path: Path) -> None:
        self._line(f"[bold]{label}[/bold]: starting vLLM on {command.url}")
        self._status = self.console.status(f"waiting for vLLM ({label}) to start; log: "
                                           f"{log_path}")
        self._status.start()

    def server_ready(self, label: str, startup_s: float) -> None:
        self.close()
        self._line(f"[bold]{label}[/bold]: vLLM ready after {startup_s:.0f} s")

    def run_started(self, label: str, total_requests: int) -> None:
        self._progress = Progress(TextColumn(f"  {label}: multi-round chat"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=self.console, transient=True)
        self._task = self._progress.add_task("requests", total=total_requests)
        self._progress.start()

    def request_done(self, label: str, result: RequestResult) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)

    def run_finished(self, label: str, run: BenchRun) -> None:
        self.phase_finished(label, run)
        self._line(f"[bold]{label}[/bold]: stopping its server")

    def phase_finished(self, label: str, run: BenchRun) -> None:
        self.close()
        s = run.summary
        self._line(f"[bold]{label}[/bold]: {s.completed}/{s.requests} requests in "
                   f"{s.duration_s:.1f} s")

    def close(self) -> None:
        """Stop any spinner or bar (also on the way out after an error)."""
        if self._status is not None:
            self._status.stop()
            self._status = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvtier demo`; 0, 1 when a server failed or a request failed, 130
    when interrupted."""
    plan: DemoPlan = PLANS["quick" if args.quick else "full"]
    # Piped or captured output (CI logs) gets room for the table's four columns; a
    # terminal keeps its own width.
    console = Console(width=None if sys.stdout.isatty() else 120)
    events = ConsoleEvents(console)
    console.print(_intro(plan, args.node))
    # vLLM runs in its own process group; SIGTERM/SIGHUP unwind through the `finally` that
    # stops it, as Ctrl-C does (main.ENDING_SIGNALS).
    work = Path(tempfile.mkdtemp(prefix="kvtier-demo-"))
    scene = run_node_demo if args.node else run_demo
    try:
        result = scene(plan, args.out, work_dir=work,
                       model_root=args.model_dir or default_model_root(), events=events)
    except ServerError as exc:
        events.close()
        console.print(f"[red]kvtier demo: {exc}[/red]")
        _keep_logs(work, args.out)
        return 1
    except KeyboardInterrupt:
        events.close()
        console.print("[yellow]kvtier demo: interrupted; servers stopped[/yellow]")
        return 130
    finally:
        events.close()
        if args.keep_logs:
            _keep_logs(work, args.out)
        shutil.rmtree(work, ignore_errors=True)
    if isinstance(result, NodeDemoResult):
        lines = node_lines(result)
        console.print(node_table(result.phases))
    else:
        lines = headline_lines(result.headline)
        console.print(summary_table(result.runs))
    for line in lines:
        console.print(f"[bold green]{line}[/bold green]")
    console.print("wrote " + ", ".join(str(p) for p in result.files.values()))
    failed = [r for run in result.runs for r in run.results if not r.ok]
    if failed:
        console.print(f"[red]{len(failed)} request(s) failed; first: {failed[0].error}[/red]")
        return 1
    return 0


def _intro(plan: DemoPlan, node: bool) -> str:
    if node:
        return (f"[bold]kvtier demo --node[/bold] ({plan.name}): engines A and B on one "
                f"kvtier node; {plan.users} users' {plan.first_len}-token conversations start "
                "on A, half of them return to B, the others to A after it is killed and "
                "started again.")
    return (f"[bold]kvtier demo[/bold] ({plan.name}): {plan.users} users x {plan.turns} turns "
            f"of a chat, {plan.first_len}-token first prompts; their histories "
            f"({plan.history_tokens():,} tokens) do not fit vLLM's KV cache "
            f"({plan.engine_kv_bytes // plan.kv_bytes_per_token():,} tokens), and fit "
            f"kvtier's memory tier ({plan.memory_tier_bytes // plan.kv_bytes_per_token():,} "
            "tokens).")


def node_table(phases: Sequence[NodePhase]) -> Table:
    """The node scene's phases: requests, hits and median TTFT."""
    table = Table(title="kvtier demo --node: one kvtier node, two engines")
    for column in ("phase", "engine", "requests", "hit tokens / prompt tokens",
                   "from the node", "TTFT p50 (ms)"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for p in phases:
        table.add_row(p.name, p.engine, f"{p.requests - p.failed} / {p.requests}",
                      f"{p.engine_hit_tokens + p.node_hit_tokens:,} / {p.prompt_tokens:,} "
                      f"({p.hit_share:.0%})", f"{p.loaded_tokens:,}",
                      "-" if p.ttft_p50_s is None else f"{p.ttft_p50_s * 1000:.1f}")
    return table


def node_lines(result: NodeDemoResult) -> list[str]:
    """The node scene's verdict, for the console."""
    head, neighbour = result.headline, result.phases[2]

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    return [
        (f"B, a neighbour, loaded {neighbour.loaded_tokens:,} of its returning turns' "
         f"{neighbour.prompt_tokens:,} prompt tokens from the node's RAM "
         f"({head.neighbour_node_share:.0%}), which A filled"),
        (f"A, killed and restarted: its returning turns' TTFT p50 is "
         f"{x(head.restart_ttft_vs_before)} what it was before; recomputed (a restart with "
         f"its tiers in process starts cold) they take {x(head.recompute_vs_restart)} as "
         "long"),
        ("/dev/shm: the node's RAM slab was removed at its stop" if not result.shm_left
         else f"/dev/shm: left behind: {', '.join(result.shm_left)}"),
    ]


def _keep_logs(work: Path, out: Path) -> None:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for log in work.glob("*.log"):
        shutil.copy2(log, logs / log.name)

