"""`kvtier bench disagg`'s settings: what the command line makes of them, what is refused,
and how a run's figures are read from its requests (no server: tests/engine/ runs the
setup itself, test_disagg_prefill.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.bench.disagg import DisaggBenchConfig, SetupRun
from kvtier.tools.bench.serving.stats import RequestResult
from kvtier.tools.cli.bench_disagg import config_from
from kvtier.tools.cli.main import build_parser, main


def test_quick_settings_then_flags_and_refusals(tmp_path: Path) -> None:
    args = build_parser().parse_args(["bench", "disagg", "--quick", "--arrivals", "3",
                                      "--setup", "disagg", "--dir", str(tmp_path)])
    config = config_from(args)
    assert (config.streams, config.arrivals, config.arrival_tokens) == (2, 3, 2048)
    assert config.setups == ("disagg",)
    for bad in ({"chunk_tokens": 100}, {"arrivals": 0}, {"arrival_tokens": 10**6},
                {"setups": ("both",)}):
        with pytest.raises(ConfigError):
            DisaggBenchConfig(tmp_path, tmp_path, **bad).validate()  # type: ignore[arg-type]
    assert main(["bench", "disagg", "--streams", "0"]) == 2


@pytest.mark.parametrize("workload", ["disagg", "interference"])
def test_a_negative_gap_is_refused_naming_the_gap_alone(workload: str) -> None:
    """`--gap-s -1` was refused as "arrival_gap_s=(-1.0, 1.0)": the gap and the lead, which
    no option sets, as one value."""
    from kvtier.tools.cli import bench_interference

    settings = bench_interference.config_from if workload == "interference" else config_from
    args = build_parser().parse_args(["bench", workload, "--gap-s=-1"])
    with pytest.raises(ConfigError) as refused:
        settings(args).validate()
    assert (refused.value.field, refused.value.value) == ("arrival_gap_s", -1.0)


def result(start_s: float, ttft_s: float, gaps: tuple[float, ...]) -> RequestResult:
    return RequestResult(session=0, turn=0, prompt_tokens=1, output_tokens=len(gaps) + 1,
                         start_s=start_s, ttft_s=ttft_s,
                         latency_s=ttft_s + sum(gaps), itl_s=gaps)


def test_streams_itl_counts_only_the_gaps_while_arrivals_came() -> None:
    stream = result(0.0, 0.1, (0.1,) * 10 + (0.5,) + (0.1,) * 10)  # slow token at 1.6 s
    arrival = result(1.0, 0.4, (0.05, 0.05))  # window 1.0-1.5 s
    run = SetupRun("single", (), 0.0, (stream,), (arrival,), None)
    assert run.window_s == (1.0, 1.5)
    assert run.ttft.p50 == pytest.approx(0.4) and run.arrival_itl.p50 == pytest.approx(0.05)
    assert run.stream_itl.p99 == pytest.approx(0.1)  # the 0.5 s gap ended after the window
