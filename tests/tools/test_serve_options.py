"""`kvtier serve --no-kvtier` (the baseline server) with an option only kvtier reads: refused,
status 2, naming the option. The baseline dropped them without a word: `kvtier serve m
--no-kvtier --memory 8GiB` printed a command with no tier, and `--kv-role kv_producer` a
server that was no prefill instance. `--dry-run` only prints the command: nothing starts."""

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
