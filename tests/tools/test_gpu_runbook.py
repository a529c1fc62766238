"""The GPU run-book (scripts/gpu-check.sh, docs/performance.md) works before a GPU is lent:
`--standin` runs its very steps on this machine, on the CPU stand-in where a step has one (the
same tests, the same `kvtier bench copy` arguments with `--device cpu --quick`, `kvtier bench
mover --quick`), and a lent GPU's budget bounds it (`--budget-s`: a step that runs out is
killed and named, the later ones not run, the summary still written). Before, the script had
neither: its bench arguments were checked only on a GPU, and nothing bounded a run that a
15-minute device lease must fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
DEVICE_TESTS = "tests/gpu/test_event_records.py"
RUNS = ("bf16-LBNHC", "fp8-LBNHC", "bf16-BLHNC", "bf16-LBNHC-16layers")


def _run(results: Path, *args: str, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run(["bash", str(SCRIPT), "--standin", "--python", sys.executable,
                           "--results", str(results), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.mark.slow
def test_the_run_book_runs_end_to_end_on_the_stand_in(tmp_path: Path) -> None:
    # Its device tests (~190, 26 s of this test's 72) run in this suite anyway: one of their
    # files here (`--tests`), as an operator reruns the one that failed within a lease.
    done = _run(tmp_path, "--tests", DEVICE_TESTS)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "gpu-check: PASS" in summary and "--standin" in summary
    assert f"tests (pytest {DEVICE_TESTS}): PASS" in summary
    assert (tmp_path / "pytest.rc").read_text().strip() == "0"
    assert " passed" in (tmp_path / "pytest.txt").read_text()
    for name in RUNS:
        assert (tmp_path / f"copy-{name}.rc").read_text().strip() == "0"
        data = json.loads((tmp_path / f"copy-{name}.json").read_text())
        assert data["verified"] and data["results"]
        assert {r["device"] for r in data["results"]} == {"cpu"}
    assert (tmp_path / "mover.rc").read_text().strip() == "0"
    assert json.loads((tmp_path / "mover.json").read_text())
    assert not (tmp_path / "timed-out.txt").exists()


def test_a_run_past_its_budget_is_killed_and_named_in_the_summary(tmp_path: Path) -> None:
    done = _run(tmp_path, "--budget-s", "6", timeout_s=300)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    timed_out = (tmp_path / "timed-out.txt").read_text().split()
    assert timed_out[0] == "tests"  # the tests take longer than 6 s: killed
    assert timed_out[1:] == [f"copy-{name}" for name in RUNS] + ["mover"]  # not run
    assert "OUT OF BUDGET" in (tmp_path / "summary.md").read_text()


def test_its_results_go_under_out_where_it_is_set(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "--standin", "--dry-run"], cwd=ROOT,
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"results in {out}/" in done.stdout
    assert "--device cpu" in done.stdout and "--device cuda" not in done.stdout
    assert "pytest tests/gpu tests/connector/test_stream_mover.py" in done.stdout  # the default


@pytest.mark.parametrize("budget", ["0", "x", "-5"])
def test_a_bad_budget_is_refused_naming_it(budget: str) -> None:
    done = subprocess.run(["bash", str(SCRIPT), "--budget-s", budget, "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert f"--budget-s {budget}" in done.stderr and "whole number of seconds" in done.stderr
