"""`kvtier demo --node`: two vLLM engines on one `kvtier node`, and an engine restarted
mid-conversation that finds its conversations still in the node's RAM.

One node (`kvtier node serve`, its RAM tier in named shared memory, removed at its stop:
`--drop-ram`) and two OpenAI servers in node mode on the demo's generated model, with the
demo's small engine KV cache (`DemoPlan`), serve one multi-round chat in phases:
  1. `A: first turns`: engine A computes every user's first turn; its chunks go to the node.
  2. `A: returning turns`: half the users (X) return to A (before any restart).
  3. `B (neighbour)`: the other half (Y) return to engine B, which never saw them: their
     histories come from the node's RAM, filled by A.
  4. `A restarted`: A crashes (its engine core, which holds the node's connections, is
     killed with SIGKILL) and is started again; X's next turns are hits in the node's RAM
     (where an engine with its tiers in process restarts cold).
  5. `cold recompute`: the same prompts on B with `skip_load` (kvtier loads nothing, and B
     never saw X's histories): what A's restart would have cost them in process.
A phase's prompts are whole histories (first prompt, the workload's stand-in answers, the
new user tokens: `Workload.static_prompts`), sent as independent requests, so that a phase
can go to any engine. Each phase's figures come from the engine's counters around it: vLLM's
own prefix-cache hits, the connector's (`external`: the node's) and kvtier's loaded tokens.

Primitives: `NodePhase`, `NodeHeadline`, `NodeDemoResult`, `run_node_demo`, `node_commands`,
`PHASES`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.testing.tinymodel import make_preset_model, served_name
from kvtier.tools.bench.demo import DemoEvents, DemoPlan, server_config, warm_up
from kvtier.tools.bench.node import node_process
from kvtier.tools.bench.serving import promdiff
from kvtier.tools.bench.serving.client import ClientConfig
from kvtier.tools.bench.serving.report import run_dict
from kvtier.tools.bench.serving.runner import BenchRun, bench_endpoint
from kvtier.tools.bench.serving.workloads import Turn, Workload
from kvtier.tools.ops.cores import bind_apart
from kvtier.tools.ops.server import VllmServer
from kvtier.tools.ops.serving import ServeCommand, build_command

PHASES = ("A: first turns", "A: returning turns", "B (neighbour): returning turns",
          "A restarted: returning turns", "cold recompute (in-process restart)")


@dataclass(frozen=True, slots=True)
class NodePhase:
    """What one phase did, from its requests and its engine's counters."""

    name: str  # one of PHASES
    engine: str  # "A", "B"
    requests: int  # sent
    failed: int  # sent - completed
    prompt_tokens: int  # of the completed requests
    engine_hit_tokens: int  # vLLM's own prefix cache
    node_hit_tokens: int  # the connector's (the node's) hits, as vLLM counted them
    loaded_tokens: int  # tokens kvtier loaded into vLLM
    ttft_p50_s: float | None  # median TTFT

    @property
    def hit_share(self) -> float:
        """Hit tokens (the engine's and the node's) per prompt token."""
        return (self.engine_hit_tokens + self.node_hit_tokens) / max(self.prompt_tokens, 1)


@dataclass(frozen=True, slots=True)
class NodeHeadline:
    """The scene's verdict, as ratios of its phases' figures."""

    neighbour_node_share: float  # B's node hit tokens / its prompt tokens
    restart_ttft_vs_before: float | None  # A restarted / A before, median TTFT (~1)
    recompute_vs_restart: float | None  # cold recompute / A restarted, median TTFT


@dataclass(frozen=True, slots=True)
class NodeDemoResult:
    runs: tuple[BenchRun, ...]  # each phase's requests and counters, in PHASES order
    phases: tuple[NodePhase, ...]  # their figures
    headline: NodeHeadline
    shm_left: tuple[str, ...]  # the node's slabs still in /dev/shm after its stop (none)
    files: dict[str, Path]  # "json", "png"
    commands: tuple[str, ...]  # the node's engines, as shell lines (A, B)


def run_node_demo(plan: DemoPlan, out_dir: Path, *, work_dir: Path, model_root: Path,
                  events: DemoEvents | None = None) -> NodeDemoResult:
    """Run the node scene (module docstring).

    Args: as `kvtier.tools.bench.demo.run_demo`.

    Returns:
        Every phase's figures, the headline ratios, and the files written.

    Raises:
        kvtier.errors.ServerError: a server did not start (the message has its log's tail).
        RuntimeError: the node did not start.
        OSError: out_dir or work_dir not writable.
        KeyboardInterrupt: passed on, after the node and both servers are stopped.

    Call from a thread with no running event loop. The node and the servers are stopped on
    every way out.
    """
    ev = events or DemoEvents()
    ev.step(f"model: the {plan.preset!r} preset (random weights, generated once, cached "
            f"under {model_root})")
    model = make_preset_model(plan.preset, model_root)
    phases = _phase_workloads(plan)
    runs: list[BenchRun] = []
    shm_paths: list[str] = []  # the node's slabs
    with node_process(work_dir, f"{plan.memory_tier_bytes // (1 << 20)}MiB") as socket_path:
        ev.step(f"node: kvtier node serve on {socket_path} (RAM tier "
                f"{plan.memory_tier_bytes // (1 << 20)} MiB in /dev/shm)")
        commands = node_commands(plan, model, socket_path, work_dir)
        with contextlib.ExitStack() as stack:
            a, b = (stack.enter_context(_server(cmd, work_dir / f"vllm-{name}.log"))
                    for name, cmd in zip("AB", commands))
            _wait_ready(ev, plan, model, [("A", a), ("B", b)])
            for phase, engine, workload, extra in phases[:3]:
                runs.append(_run_phase(ev, plan, model, a if engine == "A" else b, phase,
                                       workload, extra))
            killed = _crash(a, socket_path)
            ev.step(f"A: crashed (pid {', '.join(map(str, killed))}: SIGKILL), the rest of "
                    "its server stopped; starting it again on the same node")
            shm_paths = _slabs(socket_path)
            a.start()  # the same command: its port is free again
            _wait_ready(ev, plan, model, [("A restarted", a)])
            for phase, engine, workload, extra in phases[3:]:
                runs.append(_run_phase(ev, plan, model, a if engine == "A" else b, phase,
                                       workload, extra))
    left = tuple(p for p in shm_paths if Path(p).exists())
    result = _result(runs, phases, left, [c.display() for c in commands], out_dir, plan)
    ev.step(f"wrote results to {out_dir}")
    return result


Phase = tuple[str, str, Workload, dict[str, Any] | None]  # name, engine, prompts, params


def _phase_workloads(plan: DemoPlan) -> list[Phase]:
    """The five phases' prompts: users X (even) and Y (odd); turns 0, 1 and 2."""
    chat = plan.workload()
    prompts = {(t.session, t.turn): p for t, p in zip(chat.turns, chat.static_prompts())}
    xs = range(0, plan.users, 2)
    ys = range(1, plan.users, 2)

    def turns(users: Sequence[int], turn: int) -> Workload:
        return Workload(chat.name, tuple(
            Turn(session=u, turn=turn, tokens=prompts[u, turn], max_tokens=plan.output_len)
            for u in users), chained=False, params=chat.params)

    return [(PHASES[0], "A", turns(range(plan.users), 0), None),
            (PHASES[1], "A", turns(xs, 1), None),
            (PHASES[2], "B", turns(ys, 1), None),
            (PHASES[3], "A", turns(xs, 2), None),
            (PHASES[4], "B", turns(xs, 2), {"skip_load": True})]


def node_commands(plan: DemoPlan, model: Path, socket_path: str, work_dir: Path
                  ) -> list[ServeCommand]:
    """Servers A and B: the demo's settings, their kvtier the node's, each its own port and,
    on the CPU backend, its own cores (ops/cores.py: vLLM binds both workers to the same ones
    otherwise)."""
    def command() -> ServeCommand:
        return build_command(dataclasses.replace(server_config(plan, model, False, work_dir),
                                                 kvtier=True, extra_config={"node": socket_path}))

    return bind_apart([command(), command()])


@contextlib.contextmanager
def _server(command: ServeCommand, log: Path) -> Iterator[VllmServer]:
    """A started (not yet ready) server, stopped on exit."""
    server = VllmServer(command, log)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _wait_ready(ev: DemoEvents, plan: DemoPlan, model: Path,
                servers: list[tuple[str, VllmServer]]) -> None:
    """Wait for servers started together (~50 s each on 2 cores, side by side), then warm
    each up with an uncounted first-turn-sized request of its own: one engine's warm-up
    would be a hit in the node for the next, which would then skip the one-off costs of its
    first long prefill (and pay them in a counted phase)."""
    started = time.perf_counter()
    ev.step(f"starting vLLM in node mode: {', '.join(label for label, _ in servers)} "
            f"({', '.join(s.url for _, s in servers)})")
    for label, server in servers:
        server.wait_ready(plan.startup_timeout_s)
        ev.server_ready(label, time.perf_counter() - started)
    for label, server in servers:
        bench_endpoint(warm_up(plan, seed=1_000_003 + sum(map(ord, label))),
                       _client(server, model, plan), "warm-up")


def _client(server: VllmServer, model: Path, plan: DemoPlan,
            kv_transfer_params: dict[str, Any] | None = None) -> ClientConfig:
    return ClientConfig(server.url, served_name(model) or str(model),
                        concurrency=plan.concurrency, warmup_requests=0,
                        kv_transfer_params=kv_transfer_params)


def _run_phase(ev: DemoEvents, plan: DemoPlan, model: Path, server: VllmServer, name: str,
               workload: Workload, extra: dict[str, Any] | None) -> BenchRun:
    ev.run_started(name, len(workload.turns))
    run = bench_endpoint(workload, _client(server, model, plan, extra), name,
                         on_done=lambda r: ev.request_done(name, r))
    ev.phase_finished(name, run)
    return run


def _crash(server: VllmServer, socket_path: str) -> list[int]:
    """SIGKILL the server's processes that the node lists as engines (its engine core, which
    holds the node's connections: the node ends their leases), then stop the rest of it (its
    API server, whose exit cleans up the shared memory vLLM's processes made: a SIGKILL of
    the whole group left ~400 MiB of it in /dev/shm). The pids killed."""
    from kvtier.node.client import engine_pid, node_status

    assert server.proc is not None
    engines = node_status(socket_path)["engines"]
    assert isinstance(engines, list)
    pids = [pid for pid in map(engine_pid, map(str, engines)) if pid is not None]
    mine = [pid for pid in pids if _group_of(pid) == server.proc.pid]
    for pid in mine:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.stop()
    return mine


def _group_of(pid: int) -> int | None:
    """The process group of `pid`; None when it is gone."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _slabs(socket_path: str) -> list[str]:
    """The node's RAM slabs in /dev/shm (one per layout), from its status."""
    from kvtier.node.client import node_status

    layouts = node_status(socket_path)["layouts"]
    assert isinstance(layouts, dict)
    return [str(layout["shm_path"]) for layout in layouts.values()]


def _phase(run: BenchRun, name: str, engine: str) -> NodePhase:
    metrics = run.metrics or {}
    done = [r for r in run.results if r.ok]
    return NodePhase(
        name=name, engine=engine, requests=run.summary.requests, failed=run.summary.failed,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        engine_hit_tokens=int(metrics.get("vllm:prefix_cache_hits_total", 0)),
        node_hit_tokens=int(metrics.get("vllm:external_prefix_cache_hits_total", 0)),
        loaded_tokens=int(sum(promdiff.kvtier_counters(metrics, "loaded_tokens_total")
                              .values())),
        ttft_p50_s=run.summary.ttft.p50)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _result(runs: list[BenchRun], phases: list[Phase], shm_left: tuple[str, ...],
            commands: list[str], out_dir: Path, plan: DemoPlan) -> NodeDemoResult:
    done = tuple(_phase(run, name, engine) for run, (name, engine, _, _) in zip(runs, phases))
    _first, before, neighbour, restarted, recompute = done
    head = NodeHeadline(
        neighbour_node_share=neighbour.node_hit_tokens / max(neighbour.prompt_tokens, 1),
        restart_ttft_vs_before=_ratio(restarted.ttft_p50_s, before.ttft_p50_s),
        recompute_vs_restart=_ratio(recompute.ttft_p50_s, restarted.ttft_p50_s))
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "demo-node.json", "png": out_dir / "demo-node.png"}
    files["json"].write_text(json.dumps({
        "plan": dataclasses.asdict(plan), "server_commands": commands,
        "phases": [dict(dataclasses.asdict(p), hit_share=p.hit_share) for p in done],
        "headline": dataclasses.asdict(head), "shm_left": list(shm_left),
        "runs": [run_dict(r) for r in runs]}, indent=2))
    _plot(done, files["png"])
    return NodeDemoResult(tuple(runs), done, head, shm_left, files, tuple(commands))


def _plot(phases: Sequence[NodePhase], path: Path) -> None:
    """Median TTFT per phase, bars labelled with their hit share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    values = [1000 * (p.ttft_p50_s or 0) for p in phases]
    bars = ax.barh([p.name for p in phases][::-1], values[::-1],
                   color=["#888888", "#1f77b4", "#2ca02c", "#1f77b4", "#d62728"][::-1])
    for bar, phase in zip(bars, phases[::-1]):
        ax.annotate(f" {phase.hit_share:.0%} hit", (bar.get_width(), bar.get_y() + 0.3))
    ax.set_xlabel("TTFT p50 (ms)")
    ax.set_title("kvtier demo --node: two engines on one kvtier node, one restarted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
