"""Offline vLLM engines for the benchmarks that time prefills in-process (ttft, sharing).

Primitives: `offline_engine` (an `LLM` with the benches' small CPU settings, shut down on
exit), `counter` (one of vLLM's counters, summed over labels), `kvtier_counter` (one of
kvtier's, from this process's Prometheus registry), `quiet_engine_logs`; and what the ttft and
sharing benches share about their prompts on the generated "bench" model: `NEW_TOKENS`,
`KV_BYTES_PER_TOKEN`, `bench_prompt`, `check_settings`. Chunks are the connector's default
(`kvtier.integrations.vllm.config.TOKENS_PER_CHUNK`: 2 MiB of the bench model's KV), and
the engines' `kv_transfer_config` comes from that module's `kvtier_transfer_config`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK
from kvtier.tools.tinymodel import FIRST_WORD_ID, PRESETS

BLOCK_SIZE = 128  # tokens per vLLM block (the CPU backend's default)
NUM_BLOCKS = 384  # the engine's own KV cache, in blocks

NEW_TOKENS = 2  # tokens after a prompt's cached prefix: computed in every case
KV_BYTES_PER_TOKEN = PRESETS["bench"].kv_bytes_per_token()


def bench_prompt(tokens: int, seed: int, preset: str = "bench") -> dict[str, list[int]]:
    """A prompt of `tokens` random word ids of a preset model (the same for a seed)."""
    rng = random.Random(seed)
    vocab = PRESETS[preset].vocab_size
    return {"prompt_token_ids": [rng.randrange(FIRST_WORD_ID, vocab) for _ in range(tokens)]}


def check_settings(settings: Any, cached_tokens: Sequence[int], counts: Iterable[str],
                   choices: tuple[str, Sequence[str], Sequence[str]], *,
                   tokens_per_chunk: int = TOKENS_PER_CHUNK, preset: str = "bench") -> None:
    """Raise ConfigError naming the first bad field of a bench's settings: `cached_tokens`
    (whole chunks of `tokens_per_chunk` that fit the `preset` model with NEW_TOKENS), the
    `counts` (fields >= 1) and `choices` = (field, values chosen, values allowed)."""
    if not cached_tokens:
        raise ConfigError("cached_tokens", "", "at least one length")
    for n in cached_tokens:
        if n < tokens_per_chunk or n % tokens_per_chunk:
            raise ConfigError("cached_tokens", n, f"multiples of {tokens_per_chunk}")
    longest = PRESETS[preset].max_position_embeddings - NEW_TOKENS
    if max(cached_tokens) > longest:
        raise ConfigError("cached_tokens", max(cached_tokens), f"at most {longest}")
    for name in counts:
        if getattr(settings, name) < 1:
            raise ConfigError(name, getattr(settings, name), "at least 1")
    field, chosen, allowed = choices
    for value in chosen:
        if value not in allowed:
            raise ConfigError(field, value, f"some of {tuple(allowed)}")


@contextlib.contextmanager
def offline_engine(model_dir: Path, max_model_len: int, **overrides: Any) -> Iterator[Any]:
    """An offline `vllm.LLM` (eager, seeded, stats on); its processes are shut down on exit.

    `overrides` are any other `LLM(...)` arguments (kv_transfer_config, enable_prefix_caching).
    """
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(model_dir), enforce_eager=True, gpu_memory_utilization=0.3, seed=0,
        block_size=BLOCK_SIZE, max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
        num_gpu_blocks_override=NUM_BLOCKS, disable_log_stats=False)
    kwargs.update(overrides)
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def counter(llm: Any, name: str) -> float:
    """One of vLLM's counters (e.g. "vllm:kvtier_loaded_tokens"), summed over its labels."""
    return float(sum(m.value for m in llm.get_metrics()
                     if m.name == name and isinstance(getattr(m, "value", None), (int, float))))


def kvtier_counter(name: str, tier: str | None = None, **labels: str) -> float:
    """kvtier's counter `name` (summed over engines, and over tiers unless `tier`, and over
    other labels unless given: `reason="loaded"`).

    Read from this process's Prometheus registry, where vLLM's stat logger feeds the
    connector's stats (the same numbers a server shows on /metrics).
    """
    return _kvtier_samples(name, "_total", tier, labels)


def kvtier_gauge(name: str, tier: str | None = None) -> float:
    """kvtier's gauge `name` (summed over engines, and over tiers unless `tier`)."""
    return _kvtier_samples(name, "", tier, {})


def _kvtier_samples(name: str, suffix: str, tier: str | None, labels: dict[str, str]) -> float:
    from prometheus_client import REGISTRY

    from kvtier.integrations.vllm.metrics import PREFIX

    if tier is not None:
        labels = {**labels, "tier": tier}
    total = 0.0
    for family in REGISTRY.collect():
        if family.name != PREFIX + name:
            continue
        for sample in family.samples:
            if sample.name == PREFIX + name + suffix and all(
                    sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def quiet_engine_logs() -> None:
    """Keep engine start-up logs from burying a bench's tables."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in ("vllm", "kvtier"):
        logging.getLogger(name).setLevel(logging.WARNING)
