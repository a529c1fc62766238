"""`kvtier bench disagg`: disaggregated prefill through kvtier vs one instance, under a mixed
workload (issue 16's benchmark).

Two setups, one after the other, on 127.0.0.1 with the generated "bench" model
(`kvtier.testing.tinymodel`), kvtier on a memory tier + a `shared` directory (a scratch
directory), `chunk_tokens`-token chunks:

  - `single`: one vLLM server with kvtier (kv_both) serves everything;
  - `disagg`: a prefill server (kv_producer) and a decode server (kv_consumer) on the same
    shared directory behind `kvtier proxy` (kvtier.tools.ops.disagg_proxy), which gets every
    request; the two servers share this machine's cores.

Where the servers' model compute runs (`split_cores`): by default vLLM's CPU backend binds
each server's worker threads itself, to the same cores in every process (the first cores of
the NUMA node, the last one reserved for the engine core), so on one machine the prefill and
the decode instance compute on the same core(s). `split_cores` binds them instead
(VLLM_CPU_OMP_THREADS_BIND): the single server's worker on every core, the prefill's on the
first half, the decode's on the second, the way separate hardware would hold them.

The workload (the same for both): K streams (short prompts) decode `stream_tokens` tokens
each; while they run, M long, new prompts (`arrival_tokens`, never seen before) arrive
`arrival_gap_s` apart and generate `arrival_max_tokens` each. Measured, through the front
(the server, or the proxy): the streams' inter-token latency while the arrivals come (gaps
whose later token came between the first arrival sent and the last answered), and the
arrivals' time to first token and ITL. A warm-up request on each path comes first.

Primitives: `DisaggBenchConfig`, `SetupRun`, `DisaggResult`, `run_disagg_bench`, `SETUPS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, ServerError
from kvtier.testing.tinymodel import PRESETS, make_preset_model
from kvtier.tools.bench.serving import promdiff
from kvtier.tools.bench.serving.arrivals import (
    arrival_schedule,
    arrival_ttft,
    arrival_window,
    failures,
    machine,
    prompt,
    retry_while_memory_short,
    send_after,
    streams_itl_in_window,
    streams_workload,
)
from kvtier.tools.bench.serving.client import ClientConfig, run_workload
from kvtier.tools.bench.serving.stats import Percentiles, RequestResult, percentiles
from kvtier.tools.bench.serving.workloads import Turn, Workload
from kvtier.tools.ops.disagg_proxy import ProxyConfig, running_proxy
from kvtier.tools.ops.server import VllmServer, free_port
from kvtier.tools.ops.serving import GIB, ServeConfig, build_command

SETUPS = ("single", "disagg")


@dataclass(frozen=True, slots=True)
class DisaggBenchConfig:
    """What one `kvtier bench disagg` run does. Validated by `validate`."""

    directory: Path  # a scratch directory (server logs, the shared tier) is made under it
    model_root: Path  # where the generated bench model is written (or reused)
    setups: tuple[str, ...] = SETUPS  # which setups to run (SETUPS)
    streams: int = 4  # K: requests decoding while the arrivals come
    stream_prompt_tokens: int = 64  # each stream's prompt
    stream_tokens: int = 256  # tokens each stream generates (ignore_eos)
    arrivals: int = 6  # M: long new prompts
    arrival_tokens: int = 4096  # each arrival's prompt
    arrival_gap_s: float = 1.0  # between two arrivals
    lead_s: float = 1.0  # the first arrival is sent this long after the streams
    arrival_max_tokens: int = 16  # tokens each arrival generates
    chunk_tokens: int = 128  # kvtier's tokens_per_chunk (a multiple of vLLM's block, 128)
    engine_kv_bytes: int = 1 * GIB  # each server's own KV cache (--kv-cache-memory-bytes)
    startup_timeout_s: float = 600.0  # per server start
    # False: vLLM's own CPU binding (every server's worker on the same cores); True: the
    # cores split between prefill and decode, all of them for single (module docstring)
    split_cores: bool = False
    request_timeout_s: float = 300.0  # one request's limit

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        for name in ("streams", "stream_prompt_tokens", "stream_tokens", "arrivals",
                     "arrival_tokens", "arrival_max_tokens", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "an integer >= 1")
        if self.chunk_tokens % 128:
            raise ConfigError("chunk_tokens", self.chunk_tokens, "a multiple of 128")
        for name in ("arrival_gap_s", "lead_s"):  # each its own value (one is an option)
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "seconds >= 0")
        if self.max_model_len > PRESETS["bench"].max_position_embeddings:
            raise ConfigError("arrival_tokens", self.arrival_tokens,
                              "prompt + generated tokens within the bench model's "
                              f"{PRESETS['bench'].max_position_embeddings} positions")
        for name in self.setups:
            if name not in SETUPS:
                raise ConfigError("setups", name, f"some of {SETUPS}")
        if self.split_cores and len(os.sched_getaffinity(0)) < 2:
            raise ConfigError("split_cores", True, "a machine with at least 2 cores")

    @property
    def max_model_len(self) -> int:
        return max(self.arrival_tokens + self.arrival_max_tokens,
                   self.stream_prompt_tokens + self.stream_tokens)


@dataclass(frozen=True, slots=True)
class SetupRun:
    """What one setup did, seen from its front."""

    name: str  # one of SETUPS
    commands: tuple[str, ...]  # the servers' command lines
    startup_s: float  # until every server answered /health
    streams: tuple[RequestResult, ...]
    arrivals: tuple[RequestResult, ...]
    # counter deltas over the timed phase of the server that answers (decode, or single)
    metrics: dict[str, float] | None

    @property
    def window_s(self) -> tuple[float, float]:
        """(first arrival sent, last arrival answered), seconds into the run."""
        return arrival_window(self.arrivals)

    @property
    def stream_itl(self) -> Percentiles:
        return streams_itl_in_window(self.streams, self.arrivals)

    @property
    def ttft(self) -> Percentiles:
        return arrival_ttft(self.arrivals)

    @property
    def arrival_itl(self) -> Percentiles:
        return percentiles([g for r in self.arrivals if r.ok for g in r.itl_s])

    @property
    def external_hit_tokens(self) -> float:
        return (self.metrics or {}).get("vllm:external_prefix_cache_hits_total", 0.0)

    @property
    def failures(self) -> list[str]:
        return failures((*self.streams, *self.arrivals))


@dataclass(frozen=True, slots=True)
class DisaggResult:
    """Everything one run measured."""

    config: DisaggBenchConfig
    runs: tuple[SetupRun, ...]
    wall_s: float
    machine: dict[str, Any] = field(default_factory=dict)

    def write_json(self, path: Path) -> None:
        data: dict[str, Any] = {"config": asdict(self.config), "wall_s": self.wall_s,
                                "machine": self.machine, "runs": [dict(
                                    asdict(r), window_s=r.window_s,
                                    stream_itl=asdict(r.stream_itl), ttft=asdict(r.ttft),
                                    arrival_itl=asdict(r.arrival_itl)) for r in self.runs]}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# -- running it ------------------------------------------------------------------------------

def _command(config: DisaggBenchConfig, model: Path, shared: Path, kv_role: str) -> Any:
    extra = {"tokens_per_chunk": config.chunk_tokens,
             "tiers": [{"kind": "memory", "capacity": "2GiB"},
                       {"kind": "shared", "path": str(shared), "capacity": "8GiB"}]}
    command = build_command(ServeConfig(
        str(model), extra_config=extra, port=free_port(), kv_role=kv_role,
        vllm_args=("--enforce-eager", "--seed", "0", "--max-model-len",
                   str(config.max_model_len), "--kv-cache-memory-bytes",
                   str(config.engine_kv_bytes))))
    if not config.split_cores:
        return command
    return dataclasses.replace(command, env={
        **command.env, "VLLM_CPU_OMP_THREADS_BIND": worker_cores(kv_role)})


def worker_cores(kv_role: str, cores: list[int] | None = None) -> str:
    """The cores (VLLM_CPU_OMP_THREADS_BIND's "0,1" form) of a server's worker threads under
    `split_cores`: every core for kv_both (the single server), the first half of them for the
    prefill instance (kv_producer), the rest for the decode instance (kv_consumer).

    Args:
        cores: the cores to split; default: those this process may run on.
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    half = max(1, len(cores) // 2)
    chosen = {"kv_producer": cores[:half], "kv_consumer": cores[half:]}.get(kv_role, cores)
    return ",".join(str(c) for c in chosen)


@contextlib.contextmanager
def _servers(config: DisaggBenchConfig, model: Path, scratch: Path, roles: tuple[str, ...],
             progress: Callable[[str], None]) -> Iterator[tuple[list[VllmServer], float]]:
    """Start one server per kv role side by side; yields them and the start-up time, stops
    them on exit."""
    servers = [VllmServer(_command(config, model, scratch / "shared", role),
                          scratch / f"{role}.log") for role in roles]
    started = time.perf_counter()
    try:
        progress(f"starting {', '.join(roles)}")
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(config.startup_timeout_s)
        yield servers, time.perf_counter() - started
    finally:
        for server in servers:
            server.stop()


async def _timed(config: DisaggBenchConfig, cfg: ClientConfig, seed: int
                 ) -> tuple[list[RequestResult], list[RequestResult]]:
    t0 = time.perf_counter()
    streams = streams_workload(config.streams, config.stream_prompt_tokens,
                               config.stream_tokens, seed)
    streaming = asyncio.create_task(send_after(
        streams, dataclasses.replace(cfg, concurrency=config.streams), 0.0, t0))
    arrivals = [asyncio.create_task(send_after(Workload("arrival", (Turn(
        session=a.index, turn=0, tokens=prompt(config.arrival_tokens, seed + 100 + a.index),
        max_tokens=config.arrival_max_tokens),), chained=False), cfg, a.send_at_s, t0))
        for a in arrival_schedule(config.arrivals, config.arrival_gap_s, config.lead_s,
                                  (config.arrival_tokens,))]
    arrived = [r for results in await asyncio.gather(*arrivals) for r in results]
    return await streaming, arrived


def _measure(config: DisaggBenchConfig, name: str, front: str, answering: str, model: str,
             seed: int) -> tuple[list[RequestResult], list[RequestResult], dict[str, float] | None]:
    cfg = ClientConfig(front, model, concurrency=1, request_timeout_s=config.request_timeout_s,
                       warmup_requests=0)
    warm = Workload("warm-up", (Turn(-1, 0, prompt(config.arrival_tokens, seed - 1), 2),),
                    chained=False)
    failed = [r.error for r in asyncio.run(run_workload(warm, cfg)).results if not r.ok]
    if failed:
        raise ServerError(f"{name}: the warm-up request failed: {failed[0]}")
    before = asyncio.run(promdiff.scrape(answering))
    streams, arrivals = asyncio.run(_timed(config, cfg, seed))
    after = asyncio.run(promdiff.scrape(answering))
    metrics = promdiff.diff(before, after) if before is not None and after is not None else None
    return streams, arrivals, metrics


def _run_setup(config: DisaggBenchConfig, name: str, model: Path, scratch: Path, seed: int,
               progress: Callable[[str], None]) -> SetupRun:
    """Start setup `name`'s servers (retried while memory is short), measure, stop them."""
    roles = ("kv_both",) if name == "single" else ("kv_producer", "kv_consumer")
    directory = scratch / name

    def attempt() -> SetupRun:
        with _servers(config, model, directory, roles, progress) as (servers, startup_s):
            progress(f"{name}: {config.streams} streams, {config.arrivals} arrivals")
            commands = tuple(s.command.display() for s in servers)
            if name == "single":
                run = _measure(config, name, servers[0].url, servers[0].url, str(model), seed)
            else:
                # the prefill keeps the whole limit: a slow CPU prefill is measured, not
                # handed to the decode instance
                proxy = ProxyConfig(servers[0].url, servers[1].url, port=free_port(),
                                    request_timeout_s=config.request_timeout_s,
                                    prefill_timeout_s=config.request_timeout_s)
                with running_proxy(proxy) as url:
                    run = _measure(config, name, url, servers[1].url, str(model), seed)
        streams, arrivals, metrics = run
        return SetupRun(name, commands, startup_s, tuple(streams), tuple(arrivals), metrics)

    return retry_while_memory_short(attempt, progress)


def run_disagg_bench(config: DisaggBenchConfig,
                     progress: Callable[[str], None] = lambda _text: None) -> DisaggResult:
    """Run every setup in sequence, each on new prompts; see the module docstring.

    Raises:
        ConfigError: a bad setting.
        ServerError: a server did not start, or the warm-up request failed.
    """
    config.validate()
    begin = time.perf_counter()
    model = make_preset_model("bench", config.model_root)
    Path(config.directory).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".kvtier-disagg-", dir=config.directory))
    load_before = os.getloadavg()
    runs = []
    try:
        for name in config.setups:
            # The same prompts for every setup: each starts on an empty shared directory.
            runs.append(_run_setup(config, name, model, scratch, 10_000, progress))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return DisaggResult(config, tuple(runs), time.perf_counter() - begin,
                        machine=machine(load_before))
