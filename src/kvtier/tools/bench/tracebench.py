"""`kvtier bench trace`: a slice of a request trace replayed against real vLLM engines, without
kvtier and with kvtier under each eviction policy, beside the simulator's prediction.

The slice (traceslice.py) is sent to one vLLM OpenAI server (CPU backend, the generated
"bench" model) per configuration, all started side by side, one request at a time in the
trace's order, each request to every server in turn (what matters is the cache's decisions;
a change in the shared machine's load weighs on every configuration alike), one output token
each. Only the server being sent to runs: the others are stopped (SIGSTOP) from SETTLE_S after
their last answer until their next request, as an idle vLLM busy-polls its queue for a second
after each step: with three servers' polls running beside it, a request's TTFT was the 2
cores' contention (every configuration's p90 ~1 s, load average 15-22), not its prefill:
  - `vllm`: plain vLLM, its own prefix cache only;
  - `lru`, `prefix`, ...: kvtier with one memory tier of `capacity_blocks` chunks (a chunk is
    a trace block: `block_tokens` tokens) under that `eviction:`, storing in the step
    (`store_mode: sync`: a request's chunks are in the tier before the next request comes).
Every server gets the same engine KV cache, the smallest that holds the longest prompt, so
vLLM's own cache keeps about one request and kvtier's tier decides what comes back. The
simulator replays the same prompts through the same policy classes at the same capacity in
chunks, in this run, behind an engine cache of vLLM's size (`kvtier.tools.sim.enginereplay`):
its hit ratio is the prediction of the engine's prefill tokens saved (vLLM's own hits and
kvtier's loads together, over the prompt tokens); kvtier's tier alone (`replay`, what
`kvtier simulate --trace` prints) is recorded beside it. Per configuration: TTFT
p50/p90/p99, prompt tokens, tokens served by vLLM's cache and loaded from kvtier (and those
kvtier offered: more where a load failed), kvtier's hit ratio per tier (its chunk reads a
tier served / asked) and counters, and the ratios to plain vLLM and of each policy to LRU.

Primitives: `TraceBenchConfig`, `ConfigRun`, `TraceBenchResult`, `run_trace_bench`,
`plot_trace_bench`, `max_model_len`, `engine_kv_tokens`, `memory_tier_bytes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.core.chunkformat import ALIGN_BYTES
from kvtier.core.policies import POLICIES as MEMORY_EVICTIONS
from kvtier.errors import ConfigError
from kvtier.testing.tinymodel import PRESETS, make_preset_model, served_name
from kvtier.tools.bench.headroom import MemoryNeed, require_memory
from kvtier.tools.bench.serving.arrivals import machine
from kvtier.tools.bench.serving.client import ClientConfig
from kvtier.tools.bench.serving.promdiff import hit_rates, kvtier_counters
from kvtier.tools.bench.serving.runner import BenchRun, bench_endpoint
from kvtier.tools.bench.serving.stats import Percentiles, percentiles
from kvtier.tools.bench.serving.workloads import Turn, Workload
from kvtier.tools.bench.traceslice import TOKEN_LOW, SliceSpec, TraceSlice, slice_trace
from kvtier.tools.ops.server import VllmServer, free_port
from kvtier.tools.ops.serving import ServeConfig, build_command, connector_config
from kvtier.tools.sim.cost import CostModel, build_cost_model, model_spec
from kvtier.tools.sim.enginereplay import EngineReplay, replay_behind_engine
from kvtier.tools.sim.replay import parse_policy, replay
from kvtier.tools.sim.trace import Trace

PLAIN = "vllm"  # the configuration without kvtier
POLICIES = ("lru", "prefix")  # kvtier's configurations by default: their eviction policy
PRESET = "bench"  # the generated model: prefill dominates a request's time on 2 cores
OUTPUT_TOKENS = 1  # per request: the TTFT is the measurement
# A server runs this long past its answer before it is stopped (its stores are done by then:
# in the step, `_server`), so that no bookkeeping of the answer's step is left for the
# next request's time.
SETTLE_S = 0.1
# vLLM flags of every server: 32-token blocks (the CPU backend's minimum), no CUDA graphs, a
# fixed seed (as the demo's servers).
_VLLM_ARGS = ("--enforce-eager", "--block-size", "32", "--seed", "0")
ENGINE_BLOCK_TOKENS = 32


@dataclass(frozen=True, slots=True)
class TraceBenchConfig:
    """What one `kvtier bench trace` run does. Validated by `validate`."""

    trace: Path  # the trace file (either format of kvtier.tools.sim.trace)
    spec: SliceSpec  # the slice and its scaling
    capacity_tokens: int  # kvtier's memory tier, in tokens of the whole trace (scaled)
    work_dir: Path  # server logs, the slice as a generic trace
    model_root: Path  # where the generated model is cached
    configs: tuple[str, ...] = (PLAIN, *POLICIES)  # PLAIN and/or eviction policies
    startup_timeout_s: float = 300.0  # per server start

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        self.spec.validate()
        if self.spec.block_tokens % ENGINE_BLOCK_TOKENS:
            raise ConfigError("block_tokens", self.spec.block_tokens,
                              f"a multiple of vLLM's block ({ENGINE_BLOCK_TOKENS} tokens)")
        # Below one chunk of the slice (`TraceSlice.scaled_blocks`) every policy ran against
        # an empty memory tier: a run that measures nothing.
        least = math.ceil(self.spec.trace_block_tokens / self.spec.sample)
        if self.capacity_tokens < least and any(name != PLAIN for name in self.configs):
            raise ConfigError("capacity", self.capacity_tokens,
                              f"at least one chunk of the slice: {least:,} tokens of the trace "
                              f"(a {self.spec.trace_block_tokens}-token block at sample "
                              f"{self.spec.sample:g})")
        if not self.configs:
            raise ConfigError("configs", "", "at least one configuration")
        for i, name in enumerate(self.configs):
            if name != PLAIN and name not in MEMORY_EVICTIONS:  # named as --policy takes it
                raise ConfigError("policy", name, f"one of {', '.join(MEMORY_EVICTIONS)} (a "
                                  "memory tier's eviction; the simulator's +admitN and clock "
                                  "are not)")
            if name in self.configs[:i]:  # a second server run, its results under one name
                raise ConfigError("policy", name, "each policy once" + (
                    f" ({PLAIN}, the run without kvtier, comes first unless --no-plain)"
                    if name == PLAIN else ""))


@dataclass(frozen=True, slots=True)
class ConfigRun:
    """One configuration's run over the slice."""

    name: str  # PLAIN or an eviction policy
    requests: int  # sent
    failures: list[str]  # why failed requests failed
    prompt_tokens: int  # of the completed requests
    engine_hit_tokens: int  # served by vLLM's own prefix cache
    kvtier_hit_tokens: int  # loaded from kvtier (kvtier's loaded_tokens)
    tier_hit_ratios: dict[str, float | None]  # kvtier tier -> chunk reads served / asked
    ttft: Percentiles  # of the completed requests
    wall_s: float  # the requests' wall time
    # the simulator's prediction for this configuration (`_predict`)
    predicted: dict[str, Any] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)  # each completed request's
    # vLLM's external prefix-cache hits: what kvtier offered and vLLM took. More than
    # kvtier_hit_tokens where a load failed: a hit offered on a chunk evicted before its load
    # is recomputed.
    kvtier_offered_tokens: int = 0
    kvtier_lookup_tokens: int = 0  # prompt tokens kvtier was asked about (past vLLM's hit)
    kvtier_counters: dict[str, float] = field(default_factory=dict)  # kvtier's, this run

    @property
    def saved_tokens(self) -> int:
        """Prompt tokens not prefilled: vLLM's own hits and kvtier's."""
        return self.engine_hit_tokens + self.kvtier_hit_tokens

    @property
    def saved_ratio(self) -> float:
        return self.saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def kvtier_hit_ratio(self) -> float | None:
        """Tokens loaded from kvtier over the tokens it was asked about (past vLLM's hit)."""
        return self.kvtier_hit_tokens / self.kvtier_lookup_tokens \
            if self.kvtier_lookup_tokens else None

    @property
    def predicted_ratio(self) -> float | None:
        """The simulator's prefill tokens saved over prompt tokens, behind the engine's cache."""
        return float(self.predicted["hit_ratio"]) if self.predicted else None


@dataclass(frozen=True, slots=True)
class TraceBenchResult:
    config: TraceBenchConfig
    slice: TraceSlice
    capacity_blocks: int  # kvtier's memory tier, in chunks
    memory_tier_bytes: int
    engine_kv_tokens: int  # vLLM's own KV cache, in tokens
    runs: tuple[ConfigRun, ...]
    commands: dict[str, str]  # configuration -> its server's command line
    wall_s: float
    machine: dict[str, Any]

    def by_name(self) -> dict[str, ConfigRun]:
        return {run.name: run for run in self.runs}

    def ratios(self) -> dict[str, dict[str, float | None]]:
        """Per configuration: TTFT p50/p90/p99 over plain vLLM's and over LRU's, and the median
        of its requests' TTFT over theirs, request by request; prefill tokens saved over
        LRU's, measured and predicted."""
        runs = self.by_name()
        out: dict[str, dict[str, float | None]] = {}
        for run in self.runs:
            row: dict[str, float | None] = {}
            for base_name, label in ((PLAIN, "vs_vllm"), ("lru", "vs_lru")):
                base = runs.get(base_name)
                if base is None or base is run:
                    continue
                for q in ("p50", "p90", "p99"):
                    row[f"ttft_{q}_{label}"] = _ratio(getattr(run.ttft, q),
                                                      getattr(base.ttft, q))
                row[f"ttft_paired_median_{label}"] = _paired_median(run, base)
                if base_name == "lru":
                    row["saved_vs_lru"] = _ratio(run.saved_tokens, base.saved_tokens)
                    row["predicted_saved_vs_lru"] = _ratio(
                        run.predicted_ratio, base.predicted_ratio)
            out[run.name] = row
        return out

    def to_dict(self, command: str) -> dict[str, Any]:
        return {
            "command": command, "trace": self.slice.trace,
            "slice": {**dataclasses.asdict(self.config.spec),
                      "requests": len(self.slice.requests),
                      "trace_requests": self.slice.trace_requests,
                      "prompt_tokens": self.slice.prompt_tokens},
            "capacity_tokens_of_trace": self.config.capacity_tokens,
            "capacity_blocks": self.capacity_blocks,
            "memory_tier_bytes": self.memory_tier_bytes,
            "engine_kv_tokens": self.engine_kv_tokens, "wall_s": self.wall_s,
            "machine": self.machine, "server_commands": self.commands,
            "runs": [dict(dataclasses.asdict(run), saved_tokens=run.saved_tokens,
                          saved_ratio=run.saved_ratio, predicted_ratio=run.predicted_ratio,
                          kvtier_hit_ratio=run.kvtier_hit_ratio)
                     for run in self.runs],
            "ratios": self.ratios()}

    def write_json(self, path: Path, command: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(command), indent=2) + "\n")


def _paired_median(run: ConfigRun, base: ConfigRun) -> float | None:
    """The median over requests of `run`'s TTFT over `base`'s for the same request; None
    unless every request completed in both."""
    if run.failures or base.failures or len(run.ttft_s) != len(base.ttft_s) or not run.ttft_s:
        return None
    return statistics.median(a / b for a, b in zip(run.ttft_s, base.ttft_s) if b > 0)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def max_model_len(spec: SliceSpec) -> int:
    """vLLM's --max-model-len: the longest prompt and its output tokens."""
    return spec.max_prompt_tokens() + OUTPUT_TOKENS


def engine_kv_tokens(spec: SliceSpec) -> int:
    """vLLM's own KV cache: the longest request in whole blocks, and the block vLLM keeps
    aside (its null block: a cache of N blocks holds N - 1 blocks of requests)."""
    return (-(-max_model_len(spec) // ENGINE_BLOCK_TOKENS) + 1) * ENGINE_BLOCK_TOKENS


def memory_tier_bytes(capacity_blocks: int, block_tokens: int) -> int:
    """A memory tier of exactly `capacity_blocks` slots for chunks of `block_tokens` tokens of
    the generated model (`tiers/memory.py`: a slot is a chunk rounded up to ALIGN_BYTES)."""
    chunk = block_tokens * PRESETS[PRESET].kv_bytes_per_token()
    return capacity_blocks * (-(-chunk // ALIGN_BYTES) * ALIGN_BYTES)


def run_trace_bench(config: TraceBenchConfig,
                    progress: Callable[[str], None] = lambda _text: None) -> TraceBenchResult:
    """Cut the slice, predict each policy, run each configuration; see the module docstring.

    Raises:
        ConfigError: a bad setting or trace; NotEnoughMemory where the servers' memory
            tiers (--capacity) do not fit in the RAM available.
        kvtier.errors.ServerError: a server did not start (the message has its log's tail).
    """
    config.validate()
    started, load_before = time.perf_counter(), os.getloadavg()
    progress("slicing the trace")
    cut = slice_trace(config.trace, config.spec)
    trace = cut.as_trace(config.work_dir / "slice.jsonl")
    blocks = cut.scaled_blocks(config.capacity_tokens)
    kv_tokens = engine_kv_tokens(config.spec)
    # vLLM's pool less its null block, in chunks
    engine_blocks = (kv_tokens - ENGINE_BLOCK_TOKENS) // config.spec.block_tokens
    predictions = {name: _predict(trace, name, blocks, engine_blocks) for name in config.configs}
    tier_bytes = memory_tier_bytes(blocks, config.spec.block_tokens)
    tiers = sum(name != PLAIN for name in config.configs)  # their servers run side by side
    require_memory(MemoryNeed("--capacity", config.capacity_tokens, tiers * tier_bytes, 0,
                              f"{tiers} memory tier(s) of {blocks} chunks, a server each"))
    model = make_preset_model(PRESET, config.model_root)
    # Each request a session of one turn: "chained" only to have the server send the answer's
    # token ids (`return_token_ids`): a byte-level token alone may decode to no text, which
    # the client would take for no token.
    workload = Workload("trace", tuple(
        Turn(session=r.index, turn=0, tokens=r.prompt, max_tokens=OUTPUT_TOKENS)
        for r in cut.requests), chained=True)
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in config.configs:
            progress(f"{name}: starting vLLM")
            servers[name] = stack.enter_context(
                _server(config, name, model, tier_bytes, kv_tokens))
        sent = _send_interleaved(workload, servers, model, progress)
    runs = tuple(_config_run(name, sent[name], predictions[name]) for name in config.configs)
    return TraceBenchResult(config, cut, blocks, tier_bytes, kv_tokens, runs,
                            {name: s.command.display() for name, s in servers.items()},
                            time.perf_counter() - started, machine(load_before))


def _send_interleaved(workload: Workload, servers: dict[str, VllmServer], model: Path,
                      progress: Callable[[str], None]) -> dict[str, list[BenchRun]]:
    """Each request to every server in turn, one at a time, the servers' order rotating
    request by request: the machine's load (shared, it moves by 2x from minute to minute)
    weighs on every configuration alike, so their TTFTs compare request by request. Each
    server runs only for its request (`_running`)."""
    names = list(servers)
    sent: dict[str, list[BenchRun]] = {name: [] for name in names}
    for i, turn in enumerate(workload.turns):
        if i % 25 == 0:
            progress(f"request {i + 1}/{len(workload.turns)} to each of {', '.join(names)}")
        one = Workload(workload.name, (turn,), chained=workload.chained)
        for name in names[i % len(names):] + names[:i % len(names)]:
            with _running(servers[name]):
                sent[name].append(bench_endpoint(one, _client(servers[name], model), name))
    return sent


@contextlib.contextmanager
def _running(server: VllmServer) -> Iterator[None]:
    """The server resumed for the block, then, SETTLE_S after it (whatever it did), stopped
    (see the module docstring)."""
    server.resume()
    try:
        yield
    finally:
        time.sleep(SETTLE_S)
        server.pause()


def _predict(trace: Trace, name: str, capacity_blocks: int,
             engine_blocks: int) -> dict[str, Any]:
    """The simulator's prediction for one configuration: behind the engine's cache
    (`enginereplay`: what the engine should measure) and kvtier's tier alone (`replay`: what
    `kvtier simulate --trace` prints for the slice). Plain vLLM: a tier of no chunks."""
    cost = _cost_model()
    spec = parse_policy("lru" if name == PLAIN else name)
    blocks = 0 if name == PLAIN else capacity_blocks
    engine: EngineReplay = replay_behind_engine(trace, spec, blocks, engine_blocks,
                                                OUTPUT_TOKENS, cost)
    return {"hit_ratio": engine.result.hit_ratio, "hit_tokens": engine.result.hit_tokens,
            "engine_hit_tokens": engine.engine_hit_tokens,
            "kvtier_hit_tokens": engine.tier_hit_tokens,
            "input_tokens": engine.result.input_tokens,
            "kvtier_hit_ratio": engine.tier_hit_tokens / max(
                1, engine.result.input_tokens - engine.engine_hit_tokens),
            "tier_alone_hit_ratio": replay(trace, spec, blocks, cost).hit_ratio}


def _cost_model() -> CostModel:
    """The simulator's default prefill cost (`kvtier simulate`'s): only its token counts are
    compared here; its seconds are the simulator's, for a GPU."""
    from kvtier.tools.ops.hardware import gpu_profile

    return build_cost_model(model_spec("llama-3.1-8b"), gpu_profile("h100"))


@contextlib.contextmanager
def _server(config: TraceBenchConfig, name: str, model: Path, tier_bytes: int,
            kv_tokens: int) -> Iterator[VllmServer]:
    """The configuration's server, ready and warmed up; stopped on exit."""
    # Stores in the step (store_mode sync): a request's chunks are in the tier when its answer
    # comes, as the simulator has them for the next request, however late the server is
    # stopped (async stores land a step later, and the server may be stopped before).
    extra = None if name == PLAIN else {**connector_config(
        [{"kind": "memory", "capacity": tier_bytes, "eviction": name}],
        tokens_per_chunk=config.spec.block_tokens), "store_mode": "sync"}
    short = served_name(model)
    serve = ServeConfig(
        str(model), kvtier=name != PLAIN, extra_config=extra, port=free_port(),
        vllm_args=(*_VLLM_ARGS, "--max-model-len", str(max_model_len(config.spec)),
                   "--kv-cache-memory-bytes",
                   str(kv_tokens * PRESETS[PRESET].kv_bytes_per_token())),
        served_model_name=(short, str(model)) if short else ())
    config.work_dir.mkdir(parents=True, exist_ok=True)
    server = VllmServer(build_command(serve), config.work_dir / f"vllm-{name}.log")
    try:
        server.start()
        server.wait_ready(config.startup_timeout_s)
        # One uncounted request shorter than a chunk (so kvtier stores nothing of it): the
        # first prefill of a fresh server pays one-off costs.
        warm = tuple(TOKEN_LOW + i % 7 for i in range(config.spec.block_tokens - 1))
        with _running(server):
            bench_endpoint(Workload("warm-up", (Turn(-1, 0, warm, OUTPUT_TOKENS),),
                                    chained=True), _client(server, model), "warm-up")
        yield server
    finally:
        server.stop()


def _client(server: VllmServer, model: Path) -> ClientConfig:
    return ClientConfig(server.url, served_name(model) or str(model), concurrency=1,
                        warmup_requests=0)


def _config_run(name: str, sent: list[BenchRun], predicted: dict[str, Any]) -> ConfigRun:
    """One configuration's requests (a BenchRun each), their counters summed."""
    results = [r for run in sent for r in run.results]
    done = [r for r in results if r.ok]
    metrics: dict[str, float] = {}
    for run in sent:
        for key, value in (run.metrics or {}).items():
            if key.split("{")[0].endswith("_total"):
                metrics[key] = metrics.get(key, 0.0) + value
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    return ConfigRun(
        name=name, requests=len(results),
        failures=[r.error or "no token" for r in results if not r.ok],
        prompt_tokens=sum(r.prompt_tokens for r in done),
        engine_hit_tokens=int(metrics.get("vllm:prefix_cache_hits_total", 0.0)),
        kvtier_hit_tokens=int(sum(kvtier_counters(metrics, "loaded_tokens_total").values())),
        kvtier_offered_tokens=int(metrics.get("vllm:external_prefix_cache_hits_total", 0.0)),
        kvtier_lookup_tokens=int(sum(kvtier_counters(metrics, "lookup_tokens_total").values())),
        kvtier_counters={key.removeprefix("vllm:"): value for key, value in metrics.items()
                         if "kvtier_" in key and value},
        tier_hit_ratios={key.removeprefix("kvtier_tier:"): value
                         for key, value in hit_rates(metrics).items()
                         if key.startswith("kvtier_tier:")},
        ttft=percentiles(ttfts), wall_s=sum(run.summary.duration_s for run in sent),
        predicted=predicted,
        ttft_s=ttfts)


def plot_trace_bench(result: TraceBenchResult, path: Path) -> Path:
    """A PNG: each configuration's TTFT distribution, and its prefill tokens saved measured
    beside the simulator's prediction. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in result.runs:
        ttfts = sorted(run.ttft_s)
        label = run.name if run.name == PLAIN else f"kvtier {run.name}"
        cdf.plot([t * 1e3 for t in ttfts], [(i + 1) / len(ttfts) for i in range(len(ttfts))],
                 label=label)
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT, one at a time")
    cdf.legend()
    names = [run.name for run in result.runs]
    at = range(len(names))
    bars.bar([x - 0.2 for x in at], [run.saved_ratio * 100 for run in result.runs], 0.4,
             label="measured")
    bars.bar([x + 0.2 for x in at], [(run.predicted_ratio or 0) * 100 for run in result.runs],
             0.4, label="simulator")
    bars.set_xticks(list(at), names)
    bars.set(ylabel="prefill tokens saved (%)", title="vLLM's cache + kvtier")
    bars.legend()
    fig.suptitle(f"kvtier bench trace: {len(result.slice.requests)} requests, kvtier RAM "
                 f"{result.capacity_blocks} chunks")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
