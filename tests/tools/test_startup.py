"""The `kvtier` command starts without torch or vllm (issue 10).

`kvtier --version` once took 2.3 s and 255 MiB because building the parser imported
`kvtier.tools.bench.copy`, and with it torch. Commands that need torch or vllm import them when they
run; the parser, `--version`, `audit` and `plan` never do. Each case runs in a fresh
interpreter, since this test process may have imported torch already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "vllm")

# Runs `kvtier ARGV` in-process, then prints which HEAVY modules got imported, as JSON.
PROBE = f"""\
import json, sys
from kvtier.tools.cli.main import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def run_cli(*argv: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(argv))],
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [("--version",), ("audit", "vllm serve m")],
                         ids=["version", "audit"])
def test_command_does_not_import_torch_or_vllm(argv: tuple[str, ...]) -> None:
    result = run_cli(*argv)
    assert result["code"] == 0
    assert result["loaded"] == []


def test_the_connector_schema_imports_without_vllm() -> None:
    # vLLM finds the connector as getattr(import_module("kvtier.integrations.vllm"), ...):
    # the package imports it only on that getattr, so its config module stays light.
    code = ("import sys, kvtier.integrations.vllm.config; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert proc.stdout.strip() == "[]"
