"""Audit rules for input vLLM (or kvtier's connector) refuses at start-up: malformed flag
values, a `--kv-transfer-config` that is not a JSON object, connector names vLLM does not
know, and a kvtier connector config that kvtier's own schema rejects (rules_arguments.py:
the command and the flags themselves).

Each finding names the argument and what is wrong with it, at error level: a server started
with such input fails, or silently runs without the feature.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, model_traits, on_cpu_backend, rule
from kvtier.tools.ops.audit.rules_kernels import attention_choice
from kvtier.tools.ops.chunkfit import EngineBlock, engine_blocks, misfits
from kvtier.tools.ops.vllm_versions import Version

# Connector names vLLM's KVConnectorFactory registers (v0.9-v0.32; older names kept so
# auditing an older release does not flag them), plus kvtier's own.
KNOWN_CONNECTORS = frozenset({
    "OffloadingConnector", "SimpleCPUOffloadConnector", "LMCacheConnectorV1",
    "LMCacheMPConnector", "NixlConnector", "NixlPullConnector", "NixlPushConnector",
    "MultiConnector", "MooncakeConnector", "MooncakeStoreConnector", "P2pNcclConnector",
    "SharedStorageConnector", "ExampleConnector", "ExampleHiddenStatesConnector",
    "DecodeBenchConnector", "FlexKVConnectorV1", "HF3FSKVConnector", "MoRIIOConnector",
    "HiSparseConnector", "LMCacheConnector", "PyNcclConnector", "KVTierConnector",
})
KVTIER_CONNECTOR = "KVTierConnector"
KVTIER_MODULE = "kvtier.integrations.vllm"
_REGISTERED = re.compile(r"register_connector\(\s*[\"'](\w+)[\"']")
# vLLM 0.32's and 0.33's KVTransferConfig (vllm/config/kv_transfer.py, the same in both): its
# keys (extra ones are refused) and kv_role's values; earlier releases' kv_buffer_size,
# kv_rank, kv_parallel_size and kv_ip are accepted without a word on them.
KV_TRANSFER_KEYS = frozenset({
    "kv_connector", "engine_id", "kv_buffer_device", "kv_role", "kv_port",
    "kv_connector_extra_config", "kv_connector_module_path", "enable_permute_local_kv",
    "kv_load_failure_policy", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip"})
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_TRANSFER_KEYS_RELEASES = ((0, 32), (0, 33))  # the minor releases KV_TRANSFER_KEYS is of

# Flag -> (what the value must be, check). Token-count flags take vLLM's "32k"/"32K" forms.
_POSITIVE_INT = re.compile(r"^\s*\d+\s*$")
_HUMAN_INT = re.compile(r"^\s*\d+(\.\d+)?[kKmMgGtT]?\s*$")


def _positive_int(raw: str) -> bool:
    return bool(_POSITIVE_INT.match(raw)) and int(raw) >= 1


def _token_count(raw: str) -> bool:
    return bool(_HUMAN_INT.match(raw)) and float(raw.strip().rstrip("kKmMgGtT")) > 0


def _model_len(raw: str) -> bool:
    return raw.strip().lower() in ("-1", "auto") or _token_count(raw)


def _fraction(raw: str) -> bool:
    try:
        return 0 < float(raw) <= 1
    except ValueError:
        return False


def _non_negative(raw: str) -> bool:
    try:
        value = float(raw)
    except ValueError:
        return False
    return value >= 0 and value != float("inf")


FLAG_VALUES: dict[str, tuple[str, Any]] = {
    "--tensor-parallel-size": ("a positive integer", _positive_int),
    "--pipeline-parallel-size": ("a positive integer", _positive_int),
    "--data-parallel-size": ("a positive integer", _positive_int),
    "--block-size": ("a positive integer (tokens per KV block, e.g. 16)", _positive_int),
    "--max-num-seqs": ("a positive integer", _positive_int),
    "--max-num-batched-tokens": ("a positive token count (e.g. 8192 or 8k)", _token_count),
    "--max-model-len": ("a positive token count (e.g. 32768, 32k, 32K) or -1/auto",
                        _model_len),
    "--gpu-memory-utilization": ("a fraction in (0, 1], e.g. 0.9", _fraction),
    "--kv-offloading-size": ("a non-negative number of GiB", _non_negative),
    "--cpu-offload-gb": ("a non-negative number of GiB", _non_negative),
    "--swap-space": ("a non-negative number of GiB", _non_negative),
    "--kv-offloading-backend": ("native or lmcache",
                                lambda raw: raw.strip().lower() in ("native", "lmcache")),
}


@rule("malformed-flag-value", "a vLLM flag whose value vLLM rejects (e.g. -tp 0, --block-size abc)")
def malformed_flag_value(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    for flag, (allowed, valid) in FLAG_VALUES.items():
        if not cmd.has(flag):
            continue
        raw = cmd.value(flag)
        if raw is not None and valid(raw):
            continue
        shown = "no value" if raw is None else repr(raw)
        yield Finding(
            "malformed-flag-value", Severity.ERROR,
            f"{flag} has {shown}: it must be {allowed}",
            "vLLM's argument parser or config validation refuses it and the server does not "
            "start; the other audit rules read the flag as absent",
            f"give {flag} {allowed}",
        )


@rule("malformed-kv-transfer-config", "--kv-transfer-config that vLLM refuses (not a JSON "
      "object, a key its KVTransferConfig lacks, no or an unknown kv_role)")
def malformed_transfer_config(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    problem = cmd.transfer_config_problem
    if problem is not None:
        raw = cmd.value("--kv-transfer-config") or ""
        yield Finding(
            "malformed-kv-transfer-config", Severity.ERROR,
            f"--kv-transfer-config is {problem}: {_clip(raw)!r}",
            "vLLM parses the flag as JSON and exits at start-up; the connector checks of "
            "this audit could not run",
            "pass one JSON object in single shell quotes, e.g. --kv-transfer-config "
            "'{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\"}'",
        )
        return
    dotted = cmd.dotted_object("--kv-transfer-config")
    if dotted is not None and cmd.has("--kv-transfer-config"):
        yield Finding(
            "malformed-kv-transfer-config", Severity.ERROR,
            "--kv-transfer-config is given as JSON and as --kv-transfer-config.KEY words "
            f"({', '.join(sorted(dotted))})",
            "vLLM builds one object of the dotted words and passes it after the JSON, and "
            "argparse keeps the last: every key of the JSON (its kv_connector too) is dropped "
            "without a word, and the server runs with the dotted keys alone",
            "put every key in the JSON object, or give every key as a dotted word",
        )
    for where, entry in _connector_entries(cmd.transfer_config):
        if not isinstance(entry, Mapping):
            yield _entry_finding(where, f"{_clip(str(entry))!r}, not a JSON object")
            continue
        if not entry.get("kv_connector"):
            yield _entry_finding(f"{where}.kv_connector", "missing (no connector named)")
        yield from _transfer_keys(where, entry, cmd.vllm_version)
        extra = entry.get("kv_connector_extra_config")
        if extra is not None and not isinstance(extra, Mapping):
            yield _entry_finding(f"{where}.kv_connector_extra_config",
                                 f"{_clip(str(extra))!r}, not a JSON object")


@rule("unknown-kv-connector", "a kv_connector name vLLM does not register (a typo?)")
def unknown_connector(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    known = KNOWN_CONNECTORS | installed_connector_names()
    for where, entry in _connector_entries(cmd.transfer_config):
        if not isinstance(entry, Mapping) or not entry.get("kv_connector"):
            continue
        name, module = str(entry["kv_connector"]), entry.get("kv_connector_module_path")
        kvtier_module = _kvtier_module_problem(name, module)
        if kvtier_module is not None:
            yield Finding(
                "unknown-kv-connector", Severity.ERROR,
                f"{where}: {kvtier_module}",
                "vLLM imports kv_connector_module_path and takes the class named by "
                "kv_connector from it, and fails at start-up when either is not there",
                f'use "kv_connector": "{KVTIER_CONNECTOR}", "kv_connector_module_path": '
                f'"{KVTIER_MODULE}"',
            )
        elif name == KVTIER_CONNECTOR and not module:
            yield Finding(
                "unknown-kv-connector", Severity.INFO,
                f"{where}.kv_connector is {name} without kv_connector_module_path",
                "vLLM finds it by name through kvtier's plugin (the vllm.general_plugins "
                "entry point), so kvtier must be installed in the vLLM server's environment",
                f'or name the module: "kv_connector_module_path": "{KVTIER_MODULE}"',
            )
        elif name not in known and not module:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            yield Finding(
                "unknown-kv-connector", Severity.ERROR,
                f"{where}.kv_connector {name!r} is not a connector vLLM knows"
                + (f" (did you mean {close[0]!r}?)" if close else ""),
                "vLLM looks the name up in its connector registry and fails at start-up "
                "when it is not there",
                f"use {close[0]!r}" if close else
                "use a registered name (OffloadingConnector, LMCacheConnectorV1, "
                "NixlConnector, MultiConnector, ...) or give kv_connector_module_path",
            )


@rule("kvtier-connector-config", "kvtier connector config its own schema rejects, or a "
      "tokens_per_chunk the engine's block size does not divide",
      reads=("--gpu", "--model-config"))
def kvtier_connector_config(cmd: ServeCommand, options: AuditOptions) -> Iterator[Finding]:
    from kvtier.integrations.vllm.config import ConnectorConfig  # imports no vllm/torch

    for where, entry in _connector_entries(cmd.transfer_config):
        if not isinstance(entry, Mapping) or entry.get("kv_connector") != KVTIER_CONNECTOR:
            continue
        extra = entry.get("kv_connector_extra_config")
        if extra is not None and not isinstance(extra, Mapping):
            continue  # malformed-kv-transfer-config reports it
        try:
            config = ConnectorConfig.parse(extra, where=f"{where}.kv_connector_extra_config")
        except ConfigError as exc:
            yield Finding(
                "kvtier-connector-config", Severity.ERROR,
                f"{exc.field} = {_clip(repr(exc.value))} is invalid: {exc.allowed}",
                "kvtier's connector validates its config with this schema at start-up and "
                "refuses to load, so vLLM does not start",
                "fix the value; `kvtier serve --dry-run` prints a config the connector accepts",
            )
            continue
        if config.tokens_per_chunk_set:
            yield from _chunk_block_findings(
                f"{where}.kv_connector_extra_config.tokens_per_chunk", config.tokens_per_chunk,
                _engine_blocks(cmd, options), cmd.has("--block-size"))


def _chunk_block_findings(field: str, tokens: int, blocks: tuple[EngineBlock, ...],
                          block_given: bool) -> Iterator[Finding]:
    """An error when a block the engine uses, or every block it may use, does not divide
    `tokens` (the connector refuses it at start-up); a warning when only one it may use does
    not (an MLA model's on the CPU backend, which depends on the CPU)."""
    from kvtier.integrations.vllm.config import chunk_sizes_allowed

    bad = misfits(tokens, blocks)
    if not bad:
        return
    certain = [b for b in bad if b.certain]
    shown = certain[:1] or bad
    block = shown[0]
    sure = bool(certain) or len(bad) == len(blocks)
    depends = "" if sure else (
        "; the block depends on the CPU: vLLM's CPU backend runs an MLA model with 16-token "
        "blocks on a CPU without AMX, whatever --block-size says")
    yield Finding(
        "kvtier-connector-config", Severity.ERROR if sure else Severity.WARNING,
        f"{field} = {tokens} is not a multiple of {' nor of '.join(b.source for b in shown)}",
        "a kvtier chunk holds whole vLLM blocks: the connector refuses this tokens_per_chunk "
        f"at engine start (naming it and the engine's block_size), so vLLM does not "
        f"start{depends}",
        chunk_sizes_allowed(tokens, block.size)
        + ("" if block_given else "; or pass --block-size to state the block"),
    )


def _engine_blocks(cmd: ServeCommand, options: AuditOptions) -> tuple[EngineBlock, ...]:
    """The block sizes vLLM may run `cmd` with (none where not known: a malformed
    --block-size, an attention backend on CUDA the audit does not model). Without
    --block-size a CUDA engine's block is its attention kernel's default (16; FlashMLA 64);
    the CPU backend's is 128, or for an MLA model 16 on a CPU without AMX (chunkfit.py)."""
    raw = cmd.value("--block-size")
    if cmd.has("--block-size") and not (raw is not None and _positive_int(raw)):
        return ()
    block_size = int(raw) if raw is not None else None
    if on_cpu_backend(cmd, options):
        return engine_blocks(block_size, on_cpu=True, mla=model_traits(cmd).mla)
    if block_size is not None:
        return engine_blocks(block_size, on_cpu=False)
    choice = attention_choice(cmd, options)
    if choice is None:
        return ()
    return engine_blocks(None, on_cpu=False, cuda_default=choice.block_size)


def _kvtier_module_problem(name: str, module: Any) -> str | None:
    """What is wrong with a connector entry naming one of kvtier's modules (this kvtier is the
    one the server runs, so its modules are known here; another package's may be installed
    only on the server), or None: a module kvtier does not have, or a class other than its
    one connector."""
    if not isinstance(module, str) or module.split(".")[0] != "kvtier":
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is no package, an empty part
        found = False
    if not found:
        return f"kv_connector_module_path {module!r} is no module of kvtier"
    if name != KVTIER_CONNECTOR:
        return (f"kv_connector {name!r} is not in {module} (kvtier's connector is "
                f"{KVTIER_CONNECTOR!r})")
    return None


@functools.cache
def installed_connector_names() -> frozenset[str]:
    """Connector names the installed vLLM's factory registers (read as text, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return frozenset()
    factory = Path(spec.origin).parent / "distributed/kv_transfer/kv_connector/factory.py"
    try:
        return frozenset(_REGISTERED.findall(factory.read_text()))
    except (OSError, UnicodeDecodeError):
        return frozenset()


def _connector_entries(cfg: Mapping[str, Any] | None,
                       where: str = "--kv-transfer-config") -> Iterator[tuple[str, Any]]:
    """(where, entry) for the config and every MultiConnector child, recursively."""
    if cfg is None:
        return
    yield where, cfg
    if not isinstance(cfg, Mapping):
        return
    extra = cfg.get("kv_connector_extra_config")
    children = extra.get("connectors") if isinstance(extra, Mapping) else None
    if isinstance(children, list):
        for i, child in enumerate(children):
            yield from _connector_entries(child, f"{where}.connectors[{i}]")


def _transfer_keys(where: str, entry: Mapping[str, Any],
                   version: Version | None) -> Iterator[Finding]:
    """Findings for an entry's keys and kv_role as vLLM's KVTransferConfig validates them
    (vllm/config/kv_transfer.py: extra keys forbidden; a connector needs a kv_role, one of
    KV_ROLES): each raises at start-up, and the audit passed them."""
    for key in sorted(set(map(str, entry)) - KV_TRANSFER_KEYS):
        close = difflib.get_close_matches(key, sorted(KV_TRANSFER_KEYS), n=1, cutoff=0.8)
        on_table = version is not None and version[:2] in KV_TRANSFER_KEYS_RELEASES
        yield _entry_finding(
            f"{where}.{key}", "not a key of vLLM's KVTransferConfig"
            + (f" (did you mean {close[0]!r}?)" if close else
               f" ({', '.join(sorted(KV_TRANSFER_KEYS))})"),
            Severity.ERROR if close or on_table else Severity.WARNING)
    role = entry.get("kv_role")
    if entry.get("kv_connector") and role is None:
        yield _entry_finding(f"{where}.kv_role", f"missing: one of {', '.join(KV_ROLES)} is "
                             "required with a kv_connector")
    elif role is not None and role not in KV_ROLES:
        yield _entry_finding(f"{where}.kv_role", f"{role!r}, not one of {', '.join(KV_ROLES)}")


def _entry_finding(where: str, problem: str, severity: Severity = Severity.ERROR) -> Finding:
    return Finding(
        "malformed-kv-transfer-config", severity,
        f"{where} is {problem}",
        "vLLM reads the connector and its settings from these keys and fails at start-up",
        "give each connector entry a JSON object with kv_connector, kv_role and, where "
        "needed, a kv_connector_extra_config object",
    )


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
