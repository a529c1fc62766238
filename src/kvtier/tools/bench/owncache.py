"""Are kvtier's greedy answers vLLM's own? Two-turn conversations, one request at a time
(issue 44, item 6).

`python3 -m kvtier.tools.bench.owncache [--tokens-per-chunk N] [--no-tail-chunks]`: one
offline engine on the embedded "bench" model (random weights, so near-ties in the logits),
kvtier's RAM tier large enough for everything. Each conversation's second turn (the first turn,
its answer, a new message) is answered three ways, greedy: (a) recomputed (vLLM's cache
emptied, kvtier bypassed), (b) from vLLM's own prefix cache holding the first turn, prompt and
answer (kvtier bypassed), (c) from kvtier (vLLM's cache emptied). It prints how many answers
agree, pair by pair. (b) and (c) reuse the KV the first turn computed, its answer's included,
which decode steps computed one token at a time; (a) recomputes it in one prefill, which rounds
differently in bf16: so (a) may differ from both, and kvtier's answers are to equal (b)'s.

Primitives: `compare_answers`, `main`.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

from kvtier.integrations.vllm.config import kvtier_transfer_config
from kvtier.testing.engines import offline_engine
from kvtier.testing.tinymodel import FIRST_WORD_ID, PRESETS, make_preset_model

BYPASS = {"skip_load": True, "skip_store": True}


def compare_answers(model_root: Path, tokens_per_chunk: int, tail_chunks: bool,
                    conversations: int, seed: int = 1) -> dict[str, int]:
    """Answers that agree, of `conversations`: "recompute=own-cache", "recompute=kvtier",
    "own-cache=kvtier" (see the module docstring). Starts one engine in this process."""
    from vllm import SamplingParams

    model = make_preset_model("bench", model_root)
    extra = {"tokens_per_chunk": tokens_per_chunk, "load_when": "always",
             "tail_chunks": tail_chunks, "tiers": [{"kind": "memory", "capacity": "1GiB"}]}
    rng = random.Random(seed)
    vocab = PRESETS["bench"].vocab_size

    def words(n: int) -> list[int]:
        return [rng.randrange(FIRST_WORD_ID, vocab) for _ in range(n)]

    def answer(llm: Any, ids: list[int], params: dict[str, Any] | None = None) -> list[int]:
        sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params else None)
        out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    agree = {"recompute=own-cache": 0, "recompute=kvtier": 0, "own-cache=kvtier": 0}
    with offline_engine(model, 4096, kv_transfer_config=kvtier_transfer_config(extra),
                        block_size=32, num_gpu_blocks_override=512) as llm:
        for _ in range(conversations):
            first = words(rng.randrange(300, 900))
            llm.reset_prefix_cache()
            second = first + answer(llm, first) + words(rng.randrange(40, 120))
            own = answer(llm, second, BYPASS)  # vLLM's cache holds the first turn
            llm.reset_prefix_cache()
            recomputed = answer(llm, second, BYPASS)
            llm.reset_prefix_cache()
            kvtier = answer(llm, second)
            agree["recompute=own-cache"] += recomputed == own
            agree["recompute=kvtier"] += recomputed == kvtier
            agree["own-cache=kvtier"] += own == kvtier
    return agree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-chunk", type=int, default=256)
    parser.add_argument("--no-tail-chunks", action="store_true")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--model-root", type=Path, default=Path(".kvtier-models"))
    args = parser.parse_args(argv)
    # The engine in this process: it starts in seconds (vllm_harness.start_engine does too).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    agree = compare_answers(args.model_root, args.tokens_per_chunk, not args.no_tail_chunks,
                            args.conversations)
    tails = "off" if args.no_tail_chunks else "on"
    print(f"tokens_per_chunk {args.tokens_per_chunk}, tails {tails}: " + ", ".join(
        f"{pair} {count}/{args.conversations}" for pair, count in agree.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
