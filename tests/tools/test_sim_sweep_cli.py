"""Sweeps, their verdicts and plot, and the `kvtier simulate` command."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.cli.main import main
from kvtier.tools.sim.engine import EngineConfig
from kvtier.tools.sim.fleet import SimConfig, simulate
from kvtier.tools.sim.sweep import sweep, verdict
from kvtier.tools.sim.tiers import parse_tier
from kvtier.tools.sim.workload import workload_preset

SMALL = SimConfig(workload=workload_preset("chat", think_s=60.0, rate_rps=6.0),
                  engine=EngineConfig(kv_blocks=400), requests=600,
                  tiers=(parse_tier("cpu=8GB"),))


def test_verdict_rules() -> None:
    base = simulate(replace(SMALL, requests=200, tiers=()))
    faster = replace(base, ttft_p50_s=base.ttft_p50_s * 0.9)
    slower = replace(base, ttft_p50_s=base.ttft_p50_s * 1.01)
    more = replace(base, throughput_tok_s=base.throughput_tok_s * 1.03)
    assert verdict(faster, base) == "pays"
    assert verdict(more, base) == "pays"
    assert verdict(slower, base) == "only costs"
    assert verdict(base, base) == "neutral"


def test_cpu_sweep_finds_where_offload_pays_and_plots(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    result = sweep(SMALL, "cpu_gb", [1, 16], lambda d, t: calls.append((d, t)))
    assert calls[-1] == (3, 3)  # the baseline runs once for a capacity sweep
    small, large = result.points
    assert small.baseline is large.baseline
    assert large.verdict == "pays" and result.pays_from == 16
    assert small.verdict != "pays"  # 1 GB is smaller than the GPU pool: no extra hits
    from kvtier.tools.sim.plot import plot_sweep

    out = plot_sweep(result, tmp_path / "s.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unique_traffic_never_pays() -> None:
    unique = replace(SMALL, workload=workload_preset("unique", rate_rps=6.0),
                     engine=EngineConfig(kv_blocks=4000))
    result = sweep(unique, "rate", [3.0, 6.0])
    assert result.pays_from is None
    assert result.costs_at  # the stores and the connector are pure overhead


def test_bad_sweep_parameter() -> None:
    with pytest.raises(ConfigError):
        sweep(SMALL, "colour", [1])


def test_cli_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--requests", "300", "--rate", "4", "--tier", "cpu=8GiB",
                 "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["report"]["completed"] == 300
    assert out["config"]["workload"]["rate_rps"] == 4.0
    assert out["report"]["tiers"][0]["name"] == "cpu"


def test_cli_sweep_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--requests", "200", "--sweep", "rate=2,4", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["value"] for p in out["points"]] == [2.0, 4.0]


@pytest.mark.parametrize("argv", [["--tier", "gpu=1GiB"], ["--sweep", "rate=a"],
                                  ["--hbm-util", "1.5"], ["--model", "nope"]])
def test_cli_bad_input_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["simulate", "--requests", "10", *argv])
    except SystemExit as exc:  # argparse refuses a value its type function rejects
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "invalid config" in err or f"argument {argv[0]}" in err


@pytest.mark.parametrize(("argv", "option", "needs"), [
    (["--capacity", "1M"], "--capacity", "only with --trace"),
    (["--policies", "lru"], "--policies", "only with --trace"),
    (["--plot", "{tmp}/out.png"], "--plot", "only with --sweep or --trace"),
    (["--trace-block-tokens", "16"], "--trace-block-tokens", "only with --trace or --write-trace"),
    (["--trace", "{tmp}/t.jsonl", "--write-trace", "{tmp}/ww.jsonl"], "--write-trace",
     "not with --trace"),
    (["--sweep", "rate=2", "--write-trace", "{tmp}/ww.jsonl"], "--sweep",
     "not with --write-trace"),
    (["--validate", "--trace", "{tmp}/t.jsonl"], "--trace", "not with --validate"),
    # options a mode never reads: a trace brings its requests, --validate its scenarios
    (["--trace", "{tmp}/t.jsonl", "--tier", "cpu=1GiB"], "--tier", "not with --trace"),
    (["--trace", "{tmp}/t.jsonl", "--rate", "3"], "--rate", "not with --trace"),
    (["--write-trace", "{tmp}/ww.jsonl", "--tier", "disk=1TiB"], "--tier",
     "not with --write-trace"),
    (["--validate"], "--requests", "not with --validate"),
    # the simulated engine's and the workload's options: a trace replays no engine, and
    # `--block-tokens 16` (meant as the trace's block) read the trace in blocks of 512
    (["--trace", "{tmp}/t.jsonl", "--block-tokens", "16"], "--block-tokens", "not with --trace"),
    (["--trace", "{tmp}/t.jsonl", "--workload", "rag"], "--workload", "not with --trace"),
    (["--trace", "{tmp}/t.jsonl", "--seed", "3"], "--seed", "not with --trace"),
    (["--trace", "{tmp}/t.jsonl", "--load-when", "always"], "--load-when", "not with --trace"),
    (["--trace", "{tmp}/t.jsonl", "--hbm-util", "0.5"], "--hbm-util", "not with --trace"),
    (["--trace", "{tmp}/t.jsonl", "--max-num-seqs", "4"], "--max-num-seqs", "not with --trace"),
    (["--write-trace", "{tmp}/ww.jsonl", "--max-batched-tokens", "512"],
     "--max-batched-tokens", "not with --write-trace"),
])
def test_an_option_of_a_mode_not_asked_for_is_refused_not_ignored(
        argv: list[str], option: str, needs: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--capacity 1M` alone ran the whole default simulation; `--plot` without a sweep wrote
    no PNG and `--trace T --write-trace W` no W, each with status 0; `--trace T
    --block-tokens 16` replayed T in its own block size, the option ignored."""
    (tmp_path / "t.jsonl").write_text('{"hash_ids": [1, 2]}\n', encoding="utf-8")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["simulate", "--requests", "200", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvtier: invalid config {option}=") and needs in err, err
    assert "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # nothing written


def test_no_request_is_refused_before_any_trace_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--requests 0 wrote an empty trace (and suggested replaying it), or printed
    `nan / nan / nan ms`."""
    for extra in (["--write-trace", str(tmp_path / "w0.jsonl")], []):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", "--requests", "0", *extra])
        assert exc.value.code == 2
        assert "argument --requests: '0': must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "w0.jsonl").exists()


def test_a_sweep_where_offload_never_pays_says_so_in_words(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "unique", "--requests", "200",
                 "--sweep", "rate=3,6"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "offload never pays at the rate values swept" in out and "None" not in out


def test_the_gpu_help_names_every_profile_cpu_included(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--gpu GPU h100, h200, a100, l40s, or cpu" in out


@pytest.mark.parametrize("value", ["nan", "inf", "1e400"])
def test_a_sweep_value_that_is_not_finite_is_refused_naming_the_sweep(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--sweep cpu_gb=0,nan` ended as "invalid input: cannot convert float NaN to integer",
    naming neither the option nor what it takes."""
    assert main(["simulate", "--requests", "10", "--sweep", f"cpu_gb=0,{value}"]) == 2
    err = capsys.readouterr().err
    assert f"invalid config sweep='cpu_gb=0,{value}': PARAM=V1,V2,... with finite numeric " \
        "values" in err, err


def test_a_sweep_where_offload_never_costs_says_so_in_words(
        capsys: pytest.CaptureFixture[str]) -> None:
    """It read "it only costs at none"."""
    assert main(["simulate", "--requests", "50", "--sweep", "rate=1e-300"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "only costs at none" not in out and "it costs at none of them" in out


@pytest.mark.parametrize("rate", ["-1", "0"])
def test_a_rate_that_is_not_positive_is_told_what_is_allowed(
        rate: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--rate -1 was told "a number >= 0", and --rate 0 then "requests per second > 0"."""
    assert main(["simulate", "--requests", "10", "--rate", rate]) == 2
    assert "workload.rate_rps=" in (err := capsys.readouterr().err)
    assert "requests per second > 0" in err and ">= 0" not in err


def test_a_sweeps_table_says_where_the_plot_went(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "sweep.png"
    assert main(["simulate", "--requests", "20", "--sweep", "cpu_gb=0,16",
                 "--plot", str(plot)]) == 0
    assert f"plot written to {plot}" in capsys.readouterr().out and plot.stat().st_size


def test_a_slow_runs_request_rate_does_not_read_zero(
        capsys: pytest.CaptureFixture[str]) -> None:
    """20 requests served over hours read "0 tok/s (0.00 req/s)"."""
    assert main(["simulate", "--requests", "20", "--rate", "0.001"]) == 0
    out = capsys.readouterr().out
    assert re.search(r" 0\.[1-9]\d? tok/s \(0\.00[1-9]\d? req/s\)", out), out


def test_the_engine_options_still_shape_a_plain_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Their defaults now apply after the check; given, they still reach the simulation."""
    assert main(["simulate", "--requests", "60", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["config"]
    assert main(["simulate", "--requests", "60", "--block-tokens", "16", "--max-num-seqs", "8",
                 "--workload", "rag", "--seed", "2", "--json"]) == 0
    given = json.loads(capsys.readouterr().out)["config"]
    assert (plain["engine"]["block_tokens"], plain["engine"]["max_num_seqs"], plain["seed"]) \
        == (64, 256, 0)
    assert (given["engine"]["block_tokens"], given["engine"]["max_num_seqs"], given["seed"]) \
        == (16, 8, 2)
    assert given["workload"]["doc_prob"] > plain["workload"]["doc_prob"]  # rag's documents


@pytest.mark.parametrize(("sweep", "option", "value"), [
    ("rate=1,2", "--rate", "3"), ("hbm_util=0.5,0.9", "--hbm-util", "0.3")])
def test_the_swept_parameters_own_option_is_refused_not_ignored(
        sweep: str, option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--sweep rate=1,2 --rate 3` ran at 1 and 2 without a word of the 3."""
    assert main(["simulate", "--requests", "20", "--sweep", sweep, option, value]) == 2
    err = capsys.readouterr().err
    assert f"invalid config {option}={float(value)!r}: not with --sweep {sweep} (the sweep " \
        "sets it at each value: it would be ignored)" in err, err
