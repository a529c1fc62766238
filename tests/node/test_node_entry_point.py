"""`python -m kvtier.node`, the node's own entry point (no tools installed): its help lays
out the usage lines of its docstring one to a line (they ran together into one paragraph,
`... [--events-endpoint ENDPOINT] python -m kvtier.node status --socket ... # JSON Exit
codes: ...`), and its `status` takes `--json` as `kvtier node status` does (its output is
JSON already): a probe written for one was refused by the other, status 2, as bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.node.cli import main


def test_the_help_keeps_the_usage_lines_apart(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert "python -m kvtier.node status --socket /run/kvtier/node.sock      # JSON" in lines
    assert any(line.startswith("Exit codes: 0 stopped cleanly") for line in lines)


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_status_with_or_without_json_reports_no_node_as_status_1(
        json_flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--socket", str(tmp_path / "none.sock"), *json_flag]) == 1
    assert "no node answers" in capsys.readouterr().err
