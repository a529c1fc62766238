"""`connector-refuses-sleep-mode`: vLLM 0.33 asks each KV connector whether it can follow
sleep mode's KV remap and refuses to start when one cannot (kvtier's cannot), so the audit
says so before the server is started (KVTierConnector.supports_sleep_mode is False)."""

from __future__ import annotations

import json

import pytest

from kvtier.tools.ops.audit import Severity, parse_command_line, run_audit

RULE = "connector-refuses-sleep-mode"
KVTIER = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "kvtier.integrations.vllm.connector"}


def findings(transfer: dict, version, flags: str = "--enable-sleep-mode"):
    cmd = parse_command_line(f"vllm serve m {flags} --kv-transfer-config "
                             f"'{json.dumps(transfer)}'", vllm_version=version)
    return [(f.severity, f.what) for f in run_audit(cmd) if f.rule == RULE]


@pytest.mark.parametrize(("version", "severity"), [
    ((0, 33, 0), Severity.ERROR), (None, Severity.WARNING), ((0, 32, 0), Severity.WARNING)])
def test_sleep_mode_with_kvtier_is_found(version, severity):
    assert findings(KVTIER, version) == [
        (severity, "--enable-sleep-mode with KVTierConnector")]
    assert findings(KVTIER, version, "--disable-sleep-mode") == []
    assert findings(KVTIER, version, "") == []


def test_a_multiconnector_child_counts_and_nixl_only_off_ucx():
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [nixl, KVTIER]}}
    assert findings(multi, (0, 33, 0)) == [
        (Severity.ERROR, "--enable-sleep-mode with KVTierConnector")]
    assert findings(nixl, (0, 33, 0)) == []  # UCX alone (its default) follows the remap
    libfabric = {**nixl, "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}}
    assert findings(libfabric, (0, 33, 0)) == [
        (Severity.ERROR, "--enable-sleep-mode with NixlConnector")]
    assert findings(libfabric, (0, 32, 0)) == []  # 0.32 does not ask: no claim on Nixl
