"""`kvtier bench link`: TTFT of a prefix held in a remote tier, as its link slows down, for
recompute, kvtier's load-or-recompute rule and kvtier forced to load every hit (issue 26).

Two offline engines on the generated "bench" model, in sequence, each with a memory tier of
two chunks in front of a private redis-server reached through the emulated network of
`kvtier.testing.netem` (a bandwidth-capped TCP proxy on 127.0.0.1):
  - `rule`: load_when "faster" (the default: offer.py loads a hit only as far as it loads
    faster than it recomputes, from measured costs);
  - `always`: load_when "always" (a naive cache: every hit is loaded, whatever it costs).
Each engine stores `prompts` prompts (through an uncapped link), then for each link speed of
the sweep, fastest first (the proxy's link is changed live), runs `warmup` hits (the rule
adapts to a new link within two loads) and `reps` timed pairs: the hit (vLLM's own cache
emptied, so the prefix comes from kvtier) and, right after it in the same engine, the same
prompt recomputed (kv_transfer_params skip_load + skip_store). TTFT is the wall time of
`generate(prompt, max_tokens=1)`; figures are medians. The recompute figure is the median of
both engines' paired recomputes at that speed.

Targets: with the rule, TTFT <= TARGET_VS_RECOMPUTE x recompute at every speed, and within
TARGET_VS_FORCED of the forced load where loading wins (forced < recompute). The crossover is
the link speed where the forced load's TTFT meets recompute's (log-linear interpolation).

Primitives: `LinkConfig`, `LinkResult`, `run_link_bench`, `CONFIGS`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK, kvtier_transfer_config
from kvtier.testing.engines import kvtier_counter, offline_engine
from kvtier.testing.netem import Endpoint, delayed_proxy
from kvtier.testing.tinymodel import make_preset_model
from kvtier.tools.bench.emulators.remote_redis import stored_chunks
from kvtier.tools.bench.prompts import KV_BYTES_PER_TOKEN, NEW_TOKENS, bench_prompt
from kvtier.tools.bench.redis_baseline import local_redis

CONFIGS = ("rule", "always")
TARGET_VS_RECOMPUTE = 1.05  # the rule's TTFT <= 1.05x recompute at every link speed
TARGET_VS_FORCED = 1.10  # ... and within 10% of the forced load where loading wins
REASONS = ("loaded", "trial", "recompute_faster")
SKIP = {"skip_load": True, "skip_store": True}


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """What one `kvtier bench link` run measures. Validated by `validate`."""

    directory: Path  # redis-server's files
    model_root: Path  # where the generated bench model is written (or reused)
    cached_tokens: int = 4096  # prompt = this + NEW_TOKENS
    gbps: tuple[float, ...] = (8.0, 2.0, 1.0, 0.5, 0.25, 0.1)  # the sweep, fastest first
    delay_ms: float = 0.1  # one-way delay of the link
    prompts: int = 4  # distinct prompts, stored once, hit in turn
    warmup: int = 3  # untimed hits after each change of link
    reps: int = 5  # timed pairs (hit, recompute) per speed
    configs: tuple[str, ...] = CONFIGS

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        if self.cached_tokens < TOKENS_PER_CHUNK or self.cached_tokens % TOKENS_PER_CHUNK:
            raise ConfigError("cached_tokens", self.cached_tokens,
                              f"a multiple of {TOKENS_PER_CHUNK}")
        if not self.gbps or any(not (math.isfinite(g) and g > 0) for g in self.gbps):
            raise ConfigError("gbps", self.gbps, "link speeds in Gbit/s > 0")
        if len(set(self.gbps)) < len(self.gbps):  # a speed twice was a second sweep point
            raise ConfigError("gbps", ",".join(f"{g:g}" for g in self.gbps), "each speed once")
        if not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise ConfigError("delay_ms", self.delay_ms, "milliseconds >= 0")
        for name in ("prompts", "reps"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "at least 1")
        if self.warmup < 0:
            raise ConfigError("warmup", self.warmup, "0 or more")
        for name in self.configs:
            if name not in CONFIGS:
                raise ConfigError("configs", name, f"some of {CONFIGS}")

    @property
    def chunk_mib(self) -> float:
        return TOKENS_PER_CHUNK * KV_BYTES_PER_TOKEN / 2**20


@dataclass(slots=True)
class Point:
    """One engine at one link speed."""

    config: str
    gbps: float
    hit_s: list[float] = field(default_factory=list)
    recompute_s: list[float] = field(default_factory=list)
    decisions: dict[str, float] = field(default_factory=dict)  # chunks by reason, timed reps

    @property
    def hit_median_s(self) -> float:
        return statistics.median(self.hit_s)


@dataclass(slots=True)
class LinkResult:
    """Every point of the sweep, and what the run saw of the machine."""

    config: LinkConfig
    points: list[Point] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def point(self, config: str, gbps: float) -> Point | None:
        return next((p for p in self.points if p.config == config and p.gbps == gbps), None)

    def recompute_s(self, gbps: float) -> float:
        """The paired recomputes of every engine at this speed, median."""
        return statistics.median([s for p in self.points if p.gbps == gbps
                                  for s in p.recompute_s])

    def crossover_gbps(self) -> float | None:
        """The speed where the forced load meets recompute (None: no crossing measured)."""
        pairs = [(g, p.hit_median_s / self.recompute_s(g)) for g in self.config.gbps
                 if (p := self.point("always", g)) is not None]
        for (g1, r1), (g2, r2) in itertools.pairwise(pairs):
            if (r1 - 1) * (r2 - 1) <= 0 and r1 != r2:
                share = (1 - r1) / (r2 - r1)
                return math.exp(math.log(g1) + share * (math.log(g2) - math.log(g1)))
        return None

    def checks(self) -> list[tuple[str, str, bool]]:
        """(what, measured, met) per link speed: the rule against recompute and, where
        loading wins, against the forced load."""
        rows = []
        for gbps in self.config.gbps:
            rule, forced = self.point("rule", gbps), self.point("always", gbps)
            if rule is None:
                continue
            recompute = self.recompute_s(gbps)
            ratio = rule.hit_median_s / recompute
            rows.append((f"{gbps:g} Gbit/s: rule / recompute <= {TARGET_VS_RECOMPUTE}",
                         f"{ratio:.3f}x", ratio <= TARGET_VS_RECOMPUTE))
            if forced is not None and forced.hit_median_s < recompute:
                vs = rule.hit_median_s / forced.hit_median_s
                rows.append((f"{gbps:g} Gbit/s: rule / forced load <= {TARGET_VS_FORCED} "
                             "(loading wins)", f"{vs:.3f}x", vs <= TARGET_VS_FORCED))
        return rows

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["config"] = {k: str(v) if isinstance(v, Path) else v
                          for k, v in data["config"].items()}
        data["crossover_gbps"] = self.crossover_gbps()
        data["checks"] = self.checks()
        path.write_text(json.dumps(data, indent=2))


def run_link_bench(config: LinkConfig, progress: Callable[[str], None]) -> LinkResult:
    """Run the sweep (see the module docstring)."""
    config.validate()
    started, load_before = time.monotonic(), os.getloadavg()
    model = make_preset_model("bench", config.model_root)
    result = LinkResult(config)
    prompts = [bench_prompt(config.cached_tokens + NEW_TOKENS, seed=2600 + i)
               for i in range(config.prompts)]
    for name in config.configs:
        with tempfile.TemporaryDirectory(dir=config.directory) as work, \
                local_redis(Path(work)) as url:
            port = urlsplit(url).port
            assert port is not None
            with delayed_proxy("127.0.0.1", port, config.delay_ms, None) as proxy:
                result.points += _sweep(name, model, (url, proxy), prompts, config,
                                        progress)
    result.machine = {"cpus": os.cpu_count(), "loadavg_before": load_before,
                      "loadavg_after": os.getloadavg(), "chunk_mib": config.chunk_mib}
    result.wall_s = time.monotonic() - started
    return result


def _sweep(name: str, model: Path, redis: tuple[str, Endpoint],
           prompts: list[dict[str, list[int]]], config: LinkConfig,
           progress: Callable[[str], None]) -> list[Point]:
    """One engine's sweep: `redis` is the server's own URL and the proxy in front of it."""
    from vllm import SamplingParams

    url, proxy = redis
    tiers = [{"kind": "memory", "capacity": f"{2 * config.chunk_mib:g}MiB"},
             {"kind": "redis", "url": f"redis://{proxy.host}:{proxy.port}/0"}]
    extra = {"tiers": tiers, "load_when": "faster" if name == "rule" else "always"}
    one = SamplingParams(max_tokens=1, temperature=0.0)
    skip = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": SKIP})
    max_len = config.cached_tokens + NEW_TOKENS + 64
    progress(f"{name}: starting the engine")
    with offline_engine(model, max_len, kv_transfer_config=kvtier_transfer_config(extra)) as llm:

        def ttft(prompt: dict[str, list[int]], params: Any) -> float:
            assert llm.reset_prefix_cache()
            begin = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            return time.perf_counter() - begin

        progress(f"{name}: storing {len(prompts)} prompts")
        for prompt in prompts:  # misses: each stores its chunks (RAM, then redis)
            ttft(prompt, one)
        _wait_stored(url, len(prompts) * (config.cached_tokens // TOKENS_PER_CHUNK))
        points, turn = [], 0
        for gbps in config.gbps:
            proxy.set_link(config.delay_ms, gbps)
            point = Point(name, gbps)
            for _ in range(config.warmup):
                ttft(prompts[turn % len(prompts)], one)
                turn += 1
            before = {r: kvtier_counter("tier_hit_decisions", reason=r) for r in REASONS}
            for rep in range(config.reps):
                progress(f"{name}: {gbps:g} Gbit/s, pair {rep + 1}/{config.reps}")
                prompt = prompts[turn % len(prompts)]
                turn += 1
                point.hit_s.append(ttft(prompt, one))
                point.recompute_s.append(ttft(prompt, skip))
            point.decisions = {r: kvtier_counter("tier_hit_decisions", reason=r) - before[r]
                               for r in REASONS}
            points.append(point)
        proxy.set_link(config.delay_ms, None)
    return points


def _wait_stored(url: str, chunks: int, timeout_s: float = 120.0) -> None:
    """Wait for the write-behind to put `chunks` chunks in the redis-server at `url`."""
    deadline = time.monotonic() + timeout_s
    while stored_chunks(url) < chunks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis holds {stored_chunks(url)} of the {chunks} chunks "
                               f"stored after {timeout_s:.0f} s")
        time.sleep(0.2)
