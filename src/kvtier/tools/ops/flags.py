"""Command-line flags and environment for each offload backend, kept consistent.

Primitives:
    sglang_per_rank_to_vllm_total(per_rank, tp) -- SGLang sizes are per rank, vLLM's total
    kvtier_flags(extra, hma)              -- flags to serve with kvtier's connector (its
                                             --kv-transfer-config comes from
                                             kvtier.integrations.vllm.config, the schema)
    native_offload_flags(total_gib, hma)  -- flags for vLLM's native CPU offload
    gib_number(value_gib)                 -- a GiB size as flags take it, rounded down
    lmcache_env(total_gib, tp, ...), lmcache_flags(hma)
                                          -- LMCache in-process env + flags
    shell_quote_flags(flags)              -- one copy-pasteable line

Size conventions (the #1 sizing mistake, see the operator's guide):
    vLLM `--kv-offloading-size` is GiB TOTAL across TP ranks.
    SGLang's host-cache size is PER RANK: 200 per GPU x 8 GPUs = 1600 on vLLM.
    LMCache `LMCACHE_MAX_LOCAL_CPU_SIZE` (in-process mode) is allocated by EVERY TP rank
    (LMCache#2901), so it is the vLLM total divided by TP.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import kvtier_transfer_config

DISABLE_HMA = "--disable-hybrid-kv-cache-manager"


def sglang_per_rank_to_vllm_total(per_rank: float, tp: int) -> float:
    """Convert an SGLang per-rank host KV size to vLLM's total-across-TP size (same unit).

    Raises:
        ConfigError: when per_rank < 0 or tp < 1.
    """
    if per_rank < 0:
        raise ConfigError("from_sglang", per_rank, "a size >= 0 per GPU")
    if tp < 1:
        raise ConfigError("tp", tp, "an integer >= 1")
    return per_rank * tp


def kvtier_flags(extra: Mapping[str, Any], disable_hma: bool) -> list[str]:
    """Flags for `vllm serve` with kvtier's connector (prefix caching must stay on), `extra`
    being its kv_connector_extra_config.

    Raises:
        ConfigError: when the connector would refuse `extra` (ConnectorConfig.parse).
    """
    config = json.dumps(kvtier_transfer_config(extra), separators=(",", ":"))
    return ["--enable-prefix-caching", "--kv-transfer-config", config] + (
        [DISABLE_HMA] if disable_hma else [])


def gib_number(value_gib: float) -> str:
    """A size in GiB as `--kv-offloading-size`, LMCache and kvtier capacities take it (all
    accept fractions), rounded DOWN so a tier never exceeds its budget: to 0.01 GiB from
    1 GiB up, 0.001 below, which loses under 1% (issue 14: whole GiB turns 6 GB into 5 GiB, -10.5%).
    1600 -> "1600", 6e9 B = 5.588 GiB -> "5.58"."""
    digits = 2 if value_gib >= 1 else 3
    # + 1e-6: a size computed through int() bytes sits a hair below its decimal value
    floored = math.floor(value_gib * 10**digits + 1e-6) / 10**digits
    return f"{floored:.{digits}f}".rstrip("0").rstrip(".") or "0"


def native_offload_flags(total_gib: float, disable_hma: bool) -> list[str]:
    """Flags for vLLM's native CPU offload of `total_gib` GiB across all TP ranks."""
    return ["--enable-prefix-caching", "--kv-offloading-backend", "native",
            "--kv-offloading-size", gib_number(total_gib)] + (
        [DISABLE_HMA] if disable_hma else [])


def lmcache_env(
    total_gib: float, tp: int, disk_path: str | None = None, disk_total_gib: float = 0
) -> dict[str, str]:
    """LMCache (in-process `LMCacheConnectorV1`) environment for a `total_gib` CPU tier.

    Every TP rank allocates the per-rank sizes, so the totals match `--kv-offloading-size`.
    `PYTHONHASHSEED=0` keeps chunk keys equal across TP workers and instances;
    `LMCACHE_LOCAL_CPU=True` avoids the use_hot=False allocator deadlock (LMCache#2942).
    """
    env = {
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": gib_number(total_gib / tp),
        "PYTHONHASHSEED": "0",
    }
    if disk_path and disk_total_gib > 0:
        env["LMCACHE_LOCAL_DISK"] = f"file://{disk_path.rstrip('/')}/"
        env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = gib_number(disk_total_gib / tp)
    return env


def lmcache_flags(disable_hma: bool = True) -> list[str]:
    """Flags for `vllm serve` with LMCache in-process (LMCache needs HMA off)."""
    config = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
                        separators=(",", ":"))
    return ["--enable-prefix-caching", "--kv-transfer-config", config] + (
        [DISABLE_HMA] if disable_hma else [])


def shell_quote_flags(flags: Sequence[str]) -> str:
    """Join flags into one shell-safe line (JSON values single-quoted)."""
    return " ".join(shlex.quote(f) for f in flags)

