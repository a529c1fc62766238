"""`--quick` sets what the user left out, never what they gave: `--quick --trials 9` runs 9
trials in every bench, as `bench storage`, `interference` and `disagg` always did. The
in-process benches once dropped the given value silently (`bench node --quick --chunks 4`
ran 16 chunks), as did `bench link --quick --reps` and `bench ttft --quick --reps 9`.

The settings are read where each command builds them: its `config_from` on the real parser,
or, for the commands that build them inside `run`, the config their JSON records after a
tiny real run. Nothing is timed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.tools.cli import bench_copy, bench_fleet, bench_link, bench_ttft
from kvtier.tools.cli.main import build_parser, main


def _parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["bench", *argv])


def test_copy_fleet_link_and_ttft_keep_a_value_given_beside_quick() -> None:
    assert bench_copy.config_from(_parse("copy", "--quick", "--trials", "7")).trials == 7
    assert bench_copy.config_from(_parse("copy", "--quick")).trials == 2
    fleet = bench_fleet.config_from(_parse("fleet", "--quick", "--chunks", "500",
                                           "--writers", "2", "--seconds", "1"))
    assert (tuple(fleet.chunks), tuple(fleet.writers), fleet.seconds) == ((500,), (2,), 1.0)
    quick = bench_fleet.config_from(_parse("fleet", "--quick"))
    assert (tuple(quick.chunks), quick.seconds) == ((1_000, 10_000), 3.0)
    full = bench_fleet.config_from(_parse("fleet"))
    assert (tuple(full.chunks), tuple(full.writers), full.seconds) == ((100_000,), (1, 4), 10.0)
    link = bench_link.config_from(_parse("link", "--quick", "--reps", "7", "--warmup", "0",
                                         "--gbps", "8,2,1,0.5,0.25,0.1"))
    assert (link.reps, link.warmup, link.gbps) == (7, 0, (8.0, 2.0, 1.0, 0.5, 0.25, 0.1))
    assert bench_link.config_from(_parse("link", "--quick")).reps == bench_link.QUICK["reps"]
    assert bench_link.config_from(_parse("link")).reps == 5
    assert bench_ttft.config_from(_parse("ttft", "--quick", "--reps", "9")).reps == 9
    assert bench_ttft.config_from(_parse("ttft", "--quick")).reps == bench_ttft.QUICK["reps"]
    assert bench_ttft.config_from(_parse("ttft")).reps == 9


@pytest.mark.parametrize(("argv", "expected"), [
    (["node", "--quick", "--chunks", "2", "--chunk-kib", "4", "--trials", "1"],
     {"chunks": 2, "trials": 1}),
    (["mover", "--quick", "--chunks", "1", "--trials", "1", "--layers", "1",
      "--tokens-per-chunk", "16"], {"chunks": 1, "trials": 1}),
    (["disk-load", "--quick", "--chunks", "1", "--trials", "2"], {"trials": 2}),
    (["codecs", "--synthetic", "--quick", "--trials", "2", "--max-chunks", "2",
      "--prompts", "3"], {"trials": 2, "max_chunks": 2, "prompts": 3}),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_a_bench_run_with_quick_records_the_values_given(
        argv: list[str], expected: dict[str, int], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # codecs' scratch (--dir .) and disk-load's go here
    out = tmp_path / "bench.json"
    assert main(["bench", *argv, "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert {name: config[name] for name in expected} == expected
