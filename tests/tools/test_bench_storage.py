"""`kvtier bench storage --quick`, end to end, on small chunks in a temp dir.

The command is a benchmark, not a timed test: this checks that one run measures every tier,
size and ceiling it was asked for and writes them as positive numbers, never how fast.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvtier.tools.cli.main import main

SIZES_MIB = (0.5, 2)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # A small run of the real command: two sizes, tiny rounds, files on the test's own disk.
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "bench-storage.json"
    code = main(["bench", "storage", "--quick", "--sizes", ",".join(map(str, SIZES_MIB)),
                 "--trial-bytes", "4MiB", "--dir", str(tmp), "--json", str(out)])
    assert code == 0
    data: dict = json.loads(out.read_text())
    data["_dir_after"] = sorted(p.name for p in tmp.iterdir())
    return data


def test_every_tier_size_and_ceiling_is_measured_with_positive_numbers(report: dict) -> None:
    # Ceilings (copy, O_DIRECT per file and in one file) and the three tiers, both directions,
    # at both sizes; each with three trials.
    sizes = {int(mib * 1024**2) for mib in SIZES_MIB}
    subjects = {"copy", "direct", "direct_1file", "memory", "disk", "shared"}
    seen = {(m["subject"], m["op"], m["size_bytes"]) for m in report["measurements"]}
    assert seen == {(s, op, size) for s in subjects for op in ("put", "get") for size in sizes}
    for m in report["measurements"]:
        assert m["gbps"] > 0 and len(m["trial_s"]) == 3 and min(m["trial_s"]) > 0


def test_every_tier_is_judged_against_its_ceiling(report: dict) -> None:
    # Targets apply from 2 MiB: memory and disk get a pass/fail there, shared is information.
    verdicts = {(v["tier"], v["op"], v["size_bytes"]): v for v in report["verdicts"]}
    assert len(verdicts) == 3 * 2 * len(SIZES_MIB)
    for (tier, _op, size), v in verdicts.items():
        assert v["ratio"] > 0 and v["ceiling_gbps"] > 0
        assert v["ceiling"] == ("copy" if tier == "memory" else "direct")
        judged = tier in ("memory", "disk") and size >= 2 * 1024**2
        assert (v["passed"] is not None) == judged


def test_the_report_says_where_and_under_what_load(report: dict) -> None:
    machine = report["machine"]
    assert len(machine["loadavg_before"]) == 3 and len(machine["loadavg_after"]) == 3
    assert machine["filesystem"]["type"]
    assert report["lmcache"] is None  # not asked for


def test_the_run_leaves_nothing_behind_in_its_directory(report: dict) -> None:
    assert report["_dir_after"] == ["bench-storage.json"]


@pytest.mark.parametrize("sizes", ["0.001", "2,32,2MiB"])  # not 4 KiB-aligned; 2 MiB twice
def test_a_bad_size_is_a_config_error_naming_the_field(
    sizes: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "storage", "--sizes", sizes, "--dir", str(tmp_path),
                 "--json", str(tmp_path / "x.json")])
    assert code == 2
    assert "sizes" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_an_interpreter_without_lmcache_is_reported_not_fatal(tmp_path: Path) -> None:
    # An "interpreter" whose driver dies at import, as one without lmcache does: the run
    # goes on without LMCache and the JSON says why it was not measured.
    python = tmp_path / "python-without-lmcache"
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'lmcache'\" >&2\n"
                      "exit 1\n")
    python.chmod(0o755)
    out = tmp_path / "r.json"
    code = main(["bench", "storage", "--quick", "--sizes", "0.5", "--trial-bytes", "1MiB",
                 "--tier", "memory", "--dir", str(tmp_path), "--json", str(out),
                 "--lmcache-python", str(python)])
    assert code == 0
    report = json.loads(out.read_text())
    assert "No module named 'lmcache'" in report["lmcache"]["error"]
    assert {m["subject"] for m in report["measurements"]} == {"copy", "direct", "direct_1file",
                                                              "memory"}


def test_each_ceiling_a_tier_is_held_to_is_in_the_ceilings_table(tmp_path: Path) -> None:
    """The memory tier's get is held to the copy timed beside the gets; the ceilings table once
    showed only the copy timed beside the puts, under the header "copy"."""
    from rich.console import Console

    from kvtier.tools.bench.storage import BenchConfig, run_bench
    from kvtier.tools.cli.bench_storage import ceiling_table

    result = run_bench(BenchConfig(directory=tmp_path, sizes_bytes=(2 << 20,), tiers=("memory",),
                                   trials=1, trial_bytes=4 << 20))
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(ceiling_table(result))
    text = console.export_text()
    for v in result.verdicts:
        assert f"{v.ceiling_gbps:.2f}" in text, (v.op, v.ceiling_gbps)
    assert "copy (puts)" in text and "copy (gets)" in text


def test_the_help_says_what_the_default_and_quick_runs_move() -> None:
    """--trial-bytes' help said "quick 64MiB" of a --quick that moves 32 MiB a round."""
    from kvtier.tools.cli.bench_storage import config_from
    from kvtier.tools.cli.main import build_parser

    parser = build_parser()
    storage = parser._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    storage = storage._subparsers._group_actions[0].choices["storage"]
    helps = {a.dest: a.help for a in storage._actions}
    for argv in (["--quick"], []):
        config = config_from(parser.parse_args(["bench", "storage", *argv]))
        where = "quick" if argv else "default"
        assert f"{where} {config.trial_bytes >> 20}MiB" in helps["trial_bytes"]
        assert f"{where} {config.trials}" in helps["trials"]


def test_a_small_chunk_is_shown_in_kib(tmp_path: Path) -> None:
    """`--sizes 4KiB` read "0.00390625 MiB" in both tables."""
    from rich.console import Console

    from kvtier.tools.bench.storage import BenchConfig, run_bench
    from kvtier.tools.cli.bench_storage import ceiling_table, verdict_table

    result = run_bench(BenchConfig(directory=tmp_path, sizes_bytes=(4096, 512 << 10),
                                   tiers=("memory",), trials=1, trial_bytes=64 << 10))
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(ceiling_table(result), verdict_table(result))
    text = console.export_text()
    assert "0.0039" not in text
    assert text.count(" 4 KiB ") == 3 and text.count(" 0.5 MiB ") == 3, text



def test_a_run_that_judges_no_target_does_not_say_all_are_met(tmp_path: Path) -> None:
    """Chunks under 2 MiB (or tiers without a target) judge nothing: the summary read "all
    targets met"."""
    from kvtier.tools.bench.storage import BenchConfig, run_bench
    from kvtier.tools.cli.bench_storage import summary

    result = run_bench(BenchConfig(directory=tmp_path, sizes_bytes=(4096,), tiers=("memory",),
                                   trials=1, trial_bytes=64 << 10))
    assert all(v.passed is None for v in result.verdicts)
    line = summary(result)
    assert "no target judged" in line and "all targets met" not in line, line
