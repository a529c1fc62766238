"""When a KV connector needs `--disable-hybrid-kv-cache-manager`, release by release, as each
release's vllm/config/vllm.py decides it (read in the 0.18.0, 0.20.0, 0.21.0, 0.24.0, 0.27.0,
0.32.0 and 0.33.0 wheels) when the operator says nothing about the manager:

- 0.18-0.21: the manager is decided before the --kv-offloading-* flags make their connector,
  and turned off for ANY --kv-transfer-config (a warning). Only the flags' connector, without
  HMA support, fails at start-up: 'Connector X does not support HMA but HMA is enabled'.
- 0.24 on: decided after, and turned off for any connector without HMA support (a warning):
  no connector fails for want of the flag.

Then the model traits those rules read: which models are hybrid (gpt-oss by name; Llama 4's
chunked attention, one full-attention group by vLLM's default, not), and context lengths as
the findings write them.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvtier.tools.ops.audit import Severity, parse_command_line, run_audit
from kvtier.tools.ops.vllm_versions import hma_verdict

RULE = "offload-needs-hma-flag"
CONFIGS = Path(__file__).parents[1] / "data" / "configs"
LMCACHE = "--kv-transfer-config " + shlex.quote(json.dumps(
    {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}))
NATIVE_JSON = "--kv-transfer-config " + shlex.quote(json.dumps(
    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"cpu_bytes_to_use": 10737418240}}))


def found(command: str, version) -> list:
    cmd = parse_command_line(command, vllm_version=version)
    everything = run_audit(cmd)
    assert not [f for f in everything if f.rule.startswith("malformed")], everything
    return [f for f in everything if f.rule == RULE]


@pytest.mark.parametrize("version", [(0, 24, 0), (0, 32, 0), (0, 33, 0)])
def test_lmcache_on_a_full_attention_model_starts_without_the_flag_from_024(version):
    # The seed's "same flag is required by LMCacheConnectorV1" held to 0.21 for the flags'
    # connector; 0.24+ turns the manager off itself (the audit said: vLLM refuses to start).
    assert found(f"vllm serve meta-llama/Llama-3.1-8B-Instruct {LMCACHE}", version) == []


def test_a_transfer_config_connector_starts_without_the_flag_on_020_and_021():
    for version in ((0, 20, 2), (0, 21, 0)):
        assert found(f"vllm serve meta-llama/Llama-3.1-8B-Instruct {NATIVE_JSON}", version) \
            == [], version
        assert found(f"vllm serve meta-llama/Llama-3.1-8B-Instruct {LMCACHE}", version) == []


def test_the_offloading_flags_connector_still_fails_on_020():
    # The seed's error, verified live there: --kv-offloading-size with the manager on.
    errors = found("vllm serve m --kv-offloading-backend native --kv-offloading-size 100",
                   (0, 20, 2))
    assert [f.severity for f in errors] == [Severity.ERROR]
    # --kv-offloading-backend lmcache made LMCacheConnectorV1 up to 0.21 (MP from 0.24)
    lmcache = found("vllm serve m --kv-offloading-backend lmcache --kv-offloading-size 100",
                    (0, 21, 0))
    assert [f.severity for f in lmcache] == [Severity.ERROR]
    assert lmcache[0].what.startswith("LMCacheConnectorV1 ")


def test_an_unread_release_is_a_warning():
    warned = found(f"vllm serve meta-llama/Llama-3.1-8B-Instruct {LMCACHE}", (0, 23, 0))
    assert [f.severity for f in warned] == [Severity.WARNING]


@pytest.mark.parametrize("version, connector, via_json, required, manager_on", [
    ((0, 33, 0), "LMCacheConnectorV1", True, False, False),  # off by itself, no failure
    ((0, 33, 0), "LMCacheMPConnector", False, False, False),
    ((0, 20, 0), "OffloadingConnector", True, False, False),  # any transfer config: off
    ((0, 20, 0), "OffloadingConnector", False, True, False),  # the flags': fails
    ((0, 21, 0), "OffloadingConnector", False, False, True),  # native + HMA
    ((0, 21, 0), "OffloadingConnector", True, False, False),  # ... not via a JSON on 0.21
    ((0, 24, 0), "OffloadingConnector", True, False, True),
    ((0, 23, 0), "LMCacheConnectorV1", True, None, None),  # not read
])
def test_hma_verdict_by_release(version, connector, via_json, required, manager_on):
    verdict = hma_verdict(version, connector, False, via_transfer_config=via_json)
    assert (verdict.required, verdict.manager_on) == (required, manager_on)


def test_gpt_oss_is_a_hybrid_attention_model_by_its_name():
    # gpt-oss alternates sliding-window (128) and full attention layers
    # (tests/data/configs/gpt-oss-120b.json): LMCache's mixed-group failure (LMCache#3106)
    # applies; the audit, judging by name, did not know it.
    cmd = parse_command_line(f"vllm serve openai/gpt-oss-120b {LMCACHE}", vllm_version=(0, 33, 0))
    assert [f.severity for f in run_audit(cmd) if f.rule == "lmcache-hybrid-model"] == \
        [Severity.ERROR]


def test_llama4_config_is_not_called_hybrid_for_lmcache():
    # Llama 4's chunked layers are one full-attention group with vLLM's default (the manager
    # off for chunked attention): not LMCache's mixed-group failure.
    config = json.loads((CONFIGS / "llama-4-scout.json").read_text())
    cmd = parse_command_line(f"vllm serve /models/scout {LMCACHE}", vllm_version=(0, 33, 0),
                             model_config=config)
    assert [f for f in run_audit(cmd) if f.rule == "lmcache-hybrid-model"] == []


def test_a_long_model_maximum_is_written_out_whole():
    # Llama 4 Scout's max_position_embeddings, 10,485,760, read "1.04858e+07".
    config = json.loads((CONFIGS / "llama-4-scout.json").read_text())
    cmd = parse_command_line("vllm serve /models/scout", vllm_version=(0, 33, 0),
                             model_config=config)
    said = [f.what for f in run_audit(cmd) if f.rule == "max-model-len-traffic-unknown"]
    assert said and said[0].startswith("--max-model-len 10485760 ")
