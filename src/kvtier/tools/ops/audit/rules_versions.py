"""Audit rules from the version-gate table: features used on releases that lack them."""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.integrations.vllm.versions import example_versions
from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, rule
from kvtier.tools.ops.vllm_versions import GATES, format_version

_LMCACHE_BUNDLED = (0, 14, 0)


@rule("flag-predates-version", "a flag used on a vLLM release older than the flag")
def flag_predates_version(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    version = cmd.vllm_version
    if version is None:
        return
    seen: set[str] = set()
    for gate in GATES:
        if gate.flag is None or gate.flag in seen or not cmd.has(gate.flag):
            continue
        if version < gate.since:
            seen.add(gate.flag)
            yield Finding(
                "flag-predates-version", Severity.ERROR,
                f"{gate.flag} is used on {format_version(version)}; it first shipped in "
                f"{format_version(gate.since)} ({gate.feature})",
                "vLLM rejects the unknown argument at startup, or ignores the feature",
                f"upgrade to {format_version(gate.since)} or later; {gate.note}",
            )


@rule("lmcache-not-bundled", "LMCache on an x86 image that does not ship it")
def lmcache_not_bundled(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    version = cmd.vllm_version
    if not cmd.uses_lmcache or version is None or version >= _LMCACHE_BUNDLED:
        return
    yield Finding(
        "lmcache-not-bundled", Severity.WARNING,
        f"LMCache connector on vLLM {format_version(version)}",
        "x86 vllm/vllm-openai images before v0.14.0 were built without LMCache (torch "
        "conflict, July 2025 - Jan 2026): the connector import fails unless it is installed",
        "use a v0.14.0+ image, or `pip install lmcache` (pinned to the vLLM release) at start",
    )


@rule("version-unknown", "offload configured but the vLLM version is unknown")
def version_unknown(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    if cmd.offloads and cmd.vllm_version is None:
        yield Finding(
            "version-unknown", Severity.INFO,
            "the vLLM version is not known (no --vllm-version, no image tag)",
            "offload flags and their companions changed across v0.11-v0.21; some checks "
            "could not decide",
            f"pass --vllm-version (e.g. {example_versions()}) or audit the manifest with its "
            "image tag",
        )
