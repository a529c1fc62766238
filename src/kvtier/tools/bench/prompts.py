"""What the ttft and sharing benches share about their prompts on the generated "bench" model:
`NEW_TOKENS`, `KV_BYTES_PER_TOKEN`, `bench_prompt`, `check_settings`. Chunks are the
connector's default (`kvtier.integrations.vllm.config.TOKENS_PER_CHUNK`: 2 MiB of the bench
model's KV); the engines are `kvtier.testing.engines`'.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import TOKENS_PER_CHUNK
from kvtier.testing.tinymodel import FIRST_WORD_ID, PRESETS

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
    if len(set(cached_tokens)) < len(cached_tokens):  # its prompt again: stored already
        raise ConfigError("cached_tokens", ",".join(map(str, cached_tokens)), "each length once")
    for name in counts:
        if getattr(settings, name) < 1:
            raise ConfigError(name, getattr(settings, name), "at least 1")
    field, chosen, allowed = choices
    for value in chosen:
        if value not in allowed:
            raise ConfigError(field, value, f"some of {tuple(allowed)}")
