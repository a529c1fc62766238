"""`kvtier simulate` and `kvtier plan` run without importing torch or vllm (issue 14).

A 1,000,000-request simulation once spent 255 MiB of its 311 MiB on the CLI importing torch.
The simulator is pure Python; the cost figures it needs (hardware profiles, model shapes)
live in kvtier.tools.ops, which imports neither. Each case runs in a fresh interpreter, as in
test_startup.py, since this test process may have imported torch already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter per case: not in the fast lane

HEAVY = ("torch", "vllm")
CONFIGS = Path(__file__).parents[1] / "data" / "configs"

# Runs `kvtier ARGV` in-process, then prints which HEAVY modules got imported, as JSON.
PROBE = f"""\
import contextlib, io, json, sys
from kvtier.tools.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(json.loads(sys.argv[1]))
print(json.dumps({{"code": code, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


@pytest.mark.parametrize("argv", [
    ("simulate", "--requests", "20", "--json"),
    ("simulate", "--requests", "20", "--tier", "cpu=1GiB", "--tier", "nvme=10GiB"),
    ("simulate", "--model", str(CONFIGS / "llama-3-8b.json"), "--requests", "20", "--json"),
    ("simulate", "--sweep", "cpu_gb=0,8", "--requests", "20", "--json"),
    ("plan", str(CONFIGS / "gemma-3-27b.json"), "--vllm-version", "0.21.0"),
], ids=["simulate", "simulate-tiers", "simulate-config", "simulate-sweep", "plan"])
def test_simulator_and_plan_do_not_import_torch_or_vllm(argv: tuple[str, ...]) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(argv))],
                          capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "loaded": []}


def test_simulate_imports_no_benchmark_dependencies() -> None:
    # Only the command that runs is imported: the benchmarks' aiohttp and modules stay out of
    # `kvtier simulate` (and of its 1M-request RSS). numpy and pydantic come in with the tier
    # classes, whose facts (locality: is a tier shared by the fleet) the simulator reads.
    probe = PROBE.replace(repr(HEAVY), repr(("aiohttp", "matplotlib", "kvtier.tools.bench")))
    proc = subprocess.run([sys.executable, "-c", probe,
                           json.dumps(["simulate", "--requests", "20", "--json"])],
                          capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": 0, "loaded": []}
