"""The engine half of `kvtier bench codecs` (imports vLLM, so kept apart from bench/codecs.py):
KV produced by a real vLLM run of the generated "bench" model, and the LOSSY fp8 codec's
effect on that engine's outputs.

One engine (CPU backend): a RAM tier of two chunks over a disk tier with codec fp8 and a
shared tier stored as is. Each prompt runs alone on the miss path (exact KV; its chunks go
to both lower tiers), then, vLLM's own cache emptied, again as a hit read back from the fp8
disk tier (RAM holds two chunks). Both runs keep the chosen tokens' logprobs. The shared
tier's files are the KV that bench/codecs.py measures.

Primitives: `generate_kv`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK, kvtier_transfer_config
from kvtier.testing.engines import kvtier_counter, offline_engine, quiet_engine_logs
from kvtier.testing.tinymodel import make_preset_model
from kvtier.tools.bench.codecs_inputs import CodecsConfig, OutputEffect, read_chunk_files
from kvtier.tools.bench.prompts import bench_prompt

MODEL_ROOT = Path(".kvtier-models")


def _run(llm: Any, prompt: dict[str, list[int]], max_tokens: int) -> tuple[list[int],
                                                                            list[float]]:
    """Greedy tokens and each chosen token's logprob."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=1)
    [output] = llm.generate([prompt], params, use_tqdm=False)
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [float(step[token].logprob) for token, step in zip(tokens, completion.logprobs)]
    return tokens, logprobs


def _settle(directory: Path, timeout_s: float = 120) -> None:
    """Wait until no chunk file appears for a second (the writes behind are done)."""
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        now = len(list(directory.rglob("*.kvc")))
        if now == last:
            return
        last = now
        time.sleep(1.0)


def generate_kv(config: CodecsConfig) -> tuple[list[bytes], OutputEffect]:
    """The chunks of `config.prompts` prompts of the bench model's KV, and fp8's effect on
    their outputs (see the module docstring)."""
    quiet_engine_logs()
    model_dir = make_preset_model("bench", MODEL_ROOT)
    tokens = max(TOKENS_PER_CHUNK + 1, config.prompt_tokens)
    prompts = [bench_prompt(tokens, seed=1500 + i) for i in range(config.prompts)]
    with tempfile.TemporaryDirectory(dir=config.work_dir, prefix="kvtier-bench-kv-") as tmp:
        shared = Path(tmp) / "shared"
        chunk_bytes = 8 * 1024 * TOKENS_PER_CHUNK  # the bench model: 8 KiB of KV a token
        tiers = [{"kind": "memory", "capacity": 2 * chunk_bytes},
                 {"kind": "disk", "path": f"{tmp}/disk", "capacity": "4GiB", "codec": "fp8"},
                 {"kind": "shared", "path": str(shared), "capacity": "4GiB"}]
        transfer = kvtier_transfer_config({"tiers": tiers, "load_mode": "sync"})
        exact, lossy = [], []
        with offline_engine(model_dir, tokens + config.max_tokens + 64,
                            kv_transfer_config=transfer) as llm:
            for prompt in prompts:
                llm.reset_prefix_cache()
                exact.append(_run(llm, {**prompt}, config.max_tokens))
            _settle(shared)
            hits = kvtier_counter("tier_hits", "disk")
            for prompt in prompts:
                llm.reset_prefix_cache()
                lossy.append(_run(llm, {**prompt}, config.max_tokens))
            if kvtier_counter("tier_hits", "disk") <= hits:
                raise RuntimeError("the fp8 disk tier served no hit: the outputs check "
                                   "measured nothing")
        chunks, _ = read_chunk_files(shared, config.max_chunks)
    return chunks, _effect(exact, lossy)


def _effect(exact: list[tuple[list[int], list[float]]],
            lossy: list[tuple[list[int], list[float]]]) -> OutputEffect:
    """Token agreement counts positions up to each prompt's first divergence (after it the
    contexts differ); logprob deltas are those of the agreeing positions."""
    agree = identical = 0
    deltas: list[float] = []
    for (want, want_lp), (got, got_lp) in zip(exact, lossy):
        identical += want == got
        for i, (a, b) in enumerate(zip(want, got)):
            if a != b:
                break
            agree += 1
            deltas.append(abs(want_lp[i] - got_lp[i]))
    return OutputEffect(len(exact), identical, agree / max(1, sum(len(w) for w, _ in exact)),
                        sum(deltas) / max(1, len(deltas)), max(deltas, default=0.0))
