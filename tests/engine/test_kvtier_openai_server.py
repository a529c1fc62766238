"""vLLM's OpenAI server with kvtier: starts, serves a cached prompt, shows it on /metrics.

One server subprocess for the module (`kvtier.tools.ops.server.running_server`: its own
process group,
on 127.0.0.1 and a free port, healthy on /health, always stopped), started with kvtier's
connector (memory + disk tiers, 64-token chunks) and `VLLM_SERVER_DEV_MODE=1` so that the
test can empty vLLM's own prefix cache (`POST /reset_prefix_cache`, which leaves kvtier
alone): the repeat of a prompt is then served from kvtier, and /metrics shows it as
`vllm:external_prefix_cache_hits_total` and kvtier's `vllm:kvtier_loaded_tokens_total`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import complete, post, random_prompts, scrape, server_command

from kvtier.integrations.vllm.metrics import PREFIX
from kvtier.tools.ops.server import running_server

pytestmark = pytest.mark.vllm

CHUNK = 64
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LOADED_TOKENS = f"{PREFIX}loaded_tokens_total"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("kvtier-server")
    extra = {"tokens_per_chunk": CHUNK,
             "tiers": [{"kind": "memory", "capacity": "64MiB"},
                       {"kind": "disk", "path": str(root / "disk"), "capacity": "256MiB"}]}
    command = server_command(tiny_model_dir, extra)
    with running_server(command, log_path=root / "vllm.log", startup_timeout_s=300) as srv:
        yield srv


def test_the_server_serves_a_repeated_prompt_from_kvtier(server: Any,
                                                         tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    [prompt] = random_prompts([500], seed=50)
    tokens = prompt["prompt_token_ids"]
    first = complete(server, tokens, model=model)
    hits, loaded = scrape(server, EXTERNAL_HITS), scrape(server, LOADED_TOKENS)
    # Empty vLLM's own cache: the repeat can only be served from kvtier.
    post(server.url + "/reset_prefix_cache")
    assert complete(server, tokens, model=model) == first
    expected = (len(tokens) - 1) // CHUNK * CHUNK
    assert scrape(server, EXTERNAL_HITS) - hits == expected
    assert scrape(server, LOADED_TOKENS) - loaded == expected

    # kv_transfer_params in the request body reach the connector: skip_load recomputes.
    post(server.url + "/reset_prefix_cache")
    hits = scrape(server, EXTERNAL_HITS)
    assert complete(server, tokens, model=model, kv_transfer_params={"skip_load": True}) == first
    assert scrape(server, EXTERNAL_HITS) == hits
