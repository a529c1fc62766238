"""`kvtier serve`'s options that the server would drop are refused, status 2, naming the
option; `--dry-run` only prints the command: nothing starts.

- `--no-kvtier` (the baseline server) with an option only kvtier reads: the baseline dropped
  them without a word (`--memory 8GiB` printed a command with no tier, `--kv-role
  kv_producer` a server that was no prefill instance).
- After `--`, a flag kvtier serve sets itself: vLLM keeps the last of a flag given twice, so
  `-- --port 9000` served on 9000 while kvtier serve waited for, and announced, port 8000
  (`--host` alike; `--model other` served another model than the one whose disk directory it
  checked); beside kvtier serve's own `--engine-kv` or `--served-model-name`, vLLM's
  `--kv-cache-memory-bytes` or `--served-model-name` dropped the option given to kvtier.
"""

from __future__ import annotations

import pytest

from kvtier.tools.cli.main import main

KVTIER_ONLY = [
    ["--memory", "1GiB"], ["--memory", "0"], ["--disk", "1GiB"], ["--disk-path", "/tmp/kv"],
    ["--config", "store.yaml"], ["--node", "/run/kvtier/node.sock"],
    ["--tokens-per-chunk", "64"], ["--kv-role", "kv_producer"], ["--kv-role", "kv_both"],
]


@pytest.mark.parametrize("option", KVTIER_ONLY, ids=lambda o: " ".join(o))
def test_the_baseline_refuses_an_option_only_kvtier_reads(
        option: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "m", "--dry-run", "--no-kvtier", *option]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no command printed
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and f"{option[0]}=" in err and "--no-kvtier" in err, err


def test_the_baseline_takes_the_servers_own_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "m", "--dry-run", "--no-kvtier", "--port", "8123",
                 "--engine-kv", "64MiB", "--served-model-name", "b", "--", "--seed", "1"]) == 0
    command = capsys.readouterr().out.splitlines()[-1]
    assert "--port 8123" in command and "--seed 1" in command
    assert "--kv-transfer-config" not in command


@pytest.mark.parametrize(("options", "refused"), [
    (["--", "--port", "9000"], "--port"), (["--", "--port=9000"], "--port"),
    (["--", "--host", "0.0.0.0"], "--host"), (["--", "--model", "other"], "--model"),
    (["--no-kvtier", "--", "--port", "9000"], "--port"),
    (["--engine-kv", "1GiB", "--", "--kv-cache-memory-bytes", "1000000000"], "--engine-kv"),
    (["--engine-kv", "1GiB", "--", "--gpu-memory-utilization", "0.5"], "--engine-kv"),
    (["--served-model-name", "a", "--", "--served-model-name", "b"], "--served-model-name"),
], ids=lambda o: " ".join(o) if isinstance(o, list) else o)
def test_a_flag_after_the_double_dash_that_kvtier_serve_sets_is_refused(
        options: list[str], refused: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "m", "--dry-run", *options]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and f"{refused}=" in err, err


def test_vllms_own_flags_after_the_double_dash_still_pass(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "m", "--dry-run", "--", "--served-model-name", "b",
                 "--kv-cache-memory-bytes", "1000000000", "--max-model-len", "4096"]) == 0
    command = capsys.readouterr().out.splitlines()[-1]
    assert command.endswith("--served-model-name b --kv-cache-memory-bytes 1000000000 "
                            "--max-model-len 4096")
