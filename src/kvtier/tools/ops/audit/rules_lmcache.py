"""Audit rules for LMCache deployments (env vars and sizes that must agree with vLLM's)."""

from __future__ import annotations

import difflib
from collections.abc import Iterator

from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, model_traits, rule
from kvtier.tools.ops.vllm_versions import format_version

# Relative difference between LMCache's total and vLLM's size that we call consistent.
_TOLERANCE = 0.10
# LMCACHE_* variables LMCache reads. The seeds name LOCAL_CPU, LOCAL_DISK and
# MAX_LOCAL_CPU_SIZE, and (as lmcache.yaml keys, which LMCache also reads as LMCACHE_ +
# the key in capitals) chunk_size, local_cpu, max_local_cpu_size, remote_url, remote_serde.
# The rest are the basic keys of LMCache's lmcache/v1/config.py (_CONFIG_DEFINITIONS) and
# the variables it reads directly. The list is not complete, so a name outside it is a
# warning only when it is a near miss of a listed one (a likely typo), else information.
LMCACHE_ENV_FROM_SEEDS = frozenset({
    "LMCACHE_LOCAL_CPU", "LMCACHE_LOCAL_DISK", "LMCACHE_MAX_LOCAL_CPU_SIZE",
    "LMCACHE_CHUNK_SIZE", "LMCACHE_REMOTE_URL", "LMCACHE_REMOTE_SERDE",
})
LMCACHE_ENV_NAMES = LMCACHE_ENV_FROM_SEEDS | frozenset({
    "LMCACHE_CONFIG_FILE", "LMCACHE_USE_EXPERIMENTAL", "LMCACHE_LOG_LEVEL",
    "LMCACHE_MAX_LOCAL_DISK_SIZE", "LMCACHE_LOCAL_DISK_PATH_SHARDING",
    "LMCACHE_LOCAL_CPU_USE_HUGEPAGES", "LMCACHE_RESERVE_LOCAL_CPU_SIZE",
    "LMCACHE_USE_LAYERWISE", "LMCACHE_SAVE_DECODE_CACHE", "LMCACHE_SAVE_UNFULL_CHUNK",
    "LMCACHE_PRE_CACHING_HASH_ALGORITHM", "LMCACHE_ENABLE_BLENDING",
    "LMCACHE_ENABLE_P2P", "LMCACHE_ENABLE_CONTROLLER", "LMCACHE_ENABLE_PD",
    "LMCACHE_PD_ROLE", "LMCACHE_TRANSFER_CHANNEL", "LMCACHE_NIXL_BACKENDS",
    "LMCACHE_GDS_PATH", "LMCACHE_USE_GDS", "LMCACHE_CACHE_POLICY", "LMCACHE_EXTRA_CONFIG",
    "LMCACHE_BLOCKING_TIMEOUT_SECS", "LMCACHE_ENABLE_ASYNC_LOADING",
    "LMCACHE_LOOKUP_TIMEOUT_MS", "LMCACHE_NUMA_MODE", "LMCACHE_INSTANCE_ID",
})


@rule("lmcache-size-mismatch", "LMCACHE_MAX_LOCAL_CPU_SIZE disagrees with --kv-offloading-size")
def lmcache_size_mismatch(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    total = cmd.number("--kv-offloading-size")
    raw = cmd.env.get("LMCACHE_MAX_LOCAL_CPU_SIZE")
    if total is None or raw is None:
        return
    try:
        per_rank = float(raw)
    except ValueError:
        return
    lmcache_total, tp = per_rank * cmd.tp, cmd.tp
    if abs(lmcache_total - total) <= _TOLERANCE * max(total, 1e-9):
        return
    overcommit = lmcache_total >= 2 * total
    yield Finding(
        "lmcache-size-mismatch", Severity.ERROR if overcommit else Severity.WARNING,
        f"LMCACHE_MAX_LOCAL_CPU_SIZE={raw} per rank x TP={tp} = {lmcache_total:g} GB, but "
        f"--kv-offloading-size is {total:g} GiB",
        "LMCache allocates its size in EVERY TP worker (LMCache#2901) and its env vars win; "
        "the scheduler then miscounts cache slots" + (
            ", and the host may be over-committed at startup (OOM kill)" if overcommit else ""),
        f"set LMCACHE_MAX_LOCAL_CPU_SIZE={total / tp:g} (= {total:g} / TP {tp})",
    )


@rule("lmcache-backend-is-mp", "--kv-offloading-backend lmcache: a standalone LMCache server, "
      "not the size given", reads=("--vllm-version",))
def lmcache_backend_is_mp(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    # vLLM's config/vllm.py _post_init_kv_transfer_config (0.24.0, 0.27.0, 0.33.0): the lmcache
    # backend is LMCacheMPConnector and "kv_offloading_size is not propagated"; up to 0.21.0
    # it was LMCacheConnectorV1 (in-process).
    if cmd.flags_connector != "LMCacheMPConnector":
        return
    size = cmd.value("--kv-offloading-size")
    release = "this release" if cmd.vllm_version is None else format_version(cmd.vllm_version)
    yield Finding(
        "lmcache-backend-is-mp", Severity.WARNING,
        f"--kv-offloading-backend lmcache --kv-offloading-size {size} on {release}: vLLM "
        "makes LMCacheMPConnector (LMCache in a separate server process)",
        f"vLLM does not pass the {size} GiB on: the cache is the standalone LMCache server's, "
        "sized by that server's own config, and vLLM connects to it (tcp://localhost:5555 "
        "unless kv_connector_extra_config names another); without such a server there is no "
        "LMCache tier" + ("" if cmd.vllm_version is not None else
                          " (up to v0.21 this backend was in-process LMCacheConnectorV1)"),
        "run an LMCache MP server sized for the tier, or for LMCache inside vLLM pass "
        "--kv-transfer-config '{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":"
        "\"kv_both\"}' with LMCACHE_MAX_LOCAL_CPU_SIZE (per rank) instead",
    )


@rule("lmcache-hybrid-model", "LMCache on a hybrid-attention model (LMCache#3106)",
      reads=("--model-config",))
def lmcache_hybrid(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    traits = model_traits(cmd)
    if not cmd.uses_lmcache or not traits.hybrid:
        return
    how = "its config.json" if traits.known else "its name"
    # kvtier serves sliding-window hybrids and the GDN / short-conv state families, not
    # Mamba ones (rules_state.py): suggest it only where it starts.
    kvtier = not traits.linear or traits.state_family in ("gdn", "short_conv")
    yield Finding(
        "lmcache-hybrid-model", Severity.ERROR,
        f"LMCache connector on {cmd.model or 'the model'}, a hybrid-attention model "
        f"(judged from {how})",
        "LMCache stores one tensor shape per chunk and fails on mixed attention groups "
        "(Gemma sliding+full, Qwen3.5 DeltaNet+attention): LMCache#3106, open 2026-05",
        "use vLLM native offload on v0.21.0+ (--kv-offloading-backend native)"
        + (" or kvtier's connector" if kvtier else "") + "; or NixlConnector 1P1D for "
        "disaggregation",
    )


@rule("lmcache-local-cpu-off", "LMCACHE_LOCAL_CPU=False (allocator deadlock, LMCache#2942)")
def lmcache_local_cpu_off(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    value = cmd.env.get("LMCACHE_LOCAL_CPU")
    if value is not None and value.strip().lower() in ("false", "0", "no", "off"):
        yield Finding(
            "lmcache-local-cpu-off", Severity.ERROR,
            f"LMCACHE_LOCAL_CPU={value}",
            "LocalCPUBackend.allocate() deadlocks when the hot CPU cache is off and the "
            "staging buffer fills (LMCache#2942, open)",
            "set LMCACHE_LOCAL_CPU=True (the default)",
        )


@rule("lmcache-unknown-env-var", "LMCACHE_* variables LMCache does not read (a typo?)")
def lmcache_unknown_env(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    for name in sorted(n for n in cmd.env if n.startswith("LMCACHE_")):
        if name in LMCACHE_ENV_NAMES:
            continue
        close = difflib.get_close_matches(name, sorted(LMCACHE_ENV_NAMES), n=1, cutoff=0.8)
        yield Finding(
            "lmcache-unknown-env-var", Severity.WARNING if close else Severity.INFO,
            f"{name} is set, but it is not an LMCache setting"
            + (f" (did you mean {close[0]}?)" if close else " the audit knows"),
            "LMCache ignores environment variables it does not define: the setting silently "
            "does nothing" + (" and the intended one keeps its default" if close else ""),
            f"rename it to {close[0]}" if close else
            "check the name against LMCache's configuration reference",
        )
