"""The vLLM version a user is shown as an example is one kvtier supports, and a bad
`--vllm-version` is named as the option.

`kvtier audit`'s "version unknown" hint and its `--vllm-version` help once said "e.g. 0.21.0",
a release kvtier never ran on, long after support had moved to 0.32 and 0.33: the examples
now follow `SUPPORTED_RELEASES`, so they cannot fall behind it again."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvtier.integrations.vllm.versions import SUPPORTED_RELEASES
from kvtier.tools.cli.main import main

OFFLOAD = "vllm serve m --kv-offloading-backend native --kv-offloading-size 100"
SUPPORTED = [release.version for release in SUPPORTED_RELEASES]
MODEL = str(Path(__file__).parents[1] / "data" / "configs" / "llama-3-8b.json")


def one_line(text: str) -> str:
    """`text` with argparse's wrapping undone."""
    return re.sub(r"\s+", " ", text)


def test_the_version_unknown_hint_suggests_the_supported_releases(
        capsys: pytest.CaptureFixture[str]) -> None:
    main(["audit", OFFLOAD, "--json"])
    findings = json.loads(capsys.readouterr().out)["findings"]
    hint = next(f["fix"] for f in findings if f["rule"] == "version-unknown")
    assert all(version in hint for version in SUPPORTED), hint
    assert "0.21" not in hint


def test_the_vllm_version_help_suggests_the_supported_releases(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    help_text = one_line(capsys.readouterr().out)
    option = help_text[help_text.index("--vllm-version VLLM_VERSION vLLM"):]
    example = option[:option.index("(default")]
    assert all(version in example for version in SUPPORTED), example
    assert "0.21" not in example


@pytest.mark.parametrize("command", [["audit", OFFLOAD],
                                     ["plan", MODEL]])
def test_a_bad_vllm_version_is_named_as_the_option(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--vllm-version", "latest"]) == 2
    err = capsys.readouterr().err
    assert "--vllm-version='latest'" in err and "vllm_version=" not in err
    assert all(version in err for version in SUPPORTED), err
