"""`kvtier plan`, `kvtier audit`, `kvtier doctor` end to end through the CLI dispatcher."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.tools.cli.main import main

pytestmark = pytest.mark.slow  # whole commands, doctor probing this machine

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def run_json(capsys, argv):
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.json")))
def test_plan_json_for_every_fixture(capsys, name):
    code, out = run_json(capsys, ["plan", str(CONFIGS / f"{name}.json"), "--tp", "8", "--gpu",
                                  "h200", "--vllm-version", "0.21.0", "--json"])
    assert code == 0
    assert out["kv_bytes_per_token_total"] == 8 * out["kv_bytes_per_token_per_rank"]
    assert [t["name"] for t in out["tiers"]] == ["GPU HBM", "CPU DRAM", "NVMe"]
    alternatives = {a["name"]: a for a in out["alternatives"]}
    kvtier = alternatives["kvtier"]
    if kvtier["refused"]:  # a model kvtier refuses at start-up gets no kvtier command
        assert name == "nemotron-h-8b" and kvtier["command"] is None
        return
    flags = kvtier["flags"]
    kv_cfg = flags[flags.index("--kv-transfer-config") + 1]
    assert json.loads(kv_cfg)["kv_connector"] == "KVTierConnector"
    assert kv_cfg in shlex.split(kvtier["command"])


def test_plan_from_sglang_converts_per_rank_to_total(capsys):
    code, out = run_json(capsys, ["plan", str(CONFIGS / "llama-3-70b.json"), "--tp", "8",
                                  "--from-sglang", "200", "--vllm-version", "0.20.0", "--json"])
    assert code == 0
    assert out["recommended"]["kv_offloading_size_gib"] == 1600
    alternatives = {a["name"]: a for a in out["alternatives"]}
    native = alternatives["native"]["flags"]
    assert native[native.index("--kv-offloading-size") + 1] == "1600"
    assert "--disable-hybrid-kv-cache-manager" in native  # v0.20 needs it
    assert alternatives["lmcache"]["env"]["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "200"


def test_plan_table_output_states_figures(capsys):
    assert main(["plan", str(CONFIGS / "deepseek-v3.json"), "--tp", "8", "--gpu", "h200",
                 "--context", "131072", "--vllm-version", "0.21.0"]) == 0
    out = capsys.readouterr().out
    assert "mla" in out and "PCIe Gen5 x16" in out and "--block-size 32" in out
    assert "--kv-offloading-size" in out and "LMCACHE_MAX_LOCAL_CPU_SIZE" in out


def test_plan_prints_each_alternative_as_a_complete_command(capsys, tmp_path):
    model = tmp_path / "Llama-3-70B"
    model.mkdir()
    (model / "config.json").write_text((CONFIGS / "llama-3-70b.json").read_text())
    assert main(["plan", str(model), "--tp", "8", "--vllm-version", "0.21.0"]) == 0
    out = capsys.readouterr().out
    commands = [line.strip() for line in out.splitlines()
                if line.strip().startswith(("vllm serve", "LMCACHE_"))]
    assert len(commands) == 4 and "pick ONE" in out
    for number in range(1, 5):
        assert f"  {number}. " in out
    for command in commands:
        words = shlex.split(command)
        assert words[words.index("serve") + 1] == str(model)
        assert words[words.index("--tensor-parallel-size") + 1] == "8"
    assert "assumed: a 4 TB NVMe drive" in " ".join(out.split())
    assert "assumed: 70.55B parameters" in out


def test_plan_never_prints_a_command_for_a_refused_backend(capsys):
    assert main(["plan", str(CONFIGS / "nemotron-h-8b.json"), "--vllm-version", "0.21.0",
                 "--served-model", "nvidia/Nemotron-H"]) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if "vllm serve" in line]
    assert len(commands) == 2  # vLLM alone, native offload
    assert not any("KVTierConnector" in c or "LMCache" in c for c in commands)
    flat = " ".join(out.split())
    assert "not an option: kvtier connector" in flat and "not an option: LMCache" in flat


def test_plan_impossible_tp_exits_2_with_one_line(capsys):
    assert main(["plan", str(CONFIGS / "llama-3-8b.json"), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "32 attention heads and 8 KV heads" in err


def test_plan_bad_input_exits_2(capsys):
    assert main(["plan", str(CONFIGS / "nope.json")]) == 2
    assert main(["plan", str(CONFIGS / "llama-3-8b.json"), "--gpu", "tpu"]) == 2
    assert "invalid config" in capsys.readouterr().err


def test_audit_exit_code_follows_error_findings(capsys):
    bad = ("vllm serve m --kv-offloading-backend native --kv-offloading-size 100 "
           "--no-enable-prefix-caching")
    code, out = run_json(capsys, ["audit", bad, "--vllm-version", "0.21.0", "--json"])
    assert code == 1 and out["ok"] is False
    assert "offload-without-prefix-caching" in {f["rule"] for f in out["findings"]}
    good = ("vllm serve m --kv-offloading-backend native --kv-offloading-size 100 "
            "--enable-prefix-caching --max-model-len 16384")
    code, out = run_json(capsys, ["audit", good, "--vllm-version", "0.21.0", "--json"])
    assert code == 0 and out["findings"] == []


def test_audit_kubernetes_file_with_env_flag(capsys, tmp_path):
    manifest = tmp_path / "deploy.yaml"
    manifest.write_text("""
spec:
  containers:
  - name: vllm
    image: vllm/vllm-openai:v0.20.1
    args: ["--model", "m", "--kv-offloading-size", "100"]
    env: [{name: VLLM_USE_FASTSAFETENSOR, value: "1"}]
""")
    code, out = run_json(capsys, ["audit", str(manifest), "--env", "PYTHONHASHSEED=0",
                                  "--json"])
    rules = {f["rule"] for f in out["findings"]}
    assert code == 1  # v0.20.1 from the image tag: HMA flag missing is an error
    assert {"offload-needs-hma-flag", "nonexistent-env-var"} <= rules
    assert out["vllm_version"] == [0, 20, 1]


def test_audit_table_and_list_rules(capsys):
    assert main(["audit", "--list-rules"]) == 0
    assert "offload-size-per-gpu" in capsys.readouterr().out
    assert main(["audit", "vllm serve m --enforce-eager"]) == 0
    assert "enforce-eager-workaround" in capsys.readouterr().out
    assert main(["audit", "vllm serve m", "--env", "NOEQUALS"]) == 2



def test_audit_list_rules_json_is_json(capsys):
    """`kvtier audit --list-rules --json` printed the text listing: --json was dropped."""
    assert main(["audit", "--list-rules", "--json"]) == 0
    rules = json.loads(capsys.readouterr().out)
    by_id = {rule["id"]: rule for rule in rules}
    assert "offload-size-per-gpu" in by_id and all(rule["summary"] for rule in rules)
    assert "--typical-context" in by_id["max-model-len-too-high"]["needs"]
    assert "--model-config" in by_id["block-size-kernel-split"]["reads"]

def test_audit_takes_a_command_line_as_typed_after_a_double_dash(capsys):
    """`kvtier audit -- vllm serve ...`: the words after `--` are the command line (its
    quoting as the shell had it); typed without `--`, its flags are refused with the hint."""
    config = '{"kv_connector": "KVTierConnector", "kv_role": "kv_both"}'
    quoted = f"vllm serve m --enforce-eager --kv-transfer-config '{config}'"
    assert main(["audit", "--json", quoted]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["audit", "--json", "--", *shlex.split(quoted)]) == 0
    assert json.loads(capsys.readouterr().out) == one
    assert "enforce-eager-workaround" in {f["rule"] for f in one["findings"]}
    with pytest.raises(SystemExit) as exit_:
        main(["audit", "vllm", "serve", "m", "--max-model-len", "100"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-model-len 100" in err and "after `--`" in err


def test_audit_single_instance_local_disk_tier_exits_0_with_a_warning(capsys):
    # issue 14: the hash seed matters only where instances share the tier.
    fs_tier = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {
                              "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 10**10,
                              "secondary_tiers": [{"type": "fs", "root_dir": "/nvme/kv"}]}})
    code, out = run_json(capsys, ["audit", f"vllm serve m --kv-transfer-config '{fs_tier}'",
                                  "--vllm-version", "0.21.0", "--json"])
    assert code == 0
    assert [(f["rule"], f["severity"]) for f in out["findings"]] == [
        ("shared-storage-hash-seed", "warning"), ("offload-fs-tier-unbounded", "warning")]


@pytest.mark.parametrize("command", [
    "vllm serve m --kv-transfer-config '{\"kv_connector\":'",
    "vllm serve m --kv-transfer-config null",
    "vllm serve m --tensor-parallel-size 0",
    "vllm serve m --block-size abc",
])
def test_audit_malformed_input_exits_1_naming_the_argument(capsys, command):
    code, out = run_json(capsys, ["audit", command, "--json"])
    assert code == 1 and not out["ok"]
    flag = command.split()[3]
    assert any(f["severity"] == "error" and flag in f["what"] for f in out["findings"])


def test_audit_unreadable_inputs_exit_2_with_one_line(capsys, tmp_path):
    binary = tmp_path / "serve.sh"
    binary.write_bytes(b"\xff\xfe vllm serve m")
    bad_config = tmp_path / "config.json"
    bad_config.write_text('{"hidden_size": 64, "num_attention_heads": 4, '
                          '"num_hidden_layers": 2, "text_config": 5}')
    for argv in (["audit", str(tmp_path / "deploy.yaml")], ["audit", str(binary)],
                 ["audit", "vllm serve m", "--model-config", str(binary)],
                 ["audit", "vllm serve m", "--model-config", str(bad_config)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err


def test_audit_help_says_which_rules_need_options(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--typical-context is needed by: max-model-len-too-high" in out
    assert "--model-config is read by:" in out and "fp8-kv-without-scales" in out


def test_audit_subprocess_reads_stdin():
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli.main", "audit", "-", "--vllm-version", "0.11.0",
         "--json"], input="vllm serve m --kv-offloading-size 10\n", capture_output=True,
        text=True, timeout=60)
    assert proc.returncode == 1
    assert "flag-predates-version" in {f["rule"] for f in json.loads(proc.stdout)["findings"]}


def test_doctor_json_prints_transfer_config_and_fails_on_missing_connector(capsys, tmp_path):
    code, out = run_json(capsys, ["doctor", "--memory", "1MiB", "--disk",
                                  f"{tmp_path}/nvme:1MiB", "--connector-module",
                                  "kvtier_missing_connector_xyz", "--json"])
    status = {c["name"]: c["status"] for c in out["checks"]}
    assert status["connector"] == "fail" and status["config"] == "ok"
    assert status[f"tier disk: {tmp_path}/nvme"] == "ok"
    assert code == 1 and out["ok"] is False
    assert out["kv_transfer_config"]["kv_connector_extra_config"]["tiers"][1] == {
        "kind": "disk", "path": f"{tmp_path}/nvme", "capacity": "1MiB"}


def test_doctor_table_from_config_file(capsys, tmp_path):
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"tiers:\n- {{kind: memory, capacity: 1MiB}}\n"
                   f"- {{kind: disk, path: {tmp_path}/d, capacity: 1MiB}}\n")
    main(["doctor", str(cfg), "--connector-module", "kvtier_missing_connector_xyz"])
    out = capsys.readouterr().out
    assert "--kv-transfer-config '{\"kv_connector\":\"KVTierConnector\"" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n- {kind: tape, capacity: 1MiB}\n")
    assert main(["doctor", str(bad), "--connector-module", "kvtier_missing_connector_xyz"]) == 1
    assert "config is invalid" in capsys.readouterr().out


def test_doctor_without_arguments_checks_the_machine_and_says_what_next(capsys, tmp_path,
                                                                         monkeypatch):
    # issue 14: `kvtier doctor` alone once exited 2 without a check. The connector probe
    # imports a stand-in module here (the real one imports vLLM: ~10 s).
    (tmp_path / "standin_connector.py").write_text("KVTierConnector = object\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, out = run_json(capsys, ["doctor", "--connector-module", "standin_connector",
                                  "--json"])
    names = [c["name"] for c in out["checks"]]
    assert names[:4] == ["vllm", "connector", "pinned host memory", "host RAM"]
    assert names[4] == f"default disk tier: {tmp_path}/cache/kvtier/kv"
    assert code == (1 if any(c["status"] == "fail" for c in out["checks"]) else 0)
    assert out["checks"][1]["status"] == "ok" and out["checks"][4]["status"] == "ok"
    assert any(step.startswith("check a tier layout: kvtier doctor --memory ")
               for step in out["next"])
    code = main(["doctor", "--connector-module", "kvtier_missing_connector_xyz"])
    text = capsys.readouterr().out
    assert code == 1 and "no config given" in text and "kvtier plan MODEL_DIR" in text


@pytest.mark.parametrize("argv, named", [
    (["doctor", ""], "config=''"),  # was: the machine's checks alone, exit 0
    (["inspect", "--config", ""], "config=''"),  # was: named as None
])
def test_an_empty_config_path_is_refused(argv, named, capsys):
    """`kvtier doctor "$KVTIER_CONFIG"` with the variable unset checked the machine only and
    passed: the config it was meant to check went unread, without a word."""
    assert main(argv) == 2
    assert named in capsys.readouterr().err


def test_inspect_an_empty_metrics_url_is_refused(capsys, tmp_path):
    config = tmp_path / "kvtier.yaml"
    config.write_text(f"tiers:\n  - {{kind: disk, path: {tmp_path / 'kv'}, capacity: 1GiB}}\n")
    assert main(["inspect", "--config", str(config), "--metrics", ""]) == 2  # was: skipped
    assert "metrics=''" in capsys.readouterr().err
