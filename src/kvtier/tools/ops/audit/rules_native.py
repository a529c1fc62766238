"""Audit rules for what an OffloadingConnector config holds (`kv_connector_extra_config`).

The reference is vLLM's KV Offloading Usage Guide (seed 003): the keys of
`kv_connector_extra_config`, which are required, which `TieringOffloadingSpec` rejects, and
the keys of each secondary tier. One rule per constraint; a key the guide does not list is a
warning with the closest documented key as the likely intent.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.tools.ops.attention_kernels import DEFAULT_BLOCK_SIZE
from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, on_cpu_backend, rule
from kvtier.tools.ops.audit.rules_kernels import attention_choice
from kvtier.tools.ops.vllm_versions import Version, format_version

CPU_SPEC, TIERING_SPEC = "CPUOffloadingSpec", "TieringOffloadingSpec"
BUILTIN_SPECS = (CPU_SPEC, TIERING_SPEC)
# kv_connector_extra_config keys of the built-in specs (the guide's reference table, plus
# `backpressure`, `blocks_per_chunk` and `cache_policy_module_path`, which vLLM v0.32 also
# reads).
EXTRA_KEYS = frozenset({
    "spec_name", "cpu_bytes_to_use", "block_size", "eviction_policy", "store_threshold",
    "max_tracker_size", "secondary_tiers", "offload_prompt_only",
    "self_describing_kv_events", "spec_module_path", "backpressure",
    "blocks_per_chunk", "cache_policy_module_path",
})
# Keys vLLM 0.33 added: the scheduler's `sync_load_budget_bytes` (any spec) and the tiering
# spec's `tier_poll_interval_s` -> (the release, the specs that read it).
NEW_EXTRA_KEYS: dict[str, tuple[Version, tuple[str, ...]]] = {
    "sync_load_budget_bytes": ((0, 33, 0), BUILTIN_SPECS),
    "tier_poll_interval_s": ((0, 33, 0), (TIERING_SPEC,)),
}
EVICTION_POLICIES = ("lru", "arc", "prefix")
# Secondary tier type -> its keys (besides `type`); the fs tier's come from the guide,
# `locality`, `backpressure` and `module_path` from vLLM v0.32's tier factory. The other
# types vLLM v0.32 registers are known by name only (their keys are not documented).
TIER_KEYS: dict[str, frozenset[str] | None] = {
    "fs": frozenset({"root_dir", "n_read_threads", "n_write_threads", "locality",
                     "backpressure", "module_path"}),
    "obj": None, "p2p": None, "kvcr": None, "example": None,
}
TIER_REQUIRED = {"fs": ("root_dir",)}
# The release whose OffloadingConnector reads cpu_bytes_to_use instead of num_cpu_blocks.
CPU_BYTES_SINCE = (0, 14, 0)


@dataclass(frozen=True, slots=True)
class NativeOffload:
    """One OffloadingConnector entry of --kv-transfer-config."""

    where: str  # e.g. "--kv-transfer-config" or "...connectors[1]", for messages
    extra: Mapping[str, Any]  # its kv_connector_extra_config
    spec: str  # spec_name, CPUOffloadingSpec when absent

    @property
    def builtin(self) -> bool:
        return self.spec in BUILTIN_SPECS

    @property
    def key(self) -> str:
        return f"{self.where}.kv_connector_extra_config"


def native_offloads(cmd: ServeCommand) -> Iterator[NativeOffload]:
    """Every OffloadingConnector in the transfer config, MultiConnector children included."""
    stack: list[tuple[str, Any]] = [("--kv-transfer-config", cmd.transfer_config)]
    while stack:
        where, entry = stack.pop(0)
        if not isinstance(entry, Mapping):
            continue
        extra = entry.get("kv_connector_extra_config")
        extra = extra if isinstance(extra, Mapping) else {}
        if entry.get("kv_connector") == "OffloadingConnector":
            yield NativeOffload(where, extra, str(extra.get("spec_name") or CPU_SPEC))
        children = extra.get("connectors")
        if isinstance(children, list):
            stack.extend((f"{where}.connectors[{i}]", c) for i, c in enumerate(children))


@rule("offload-cpu-bytes-required", "OffloadingConnector config without cpu_bytes_to_use")
def cpu_bytes_required(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    version = cmd.vllm_version
    if version is not None and version < CPU_BYTES_SINCE:
        return  # num_cpu_blocks was the form then
    for off in native_offloads(cmd):
        if not off.builtin:
            continue  # an out-of-tree spec (llm-d's fs backend) has its own keys
        value = off.extra.get("cpu_bytes_to_use")
        if value is not None and _positive_int(value):
            continue
        legacy = "num_cpu_blocks" in off.extra
        if value is None:
            what = f"{off.key} has no cpu_bytes_to_use" + (
                " (it has num_cpu_blocks, the pre-v0.14 form)" if legacy else "")
        else:
            what = f"{off.key}.cpu_bytes_to_use is {value!r}, not a positive integer"
        yield Finding(
            "offload-cpu-bytes-required", Severity.ERROR, what,
            f"{off.spec} raises 'cpu_bytes_to_use must be specified' at start-up"
            + ("; num_cpu_blocks is no longer read" if legacy else ""),
            "set cpu_bytes_to_use to the host bytes for the CPU tier, TOTAL across workers "
            "(e.g. 10737418240 for 10 GiB), or use --kv-offloading-size <GiB>"
            + (f"; on vLLM before {format_version(CPU_BYTES_SINCE)} pass --vllm-version"
               if legacy and version is None else ""),
        )


@rule("offload-block-size-multiple", "offloaded block_size not a multiple of the GPU block size",
      reads=("--gpu", "--model-config"))
def offload_block_size(cmd: ServeCommand, options: AuditOptions) -> Iterator[Finding]:
    # vLLM raises at start-up (offloading/config.py); seed 003, the KV Offloading Usage
    # Guide: "block_size ... must be a multiple of the GPU block size". Without --block-size
    # the GPU block is vLLM's default: on CUDA 16, or what the attention kernel needs
    # (FlashMLA: 64), always a multiple of 16 (issue 23: so block_size 24 is flagged there).
    gpu, source, known = _gpu_block_size(cmd, options)
    for off in native_offloads(cmd):
        value = off.extra.get("block_size")
        if value is None:
            continue
        number = _as_int(value)
        if number is not None and number > 0 and number % gpu == 0:
            continue
        use = f"{-(-number // gpu) * gpu}" if number is not None and number > 0 else f"{gpu * 4}"
        yield Finding(
            "offload-block-size-multiple", Severity.ERROR if known else Severity.WARNING,
            f"{off.key}.block_size is {value!r}, not a multiple of {source}",
            "an offloaded block is a whole number of GPU blocks (KV Offloading Usage Guide); "
            f"vLLM refuses the config at start-up: \"'block_size'={value} ... must be a "
            f"multiple of the GPU KV cache block size ({gpu} tokens)\""
            + ("" if known else f" (when the GPU block size is the default {gpu})"),
            f"set block_size to a multiple of {gpu} (e.g. {use}), or give blocks_per_chunk "
            "instead" + ("" if cmd.has("--block-size") else
                         ", and pass --block-size so both sizes are stated"),
        )


def _gpu_block_size(cmd: ServeCommand, options: AuditOptions) -> tuple[int, str, bool]:
    """The GPU block size, where it comes from (for messages), and whether it is known
    (False: a malformed --block-size, or vLLM's default off CUDA, which differs by platform
    and release)."""
    raw = cmd.value("--block-size")
    if raw is not None and _positive_int(raw):
        return int(raw), f"--block-size {int(raw)}", True
    if cmd.has("--block-size") or on_cpu_backend(cmd, options):
        return DEFAULT_BLOCK_SIZE, f"vLLM's default GPU block size {DEFAULT_BLOCK_SIZE}", \
            False
    choice = attention_choice(cmd, options)
    size = choice.block_size if choice is not None else DEFAULT_BLOCK_SIZE
    backend = choice.backend.name if choice is not None and choice.backend else ""
    kernel = f" for {backend}" if size != DEFAULT_BLOCK_SIZE else ""
    return size, f"vLLM's default block size on CUDA ({size}{kernel})", True


@rule("offload-tiering-store-threshold", "store_threshold >= 2 with TieringOffloadingSpec")
def tiering_store_threshold(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    for off in native_offloads(cmd):
        value = off.extra.get("store_threshold")
        if off.spec != TIERING_SPEC or value is None:
            continue
        number = _as_int(value)
        if number is None or number < 2:
            continue  # offload-config-values reports a non-integer
        yield Finding(
            "offload-tiering-store-threshold", Severity.ERROR,
            f"{off.key}.store_threshold is {value!r} with spec_name {TIERING_SPEC}",
            "store_threshold is a single-tier (CPUOffloadingSpec) setting; "
            "TieringOffloadingSpec raises 'store_threshold is not supported' for values >= 2",
            "remove store_threshold, or use CPUOffloadingSpec (no secondary tiers)",
        )


@rule("offload-tiering-kv-events", "self_describing_kv_events with TieringOffloadingSpec")
def tiering_kv_events(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    for off in native_offloads(cmd):
        value = off.extra.get("self_describing_kv_events")
        if off.spec != TIERING_SPEC or value in (None, False, 0, "false", "False"):
            continue
        yield Finding(
            "offload-tiering-kv-events", Severity.ERROR,
            f"{off.key}.self_describing_kv_events is {value!r} with spec_name {TIERING_SPEC}",
            "self-describing KV events are single-tier only: TieringOffloadingSpec rejects "
            "them",
            "remove self_describing_kv_events, or use CPUOffloadingSpec",
        )


@rule("offload-secondary-tiers", "secondary_tiers entries: type, required and known keys")
def secondary_tiers(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    for off in native_offloads(cmd):
        tiers = off.extra.get("secondary_tiers")
        if tiers is None or not off.builtin:
            continue
        if not isinstance(tiers, list):
            yield _tier_finding(f"{off.key}.secondary_tiers is {tiers!r}, not a list",
                                "TieringOffloadingSpec raises 'secondary_tiers must be a list'",
                                "give a list of tier objects, e.g. "
                                '[{"type": "fs", "root_dir": "/mnt/kv"}]')
            continue
        if tiers and off.spec != TIERING_SPEC:
            yield _tier_finding(
                f"{off.key}.secondary_tiers is set but spec_name is {off.spec}",
                "only TieringOffloadingSpec reads secondary tiers: they are silently unused",
                f'add "spec_name": "{TIERING_SPEC}"', Severity.WARNING)
        for i, tier in enumerate(tiers):
            yield from _check_tier(f"{off.key}.secondary_tiers[{i}]", tier)


@rule("offload-config-values", "OffloadingConnector keys with values vLLM rejects")
def offload_config_values(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    for off in native_offloads(cmd):
        if off.spec not in BUILTIN_SPECS and not off.extra.get("spec_module_path"):
            yield _value_finding(off, "spec_name", f"one of {', '.join(BUILTIN_SPECS)}, or "
                                 "an out-of-tree spec with spec_module_path",
                                 "vLLM raises 'Unsupported spec type'")
        if not off.builtin:
            continue
        if "block_size" in off.extra and "blocks_per_chunk" in off.extra:
            yield _value_finding(off, "blocks_per_chunk", "absent when block_size is given",
                                 "vLLM raises 'Specify only one of block_size or "
                                 "blocks_per_chunk'")
        policy = off.extra.get("eviction_policy")
        if policy is not None and policy not in EVICTION_POLICIES:
            yield _value_finding(off, "eviction_policy", "lru or arc",
                                 "the CPU tier has no other policy")
        for key in ("max_tracker_size", "blocks_per_chunk"):
            if key in off.extra and not _positive_int(off.extra[key]):
                yield _value_finding(off, key, "a positive integer", "vLLM reads it as int")
        threshold = off.extra.get("store_threshold")
        if threshold is not None and (_as_int(threshold) is None
                                      or _as_int(threshold) < 0):  # type: ignore[operator]
            yield _value_finding(off, "store_threshold", "a non-negative integer",
                                 "vLLM reads it with int()")
        for key in ("offload_prompt_only", "self_describing_kv_events"):
            if key in off.extra and not isinstance(off.extra[key], bool):
                yield _value_finding(off, key, "true or false (JSON booleans)",
                                     "a string such as \"false\" is truthy")


@rule("offload-config-unknown-key", "OffloadingConnector keys the reference does not document")
def offload_unknown_key(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    version = cmd.vllm_version
    for off in native_offloads(cmd):
        if not off.builtin:
            continue
        for key in sorted(set(off.extra) - EXTRA_KEYS - {"num_cpu_blocks"}):
            if key in NEW_EXTRA_KEYS:
                yield from _new_key(off, key, version)
                continue
            known = sorted(EXTRA_KEYS | set(NEW_EXTRA_KEYS))
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            yield Finding(
                "offload-config-unknown-key", Severity.WARNING,
                f"{off.key}.{key} is not an OffloadingConnector setting"
                + (f" (did you mean {close[0]!r}?)" if close else ""),
                "the connector ignores keys it does not know: the setting has no effect",
                f"rename it to {close[0]!r}" if close else
                f"remove it; the settings are {', '.join(known)}",
            )


def _new_key(off: NativeOffload, key: str, version: Version | None) -> Iterator[Finding]:
    """A key of a newer release: known there (with the specs that read it), ignored before."""
    since, specs = NEW_EXTRA_KEYS[key]
    too_old = version is not None and version < since
    if not too_old and off.spec in specs:
        return
    why = (f"vLLM {format_version(version)} does not read it (it is read from "
           f"{format_version(since)} on)" if too_old and version is not None else
           f"only {', '.join(specs)} reads it")
    yield Finding(
        "offload-config-unknown-key", Severity.WARNING,
        f"{off.key}.{key} has no effect here", f"{why}: the setting has no effect",
        f"remove it, or run vLLM {format_version(since)} or later" if too_old else
        f"remove it, or use spec_name {specs[0]}",
    )


def _check_tier(where: str, tier: Any) -> Iterator[Finding]:
    if not isinstance(tier, Mapping):
        yield _tier_finding(f"{where} is {tier!r}, not an object",
                            "each secondary tier is a dict with a `type` key",
                            '{"type": "fs", "root_dir": "/mnt/kv"}')
        return
    kind = tier.get("type")
    if kind is None:
        yield _tier_finding(f"{where} has no `type`",
                            "vLLM raises 'Secondary tier configuration must include type'",
                            'add "type": "fs" (the documented secondary tier)')
        return
    if kind not in TIER_KEYS:
        if tier.get("module_path"):
            return  # an out-of-tree tier, loaded from module_path
        close = difflib.get_close_matches(str(kind), sorted(TIER_KEYS), n=1, cutoff=0.5)
        yield _tier_finding(
            f"{where}.type is {kind!r}, not a secondary tier vLLM knows"
            + (f" (did you mean {close[0]!r}?)" if close else ""),
            "vLLM raises 'Unknown secondary tier type' at start-up",
            f"use {close[0]!r}" if close else f"use one of {', '.join(sorted(TIER_KEYS))}")
        return
    for key in TIER_REQUIRED.get(str(kind), ()):
        if not tier.get(key):
            yield _tier_finding(f"{where} ({kind}) has no {key}",
                                f"the {kind} tier needs {key}; start-up fails without it",
                                f'add "{key}": "/mnt/kv_cache" (a directory)')
    allowed = TIER_KEYS[str(kind)]
    for key in sorted(set(tier) - {"type"} - (allowed or set(tier))):
        close = difflib.get_close_matches(key, sorted(allowed or ()), n=1, cutoff=0.6)
        yield _tier_finding(
            f"{where}.{key} is not a {kind} tier setting"
            + (f" (did you mean {close[0]!r}?)" if close else ""),
            f"vLLM passes every key to the {kind} tier's constructor, which fails on an "
            "unknown one at start-up",
            f"rename it to {close[0]!r}" if close else f"remove it; the {kind} tier takes "
            f"{', '.join(sorted(allowed or ()))}")
    for key in ("n_read_threads", "n_write_threads"):
        if key in tier and not _positive_int(tier[key]):
            yield _tier_finding(f"{where}.{key} is {tier[key]!r}, not a positive integer",
                                "the tier starts that many I/O threads",
                                f"set {key} to the concurrency your storage sustains, e.g. 16")


def _tier_finding(what: str, why: str, fix: str,
                  severity: Severity = Severity.ERROR) -> Finding:
    return Finding("offload-secondary-tiers", severity, what, why, fix)


def _value_finding(off: NativeOffload, key: str, allowed: str, why: str) -> Finding:
    return Finding(
        "offload-config-values", Severity.ERROR,
        f"{off.key}.{key} is {off.extra.get(key)!r}: it must be {allowed}",
        f"{why}; the connector fails at start-up or does not do what was meant",
        f"set {key} to {allowed}",
    )


def _as_int(value: Any) -> int | None:
    """`value` as vLLM's int() reads it (42, 42.0, "42"), None when it cannot."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _positive_int(value: Any) -> bool:
    number = _as_int(value)
    return number is not None and number > 0


@rule("native-offload-on-cpu-backend", "vLLM's native CPU offload on its CPU backend, which "
                                       "refuses it at start-up")
def native_offload_on_cpu_backend(cmd: ServeCommand, options: AuditOptions) -> Iterator[Finding]:
    """The guide: "The OffloadingConnector currently supports CUDA, ROCm, and XPU only";
    vLLM 0.32 and 0.33's CPUOffloadingSpec.get_worker raises on another platform (the
    TieringOffloadingSpec is one). `--kv-offloading-size` with the native backend builds the
    same connector."""
    if not on_cpu_backend(cmd, options):
        return
    wheres = [off.where for off in native_offloads(cmd) if off.builtin]
    if cmd.has("--kv-offloading-size") and (
            cmd.value("--kv-offloading-backend") or "native").lower() == "native":
        wheres.append("--kv-offloading-size")
    for where in wheres:
        yield Finding(
            "native-offload-on-cpu-backend", Severity.ERROR,
            f"{where}: vLLM's native OffloadingConnector on vLLM's CPU backend",
            "its worker raises 'CPU Offloading is currently only supported on CUDA-alike and "
            "XPU GPUs' as the engine starts",
            "on the CPU backend offload with kvtier's connector (its memory and disk tiers), "
            "or drop the offload",
        )


@rule("offload-fs-tier-unbounded", "an fs secondary tier: vLLM never deletes its files")
def fs_tier_unbounded(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    """llm-d's offloading guide (seed 002): "The storage connector does not handle cleanup or
    eviction"; vLLM 0.33's FileSystemTierManager writes and reads block files and removes
    none. The directory grows until the filesystem is full, and then stores fail."""
    for off in native_offloads(cmd):
        tiers = off.extra.get("secondary_tiers")
        if off.spec != TIERING_SPEC or not isinstance(tiers, list):
            continue
        for i, tier in enumerate(tiers):
            if not isinstance(tier, Mapping) or tier.get("type") != "fs":
                continue
            root = tier.get("root_dir", "its root_dir")
            yield Finding(
                "offload-fs-tier-unbounded", Severity.WARNING,
                f"{off.key}.secondary_tiers[{i}] (fs, {root}) has no size limit",
                "vLLM's fs tier never deletes a block file: the directory grows until the "
                "filesystem is full, and then every store to it fails",
                "run an evictor beside it (llm-d's PVC Evictor, or a cron that removes the "
                "oldest files past a size), or give it a filesystem of its own with a quota; "
                "kvtier's disk and shared tiers evict within their capacity",
            )
