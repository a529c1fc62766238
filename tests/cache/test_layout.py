"""The KV layout: how many bytes a token and a chunk take, and a digest that keeps KV of
different shapes apart."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from kvtier.core.layout import DTYPE_BYTES, KVLayout
from kvtier.errors import ConfigError

# Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16; 256-token chunks.
LLAMA_8B = KVLayout(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                    tokens_per_chunk=256)


def test_llama_8b_chunk_of_256_tokens_is_32_mib() -> None:
    """K and V x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB a token; 256 tokens = 32 MiB
    (the figure the benchmark's largest chunk size is based on)."""
    assert LLAMA_8B.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert LLAMA_8B.bytes_per_chunk == 32 * 1024 * 1024


def test_mla_keeps_one_latent_per_token_and_fp8_halves_the_bytes() -> None:
    """DeepSeek-style MLA stores one 576-wide latent (kv_factor 1); fp8 takes 1 byte."""
    mla = KVLayout(num_layers=61, num_kv_heads=1, head_size=576, dtype="bfloat16",
                   tokens_per_chunk=64, kv_factor=1)
    assert mla.bytes_per_token == 61 * 576 * 2
    fp8 = dataclasses.replace(LLAMA_8B, dtype="float8_e4m3fn")
    assert fp8.bytes_per_chunk * 2 == LLAMA_8B.bytes_per_chunk
    assert all(dataclasses.replace(LLAMA_8B, dtype=d).bytes_per_token
               == LLAMA_8B.bytes_per_token // 2 * n for d, n in DTYPE_BYTES.items())


def test_equal_layouts_have_equal_digests_even_in_another_process() -> None:
    """The digest namespaces stored chunks on shared storage: another process (another
    node, after a restart) must compute the same 32-hex-digit string."""
    code = ("from kvtier.core.layout import KVLayout; print(KVLayout(num_layers=32, "
            "num_kv_heads=8, head_size=128, dtype='bfloat16', tokens_per_chunk=256).digest())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60).stdout.strip()
    assert other == LLAMA_8B.digest() == dataclasses.replace(LLAMA_8B).digest()
    assert len(other) == 32 and int(other, 16) >= 0


@pytest.mark.parametrize("change", [
    {"num_layers": 16}, {"num_kv_heads": 4}, {"head_size": 64}, {"dtype": "float16"},
    {"tokens_per_chunk": 128}, {"tp_rank": 1, "tp_world_size": 2}, {"tp_world_size": 2},
    {"kv_factor": 1},
])
def test_changing_any_field_changes_the_digest(change: dict[str, object]) -> None:
    """fp16 vs bf16 have the same size but different bits; TP rank 1 holds other heads than
    rank 0: any field that differs must give another digest, so such KV is never served."""
    assert dataclasses.replace(LLAMA_8B, **change).digest() != LLAMA_8B.digest()


@pytest.mark.parametrize("field, value", [
    ("num_layers", 0), ("num_kv_heads", -1), ("head_size", 1.5), ("tokens_per_chunk", "256"),
    ("tp_world_size", 0), ("dtype", "float64"), ("tp_rank", 2), ("tp_rank", -1),
    ("tp_rank", "0"), ("kv_factor", 3), ("kv_factor", 2.0),
])
def test_an_invalid_field_raises_config_error_naming_field_value_and_what_is_allowed(
    field: str, value: object,
) -> None:
    """A typo in a layout must fail at construction with a message a user can act on."""
    fields = dict(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                  tokens_per_chunk=256, tp_world_size=2)
    with pytest.raises(ConfigError) as caught:
        KVLayout(**{**fields, field: value})
    assert caught.value.field == f"layout.{field}"
    assert caught.value.value == value
    assert caught.value.allowed
    assert repr(value) in str(caught.value) and field in str(caught.value)
