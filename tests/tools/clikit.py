"""The `kvtier` command's JSON reports, run in-process, for the tools' tests over store
configs (tests/storekit.py). (Not named conftest.py: imported by name.)

Primitives: `cli_json`, `by_namespace`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtier.tools.cli.main import main


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """Run `kvtier *argv --json` in-process; its JSON report."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def by_namespace(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """An inspect / gc report's rows by namespace."""
    return {row["namespace"]: row for row in report["namespaces"]}
