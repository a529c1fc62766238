"""Audit rule for vLLM's sleep mode (`--enable-sleep-mode`) with a KV connector.

Sleep mode frees the KV cache and maps it again on wake-up. From 0.33 vLLM asks each
connector whether it can follow that (`KVConnectorBase_V1.supports_sleep_mode`; a
MultiConnector only if every child can) and refuses to start when one cannot
(vllm/config/vllm.py: "X does not support sleep mode"). kvtier's connector says it cannot:
its workers' load and store threads hold views of the KV cache. So do 0.33's
MooncakeStoreConnector and MoRIIOConnector, and NixlConnector with any backend but UCX
alone. Before 0.33 vLLM does not ask: the server starts, and kvtier's threads outlive the
memory they copy from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvtier.tools.ops.audit.command import ServeCommand
from kvtier.tools.ops.audit.finding import Finding, Severity
from kvtier.tools.ops.audit.registry import AuditOptions, rule
from kvtier.tools.ops.vllm_versions import Version, format_version

RULE = "connector-refuses-sleep-mode"
SLEEP_CHECK_SINCE: Version = (0, 33, 0)  # vLLM asks connectors from this release
KVTIER_CONNECTOR = "KVTierConnector"
# vLLM 0.33's connectors whose supports_sleep_mode says False (NixlConnector: see below).
_REFUSING = frozenset({KVTIER_CONNECTOR, "MooncakeStoreConnector", "MoRIIOConnector"})


def refusing_connectors(cfg: Mapping[str, Any]) -> list[str]:
    """The connectors of a KV transfer config (MultiConnector children included) that 0.33
    says cannot follow sleep mode."""
    name = str(cfg.get("kv_connector") or "")
    extra = cfg.get("kv_connector_extra_config")
    extra = extra if isinstance(extra, Mapping) else {}
    out = [name] if name in _REFUSING else []
    if name == "NixlConnector" and extra.get("backends", ["UCX"]) != ["UCX"]:
        out.append(name)
    children = extra.get("connectors")
    for child in children if isinstance(children, list) else []:
        if isinstance(child, Mapping):
            out += refusing_connectors(child)
    return list(dict.fromkeys(out))


@rule(RULE, "--enable-sleep-mode with a KV connector that cannot follow it (kvtier's: vLLM "
            "0.33 refuses to start)")
def connector_refuses_sleep_mode(cmd: ServeCommand, _: AuditOptions) -> Iterator[Finding]:
    cfg = cmd.transfer_config
    if not cmd.has("--enable-sleep-mode") or not cfg:
        return
    version = cmd.vllm_version
    asked = version is None or version >= SLEEP_CHECK_SINCE
    names = [n for n in refusing_connectors(cfg) if asked or n == KVTIER_CONNECTOR]
    if not names:
        return
    since = format_version(SLEEP_CHECK_SINCE)
    if version is not None and version >= SLEEP_CHECK_SINCE:
        severity = Severity.ERROR
        why = (f"vLLM {format_version(version)} exits at start-up: {names[0]} does not "
               "support sleep mode")
    elif version is None:
        severity = Severity.WARNING
        why = (f"vLLM {since} and later exit at start-up ({names[0]} does not support sleep "
               "mode); an older release starts, and the connector's threads keep copying "
               "KV memory that sleep frees")
    else:
        severity = Severity.WARNING
        why = (f"vLLM {format_version(version)} does not ask the connector and starts; "
               "kvtier's load and store threads hold views of the KV cache that sleep frees "
               f"and maps again ({since} refuses this)")
    yield Finding(
        RULE, severity,
        f"--enable-sleep-mode with {', '.join(names)}",
        why,
        "drop --enable-sleep-mode on the servers that run the connector (or run one "
        "without it where sleep mode is needed)",
    )
