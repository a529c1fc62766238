"""Audit rules for LMCache deployments (env vars and sizes that must agree with vLLM's)."""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.ops.audit.command import ServeCommand
from kvtier.ops.audit.finding import Finding, Severity
from kvtier.ops.audit.registry import AuditOptions, model_traits, rule

# Relative difference between LMCache's total and vLLM's size that we call consistent.
_TOLERANCE = 0.10


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


@rule("lmcache-hybrid-model", "LMCache on a hybrid-attention model (LMCache#3106)")
def lmcache_hybrid(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    traits = model_traits(cmd)
    if not cmd.uses_lmcache or not traits.hybrid:
        return
    how = "its config.json" if traits.known else "its name"
    yield Finding(
        "lmcache-hybrid-model", Severity.ERROR,
        f"LMCache connector on {cmd.model or 'the model'}, a hybrid-attention model "
        f"(judged from {how})",
        "LMCache stores one tensor shape per chunk and fails on mixed attention groups "
        "(Gemma sliding+full, Qwen3.5 DeltaNet+attention): LMCache#3106, open 2026-05",
        "use vLLM native offload on v0.21.0+ (--kv-offloading-backend native) or kvtier's "
        "connector; or NixlConnector 1P1D for disaggregation",
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
