"""`kvtier bench codecs --ttft`: a disk-tier hit's time to first token with each codec, as
`kvtier bench ttft`'s `kvtier-disk` engine times it (imports vLLM).

One engine per codec, in sequence, on the generated "bench" model: a RAM tier of two chunks
in front of a disk tier with that codec, so every load reads the disk (O_DIRECT where the
filesystem allows it) and decodes. A prompt of `tokens` cached tokens + 2 new is computed
once (stored), then, `reps` times: vLLM's own prefix hit (paired, the floor in that engine),
`reset_prefix_cache()`, and the kvtier hit. Figures: the medians, and the median of each
pair's difference (`extra_s`: what the disk hit costs beyond vLLM's own hit, in the same
engine, which is what varies least with the machine's load).

Primitives: `TtftFigures`, `measure_disk_ttft`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK, kvtier_transfer_config
from kvtier.testing.engines import counter, offline_engine, quiet_engine_logs
from kvtier.testing.tinymodel import make_preset_model
from kvtier.tools.bench.prompts import KV_BYTES_PER_TOKEN, NEW_TOKENS, bench_prompt

MODEL_ROOT = Path(".kvtier-models")
HITS = "vllm:external_prefix_cache_hits"


@dataclass(frozen=True, slots=True)
class TtftFigures:
    """One codec's disk hits."""

    codec: str
    tokens: int  # cached tokens of the prompt
    hit_s: float  # median TTFT of the kvtier disk hit
    prefix_s: float  # median TTFT of vLLM's own prefix hit, paired
    extra_s: float  # median of (kvtier hit - vLLM hit), pair by pair
    file_bytes: int  # what the prompt's chunks take on disk


def _ttft_s(llm: Any, prompt: dict[str, list[int]]) -> float:
    from vllm import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def _files(root: Path) -> list[Path]:
    return list(root.rglob("*.kvc"))


def measure_disk_ttft(codecs: Sequence[str], tokens: int, reps: int, work_dir: Path,
                      progress: Callable[[str], None]) -> list[TtftFigures]:
    """Raises RuntimeError when a hit did not come from kvtier (the figure would be wrong)."""
    quiet_engine_logs()
    model_dir = make_preset_model("bench", MODEL_ROOT)
    tokens = max(TOKENS_PER_CHUNK, tokens // TOKENS_PER_CHUNK * TOKENS_PER_CHUNK)
    prompt = bench_prompt(tokens + NEW_TOKENS, seed=tokens)
    out = []
    for codec in codecs:
        progress(f"ttft: disk tier, codec {codec}")
        with tempfile.TemporaryDirectory(dir=work_dir, prefix="kvtier-bench-ttft-") as tmp:
            disk = Path(tmp) / "disk"
            transfer = kvtier_transfer_config({
                "tokens_per_chunk": TOKENS_PER_CHUNK, "write_queue_depth": 1024,
                "load_mode": "sync", "tiers": [
                    {"kind": "memory", "capacity": 2 * TOKENS_PER_CHUNK * KV_BYTES_PER_TOKEN},
                    {"kind": "disk", "path": str(disk), "capacity": "4GiB", "codec": codec}]})
            with offline_engine(model_dir, tokens + 64, kv_transfer_config=transfer) as llm:
                _ttft_s(llm, prompt)  # a miss: computes and stores the prefix
                deadline = time.monotonic() + 120
                while len(_files(disk)) < tokens // TOKENS_PER_CHUNK:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"codec {codec}: the disk tier did not store the "
                                           "prompt's chunks within 2 minutes")
                    time.sleep(0.2)
                hits, prefixes = [], []
                for _ in range(reps):
                    prefixes.append(_ttft_s(llm, prompt))
                    llm.reset_prefix_cache()
                    before = counter(llm, HITS)
                    hits.append(_ttft_s(llm, prompt))
                    if counter(llm, HITS) - before < tokens:
                        raise RuntimeError(f"codec {codec}: a timed request was not a "
                                           "kvtier hit")
                file_bytes = sum(p.stat().st_size for p in _files(disk))
        out.append(TtftFigures(codec, tokens, statistics.median(hits),
                               statistics.median(prefixes),
                               statistics.median(h - p for h, p in zip(hits, prefixes)),
                               file_bytes))
    return out
