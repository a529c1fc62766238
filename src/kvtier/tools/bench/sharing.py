"""`kvtier bench sharing`: TTFT of engine B on prompts engine A computed, served through a
shared directory and through Redis, against B's own recompute, in one run.

Engines run one after the other (never two at once), each an offline `vllm.LLM` with its own
engine-core process, on the generated "bench" model (`kvtier.testing.tinymodel`):
  - `A`: memory + shared + redis tiers. Computes every prompt once (the miss path) and writes
    its chunks behind to the shared directory and to Redis; then it is shut down.
  - `B-shared`: a new engine on A's directory; its memory tier is smaller than one chunk, so
    every prefix it loads comes from the files A wrote.
  - `B-redis`: a new engine on A's Redis server, likewise.
  - `node`: engines in node mode on one `kvtier node` process (its RAM tier in shared
    memory): `A-node` computes the prompts, its own RAM hits through the node are timed as
    `node-before` (before the restart), then it is shut down; `B-node`, a new engine (the
    restarted one, or a neighbour), is timed as `node`: its hits come from the node's RAM. An
    engine restarted in process starts cold: its recompute is the `recompute` column.
In each B, per prompt length: the first request (the first time this engine sees the prompt,
found through the scheduler's probe of the tier), `reps` more, each after
`reset_prefix_cache()` (only kvtier can serve the prefix), then `recompute_reps` requests
with `skip_load` (B's recompute: the same engine, nothing loaded). TTFT is the wall time of
`generate(prompt, max_tokens=1)`; figures are medians; `speedup` = recompute / hit.

Redis: `redis_url`, or a private redis-server on 127.0.0.1 started for the run and killed
after (`kvtier.tools.bench.redis_baseline.local_redis`).

Primitives: `SharingConfig`, `SharingResult`, `Ttft`, `run_sharing_bench`, `SOURCES`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK, kvtier_transfer_config
from kvtier.redaction import redact_text
from kvtier.testing.engines import counter, offline_engine
from kvtier.testing.tinymodel import make_preset_model
from kvtier.tools.bench.prompts import KV_BYTES_PER_TOKEN, NEW_TOKENS, bench_prompt, check_settings

SOURCES = ("shared", "redis", "node")  # how B gets A's chunks
KEY_PREFIX = "kvtier-bench-sharing:"


@dataclass(frozen=True, slots=True)
class SharingConfig:
    """What one `kvtier bench sharing` run measures. Validated by `validate`."""

    directory: Path  # the shared directory (a temp dir) is created here
    model_root: Path  # where the generated bench model is written (or reused)
    cached_tokens: tuple[int, ...] = (1024, 4096)  # prompt = this + NEW_TOKENS
    reps: int = 5  # timed hits per prompt after the first one
    recompute_reps: int = 3  # timed recomputes (skip_load) per prompt
    redis_url: str | None = None  # None: start a private redis-server for the run
    sources: tuple[str, ...] = SOURCES  # which B engines to run

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        check_settings(self, self.cached_tokens, ("reps", "recompute_reps"),
                       ("sources", self.sources, SOURCES))
        if self.redis_url is not None and "redis" not in self.sources:
            # Dropped without a word: `--source node --redis-url URL` reported no Redis run
            raise ConfigError("redis_url", redact_text(self.redis_url),
                              "a Redis for the redis source: add --source redis, or leave "
                              "--redis-url out")

    @property
    def max_model_len(self) -> int:
        return max(self.cached_tokens) + NEW_TOKENS + 64


@dataclass(frozen=True, slots=True)
class Ttft:
    """Engine B's TTFT on one prompt A computed, through one source."""

    source: str  # "shared" | "redis" | "node" | "node-before" (A-node's own RAM hits)
    cached_tokens: int
    first_s: float  # B's first request for the prompt
    hits_s: tuple[float, ...]  # the repeats (vLLM's cache emptied before each)
    recompute_s: tuple[float, ...]  # skip_load
    hit_tokens: int  # tokens vLLM counted as external hits in B's first request

    @property
    def hit_median_s(self) -> float:
        return statistics.median(self.hits_s)

    @property
    def recompute_median_s(self) -> float:
        return statistics.median(self.recompute_s)

    @property
    def speedup(self) -> float:
        """B's recompute over B's hit (medians)."""
        return self.recompute_median_s / self.hit_median_s


@dataclass(frozen=True, slots=True)
class SharingResult:
    """Everything one run measured."""

    config: SharingConfig
    ttft: tuple[Ttft, ...]
    engine_start_s: dict[str, float]
    wall_s: float
    machine: dict[str, Any] = field(default_factory=dict)

    def get(self, source: str, cached_tokens: int) -> Ttft | None:
        return next((t for t in self.ttft
                     if t.source == source and t.cached_tokens == cached_tokens), None)

    def write_json(self, path: Path, command: str = "") -> None:
        data = asdict(self)
        data["command"] = command
        data["ttft"] = [dict(asdict(t), hit_median_s=t.hit_median_s,
                             recompute_median_s=t.recompute_median_s, speedup=t.speedup)
                        for t in self.ttft]
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".tmp")
        temp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(temp, path)


def _tiers(role: str, shared: Path, redis_url: str) -> list[dict[str, Any]]:
    """A: a memory tier that holds its prompts, both lower tiers. B: a memory tier smaller
    than one chunk (stores nothing) over the one source it is measured on."""
    memory = {"kind": "memory",
              "capacity": "1GiB" if role == "A" else TOKENS_PER_CHUNK * KV_BYTES_PER_TOKEN // 2}
    shared_tier = {"kind": "shared", "path": str(shared), "capacity": "8GiB"}
    redis_tier = {"kind": "redis", "url": redis_url, "key_prefix": KEY_PREFIX}
    if role == "A":
        return [memory, shared_tier, redis_tier]
    return [memory, shared_tier if role == "B-shared" else redis_tier]


def _engine(model_dir: Path, config: SharingConfig, tiers: list[dict[str, Any]] | str
            ) -> contextlib.AbstractContextManager[Any]:
    """An offline LLM with kvtier on `tiers`, or in node mode (`tiers`: the node's socket);
    its processes are shut down on exit."""
    where = {"node": tiers} if isinstance(tiers, str) else {"write_queue_depth": 1024,
                                                            "tiers": tiers}
    transfer = kvtier_transfer_config({"tokens_per_chunk": TOKENS_PER_CHUNK, **where})
    return offline_engine(model_dir, config.max_model_len, kv_transfer_config=transfer)


def _generate_s(llm: Any, prompt: dict[str, list[int]], skip_load: bool = False) -> float:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"skip_load": True}} if skip_load else None
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, extra_args=extra)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - start


def _stored_chunks(config: SharingConfig) -> int:
    return sum(n // TOKENS_PER_CHUNK for n in config.cached_tokens)


def _wait_until(done: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:g} s")
        time.sleep(0.05)


def _redis_chunks(url: str) -> int:
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return sum(1 for _ in client.scan_iter(match=KEY_PREFIX + "*}:c", count=1000))


def _measure_b(llm: Any, source: str, config: SharingConfig,
               progress: Callable[[str], None]) -> list[Ttft]:
    out = []
    for n in config.cached_tokens:
        progress(f"B-{source}: {n} tokens")
        prompt = bench_prompt(n + NEW_TOKENS, seed=n)
        before = counter(llm, "vllm:external_prefix_cache_hits")
        first = _generate_s(llm, prompt)
        hit_tokens = int(counter(llm, "vllm:external_prefix_cache_hits") - before)
        hits = []
        for _ in range(config.reps):
            llm.reset_prefix_cache()
            hits.append(_generate_s(llm, prompt))
        recompute = []
        for _ in range(config.recompute_reps):
            llm.reset_prefix_cache()
            recompute.append(_generate_s(llm, prompt, skip_load=True))
        out.append(Ttft(source, n, first, tuple(hits), tuple(recompute), hit_tokens))
    return out


def _node_engines(model_dir: Path, config: SharingConfig, stack: contextlib.ExitStack,
                  scratch: Path, starts: dict[str, float],
                  progress: Callable[[str], None]) -> list[Ttft]:
    """A-node computes the prompts into a node's RAM and times its own hits through it
    (`node-before`); then B-node, started after A-node is gone, times its hits (`node`)."""
    from kvtier.tools.bench.node import node_process

    socket_path = stack.enter_context(node_process(scratch, "2GiB"))
    progress("A-node: starting the engine, computing the prompts")
    start = time.perf_counter()
    with _engine(model_dir, config, socket_path) as llm:
        starts["A-node"] = time.perf_counter() - start
        for n in config.cached_tokens:
            _generate_s(llm, bench_prompt(n + NEW_TOKENS, seed=n))
        llm.reset_prefix_cache()  # its own hits must come from the node
        out = _measure_b(llm, "node-before", config, progress)
    progress("B-node: starting the engine")
    start = time.perf_counter()
    with _engine(model_dir, config, socket_path) as llm:
        _generate_s(llm, bench_prompt(64, seed=7))  # warm-up, not timed, not shared
        starts["B-node"] = time.perf_counter() - start
        out += _measure_b(llm, "node", config, progress)
    return out


def run_sharing_bench(config: SharingConfig,
                      progress: Callable[[str], None] = lambda _text: None) -> SharingResult:
    """Run A, then each B; see the module docstring.

    Raises:
        ConfigError: a bad setting.
        RuntimeError: no redis_url and redis-server is not installed or does not start.
        TimeoutError: A's chunks did not reach the shared directory or Redis in 2 minutes.
    """
    from kvtier.tools.bench.redis_baseline import local_redis  # redis-py: ~0.3 s to import

    config.validate()
    begin = time.perf_counter()
    model_dir = make_preset_model("bench", config.model_root)
    config.directory.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".kvtier-sharing-", dir=config.directory))
    shared = scratch / "shared"
    starts: dict[str, float] = {}
    ttft: list[Ttft] = []
    load_before = os.getloadavg()
    try:
        with contextlib.ExitStack() as stack:
            if "node" in config.sources:
                ttft += _node_engines(model_dir, config, stack, scratch, starts, progress)
            others = [s for s in config.sources if s != "node"]
            if not others:
                return _result(config, ttft, starts, begin, load_before)
            url = config.redis_url or stack.enter_context(local_redis(scratch))
            progress("A: starting the engine, computing the prompts")
            start = time.perf_counter()
            with _engine(model_dir, config, _tiers("A", shared, url)) as llm:
                starts["A"] = time.perf_counter() - start
                for n in config.cached_tokens:
                    _generate_s(llm, bench_prompt(n + NEW_TOKENS, seed=n))
                want = _stored_chunks(config)
                _wait_until(lambda: sum(1 for _ in shared.rglob("*.kvc")) >= want,
                            f"fewer than {want} chunk files in {shared}")
                _wait_until(lambda: _redis_chunks(url) >= want,
                            f"fewer than {want} chunks in redis")
            for source in others:
                progress(f"B-{source}: starting the engine")
                start = time.perf_counter()
                with _engine(model_dir, config, _tiers(f"B-{source}", shared, url)) as llm:
                    _generate_s(llm, bench_prompt(64, seed=7))  # warm-up, not timed, not shared
                    starts[f"B-{source}"] = time.perf_counter() - start
                    ttft += _measure_b(llm, source, config, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _result(config, ttft, starts, begin, load_before)


def _result(config: SharingConfig, ttft: list[Ttft], starts: dict[str, float], begin: float,
            load_before: tuple[float, float, float]) -> SharingResult:
    return SharingResult(config=config, ttft=tuple(ttft), engine_start_s=starts,
                         wall_s=time.perf_counter() - begin,
                         machine={"cpus": os.cpu_count(), "loadavg_before": load_before,
                                  "loadavg_after": os.getloadavg()})
