"""`kvtier bench interference`: what running streams feel while other requests' prefixes load.

Issue 13's benchmark. For each configuration, in sequence (one server at a time), a vLLM
OpenAI server on 127.0.0.1 serves the generated "bench" model (`kvtier.testing.tinymodel`):

  - `vllm`: no kvtier; the arrivals' prefixes are recomputed.
  - `kvtier-sync`: kvtier with `load_mode: sync` and `store_mode: sync`; a hit is loaded
    inside the step that needs it, so every running stream waits for it, and a step's stores
    are gathered before it returns (kvtier before issue 13).
  - `kvtier-async`: kvtier with `load_mode: async` and `store_mode: async`; a hit is loaded on
    a worker thread while the engine keeps stepping the other requests, and stores are
    gathered on the store thread.
  - `kvtier-auto` (not run by default): the connector's default rule.
  - `kvtier-node` (not run by default): `kvtier-async`'s modes with the tiers in a `kvtier
    node` process (a memory tier in its shared memory, over the same lower tier): the engine
    only copies from the node's RAM; the disk or redis reads run off its interpreter. The
    node reads a chunk from below RAM into a RAM slot, which it lends: its RAM has room for
    every arrival's load besides `memory_tier_chunks` (a node's RAM holds GBs; one that had
    none would send the bytes over its socket), and is emptied after the warm-up (the node
    restarted, then one request of a chunk, so that the engine has reconnected and the node
    built its store before the timed phase), so that the prefixes come back from below RAM,
    as in process.
  - `vllm-prefix` (not run by default): no kvtier, and vLLM's own prefix cache is not reset,
    so the arrivals hit it: the floor, what the arrivals' own new tokens cost the streams
    with a free load.

kvtier's memory tier holds `memory_tier_chunks` chunks only, in front of a disk tier in a
scratch directory, so the arrivals' prefixes come back from the disk (read with O_DIRECT: the
page cache does not serve them). With `tier="redis"`, the tier below the memory tier is a
redis tier instead: a private redis-server per kvtier configuration, behind an emulated
network (`kvtier.testing.netem`: `net_delay_ms` each way, `net_bandwidth_gbps`
per direction;
the defaults, 0.5 ms round trip and 10 Gbit/s, are a redis in the same datacenter). With
`tier="memory"`, kvtier has a memory tier only, large enough for every prefix: the other side
of the connector's rule ("auto" loads a hit held in RAM inline, one below it asynchronously),
measured with the same workload.

Per configuration:
  1. warm-up, not timed: one short request (one-off start-up costs), then every arrival's
     prefix once (its chunks go to the disk or redis tier, or stay in the memory tier; the
     bench waits until they are there), then POST /reset_prefix_cache (the server runs with
     VLLM_SERVER_DEV_MODE=1), so that vLLM's own prefix cache cannot serve them;
  2. baseline: K streams decode `stream_tokens` tokens each with no arrivals;
  3. timed: K other streams decode (`stream_tokens`, or more where at the baseline's pace
     they would stop before the last arrival: `timed_stream_tokens`), and M arrivals are sent
     on `arrival_schedule` (a warmed prefix + `new_tokens` new tokens, `arrival_max_tokens`
     generated).
The streams' ITL with arrivals counts the gaps whose later token came inside the arrival
window (from the first arrival sent to the last one answered), so streams that run past the
window do not dilute it (`gaps_in_window`). Requests are sent by
`kvtier.tools.bench.serving.client`; the schedule, the window and the server start's retries
are `kvtier.tools.bench.serving.arrivals`'. A watcher process (`serving.stalls`) notes where
the machine itself stopped (100 ms or more in which no ordinary process ran: a paused VM, not
a busy one): each configuration reports the stalls inside its arrival window, and its arrivals'
TTFT over those that no stall touched, beside the TTFT of all of them.

Primitives: `InterferenceConfig`, `timed_stream_tokens`, `ConfigRun`, `Check`, `checks`,
`InterferenceResult`, `run_interference_bench`, `CONFIGS`, `TIERS`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from kvtier.errors import ConfigError, ServerError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK
from kvtier.testing.tinymodel import PRESETS, make_preset_model
from kvtier.tools.bench.headroom import MemoryNeed, require_memory
from kvtier.tools.bench.prompts import KV_BYTES_PER_TOKEN
from kvtier.tools.bench.serving import promdiff
from kvtier.tools.bench.serving.arrivals import (
    Arrival,
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
    token_times,
)
from kvtier.tools.bench.serving.client import ClientConfig, run_workload
from kvtier.tools.bench.serving.stalls import Stall, StallWatch, watching
from kvtier.tools.bench.serving.stats import Percentiles, RequestResult, percentiles
from kvtier.tools.bench.serving.workloads import Turn, Workload
from kvtier.tools.ops.server import free_port, running_server
from kvtier.units import format_size

if TYPE_CHECKING:
    from kvtier.tools.bench.node import BenchNode
from kvtier.tools.ops.serving import GIB, ServeCommand, ServeConfig, build_command

CONFIGS = ("vllm", "kvtier-sync", "kvtier-async")
CHOICES = (*CONFIGS, "kvtier-auto", "kvtier-node", "vllm-prefix")
TIERS = ("disk", "redis", "memory")  # where the arrivals' prefixes come back from
# The redis tier's timeouts: generous, as the bench measures loads over a working network,
# not failure handling (a 200 ms default timeout on 2 loaded cores would turn hits into misses).
REDIS_TIMEOUT_MS = 10_000
TARGET_ITL_P99_RATIO = 1.2  # async: streams' ITL p99 with arrivals <= 1.2x without
TARGET_TTFT_VS_SYNC = 1.0  # async: arrivals' TTFT p50 and p99 no worse than sync
# The timed streams decode at least this long after the last arrival is sent.
STREAM_TAIL_S = 2.0


@dataclass(frozen=True, slots=True)
class InterferenceConfig:
    """What one `kvtier bench interference` run does. Validated by `validate`."""

    directory: Path  # a scratch directory (server logs, the disk tiers) is made under it
    model_root: Path  # where the generated bench model is written (or reused)
    configs: tuple[str, ...] = CONFIGS  # which configurations to run (CHOICES)
    streams: int = 4  # K: requests decoding while the arrivals come
    stream_prompt_tokens: int = 64  # each stream's prompt (unique, under one chunk)
    stream_tokens: int = 256  # tokens each stream generates (ignore_eos)
    arrivals: int = 8  # M: requests whose prefixes are in the disk (or redis) tier
    arrival_gap_s: float = 0.5  # between two arrivals
    lead_s: float = 1.0  # the first arrival is sent this long after the streams
    prefix_tokens: tuple[int, ...] = (4096, 8192)  # arrival i's prefix: item i % len
    new_tokens: int = 16  # tokens after an arrival's prefix (computed in every case)
    arrival_max_tokens: int = 4  # tokens each arrival generates
    memory_tier_chunks: int = 2  # kvtier's memory tier; the disk (redis) tier holds the rest
    tier: str = "disk"  # the tier below the memory tier (TIERS); "memory": no tier below it
    net_delay_ms: float = 0.25  # tier "redis": the emulated network's one-way delay
    net_bandwidth_gbps: float = 10.0  # tier "redis": its bandwidth per direction
    engine_kv_bytes: int = 1 * GIB  # vLLM's own KV cache (--kv-cache-memory-bytes)
    startup_timeout_s: float = 600.0  # per server start
    request_timeout_s: float = 300.0  # one request's limit

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field; NotEnoughMemory where the memory
        tier of --memory-chunks does not fit in the RAM available (the engine's failed to
        start, minutes in)."""
        for name in ("streams", "stream_prompt_tokens", "stream_tokens", "arrivals",
                     "new_tokens", "arrival_max_tokens", "memory_tier_chunks"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "an integer >= 1")
        for name in ("arrival_gap_s", "lead_s"):  # each its own value (one is an option)
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "seconds >= 0")
        if not self.prefix_tokens:
            raise ConfigError("prefix_tokens", "", "at least one length")
        for n in self.prefix_tokens:
            if n < TOKENS_PER_CHUNK or n % TOKENS_PER_CHUNK:
                raise ConfigError("prefix_tokens", n, f"multiples of {TOKENS_PER_CHUNK}")
        if self.max_model_len > PRESETS["bench"].max_position_embeddings:
            raise ConfigError("prefix_tokens", max(self.prefix_tokens),
                              "prefix + new + generated tokens within the bench model's "
                              f"{PRESETS['bench'].max_position_embeddings} positions")
        for name in self.configs:
            if name not in CHOICES:
                raise ConfigError("configs", name, f"some of {CHOICES}")
        if self.tier not in TIERS:
            raise ConfigError("tier", self.tier, f"one of {TIERS}")
        if not (math.isfinite(self.net_delay_ms) and self.net_delay_ms >= 0):
            raise ConfigError("net_delay_ms", self.net_delay_ms, "milliseconds >= 0")
        if not (math.isfinite(self.net_bandwidth_gbps) and self.net_bandwidth_gbps > 0):
            raise ConfigError("net_bandwidth_gbps", self.net_bandwidth_gbps, "Gbit/s > 0")
        if self.tier != "memory":  # tier memory: sized by the prefixes, which are bounded
            chunk = TOKENS_PER_CHUNK * KV_BYTES_PER_TOKEN
            require_memory(MemoryNeed(
                "--memory-chunks", self.memory_tier_chunks,
                self.memory_tier_chunks * chunk + self.engine_kv_bytes, 0,
                f"a memory tier of {self.memory_tier_chunks} chunks of {format_size(chunk)} "
                "beside the engine's KV cache"))

    @property
    def max_model_len(self) -> int:
        return max(max(self.prefix_tokens, default=0) + self.new_tokens
                   + self.arrival_max_tokens, self.stream_prompt_tokens + self.stream_tokens)

    @property
    def source(self) -> str:
        """Where the arrivals' prefixes come back from, in words (tables, results)."""
        if self.tier in ("disk", "memory"):
            return f"the {self.tier} tier"
        return (f"the redis tier over an emulated network ({self.net_delay_ms:g} ms each way, "
                f"{self.net_bandwidth_gbps:g} Gbit/s)")

    def chunks_stored(self) -> int:
        """Chunks the warm-up's prefixes put in kvtier (all of them reach the lower tier)."""
        return sum(a.prefix_tokens // TOKENS_PER_CHUNK for a in self.schedule())

    def schedule(self) -> tuple[Arrival, ...]:
        return arrival_schedule(self.arrivals, self.arrival_gap_s, self.lead_s,
                                self.prefix_tokens)


def timed_stream_tokens(config: InterferenceConfig, itl_mean_s: float | None) -> int:
    """Tokens each stream of the timed phase generates: `stream_tokens`, or more where, at
    the baseline's pace (`itl_mean_s`), the streams would stop before the last arrival is
    sent plus STREAM_TAIL_S (arrivals only slow them down); at most what max_model_len
    leaves after the stream's prompt."""
    last_s = config.lead_s + (config.arrivals - 1) * config.arrival_gap_s + STREAM_TAIL_S
    needed = math.ceil(last_s / itl_mean_s) if itl_mean_s else 0
    return min(max(config.stream_tokens, needed),
               config.max_model_len - config.stream_prompt_tokens)


@dataclass(frozen=True, slots=True)
class ConfigRun:
    """What one configuration's server did."""

    name: str  # one of CHOICES
    command: str  # the server's command line
    startup_s: float  # until /health answered
    warmup_s: float  # phase 1: the prefixes computed, stored and reset
    timed_stream_tokens: int  # tokens each stream generated in phase 3 (timed_stream_tokens)
    baseline: tuple[RequestResult, ...]  # the streams with no arrivals
    streams: tuple[RequestResult, ...]  # the streams of the timed phase
    arrivals: tuple[RequestResult, ...]  # the arrivals, in schedule order
    metrics: dict[str, float] | None  # counter deltas over the timed phase (promdiff)
    ping_ms: float | None = None  # tier "redis": PING round trip through the network, idle
    # the machine's stalls (serving.stalls) during the timed phase, in seconds into it
    stalls: tuple[Stall, ...] = ()

    @property
    def window_s(self) -> tuple[float, float]:
        """(first arrival sent, last arrival answered), seconds into the timed phase."""
        return arrival_window(self.arrivals)

    @property
    def baseline_itl(self) -> Percentiles:
        return percentiles([g for r in self.baseline if r.ok for g in r.itl_s])

    @property
    def itl(self) -> Percentiles:
        """The streams' gaps while the arrivals came (see gaps_in_window)."""
        return streams_itl_in_window(self.streams, self.arrivals)

    @property
    def ttft(self) -> Percentiles:
        return arrival_ttft(self.arrivals)

    @property
    def stalls_in_window(self) -> list[Stall]:
        """The machine's stalls while the arrivals came."""
        return [s for s in self.stalls if s.overlaps(*self.window_s)]

    @property
    def unstalled_arrivals(self) -> list[RequestResult]:
        """The arrivals no stall of the machine touched before their first token: what
        they measured is the code's, not the machine's stops."""
        return [r for r in self.arrivals
                if r.ttft_s is not None
                and not any(s.overlaps(r.start_s, r.start_s + r.ttft_s) for s in self.stalls)]

    @property
    def unstalled_ttft(self) -> Percentiles:
        return arrival_ttft(self.unstalled_arrivals)

    @property
    def itl_p99_ratio(self) -> float | None:
        """Streams' ITL p99 with arrivals / without."""
        return _ratio(self.itl.p99, self.baseline_itl.p99)

    @property
    def streams_cover_window(self) -> bool:
        """Whether some stream was still decoding when the last arrival was answered."""
        ends = [t[-1] for r in self.streams if (t := token_times(r))]
        return bool(ends) and max(ends) >= self.window_s[1]

    @property
    def failures(self) -> list[str]:
        return failures((*self.baseline, *self.streams, *self.arrivals))

    def counter(self, suffix: str) -> float:
        """A kvtier counter's delta over the timed phase, summed over tiers."""
        return sum(promdiff.kvtier_counters(self.metrics or {}, suffix).values())


@dataclass(frozen=True, slots=True)
class Check:
    """One of the issue's targets, with its figures."""

    what: str
    value: str
    limit: str
    passed: bool | None  # None: not measured in this run


def checks(runs: Mapping[str, ConfigRun]) -> list[Check]:
    """Issue 13's targets over the runs by configuration name (those absent are skipped)."""
    out = []
    if (a := runs.get("kvtier-async")) is not None:
        ratio = a.itl_p99_ratio
        out.append(Check("kvtier-async: streams' ITL p99, with / without arrivals",
                         _x(ratio), f"<= {TARGET_ITL_P99_RATIO}x",
                         None if ratio is None else ratio <= TARGET_ITL_P99_RATIO))
    if (f := runs.get("vllm-prefix")) is not None:
        out.append(Check("floor (vllm-prefix: arrivals hit vLLM's own cache): streams' ITL "
                         "p99, with / without", _x(f.itl_p99_ratio), "(for reference)", None))
    s = runs.get("kvtier-sync")
    if a is not None and s is not None:
        for q in ("p50", "p99"):
            ratio = _ratio(getattr(a.ttft, q), getattr(s.ttft, q))
            out.append(Check(f"arrivals' TTFT {q}, async / sync", _x(ratio),
                             f"<= {TARGET_TTFT_VS_SYNC}x (no worse)",
                             None if ratio is None else ratio <= TARGET_TTFT_VS_SYNC))
    return out


@dataclass(frozen=True, slots=True)
class InterferenceResult:
    """Everything one run measured."""

    config: InterferenceConfig
    runs: tuple[ConfigRun, ...]
    wall_s: float
    machine: dict[str, Any] = field(default_factory=dict)

    def by_name(self) -> dict[str, ConfigRun]:
        return {r.name: r for r in self.runs}

    def write_json(self, path: Path) -> None:
        data: dict[str, Any] = {"config": asdict(self.config), "source": self.config.source,
                                "wall_s": self.wall_s, "machine": self.machine, "runs": [],
                                "checks": [asdict(c) for c in checks(self.by_name())]}
        for run in self.runs:
            data["runs"].append(dict(
                asdict(run), window_s=run.window_s, baseline_itl=asdict(run.baseline_itl),
                itl=asdict(run.itl), ttft=asdict(run.ttft), itl_p99_ratio=run.itl_p99_ratio,
                streams_cover_window=run.streams_cover_window,
                stalls_in_window=[asdict(s) for s in run.stalls_in_window],
                unstalled_ttft=asdict(run.unstalled_ttft)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


# -- running it ------------------------------------------------------------------------------

def server_command(config: InterferenceConfig, name: str, model: Path, scratch: Path,
                   redis_url: str | None = None, node: str | None = None) -> ServeCommand:
    """The OpenAI server of configuration `name`, dev mode on (/reset_prefix_cache);
    `redis_url`: the redis tier's server (tier "redis"); `node`: kvtier-node's socket.

    Raises:
        ConfigError: tier "redis" without `redis_url`; kvtier-node without `node`.
    """
    extra: dict[str, Any] | None = None
    if name == "kvtier-node":
        if node is None:
            raise ConfigError("node", None, "the node's socket (configuration kvtier-node)")
        extra = {"tokens_per_chunk": TOKENS_PER_CHUNK, "load_mode": "async",
                 "store_mode": "async", "node": node}
    elif name.startswith("kvtier"):
        mode = name.split("-", 1)[1]
        extra = {"tokens_per_chunk": TOKENS_PER_CHUNK, "load_mode": mode, "store_mode": mode,
                 # the warm-up's chunks all reach the lower tier (none dropped on the way)
                 "write_queue_depth": max(1024, config.chunks_stored()),
                 "tiers": _tiers(config, name, scratch, redis_url)}
    command = build_command(ServeConfig(
        str(model), kvtier=extra is not None, extra_config=extra, port=free_port(),
        vllm_args=("--enforce-eager", "--seed", "0", "--max-model-len",
                   str(config.max_model_len), "--kv-cache-memory-bytes",
                   str(config.engine_kv_bytes))))
    return dataclasses.replace(command, env={**command.env, "VLLM_SERVER_DEV_MODE": "1"})


def _tiers(config: InterferenceConfig, name: str, scratch: Path,
           redis_url: str | None) -> list[dict[str, Any]]:
    """kvtier's tiers: a memory tier of `memory_tier_chunks` over the tier the arrivals'
    prefixes come back from, or (tier "memory") a memory tier that holds them all, twice over
    (the streams store chunks too). Raises ConfigError (see above)."""
    chunks = 2 * config.chunks_stored() if config.tier == "memory" else config.memory_tier_chunks
    memory = {"kind": "memory", "capacity": chunks * TOKENS_PER_CHUNK * KV_BYTES_PER_TOKEN}
    if config.tier == "memory":
        return [memory]
    return [memory, _lower_tier(config, name, scratch, redis_url)]


def _lower_tier(config: InterferenceConfig, name: str, scratch: Path,
                redis_url: str | None) -> dict[str, Any]:
    """The tier the arrivals' prefixes come back from. Raises ConfigError (see above)."""
    if config.tier == "disk":
        return {"kind": "disk", "path": str(scratch / name / "disk"), "capacity": "8GiB"}
    if redis_url is None:
        raise ConfigError("redis_url", None, "the redis tier's server URL (tier redis)")
    # capacity 0: the private server holds everything (no LRU index round trip)
    return {"kind": "redis", "url": redis_url, "capacity": 0,
            "socket_timeout_ms": REDIS_TIMEOUT_MS, "connect_timeout_ms": REDIS_TIMEOUT_MS}


def _arrival_turn(config: InterferenceConfig, arrival: Arrival, timed: bool) -> Turn:
    """Arrival `arrival`'s prompt: its prefix + new tokens (other ones in the warm-up)."""
    prefix = prompt(arrival.prefix_tokens, 1_000 + arrival.index)
    new = prompt(config.new_tokens, (3_000 if timed else 2_000) + arrival.index)
    return Turn(session=arrival.index, turn=int(timed), tokens=prefix + new,
                max_tokens=config.arrival_max_tokens if timed else 1)


async def _reset_prefix_cache(url: str) -> None:
    """Empty vLLM's own prefix cache. Raises ServerError when the server refuses."""
    async with aiohttp.ClientSession() as http, \
            http.post(url + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(60)) as resp:
        if resp.status != 200:
            raise ServerError(f"POST /reset_prefix_cache: HTTP {resp.status} "
                              f"{(await resp.text())[:200]}")


@dataclass(frozen=True, slots=True)
class StoredChunks:
    """How many chunks the tier the arrivals' prefixes come back from holds: the warm-up
    waits for its write-behind (or, tier "memory", the stores of its last step)."""

    where: str  # the disk tier's directory, the redis server's URL, the server's /metrics
    count: Callable[[], int]


def _wait_for_chunks(stored: StoredChunks, count: int, timeout_s: float = 180.0) -> None:
    """Wait until the lower tier's write-behind has stored `count` chunks.

    Raises:
        TimeoutError: fewer after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stored.count() >= count:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{stored.where}: fewer than {count} chunks after {timeout_s:g} s")


def _disk_chunks(directory: Path) -> StoredChunks:
    return StoredChunks(str(directory), lambda: sum(1 for _ in directory.rglob("*.kvc")))


def _memory_chunks(url: str) -> StoredChunks:
    """The memory tier's chunks, as the server's /metrics counts them."""
    def count() -> int:
        scrape = asyncio.run(promdiff.scrape(url)) or {}
        return int(sum(v for k, v in scrape.items()
                       if k.startswith("vllm:kvtier_tier_chunks{") and "tier=memory" in k))
    return StoredChunks(url + "/metrics", count)


def _node_chunks(socket_path: str) -> StoredChunks:
    """The node's memory tier's chunks (every layout's), from its status."""
    from kvtier.node.client import node_status

    def count() -> int:
        layouts = node_status(socket_path)["layouts"]
        assert isinstance(layouts, dict)
        return sum(layout["tiers"][0]["chunks"] for layout in layouts.values())
    return StoredChunks(socket_path, count)


# the streams, the arrivals, the counters' deltas, the phase's start (time.monotonic())
_Timed = tuple[list[RequestResult], list[RequestResult], dict[str, float] | None, float]


async def _timed_phase(config: InterferenceConfig, cfg: ClientConfig,
                       stream_tokens: int) -> _Timed:
    """Phase 3: the streams and, on schedule, the arrivals; and the counters' deltas."""
    before = await promdiff.scrape(cfg.url)
    t0, origin_s = time.perf_counter(), time.monotonic()
    streams = asyncio.create_task(send_after(
        streams_workload(config.streams, config.stream_prompt_tokens, stream_tokens, 500),
        dataclasses.replace(cfg, concurrency=config.streams), 0.0, t0))
    arrivals = [asyncio.create_task(send_after(
        Workload("arrival", (_arrival_turn(config, a, timed=True),), chained=False),
        dataclasses.replace(cfg, concurrency=1), a.send_at_s, t0)) for a in config.schedule()]
    arrived = [r for results in await asyncio.gather(*arrivals) for r in results]
    streamed = await streams
    after = await promdiff.scrape(cfg.url)
    metrics = promdiff.diff(before, after) if before is not None and after is not None else None
    return streamed, arrived, metrics, origin_s


def _measure(config: InterferenceConfig, name: str, url: str, model: str,
             stored: StoredChunks | None, progress: Callable[[str], None],
             cold_ram: Callable[[], None] | None = None,
             watch: StallWatch | None = None) -> ConfigRun:
    """Phases 1-3 against a ready server (command and startup_s left for the caller);
    `stored`: the lower tier to wait for after the warm-up (None: no kvtier); `cold_ram`:
    empties kvtier's RAM after it (kvtier-node: the node restarted, then one request of a
    chunk, so that the engine has reconnected and the node built its store before the timed
    phase, as an engine in process has); `watch`: the machine's stalls, kept for the timed
    phase.

    Raises:
        ServerError: a warm-up request failed, or the prefix cache could not be reset.
        TimeoutError: the lower tier did not get the warm-up's chunks in time.
    """
    cfg = ClientConfig(url, model, request_timeout_s=config.request_timeout_s)
    started = time.perf_counter()
    progress(f"{name}: warm-up, {config.arrivals} prefixes computed and stored")
    warm = Workload("warm-up", (Turn(-1, 0, prompt(64, 7), 2),
                                *(_arrival_turn(config, a, timed=False)
                                  for a in config.schedule())), chained=False)
    one_at_a_time = dataclasses.replace(cfg, concurrency=1)
    failed = [r.error for r in asyncio.run(run_workload(warm, one_at_a_time)).results
              if not r.ok]
    if failed:
        raise ServerError(f"{name}: a warm-up request failed: {failed[0]}")
    if stored is not None:
        _wait_for_chunks(stored, config.chunks_stored())
    if cold_ram is not None:
        progress(f"{name}: the node restarted, its RAM empty")
        cold_ram()
        # The engine reconnects at its next call, and the node builds the layout's store
        # (its RAM slab, its tiers' connections) at the engine's hello: one request of a
        # chunk does both now, as an engine in process has its store long built, rather
        # than the first arrival's load.
        settle = Workload("reconnect", (Turn(-2, 0, prompt(TOKENS_PER_CHUNK + 16, 11), 1),),
                          chained=False)
        if not all(r.ok for r in asyncio.run(run_workload(settle, one_at_a_time)).results):
            raise ServerError(f"{name}: the request after the node's restart failed")
    keep = name == "vllm-prefix"  # the floor: the arrivals hit vLLM's own cache
    if not keep:
        asyncio.run(_reset_prefix_cache(url))
    warmup_s = time.perf_counter() - started
    progress(f"{name}: {config.streams} streams, no arrivals")
    baseline = asyncio.run(run_workload(
        streams_workload(config.streams, config.stream_prompt_tokens, config.stream_tokens, 100),
        dataclasses.replace(cfg, concurrency=config.streams)))
    tokens = timed_stream_tokens(config, percentiles(
        [g for r in baseline.results if r.ok for g in r.itl_s]).mean)
    if not keep:
        asyncio.run(_reset_prefix_cache(url))
    progress(f"{name}: {config.streams} streams, {config.arrivals} arrivals")
    streamed, arrived, metrics, origin_s = asyncio.run(_timed_phase(config, cfg, tokens))
    stalls = () if watch is None else tuple(
        s.shifted(origin_s) for s in watch.stalls(origin_s, time.monotonic()))
    return ConfigRun(name, "", 0.0, warmup_s, tokens, baseline.results, tuple(streamed),
                     tuple(arrived), metrics, stalls=stalls)


def _run_config(config: InterferenceConfig, name: str, model: Path, scratch: Path,
                progress: Callable[[str], None], watch: StallWatch | None = None) -> ConfigRun:
    """Start configuration `name`'s server (and, for kvtier with tier "redis", a private
    redis-server behind the emulated network), measure, stop them. A start that fails
    because another engine on the machine holds the memory is retried after a minute.

    Raises:
        ServerError: the server did not start (the message has its log's tail).
        RuntimeError: redis-server or the emulated network did not start.
    """
    with ExitStack() as stack:
        stored: StoredChunks | None = None
        redis_url: str | None = None
        ping_ms: float | None = None
        if name.startswith("kvtier") and config.tier == "redis":
            # redis-py and the proxy only when asked for (redis-py: ~0.3 s to import)
            from kvtier.tools.bench.emulators.remote_redis import remote_redis, stored_chunks
            progress(f"{name}: starting redis-server behind the emulated network")
            remote = stack.enter_context(remote_redis(
                scratch, config.net_delay_ms, config.net_bandwidth_gbps))
            redis_url, ping_ms = remote.proxy_url, remote.ping_ms
            stored = StoredChunks(remote.url, lambda: stored_chunks(remote.url))
        elif name.startswith("kvtier") and config.tier == "disk":
            stored = _disk_chunks(scratch / name / "disk")
        node: BenchNode | None = None
        if name == "kvtier-node":
            from kvtier.tools.bench.node import restartable_node

            progress(f"{name}: starting kvtier node")
            memory, *below = _tiers(config, name, scratch, redis_url)
            if below:  # room to stage every arrival's load (a node's RAM holds GBs)
                memory["capacity"] += config.chunks_stored() * TOKENS_PER_CHUNK \
                    * KV_BYTES_PER_TOKEN
            node = stack.enter_context(restartable_node(
                scratch / name, memory["capacity"], below,
                {"write_queue_depth": max(1024, config.chunks_stored())}))
        command = server_command(config, name, model, scratch, redis_url,
                                 None if node is None else node.socket_path)

        def attempt() -> ConfigRun:
            progress(f"{name}: starting the server")
            started = time.perf_counter()
            with running_server(command, log_path=scratch / f"{name}.log",
                                startup_timeout_s=config.startup_timeout_s) as server:
                startup_s = time.perf_counter() - started
                in_ram = name.startswith("kvtier") and config.tier == "memory"
                source = stored
                if in_ram:
                    source = (_memory_chunks(server.url) if node is None
                              else _node_chunks(node.socket_path))
                cold_ram = None if node is None or in_ram else node.restart
                run = _measure(config, name, server.url, str(model), source, progress,
                               cold_ram, watch)
                return dataclasses.replace(run, command=command.display(),
                                           startup_s=startup_s, ping_ms=ping_ms)

        return retry_while_memory_short(attempt, progress, f"{name}: ")


def run_interference_bench(config: InterferenceConfig,
                           progress: Callable[[str], None] = lambda _text: None
                           ) -> InterferenceResult:
    """Run every configuration in sequence; see the module docstring.

    Raises:
        ConfigError: a bad setting.
        ServerError: a server did not start, or a warm-up request failed.
        TimeoutError: a disk (redis) tier did not get the warm-up's chunks in time.
        RuntimeError: tier "redis": redis-server or the emulated network did not start.
    """
    config.validate()
    begin = time.perf_counter()
    model = make_preset_model("bench", config.model_root)
    Path(config.directory).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".kvtier-interference-", dir=config.directory))
    load_before = os.getloadavg()
    runs = []
    try:
        with watching() as watch:
            for name in config.configs:
                runs.append(_run_config(config, name, model, scratch, progress, watch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return InterferenceResult(config, tuple(runs), time.perf_counter() - begin,
                              machine=machine(load_before))
