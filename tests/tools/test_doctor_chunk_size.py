"""`kvtier doctor CONFIG` says ahead when the config's tokens_per_chunk is no multiple of
vLLM's default block size on this machine's vLLM build: the README's config with a
tokens_per_chunk of 100 passed doctor and failed at engine start. Doctor sees no command
line, so it warns (a --block-size may divide the size); `kvtier audit` judges a command line
(tests/tools/test_audit_rules.py)."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.versions import running_vllm
from kvtier.tools.ops.doctor import check_chunk_size
from kvtier.tools.ops.serving import is_cpu_backend

TIERS = [{"kind": "memory", "capacity": "1GiB"}]
ON_CPU = running_vllm() is not None and is_cpu_backend()


def test_a_chunk_size_no_default_block_divides_is_said_ahead() -> None:
    [check] = check_chunk_size({"tokens_per_chunk": 100, "tiers": TIERS})
    assert check.status == "warn"
    assert "100 is not a multiple of vLLM's default block size" in check.detail
    assert "--block-size" in check.detail and "e.g. " in check.detail


@pytest.mark.skipif(not ON_CPU, reason="vLLM's CPU build is not installed here")
def test_on_the_cpu_backend_the_block_is_128_and_depends_on_the_cpu() -> None:
    [check] = check_chunk_size({"tokens_per_chunk": 48, "tiers": TIERS})
    assert check.status == "warn"
    assert "CPU backend (128; 16 for an MLA model on a CPU without AMX)" in check.detail


def test_a_chunk_size_the_default_blocks_divide_or_none_set_is_fine() -> None:
    [check] = check_chunk_size({"tokens_per_chunk": 256, "tiers": TIERS})
    assert check.status == "ok"
    assert check_chunk_size({"tiers": TIERS}) == []
    assert check_chunk_size({"tokens_per_chunk": "x", "tiers": TIERS}) == []  # config's job
