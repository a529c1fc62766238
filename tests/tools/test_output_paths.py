"""Where commands write: no parent directory is created, a bad --dir is one line (issue 14).

Every option that names a file or directory to write (`--json PATH`, `--plot`, `--out`) must
name one whose parent exists; `--dir` must be an existing directory where files can be
created (probed, so /proc fails before a benchmark starts). Each refusal is argparse's one
line and exit status 2, before anything runs. JSON written into a pipe whose reader quits
(`| head`) ends quietly.
"""

from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvtier.tools.cli.main import main

pytestmark = pytest.mark.slow  # each case runs a whole command: not in the fast lane

CONFIG = str(Path(__file__).parents[1] / "data" / "configs" / "llama-3-8b.json")

# (command, option) for every option of `kvtier` that names a path to write.
WRITERS = [
    (["bench", "storage"], "--json"), (["bench", "copy"], "--json"),
    (["bench", "ttft"], "--json"), (["bench", "sharing"], "--json"),
    (["bench", "interference"], "--json"), (["bench", "disagg"], "--json"),
    (["bench", "codecs"], "--json"), (["bench", "ttft"], "--model-root"),
    (["bench", "sharing"], "--model-root"), (["demo"], "--model-dir"),
    (["bench", "multi-round"], "--out"), (["bench", "prefix-repetition"], "--out"),
    (["bench", "long-doc"], "--out"), (["demo"], "--out"),
    (["simulate", "--sweep", "cpu_gb=0,16", "--requests", "5"], "--plot"),
    (["bench", "pooling"], "--json"), (["bench", "pooling"], "--model-root"),
]
WORK_DIRS = [["bench", cmd]
             for cmd in ("storage", "ttft", "sharing", "interference", "disagg", "codecs",
                         "pooling")]


def run_cli(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


@pytest.mark.parametrize(("command", "option"), WRITERS)
def test_a_missing_parent_directory_is_refused_not_created(command, option, tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "missing" / "deeper" / "out.json"
    code, err = run_cli([*command, f"{option}={target}"])
    assert code == 2, err
    assert f"argument {option}: directory '{target.parent}' does not exist" in err
    assert "Traceback" not in err
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("command", WORK_DIRS)
@pytest.mark.parametrize(("directory", "why"), [
    ("/proc", "cannot create files there"), ("/nonexistent-kvtier", "does not exist"),
    ("/etc/hostname", "is not a directory")])
def test_an_unusable_work_dir_is_one_line(command, directory, why) -> None:  # type: ignore[no-untyped-def]
    code, err = run_cli([*command, f"--dir={directory}"])
    assert code == 2 and f"argument --dir: '{directory}'" in err and why in err, err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize(("command", "option"), WRITERS)
def test_a_path_that_cannot_be_written_is_refused_before_the_work(command, option) -> None:  # type: ignore[no-untyped-def]
    """/proc takes no new file or directory: refused in one line, not a traceback when the
    results are written after the measurement (`bench node --json /sys/x.json` once ran,
    then crashed)."""
    code, err = run_cli([*command, f"{option}=/proc/kvtier-out"])
    assert code == 2, err
    assert f"argument {option}: '/proc/kvtier-out': cannot be written" in err
    assert "Traceback" not in err


def test_a_directory_given_as_the_json_file_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code, err = run_cli(["bench", "storage", f"--json={tmp_path}"])
    assert code == 2 and "is a directory, not a file" in err


def test_a_plot_in_an_existing_directory_is_written(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    code, err = run_cli(["simulate", "--sweep", "cpu_gb=0,16", "--requests", "20",
                         "--json", f"--plot={plot}"])
    assert code == 0, err
    assert plot.stat().st_size > 0


# (command, option) for every option of `kvtier` that names an image to write.
PLOTTERS = [
    (["simulate", "--sweep", "cpu_gb=0,16", "--requests", "5"], "--plot"),
    (["simulate", "--trace", "/nonexistent.jsonl"], "--plot"),
    (["bench", "trace", "/nonexistent.jsonl"], "--plot"),
    (["bench", "link"], "--png"),
]


@pytest.mark.parametrize(("command", "option"), PLOTTERS)
@pytest.mark.parametrize("name", ["hit-ratio", "hit-ratio.txt", "hit-ratio.json"])
def test_a_plot_named_without_an_image_suffix_is_refused_before_the_work(  # type: ignore[no-untyped-def]
        command, option, name, tmp_path) -> None:
    """matplotlib takes the format from the suffix: `--plot hit-ratio` wrote hit-ratio.png,
    not the file named, and `--plot hit-ratio.txt` failed only after the run."""
    pytest.importorskip("matplotlib")
    code, err = run_cli([*command, f"{option}={tmp_path / name}"])
    assert code == 2, err
    assert f"argument {option}: '{tmp_path / name}': a file name ending in an image format: " \
        ".png, or one of " in err and ".svg" in err, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["hit.svg", "hit.PNG", "hit.pdf"])
def test_a_plot_takes_any_image_format_matplotlib_writes(name, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    plot = tmp_path / name
    code, err = run_cli(["simulate", "--sweep", "cpu_gb=0,16", "--requests", "20",
                         "--json", f"--plot={plot}"])
    assert code == 0, err
    assert [p.name for p in tmp_path.iterdir()] == [name] and plot.stat().st_size > 0


@pytest.mark.parametrize("argv", [
    ["simulate", "--requests", "300", "--json"],
    ["plan", CONFIG, "--vllm-version", "0.21.0", "--json"],
    ["audit", "vllm serve m --enforce-eager", "--json"],
    ["doctor", "--json"],
])
def test_json_into_head_ends_without_a_traceback(argv) -> None:  # type: ignore[no-untyped-def]
    # A real pipe whose reader leaves after one line, as `kvtier ... --json | head -1`.
    kvtier = subprocess.Popen([sys.executable, "-m", "kvtier.tools.cli.main", *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert kvtier.stdout is not None
    kvtier.stdout.readline()
    kvtier.stdout.close()
    _, err = kvtier.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert kvtier.returncode in (0, 1, 141), kvtier.returncode
