"""`kvtier demo`: kvtier making returning conversations fast, on this machine, in minutes.

The demo generates a small random-weight model (no downloads), then serves it twice with
vLLM's OpenAI server, one server at a time: once without kvtier, once with it. Both servers
get the same, deliberately small, engine KV cache; the same multi-round chat workload runs
against each. The workload's users take turns round-robin, and all their histories together
are several times the engine's KV cache, so by the time a user returns, vLLM's own prefix
cache has evicted that user's history:
  - without kvtier, every returning turn recomputes its whole history (prefill);
  - with kvtier, the history's chunks come back from kvtier's memory tier, and only the new
    tokens are computed.
The model is the "bench" preset (kvtier.testing.tinymodel): big enough that prefill dominates a
request's time on a 2-core CPU, as it does with a real model on a GPU.

Primitives:
  - `DemoPlan`, `PLANS` ("full", "quick"): model, workload and cache sizes (frozen).
  - `server_config(plan, model, kvtier, work_dir)`: the ServeConfig of one of the two servers.
  - `run_demo(plan, out_dir, ...)`: the whole demo; returns a `DemoResult`.
  - `headline(runs)`: the ratios the demo is about, as data.
  - `warm_up(plan, seed)`: a server's uncounted first request.
The node scene (`kvtier demo --node`: two engines on one `kvtier node`) is demo_node.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.testing.tinymodel import PRESETS, make_preset_model, served_name
from kvtier.tools.bench.serving import promdiff
from kvtier.tools.bench.serving.client import ClientConfig
from kvtier.tools.bench.serving.report import write_outputs
from kvtier.tools.bench.serving.runner import BenchRun, bench_endpoint
from kvtier.tools.bench.serving.stats import RequestResult, Summary, summarize
from kvtier.tools.bench.serving.workloads import Workload, multi_round
from kvtier.tools.ops.server import free_port, running_server
from kvtier.tools.ops.serving import (
    MIB,
    ServeCommand,
    ServeConfig,
    build_command,
    connector_config,
    default_tiers,
    is_cpu_backend,
)


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """What the demo runs. The engine's KV cache must hold one longest request (vLLM
    refuses to start otherwise) and the `concurrency` requests in flight, but not all the
    users' histories; kvtier's memory tier must hold them all."""

    name: str  # "full" or "quick"
    preset: str  # model preset (kvtier.testing.tinymodel.PRESETS)
    users: int  # conversations, served round-robin
    turns: int  # turns per conversation; turns >= 1 are the "returning" ones
    first_len: int  # tokens of a conversation's first prompt (system prompt + question)
    user_len: int  # new user tokens per later turn
    output_len: int  # tokens generated per turn
    concurrency: int  # requests in flight
    max_model_len: int  # vLLM's --max-model-len (>= the longest prompt + output)
    engine_kv_bytes: int  # vLLM's own KV cache (--kv-cache-memory-bytes)
    memory_tier_bytes: int  # kvtier's memory tier
    disk_tier_bytes: int  # kvtier's disk tier (under the work directory)
    startup_timeout_s: float = 300.0  # per server start

    def workload(self) -> Workload:
        """The multi-round chat workload of this plan."""
        return multi_round(users=self.users, turns=self.turns, first_len=self.first_len,
                           user_len=self.user_len, output_len=self.output_len)

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes in the engine (and in kvtier) for this plan's model."""
        return PRESETS[self.preset].kv_bytes_per_token()

    def history_tokens(self) -> int:
        """Tokens of all users' histories at the last turn: what a cache must hold so that
        every returning turn hits."""
        last = self.first_len + (self.turns - 1) * (self.output_len + self.user_len)
        return self.users * (last + self.output_len)


# "bench" preset: 8 KiB of KV per token; prefill of 2k tokens takes about 0.5-1 s on 2 cores.
PLANS: dict[str, DemoPlan] = {
    # 8 users x 4 turns, ~2.5k-token histories: 20k tokens (160 MiB) of history against an
    # engine cache of 6k tokens (48 MiB), which holds the 2 requests in flight and little
    # else, so each returning user has been evicted by the 7 others' turns.
    "full": DemoPlan(name="full", preset="bench", users=8, turns=4, first_len=2048,
                     user_len=96, output_len=8, concurrency=2, max_model_len=4096,
                     engine_kv_bytes=48 * MIB, memory_tier_bytes=512 * MIB,
                     disk_tier_bytes=1024 * MIB),
    # For CI: 4 users x 3 turns, 1k-token prompts; 5k tokens of history against 3k.
    "quick": DemoPlan(name="quick", preset="bench", users=4, turns=3, first_len=1024,
                      user_len=64, output_len=8, concurrency=2, max_model_len=2048,
                      engine_kv_bytes=24 * MIB, memory_tier_bytes=256 * MIB,
                      disk_tier_bytes=512 * MIB),
}

# vLLM flags of both servers: 32-token blocks (the CPU backend's minimum), no CUDA graphs
# (start-up time), a fixed seed. kvtier's chunks are 256 tokens (8 blocks).
_VLLM_ARGS = ("--enforce-eager", "--block-size", "32", "--seed", "0")
LABELS = ("without kvtier", "with kvtier")


@dataclass(frozen=True, slots=True)
class Headline:
    """The demo's verdict: with kvtier / without, for the figures the demo is about."""

    returning_ttft_p50_speedup: float | None  # p50 TTFT of turns >= 1: without / with
    request_throughput_ratio: float | None  # requests per second: with / without
    kvtier_hit_rate: float | None  # prompt tokens kvtier could load / tokens asked about
    kvtier_loaded_tokens: float  # tokens kvtier loaded into vLLM during the run


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What `run_demo` did."""

    runs: tuple[BenchRun, ...]  # (without kvtier, with kvtier)
    headline: Headline
    files: dict[str, Path]  # "json", "csv", "png" (write_outputs) and "demo" (demo.json)
    commands: tuple[str, ...]  # the two server commands, as shell lines


class DemoEvents:
    """Hooks a front end implements to show progress; every method is optional to
    override. Called on the caller's thread, except `request_done` (the client's loop
    thread, which is the caller's thread too: bench_endpoint runs its own loop)."""

    def step(self, text: str) -> None:
        """A phase begins (model generation, a server start, a run, writing files)."""

    def server_starting(self, label: str, command: ServeCommand, log_path: Path) -> None:
        """The server of the run `label` is being started (this takes ~30-60 s on CPU)."""

    def server_ready(self, label: str, startup_s: float) -> None:
        """The server of the run `label` answers /health."""

    def run_started(self, label: str, total_requests: int) -> None:
        """The workload starts against the server of `label`."""

    def request_done(self, label: str, result: RequestResult) -> None:
        """One request of the run `label` finished (successfully or not)."""

    def run_finished(self, label: str, run: BenchRun) -> None:
        """The run `label` finished; its server is being stopped."""

    def phase_finished(self, label: str, run: BenchRun) -> None:
        """A phase of `kvtier demo --node` finished (its engines go on serving)."""


def server_config(plan: DemoPlan, model: Path, kvtier: bool, work_dir: Path) -> ServeConfig:
    """The server of one half of the demo: the same vLLM settings either way, plus kvtier
    (a memory tier and a disk tier under `work_dir`) when `kvtier` is True.

    The engine KV size is passed as vLLM's own --kv-cache-memory-bytes, which both the CPU
    build and CUDA vLLM understand, so the comparison is the same on a GPU."""
    extra = connector_config(default_tiers(
        cpu=is_cpu_backend(), memory_bytes=plan.memory_tier_bytes,
        disk_path=work_dir / "kv", disk_bytes=plan.disk_tier_bytes)) if kvtier else None
    short = served_name(model)  # as `kvtier serve` names it: "kvtier-bench", the dir too
    return ServeConfig(
        str(model), kvtier=kvtier, extra_config=extra, port=free_port(),
        vllm_args=(*_VLLM_ARGS, "--max-model-len", str(plan.max_model_len),
                   "--kv-cache-memory-bytes", str(plan.engine_kv_bytes)),
        served_model_name=(short, str(model)) if short else ())


def run_demo(plan: DemoPlan, out_dir: Path, *, work_dir: Path, model_root: Path,
             events: DemoEvents | None = None) -> DemoResult:
    """Run the demo: generate (or reuse) the model, then for each of "without kvtier" and
    "with kvtier" start a server, run the workload, stop the server.

    Args:
        plan: sizes (PLANS).
        out_dir: where the JSON, CSV and PNG go (created).
        work_dir: server logs and kvtier's disk tier (created; the caller removes it).
        model_root: where the generated model is cached between runs.
        events: progress hooks.

    Returns:
        The runs, the headline ratios, and the files written.

    Raises:
        kvtier.tools.ops.server.ServerError: a server did not start (the message has its
            log's tail).
        OSError: out_dir or work_dir not writable.
        KeyboardInterrupt: passed on, after the running server is stopped.

    Call from a thread with no running event loop. At most one server runs at a time, and
    it is stopped on every way out of this function.
    """
    ev = events or DemoEvents()
    ev.step(f"model: the {plan.preset!r} preset (random weights, generated once, cached "
            f"under {model_root})")
    model = make_preset_model(plan.preset, model_root)
    workload = plan.workload()
    runs: list[BenchRun] = []
    commands: list[str] = []
    for label, on in zip(LABELS, (False, True)):
        command = build_command(server_config(plan, model, on, work_dir))
        commands.append(command.display())
        log = work_dir / f"vllm-{'kvtier' if on else 'baseline'}.log"
        ev.server_starting(label, command, log)
        started = time.perf_counter()
        with running_server(command, log_path=log,
                            startup_timeout_s=plan.startup_timeout_s) as server:
            ev.server_ready(label, time.perf_counter() - started)
            cfg = ClientConfig(server.url, served_name(model) or str(model),
                               concurrency=plan.concurrency)
            ev.step(f"{label}: warming up (one uncounted {plan.first_len}-token request)")
            bench_endpoint(warm_up(plan), cfg, "warm-up")
            ev.run_started(label, len(workload.turns))

            def done(result: RequestResult, label: str = label) -> None:
                ev.request_done(label, result)

            run = bench_endpoint(workload, cfg, label, on_done=done)
            runs.append(run)
            ev.run_finished(label, run)
    ev.step(f"writing results to {out_dir}")
    files = write_outputs(runs, out_dir)
    head = headline(runs)
    files["demo"] = out_dir / "demo.json"
    files["demo"].write_text(json.dumps({
        "plan": asdict(plan), "history_tokens": plan.history_tokens(),
        "engine_kv_tokens": plan.engine_kv_bytes // plan.kv_bytes_per_token(),
        "headline": asdict(head), "server_commands": commands,
        "results": {k: str(v) for k, v in files.items() if k != "demo"},
    }, indent=2))
    return DemoResult(tuple(runs), head, files, tuple(commands))


def warm_up(plan: DemoPlan, seed: int = 1_000_003) -> Workload:
    """One first-turn-sized request sharing no token sequence with the workload (another
    seed). The first long prefill of a fresh server pays one-off costs (allocations, kernel
    selection for new shapes: turn 0 of whichever run came first was slower by up to 2x
    in trials), and kvtier's first stores touch fresh memory; both servers pay them here."""
    return multi_round(users=1, turns=1, first_len=plan.first_len, user_len=1,
                       output_len=plan.output_len, seed=seed)


def headline(runs: Sequence[BenchRun]) -> Headline:
    """The demo's ratios from its two runs (without kvtier, with kvtier)."""
    without, with_ = runs
    slow, fast = returning(without).ttft.p50, returning(with_).ttft.p50
    rate_a = without.summary.request_throughput_rps
    rate_b = with_.summary.request_throughput_rps
    loaded = sum(promdiff.kvtier_counters(with_.metrics or {}, "loaded_tokens_total").values())
    return Headline(
        returning_ttft_p50_speedup=slow / fast if slow and fast else None,
        request_throughput_ratio=rate_b / rate_a if rate_a and rate_b else None,
        kvtier_hit_rate=with_.hit_rates.get("kvtier_lookup"),
        kvtier_loaded_tokens=loaded)


def returning(run: BenchRun) -> Summary:
    """Summary of the returning turns of a run (turn >= 1: a user's history is in the
    prompt), over the whole run's wall time."""
    return summarize([r for r in run.results if r.turn >= 1], run.summary.duration_s)


def _ratio_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


def headline_lines(head: Headline) -> list[str]:
    """The verdict as two short sentences, for the console."""
    return [
        (f"returning turns get their first token "
         f"{_ratio_text(head.returning_ttft_p50_speedup)} faster with kvtier (p50)"),
        (f"request throughput: {_ratio_text(head.request_throughput_ratio)} with kvtier; "
         f"kvtier loaded {head.kvtier_loaded_tokens:,.0f} prompt tokens instead of "
         "recomputing them"),
    ]

