"""Compressed and encrypted tiers in a real vLLM (CPU backend), issue 15: hits read from a
zstd disk tier, an lz4 shared directory and a zstd redis tier give the outputs of vLLM
without kvtier, token for token; the chunks of two tenants (cache salts) are encrypted at
rest there, under two keys, and still give those outputs.

Two engines, one after the other: vLLM alone (the reference outputs), then kvtier with a RAM
tier of two chunks over disk (zstd), shared (lz4) and redis (zstd), all three encrypting
salted requests' chunks with a secret read from a file. A case stores its prompts (the miss
path, which must match the reference too), then reads them back from disk, then from the
shared directory once the disk copies are deleted, then from redis once the shared copies
are deleted too: each read counted in that tier's `tier_hits`. Last, a compressed chunk
damaged on disk is a counted corrupt read, and the shared tier's copy serves the hit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from vllm_harness import (
    chunk_files,
    kvtier_counter,
    kvtier_transfer_config,
    random_prompts,
    start_engine,
    token_ids,
)

from kvtier.core.chunkformat import HEADER_BYTES, VERSION_ENCODED

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

CHUNK = 64
MAX_TOKENS = 12
PLAIN = random_prompts([450, 700, 330], seed=150)
# The same prompt under two tenants, and one more prompt of tenant b.
SALTED = [{**PLAIN[0], "cache_salt": "tenant-a"}, {**PLAIN[0], "cache_salt": "tenant-b"},
          {**random_prompts([520], seed=151)[0], "cache_salt": "tenant-b"}]
DAMAGED = random_prompts([400], seed=152)  # its disk copies are damaged (the last case)
SECRET = b"e2e-operator-secret-0123456789abcdefghijklmnop"


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    """The outputs of vLLM without kvtier."""
    with start_engine(tiny_model_dir, None) as llm:
        return {"plain": token_ids(llm, PLAIN, MAX_TOKENS),
                "salted": token_ids(llm, SALTED, MAX_TOKENS),
                "damaged": token_ids(llm, DAMAGED, MAX_TOKENS)}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           redis_session: Any, reference: dict[str, list[list[int]]],
           ) -> Iterator[tuple[Any, dict[str, Path], str]]:
    root = tmp_path_factory.mktemp("codecs-e2e")
    secret = root / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    dirs = {"disk": root / "disk", "shared": root / "shared"}
    sealing = {"encryption_secret_file": str(secret)}
    redis_session.client().flushall()
    tiers = [{"kind": "memory", "capacity": "64KiB"},  # two 32 KiB chunks: hits come from below
             {"kind": "disk", "path": str(dirs["disk"]), "capacity": "256MiB", "codec": "zstd",
              **sealing},
             {"kind": "shared", "path": str(dirs["shared"]), "capacity": "256MiB",
              "codec": "lz4", **sealing},
             {"kind": "redis", "url": redis_session.url, "capacity": 0, "codec": "zstd",
              **sealing}]
    with start_engine(tiny_model_dir, kvtier_transfer_config(tiers, CHUNK)) as llm:
        yield llm, dirs, redis_session.url


def settled(dirs: dict[str, Path], url: str, timeout_s: float = 60) -> None:
    """Wait until the write-behind threads are done: no chunk file or redis value appears
    for a second."""
    client = redis.Redis.from_url(url)

    def count() -> tuple[int, ...]:
        return (*(len(chunk_files(d)) for d in dirs.values()), int(client.dbsize()))

    deadline, last = time.monotonic() + timeout_s, count()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = count()
        if now == last:
            return
        last = now
    raise AssertionError("writes behind did not settle")


def misses(llm: Any, prompts: list[dict[str, Any]]) -> list[list[int]]:
    """The miss path, one prompt at a time (each stores its chunks)."""
    outs = []
    for prompt in prompts:
        assert llm.reset_prefix_cache()
        outs += token_ids(llm, [prompt], MAX_TOKENS)
    return outs


def served_by(tier: str, llm: Any, prompts: list[dict[str, Any]]) -> list[list[int]]:
    """The prompts as one batch, their hits read from `tier` (its hits counted)."""
    hits = kvtier_counter("tier_hits", tier)
    assert llm.reset_prefix_cache()
    outs = token_ids(llm, prompts, MAX_TOKENS)
    assert kvtier_counter("tier_hits", tier) > hits, f"no hit read from {tier}"
    return outs


def delete_files(directory: Path) -> None:
    for path in chunk_files(directory):
        path.unlink()


def read_down_the_tiers(engine: tuple[Any, dict[str, Path], str],
                        prompts: list[dict[str, Any]], expected: list[list[int]]) -> None:
    llm, dirs, url = engine
    assert misses(llm, prompts) == expected
    settled(dirs, url)
    assert served_by("disk", llm, prompts) == expected
    delete_files(dirs["disk"])
    assert served_by("shared", llm, prompts) == expected
    settled(dirs, url)  # the shared hits were promoted to disk again
    delete_files(dirs["disk"])
    delete_files(dirs["shared"])
    assert served_by("redis", llm, prompts) == expected
    assert kvtier_counter("tier_corrupt_reads") == 0
    assert kvtier_counter("load_failures") == 0


def test_compressed_tiers_give_the_outputs_of_vllm_without_kvtier(
        engine: tuple[Any, dict[str, Path], str], reference: dict[str, list[list[int]]]) -> None:
    _, dirs, url = engine
    read_down_the_tiers(engine, PLAIN, reference["plain"])
    # What the disk holds now (promoted back from redis) is zstd-compressed, in clear.
    settled(dirs, url)
    headers = [p.read_bytes()[:128] for p in chunk_files(dirs["disk"])]
    assert headers and all(int.from_bytes(h[8:10], "little") == VERSION_ENCODED for h in headers)
    assert {(h[60], h[61]) for h in headers} == {(1, 0)}  # codec zstd, no seal


def test_two_tenants_encrypted_at_rest_give_the_outputs_of_vllm_without_kvtier(
        engine: tuple[Any, dict[str, Path], str], reference: dict[str, list[list[int]]]) -> None:
    llm, dirs, url = engine
    before = {d: set(chunk_files(p)) for d, p in dirs.items()}
    assert misses(llm, SALTED) == reference["salted"]
    settled(dirs, url)
    for name, directory in dirs.items():
        new = sorted(set(chunk_files(directory)) - before[name])
        assert new, f"nothing stored in {name}"
        headers = [p.read_bytes()[:128] for p in new]
        assert all(h[61] == 1 for h in headers)  # sealed (AES-256-GCM)
        assert len({h[84:92] for h in headers}) == 2  # two tenants, two key ids
    delete_files(dirs["disk"])
    delete_files(dirs["shared"])
    read_down_the_tiers(engine, SALTED, reference["salted"])


def test_a_damaged_compressed_chunk_is_a_counted_miss_and_the_next_tier_serves(
        engine: tuple[Any, dict[str, Path], str], reference: dict[str, list[list[int]]]) -> None:
    llm, dirs, url = engine
    before = set(chunk_files(dirs["disk"]))
    assert misses(llm, DAMAGED) == reference["damaged"]
    settled(dirs, url)
    damaged = sorted(set(chunk_files(dirs["disk"])) - before)
    assert damaged
    for path in damaged:  # one bit of the zstd body
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 64] ^= 0x01
        path.write_bytes(bytes(data))
    corrupt = kvtier_counter("tier_corrupt_reads", "disk")
    failures = kvtier_counter("load_failures")
    assert served_by("shared", llm, DAMAGED) == reference["damaged"]
    # (the chunks the RAM tier still held were not read from disk)
    assert 0 < kvtier_counter("tier_corrupt_reads", "disk") - corrupt <= len(damaged)
    assert kvtier_counter("load_failures") == failures  # the next tier served every chunk
