"""Audit rules about environment variables operators set by habit that vLLM never reads."""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, on_cpu_backend, rule
from kvtier.tools.ops.vllm_versions import Version, format_version, installed_vllm_version

# Variables that do not exist in any vLLM release, and what was meant.
KNOWN_FAKE_ENV: dict[str, str] = {
    "VLLM_USE_FASTSAFETENSOR": "--load-format fastsafetensors (a CLI flag, not an env var)",
    "VLLM_USE_FASTSAFETENSORS": "--load-format fastsafetensors (a CLI flag, not an env var)",
    "VLLM_KV_OFFLOADING_SIZE": "--kv-offloading-size <GiB total>",
    "VLLM_ENABLE_PREFIX_CACHING": "--enable-prefix-caching",
}
_QUOTED = re.compile(r'"(VLLM_[A-Z0-9_]+)"')
_ANNOTATED = re.compile(r"^\s+(VLLM_[A-Z0-9_]+)\s*:", re.MULTILINE)


@functools.cache
def installed_vllm_env_names() -> frozenset[str] | None:
    """Every VLLM_* name the installed vLLM's envs.py mentions, or None without vLLM.

    Reads the source text; vllm is not imported (that takes seconds and may touch CUDA).
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    envs = Path(spec.origin).with_name("envs.py")
    try:
        text = envs.read_text()
    except OSError:
        return None
    return frozenset(_QUOTED.findall(text)) | frozenset(_ANNOTATED.findall(text))


@rule("nonexistent-env-var", "environment variables vLLM does not read")
def nonexistent_env(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    for name in sorted(cmd.env):
        if name in KNOWN_FAKE_ENV:
            yield _finding(name, f"use {KNOWN_FAKE_ENV[name]}", "in no vLLM release")
    known, installed = installed_vllm_env_names(), installed_vllm_version()
    if known is None or not _same_release(cmd.vllm_version, installed):
        return
    for name in sorted(cmd.env):
        if name.startswith("VLLM_") and name not in known and name not in KNOWN_FAKE_ENV:
            yield _finding(name, "remove it, or look up the current name in vllm/envs.py",
                           f"checked against the installed vLLM {format_version(installed)}"  # type: ignore[arg-type]
                           )


def _same_release(target: Version | None, installed: Version | None) -> bool:
    """Judge against the installed vLLM only when it is the release being audited."""
    return installed is not None and (target is None or target[:2] == installed[:2])


def _finding(name: str, fix: str, checked: str) -> Finding:
    return Finding(
        "nonexistent-env-var", Severity.WARNING,
        f"{name} is set, but it is not a vLLM environment variable ({checked})",
        "the setting silently does nothing, and the feature it was meant to turn on is off",
        fix,
    )


@rule("cpu-connector-reserves-core", "a KV connector on the CPU backend takes a core per worker")
def cpu_connector_reserved_core(cmd: ServeCommand, options: AuditOptions) -> Iterator[Finding]:
    if not on_cpu_backend(cmd, options) or not cmd.connectors \
            or "VLLM_CPU_NUM_OF_RESERVED_CPU" in cmd.env:
        return
    workers = cmd.tp * int(cmd.number("--pipeline-parallel-size") or cmd.number("-pp") or 1)
    yield Finding(
        "cpu-connector-reserves-core", Severity.WARNING,
        f"KV connector {cmd.connectors[0]} on the CPU backend without "
        "VLLM_CPU_NUM_OF_RESERVED_CPU",
        "with any KV connector configured, vLLM's CPU backend reserves one more core per worker "
        "(meant for NIXL's transfer threads) and binds the worker's OpenMP threads to fewer "
        "cores; on a small host that leaves the engine core and API server without a core and "
        "every step slows down (seen: ~5x on 2 cores with kvtier, whose copies need no core)",
        f"set VLLM_CPU_NUM_OF_RESERVED_CPU={workers} (one per worker, the binding without a "
        "connector), as `kvtier serve` does",
    )
